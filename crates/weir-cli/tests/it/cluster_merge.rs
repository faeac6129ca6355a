//! The Delta MERGE on three `weir worker`s: the workers find the newest row per key (and
//! judge the NULL rules over the whole batch), the driver MERGEs those rows once per batch
//! with its `txn`; exact through worker and driver kills, equal to one process.

use std::path::Path;

use weir_core::datafusion::prelude::SessionContext;
use weir_core::fault::BEFORE_COMMIT_WRITE;
use weir_testkit::{rows, temp_dir};

use crate::cluster::{
    Worker, cluster_pipeline, progress_reports, refs, run_killing_a_worker,
    run_through_a_worker_kill, tasks_of,
};
use crate::cluster_pg::{gen_odd_orders, newest_per_key, null_keys_counted, same_form};
use crate::kills::killed_in_batch_2_then_rerun;

/// `cluster_pipeline` with a MERGE into the Delta table `delta` by `order_id`, newest
/// `updated_at`, with `options`; without its `[cluster]` table when `cluster` is false.
fn merge_pipeline(
    dir: &Path,
    workers: &[&Worker],
    max_files: usize,
    options: &str,
    cluster: bool,
) -> std::path::PathBuf {
    let p = cluster_pipeline(dir, workers, "max-batch-attempts = 4", max_files);
    let mut text = std::fs::read_to_string(&p).unwrap().replace(
        "type = \"parquet\"\npath = \"out\"",
        &format!(
            "type = \"delta-merge\"\npath = \"delta\"\nkeys = [\"order_id\"]\n\
             ordering = \"updated_at\"\n{options}"
        ),
    );
    if !cluster {
        text = text[..text.find("[cluster]").unwrap()].to_string();
    }
    std::fs::write(&p, text).unwrap();
    p
}

/// The table's rows: `cols`, in `same_form`.
async fn table_rows(table: &Path, cols: &[&str]) -> Vec<String> {
    let ctx = SessionContext::new();
    let df = weir_delta::read_table(&ctx, &table.into()).await.unwrap();
    same_form(rows(df.select_columns(cols).unwrap()).await)
}

/// The `txn` version of each commit of the table's log, in version order.
fn txns(table: &Path) -> Vec<Option<i64>> {
    let log = table.join("_delta_log");
    let mut names: Vec<String> = std::fs::read_dir(&log)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".json") && !n.starts_with('_'))
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| {
            std::fs::read_to_string(log.join(n))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .find_map(|a| a["txn"]["version"].as_i64())
        })
        .collect()
}

const ALL: [&str; 4] = ["order_id", "status", "amount", "updated_at"];

#[tokio::test]
async fn a_merge_fed_by_the_workers_equals_one_process_through_a_worker_kill() {
    let mut ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_odd_orders(&input, 30, 1000, 400);
    let p = merge_pipeline(dir.path(), &refs(&ws), 3, "", true);
    let progress = dir.path().join("progress.jsonl");
    run_through_a_worker_kill(&p, &progress, &mut ws, 2, 10);
    let table = dir.path().join("delta");
    assert_eq!(
        table_rows(&table, &ALL[..3]).await,
        newest_per_key(&input, None).await,
        "the table holds the newest row of every key over all input"
    );
    assert_eq!(txns(&table), (0..10).map(Some).collect::<Vec<_>>());
    let reports = progress_reports(&progress);
    assert!(tasks_of(&reports) >= 3 * 5, "{reports:?}");
    let read: u64 = reports
        .iter()
        .map(|r| r["numInputRows"].as_u64().unwrap())
        .sum();
    assert_eq!(
        read as usize,
        crate::input_rows(&input).await.len(),
        "each row read once as far as the progress goes"
    );

    // The same pipeline in one process: the same table, every column (ties on the
    // timestamp are decided by the other columns the same way).
    let alone = temp_dir();
    std::fs::rename(&input, alone.path().join("in")).unwrap();
    let p = merge_pipeline(alone.path(), &[], 3, "", false);
    run_killing_a_worker(&p, &alone.path().join("progress.jsonl"), &[], None);
    assert_eq!(
        table_rows(&table, &ALL).await,
        table_rows(&alone.path().join("delta"), &ALL).await
    );
}

#[tokio::test]
async fn the_driver_killed_around_a_merge_fed_by_the_workers_replays_exactly() {
    let ws = Worker::three(None);
    for point in [
        weir_delta::POINT_BEFORE_COMMIT,
        weir_delta::POINT_AFTER_COMMIT,
        BEFORE_COMMIT_WRITE,
    ] {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_odd_orders(&input, 8, 100, 50);
        let p = merge_pipeline(dir.path(), &refs(&ws), 2, "", true);
        let first = dir.path().join("p1.jsonl");
        let second = dir.path().join("p2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        let table = dir.path().join("delta");
        assert_eq!(
            table_rows(&table, &ALL[..3]).await,
            newest_per_key(&input, None).await,
            "{point}"
        );
        assert_eq!(
            txns(&table),
            vec![Some(0), Some(1), Some(2), Some(3)],
            "{point}: one version per batch"
        );
    }
}

/// Keys made NULL in one row of 7: the workers' winners show them, a second pass counts
/// them over the batch, so the error names all of them; with `null-keys = "drop"` the
/// dropped count is the batch's.
#[tokio::test]
async fn null_keys_in_a_merge_fed_by_the_workers_are_counted_over_the_batch() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    null_keys_counted(&input, &dir.path().join("progress.jsonl"), &|options| {
        merge_pipeline(dir.path(), &refs(&ws), 6, options, true)
    })
    .await;
    assert_eq!(
        table_rows(&dir.path().join("delta"), &ALL[..3]).await,
        newest_per_key(&input, Some(3)).await
    );
}
