//! Delta sinks against real Delta tables in temp folders.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::{BatchContext, ForeachBatch};
use weir_delta::{DeltaAppend, DeltaMerge, read_table, recorded_version, table_version};

fn df(rows: &[(i64, &str, i64)]) -> DataFrame {
    weir_testkit::order_rows(rows)
}

fn ctx(query_id: uuid::Uuid, batch_id: u64) -> BatchContext {
    weir_testkit::batch_context(query_id, batch_id)
}

async fn table_rows(path: &Path) -> Vec<String> {
    let c = SessionContext::new();
    let t = read_table(&c, path).await.unwrap();
    weir_testkit::rows(t.select_columns(&["order_id", "status"]).unwrap()).await
}

#[tokio::test]
async fn a_replayed_append_is_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let sink = DeltaAppend::new(&path);
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "a", 1), (2, "b", 1)]), ctx(q, 0))
        .await
        .unwrap();
    sink.call(df(&[(3, "c", 2)]), ctx(q, 1)).await.unwrap();
    let replay = ctx(q, 1);
    sink.call(df(&[(3, "c", 2)]), replay.clone()).await.unwrap();
    assert_eq!(replay.metrics.skipped(), 1, "the skip is counted");
    assert_eq!(
        table_version(&path).await.unwrap(),
        Some(1),
        "no third commit"
    );
    assert_eq!(table_rows(&path).await, vec!["1|a", "2|b", "3|c"]);
    assert_eq!(
        recorded_version(&path, &replay.app_id()).await.unwrap(),
        Some(1)
    );
    // An older batch id (a replay of a batch before the last) is skipped too.
    sink.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    assert_eq!(table_version(&path).await.unwrap(), Some(1));
}

#[tokio::test]
async fn a_new_checkpoint_is_not_hidden_by_an_old_ones_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let sink = DeltaAppend::new(&path);
    for b in 0..3 {
        sink.call(df(&[(b as i64, "old", 1)]), ctx(uuid::Uuid::new_v4(), b))
            .await
            .unwrap();
    }
    // Same query name, new checkpoint (new query id): batch 0 again, and it is written.
    let fresh = ctx(uuid::Uuid::new_v4(), 0);
    sink.call(df(&[(10, "new", 1)]), fresh.clone())
        .await
        .unwrap();
    assert_eq!(fresh.metrics.skipped(), 0);
    assert_eq!(table_rows(&path).await.len(), 4);
}

#[tokio::test]
async fn two_app_ids_on_one_table_do_not_hide_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let a = DeltaAppend::new(&path).app_id("query-a-v1");
    let b = DeltaAppend::new(&path).app_id("query-b-v1");
    let q = uuid::Uuid::new_v4();
    a.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    a.call(df(&[(2, "a", 1)]), ctx(q, 1)).await.unwrap();
    b.call(df(&[(3, "b", 1)]), ctx(q, 0)).await.unwrap();
    b.call(df(&[(3, "b", 1)]), ctx(q, 0)).await.unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|a", "2|a", "3|b"]);
    assert_eq!(
        recorded_version(&path, "query-a-v1").await.unwrap(),
        Some(1)
    );
    assert_eq!(
        recorded_version(&path, "query-b-v1").await.unwrap(),
        Some(0)
    );
}

#[tokio::test]
async fn merge_keeps_the_newest_row_per_key_within_and_across_batches_and_ignores_late_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let sink = DeltaMerge::new(&path, vec!["order_id".into()], "updated_at");
    let q = uuid::Uuid::new_v4();
    // Batch 0 creates the table; order 1 appears twice in it.
    sink.call(
        df(&[(1, "created", 10), (1, "paid", 20), (2, "created", 10)]),
        ctx(q, 0),
    )
    .await
    .unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|paid", "2|created"]);
    // Batch 1: a newer row for 2, a late older row for 1, a new key 3.
    let c1 = ctx(q, 1);
    sink.call(
        df(&[(2, "shipped", 30), (1, "created", 15), (3, "created", 5)]),
        c1.clone(),
    )
    .await
    .unwrap();
    assert_eq!(
        table_rows(&path).await,
        vec!["1|paid", "2|shipped", "3|created"]
    );
    let v1 = table_version(&path).await.unwrap();
    // The replay of batch 1 is skipped without a MERGE.
    let replay = ctx(q, 1);
    sink.call(
        df(&[(2, "shipped", 30), (1, "created", 15), (3, "created", 5)]),
        replay.clone(),
    )
    .await
    .unwrap();
    assert_eq!(replay.metrics.skipped(), 1);
    assert_eq!(table_version(&path).await.unwrap(), v1);
    // A batch whose every row is late changes nothing, but its transaction is recorded.
    sink.call(df(&[(2, "created", 1)]), ctx(q, 2))
        .await
        .unwrap();
    assert_eq!(
        table_rows(&path).await,
        vec!["1|paid", "2|shipped", "3|created"]
    );
    assert_eq!(
        recorded_version(&path, &c1.app_id()).await.unwrap(),
        Some(2)
    );
}

#[tokio::test]
async fn merge_without_dedupe_names_the_duplicate_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let sink = DeltaMerge::new(&path, vec!["order_id".into()], "updated_at").dedupe(false);
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    let err = sink
        .call(df(&[(7, "a", 2), (7, "b", 3)]), ctx(q, 1))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("order_id=7") && msg.contains("batch 1"),
        "{msg}"
    );
}

#[tokio::test]
async fn merge_with_pruning_gives_the_same_result() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let sink = DeltaMerge::new(&path, vec!["order_id".into()], "updated_at").prune_by("status");
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "x", 1), (2, "y", 1)]), ctx(q, 0))
        .await
        .unwrap();
    sink.call(df(&[(1, "x", 5), (3, "x", 5)]), ctx(q, 1))
        .await
        .unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|x", "2|y", "3|x"]);
}
