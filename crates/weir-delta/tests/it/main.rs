//! Delta sinks against real Delta tables in temp folders.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::{BatchContext, ForeachBatch, Location, NullKeys, NullOrdering};
use weir_delta::{DeltaAppend, DeltaMerge, read_table, recorded_version, table_version};

fn df(rows: &[(i64, &str, i64)]) -> DataFrame {
    weir_testkit::order_rows(rows)
}

fn ctx(query_id: uuid::Uuid, batch_id: u64) -> BatchContext {
    weir_testkit::batch_context(query_id, batch_id)
}

fn table(dir: &tempfile::TempDir) -> Location {
    Location::local(dir.path().join("t"))
}

async fn table_rows(at: &Location) -> Vec<String> {
    let c = SessionContext::new();
    let t = read_table(&c, at).await.unwrap();
    weir_testkit::rows(t.select_columns(&["order_id", "status"]).unwrap()).await
}

fn chain(e: &weir_core::BoxError) -> String {
    weir_core::sink::error_chain(e.as_ref())
}

#[tokio::test]
async fn a_replayed_append_is_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let sink = DeltaAppend::new(path.clone());
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "a", 1), (2, "b", 1)]), ctx(q, 0))
        .await
        .unwrap();
    sink.call(df(&[(3, "c", 2)]), ctx(q, 1)).await.unwrap();
    let replay = ctx(q, 1).replay(true);
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
    // Batch 0 again, when the table records batch 1: this query cannot be replaying it.
    let err = sink
        .call(df(&[(1, "a", 1)]), ctx(q, 0).replay(true))
        .await
        .unwrap_err();
    assert!(
        chain(&err).contains("which this query did not write"),
        "{}",
        chain(&err)
    );
    assert_eq!(table_version(&path).await.unwrap(), Some(1));
}

#[tokio::test]
async fn a_new_checkpoint_is_not_hidden_by_an_old_ones_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let sink = DeltaAppend::new(path.clone());
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
async fn an_explicit_app_id_reused_by_a_new_checkpoint_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let old = DeltaAppend::new(path.clone()).app_id("orders-v1");
    let q = uuid::Uuid::new_v4();
    for b in 0..3 {
        old.call(df(&[(b as i64, "old", 1)]), ctx(q, b))
            .await
            .unwrap();
    }
    // A new checkpoint with the same explicit app id starts at batch 0 again.
    let fresh = DeltaAppend::new(path.clone()).app_id("orders-v1");
    let err = fresh
        .call(df(&[(10, "new", 1)]), ctx(uuid::Uuid::new_v4(), 0))
        .await
        .unwrap_err();
    let msg = chain(&err);
    assert!(
        msg.contains("records version 2 for app id 'orders-v1'")
            && msg.contains("give the sink a new app-id"),
        "{msg}"
    );
    assert_eq!(table_rows(&path).await.len(), 3, "nothing written");
    // Said on purpose: the old behaviour, a skip with a warning.
    let allowed = DeltaAppend::new(path.clone())
        .app_id("orders-v1")
        .allow_app_id_reuse(true);
    let c = ctx(uuid::Uuid::new_v4(), 0);
    allowed
        .call(df(&[(10, "new", 1)]), c.clone())
        .await
        .unwrap();
    assert_eq!(c.metrics.skipped(), 1);
}

#[tokio::test]
async fn two_app_ids_on_one_table_do_not_hide_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let a = DeltaAppend::new(path.clone()).app_id("query-a-v1");
    let b = DeltaAppend::new(path.clone()).app_id("query-b-v1");
    let q = uuid::Uuid::new_v4();
    a.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    a.call(df(&[(2, "a", 1)]), ctx(q, 1)).await.unwrap();
    b.call(df(&[(3, "b", 1)]), ctx(q, 0)).await.unwrap();
    b.call(df(&[(3, "b", 1)]), ctx(q, 0).replay(true))
        .await
        .unwrap();
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
    let path = table(&dir);
    let sink = DeltaMerge::new(path.clone(), ["order_id"], "updated_at");
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
    let replay = ctx(q, 1).replay(true);
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
async fn ties_on_the_ordering_column_end_the_same_however_the_rows_were_batched() {
    // Three rows of key 1 share updated_at; the greatest other column ("c") wins.
    let rows = [(1, "b", 5), (1, "c", 5), (1, "a", 5)];
    let mut results = Vec::new();
    for split in [vec![3], vec![1, 2], vec![1, 1, 1], vec![2, 1]] {
        let dir = tempfile::tempdir().unwrap();
        let path = table(&dir);
        let sink = DeltaMerge::new(path.clone(), ["order_id"], "updated_at");
        let q = uuid::Uuid::new_v4();
        let mut at = 0;
        for (b, n) in split.iter().enumerate() {
            sink.call(df(&rows[at..at + n]), ctx(q, b as u64))
                .await
                .unwrap();
            at += n;
        }
        results.push(table_rows(&path).await);
    }
    for r in &results {
        assert_eq!(r, &vec!["1|c".to_string()], "{results:?}");
    }
}

#[tokio::test]
async fn null_keys_and_orderings_fail_the_batch_naming_them_or_follow_the_chosen_rule() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let q = uuid::Uuid::new_v4();
    let rows = weir_testkit::order_rows_opt(&[
        (Some(1), "a", Some(1)),
        (None, "no key", Some(1)),
        (None, "no key", Some(2)),
    ]);
    let strict = DeltaMerge::new(path.clone(), ["order_id"], "updated_at");
    let err = strict.call(rows.clone(), ctx(q, 0)).await.unwrap_err();
    let msg = chain(&err);
    assert!(
        msg.contains("batch 0")
            && msg.contains("2 row(s) have a NULL in order_id")
            && msg.contains("delta-merge"),
        "{msg}"
    );
    let dropping =
        DeltaMerge::new(path.clone(), ["order_id"], "updated_at").null_keys(NullKeys::Drop);
    let c = ctx(q, 0);
    dropping.call(rows.clone(), c.clone()).await.unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|a"]);
    assert!(
        c.metrics
            .entries()
            .iter()
            .any(|(k, v)| k.ends_with(".dropped") && v == "2"),
        "{:?}",
        c.metrics.entries()
    );
    // A NULL ordering: refused by default; with "oldest" it never wins over a value, and
    // any value replaces it.
    let nulls = weir_testkit::order_rows_opt(&[(Some(2), "null time", None)]);
    let err = strict.call(nulls.clone(), ctx(q, 1)).await.unwrap_err();
    assert!(
        chain(&err).contains("NULL in updated_at"),
        "{}",
        chain(&err)
    );
    let oldest = DeltaMerge::new(path.clone(), ["order_id"], "updated_at")
        .null_ordering(NullOrdering::Oldest);
    oldest.call(nulls, ctx(q, 1)).await.unwrap();
    oldest
        .call(
            weir_testkit::order_rows_opt(&[
                (Some(1), "late null", None),
                (Some(2), "real", Some(1)),
            ]),
            ctx(q, 2),
        )
        .await
        .unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|a", "2|real"]);
}

#[tokio::test]
async fn merge_without_dedupe_names_the_duplicate_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let sink = DeltaMerge::new(path, ["order_id"], "updated_at").dedupe(false);
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
async fn pruning_by_a_key_column_gives_the_same_result_and_a_non_key_column_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = table(&dir);
    let sink = DeltaMerge::new(path.clone(), ["order_id"], "updated_at").prune_by("order_id");
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "x", 1), (2, "y", 1)]), ctx(q, 0))
        .await
        .unwrap();
    sink.call(df(&[(1, "z", 5), (3, "x", 5)]), ctx(q, 1))
        .await
        .unwrap();
    assert_eq!(table_rows(&path).await, vec!["1|z", "2|y", "3|x"]);
    // "status" changes for a key: pruning by it would insert a second row for order 1.
    let bad = DeltaMerge::new(path.clone(), ["order_id"], "updated_at").prune_by("status");
    let err = bad.check().unwrap_err().to_string();
    assert!(err.contains("'status' is not a key column"), "{err}");
    let err = bad.call(df(&[(1, "w", 9)]), ctx(q, 2)).await.unwrap_err();
    assert!(chain(&err).contains("prune-by"), "{}", chain(&err));
    assert_eq!(table_rows(&path).await, vec!["1|z", "2|y", "3|x"]);
}

/// One-row batches, past the automatic compaction (100 small batches) and the reload of the
/// cached table (100 versions), with a replay after both: every row once, one data commit
/// per batch, and the table's active files bounded instead of one per batch.
#[tokio::test]
async fn tiny_batches_are_compacted_by_default_and_replays_still_skip() {
    let dir = tempfile::tempdir().unwrap();
    let append_at = Location::local(dir.path().join("append"));
    let merge_at = Location::local(dir.path().join("merge"));
    let append = DeltaAppend::new(append_at.clone());
    let merge = DeltaMerge::new(merge_at.clone(), ["order_id"], "updated_at");
    let q = uuid::Uuid::new_v4();
    let batches: u64 = 230;
    for id in 0..batches {
        let i = id as i64;
        // The merge sees 20 keys, each updated again and again.
        let version = format!("v{i}");
        append.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
        merge
            .call(df(&[(i % 20, &version, i)]), ctx(q, id))
            .await
            .unwrap();
        if id == 150 || id == batches - 1 {
            let replay = ctx(q, id).replay(true);
            append
                .call(df(&[(i, "a", i)]), replay.clone())
                .await
                .unwrap();
            merge
                .call(df(&[(i % 20, &version, i)]), replay.clone())
                .await
                .unwrap();
            assert_eq!(replay.metrics.skipped(), 2, "batch {id}: both replays skip");
        }
    }
    for at in [&append_at, &merge_at] {
        assert_eq!(
            weir_delta::data_commits(at).await.unwrap(),
            Some(batches),
            "{at}: one data commit per batch"
        );
        let version = table_version(at).await.unwrap().unwrap();
        assert!(version >= batches, "{at}: OPTIMIZE commits too ({version})");
        let files = weir_delta::open(at, 0)
            .await
            .unwrap()
            .get_file_uris()
            .unwrap()
            .count();
        assert!(
            files <= 40,
            "{at}: {files} active files after {batches} batches"
        );
        assert_eq!(
            recorded_version(at, &ctx(q, 0).app_id()).await.unwrap(),
            Some(batches as i64 - 1)
        );
    }
    assert!(
        append_at
            .local_path()
            .unwrap()
            .join(format!("_delta_log/{:020}.json", 0))
            .exists(),
        "within the default log retention (30 days) no commit goes"
    );
    let rows = table_rows(&append_at).await;
    assert_eq!(rows.len() as u64, batches, "every appended row once");
    let want: Vec<String> = {
        let mut v: Vec<String> = (0..batches as i64).map(|i| format!("{i}|a")).collect();
        v.sort();
        v
    };
    let mut got = rows;
    got.sort();
    assert_eq!(got, want);
    let newest = table_rows(&merge_at).await;
    let mut want: Vec<String> = (0..20i64)
        .map(|k| {
            let last = (0..batches as i64).filter(|i| i % 20 == k).max().unwrap();
            format!("{k}|v{last}")
        })
        .collect();
    want.sort();
    let mut newest = newest;
    newest.sort();
    assert_eq!(newest, want, "the newest row per key");
}

/// The log cleanup delta-rs runs after every commit (listing the whole `_delta_log`) is
/// replaced by one at each reload of the cached table: expired log files still go, and the
/// table still reads whole from its checkpoint.
#[tokio::test]
async fn expired_log_files_are_removed_at_checkpoints_and_the_table_reads_whole() {
    let dir = tempfile::tempdir().unwrap();
    let at = table(&dir);
    let sink = DeltaAppend::new(at.clone()).optimize_every(0);
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(0, "a", 0)]), ctx(q, 0)).await.unwrap();
    set_properties(&at, &[("delta.logRetentionDuration", "interval 0 seconds")]).await;
    let batches: u64 = 205;
    for id in 1..batches {
        let i = id as i64;
        sink.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
    }
    let log = dir.path().join("t/_delta_log");
    let versions = |suffix: &str| log_versions(&log, suffix);
    // Versions 0..=205 (batch 0, the property commit, batches 1..205); the reload at 200
    // removes everything below checkpoint 199.
    assert_eq!(versions(".json"), (199..=205).collect::<Vec<_>>());
    assert_eq!(versions(".checkpoint.parquet"), vec![199]);
    assert_eq!(table_rows(&at).await.len() as u64, batches);
    assert_eq!(
        recorded_version(&at, &ctx(q, 0).app_id()).await.unwrap(),
        Some(batches as i64 - 1)
    );
    // A new sink (as after a restart) finds where the log starts and goes on from there.
    let sink = DeltaAppend::new(at.clone()).optimize_every(0);
    let more: u64 = 400;
    for id in batches..more {
        let i = id as i64;
        sink.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
    }
    // Loaded at 205, reloaded at 305: everything below checkpoint 299 goes.
    assert_eq!(versions(".json"), (299..=more).collect::<Vec<_>>());
    assert_eq!(versions(".checkpoint.parquet"), vec![299, 399]);
    assert_eq!(table_rows(&at).await.len() as u64, more);
}

/// Sets table properties of the table at `at` (a commit of its own).
async fn set_properties(at: &Location, props: &[(&str, &str)]) {
    weir_delta::open(at, 0)
        .await
        .unwrap()
        .set_tbl_properties()
        .with_properties(
            props
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
        .await
        .unwrap();
}

/// The commit file versions in the `_delta_log` folder `log` whose names end in `suffix`.
fn log_versions(log: &std::path::Path, suffix: &str) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(log)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(suffix)?.parse().ok()
        })
        .collect();
    v.sort();
    v
}

/// OPTIMIZE's own commit does not run delta-rs's log cleanup (which lists the whole
/// `_delta_log`, 30 days of commits by default, at every compaction): with a checkpoint
/// every 10 versions and no log retention, every commit file is still there after several
/// compactions until weir's own cleanup at the reload of the cached table removes the ones
/// below the newest checkpoint; the table reads whole and replays still skip.
#[tokio::test]
async fn compactions_leave_expired_log_files_to_the_cleanup_at_reload() {
    let dir = tempfile::tempdir().unwrap();
    let at = table(&dir);
    let sink = DeltaAppend::new(at.clone()).optimize_every(10);
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(0, "a", 0)]), ctx(q, 0)).await.unwrap();
    set_properties(
        &at,
        &[
            ("delta.logRetentionDuration", "interval 0 seconds"),
            ("delta.checkpointInterval", "10"),
        ],
    )
    .await;
    let log = dir.path().join("t/_delta_log");
    let mut id = 1;
    // Versions 0 (batch 0), 1 (the properties), then a commit per batch and one per
    // compaction (after batches 9, 19, ...): below the reload at version 100.
    while table_version(&at).await.unwrap().unwrap() < 90 {
        let i = id as i64;
        sink.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
        id += 1;
    }
    let now = table_version(&at).await.unwrap().unwrap();
    let data = weir_delta::data_commits(&at).await.unwrap().unwrap();
    assert!(
        now + 1 - data >= 8,
        "at least 8 compactions by version {now}"
    );
    assert_eq!(log_versions(&log, ".json"), (0..=now).collect::<Vec<_>>());
    assert!(log_versions(&log, ".checkpoint.parquet").len() >= 8);
    // Past the reload: the files below the newest checkpoint go.
    while table_version(&at).await.unwrap().unwrap() < 105 {
        let i = id as i64;
        sink.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
        id += 1;
    }
    let json = log_versions(&log, ".json");
    let checkpoints = log_versions(&log, ".checkpoint.parquet");
    assert!(json[0] >= 90, "expired commit files removed: {json:?}");
    assert_eq!(Some(&json[0]), checkpoints.first(), "{checkpoints:?}");
    assert_eq!(table_rows(&at).await.len() as u64, id);
    assert_eq!(
        recorded_version(&at, &ctx(q, 0).app_id()).await.unwrap(),
        Some(id as i64 - 1)
    );
    let replay = ctx(q, id - 1).replay(true);
    sink.call(df(&[(0, "a", 0)]), replay.clone()).await.unwrap();
    assert_eq!(replay.metrics.skipped(), 1);
    assert_eq!(
        table_rows(&at).await.len() as u64,
        id,
        "the replay is skipped"
    );
}

#[tokio::test]
async fn tables_in_folders_with_brackets_and_spaces_take_appends_merges_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let raw = Location::local(dir.path().join("raw [d] ü"));
    let latest = Location::local(dir.path().join("latest [d]"));
    let append = DeltaAppend::new(raw.clone());
    let merge = DeltaMerge::new(latest.clone(), ["order_id"], "updated_at");
    let q = uuid::Uuid::new_v4();
    for (id, rows) in [(0, vec![(1, "a", 1), (2, "b", 1)]), (1, vec![(1, "c", 2)])] {
        append.call(df(&rows), ctx(q, id)).await.unwrap();
        merge.call(df(&rows), ctx(q, id)).await.unwrap();
    }
    let replay = ctx(q, 1).replay(true);
    append
        .call(df(&[(1, "c", 2)]), replay.clone())
        .await
        .unwrap();
    merge
        .call(df(&[(1, "c", 2)]), replay.clone())
        .await
        .unwrap();
    assert_eq!(replay.metrics.skipped(), 2, "both replays skip");
    assert_eq!(table_rows(&raw).await, vec!["1|a", "1|c", "2|b"]);
    assert_eq!(table_rows(&latest).await, vec!["1|c", "2|b"]);
}

/// Removes (tombstones) in the newest checkpoint of the table at `at`, after writing one.
async fn tombstones_in_a_new_checkpoint(at: &Location) -> i64 {
    let t = weir_delta::open(at, 0).await.unwrap();
    weir_delta::deltalake::checkpoints::create_checkpoint(&t, None)
        .await
        .unwrap();
    let version = t.version().unwrap();
    let file = at
        .local_path()
        .unwrap()
        .join(format!("_delta_log/{version:020}.checkpoint.parquet"));
    let c = SessionContext::new();
    c.register_parquet("cp", file.to_str().unwrap(), Default::default())
        .await
        .unwrap();
    let rows = weir_testkit::rows(
        c.sql("select count(*) from cp where remove is not null")
            .await
            .unwrap(),
    )
    .await;
    rows[0].parse().unwrap()
}

fn retention_property(t: &weir_delta::deltalake::DeltaTable) -> Option<String> {
    t.snapshot()
        .unwrap()
        .metadata()
        .configuration()
        .get(weir_delta::compact::DELETED_FILE_RETENTION_PROPERTY)
        .cloned()
}

/// Compaction leaves a tombstone per replaced file; a table the sink creates keeps them in
/// its checkpoints for one day by default, and for the retention the sink is given, so a
/// long-running query's checkpoints stop growing. An existing table keeps its own property.
#[tokio::test]
async fn created_tables_carry_the_tombstone_retention_and_checkpoints_drop_expired_ones() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let kept_at = Location::local(dir.path().join("kept"));
    let short_at = Location::local(dir.path().join("short"));
    let merge_at = Location::local(dir.path().join("merge"));
    let kept = DeltaAppend::new(kept_at.clone()).optimize_every(3);
    let short = DeltaAppend::new(short_at.clone())
        .optimize_every(3)
        .deleted_file_retention(Duration::ZERO);
    let merge = DeltaMerge::new(merge_at.clone(), ["order_id"], "updated_at")
        .deleted_file_retention(Duration::from_secs(3600));
    let q = uuid::Uuid::new_v4();
    for id in 0..6u64 {
        let i = id as i64;
        kept.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
        short.call(df(&[(i, "a", i)]), ctx(q, id)).await.unwrap();
        merge.call(df(&[(0, "a", i)]), ctx(q, id)).await.unwrap();
    }
    let open = |at: Location| async move { weir_delta::open(&at, 0).await.unwrap() };
    assert_eq!(
        retention_property(&open(kept_at.clone()).await).as_deref(),
        Some("interval 86400 seconds")
    );
    assert_eq!(
        retention_property(&open(short_at.clone()).await).as_deref(),
        Some("interval 0 seconds")
    );
    assert_eq!(
        retention_property(&open(merge_at.clone()).await).as_deref(),
        Some("interval 3600 seconds")
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let removes_in_commits = |at: &Location| {
        let log = at.local_path().unwrap().join("_delta_log");
        std::fs::read_dir(log)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .map(|p| {
                std::fs::read_to_string(p)
                    .unwrap()
                    .lines()
                    .filter(|l| l.starts_with("{\"remove\""))
                    .count() as i64
            })
            .sum::<i64>()
    };
    let made = removes_in_commits(&kept_at);
    assert!(made >= 6, "two compactions of at least three files: {made}");
    assert_eq!(
        tombstones_in_a_new_checkpoint(&kept_at).await,
        made,
        "every tombstone is within the default retention"
    );
    assert!(removes_in_commits(&short_at) >= 6);
    assert_eq!(
        tombstones_in_a_new_checkpoint(&short_at).await,
        0,
        "expired tombstones are left out of the checkpoint"
    );
    for at in [&kept_at, &short_at] {
        let mut rows = table_rows(at).await;
        rows.sort();
        assert_eq!(rows, ["0|a", "1|a", "2|a", "3|a", "4|a", "5|a"], "{at}");
        assert_eq!(
            recorded_version(at, &ctx(q, 0).app_id()).await.unwrap(),
            Some(5)
        );
    }
    // A sink with another retention on the existing table writes without changing it.
    let other = DeltaAppend::new(kept_at.clone()).deleted_file_retention(Duration::ZERO);
    other.call(df(&[(6, "a", 6)]), ctx(q, 6)).await.unwrap();
    assert_eq!(
        retention_property(&open(kept_at.clone()).await).as_deref(),
        Some("interval 86400 seconds")
    );
}

/// A file of the compaction target size or more is left alone: compactions rewrite the new
/// small files only, so their cost does not grow with the table.
#[tokio::test]
async fn compaction_leaves_files_of_the_target_size_alone() {
    let dir = tempfile::tempdir().unwrap();
    let at = table(&dir);
    let sink = DeltaAppend::new(at.clone()).optimize_every(3);
    let q = uuid::Uuid::new_v4();
    // About 10 MB of incompressible text in one file.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let text: Vec<String> = (0..160_000)
        .map(|_| {
            (0..4)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    format!("{x:016x}")
                })
                .collect()
        })
        .collect();
    let rows: Vec<(i64, &str, i64)> = text
        .iter()
        .enumerate()
        .map(|(i, s)| (i as i64, s.as_str(), 0))
        .collect();
    sink.call(df(&rows), ctx(q, 0)).await.unwrap();
    let files = |t: &weir_delta::deltalake::DeltaTable| -> Vec<String> {
        let mut f: Vec<String> = t.get_file_uris().unwrap().collect();
        f.sort();
        f
    };
    let big = files(&weir_delta::open(&at, 0).await.unwrap());
    assert_eq!(big.len(), 1);
    let size = std::fs::metadata(&big[0]).unwrap().len();
    assert!(
        size > weir_delta::compact::COMPACT_TARGET_BYTES,
        "the big file has {size} bytes"
    );
    for id in 1..6u64 {
        let i = 1_000_000 + id as i64;
        sink.call(df(&[(i, "small", 0)]), ctx(q, id)).await.unwrap();
    }
    let after = files(&weir_delta::open(&at, 0).await.unwrap());
    assert!(
        after.contains(&big[0]),
        "the big file is still there: {after:?}"
    );
    assert_eq!(
        after.len(),
        2,
        "the big file and one compacted file: {after:?}"
    );
    assert_eq!(table_rows(&at).await.len(), 160_005);
}

#[tokio::test]
async fn compaction_writes_row_groups_of_bounded_size() {
    use weir_delta::deltalake::parquet::file::reader::{FileReader, SerializedFileReader};
    let dir = tempfile::tempdir().unwrap();
    let at = table(&dir);
    let sink = DeltaAppend::new(at.clone()).optimize_every(3);
    let q = uuid::Uuid::new_v4();
    for id in 0..3u64 {
        let rows: Vec<(i64, &str, i64)> = (0..50_000)
            .map(|i| (id as i64 * 50_000 + i, "s", i))
            .collect();
        sink.call(df(&rows), ctx(q, id)).await.unwrap();
    }
    let t = weir_delta::open(&at, 0).await.unwrap();
    let files: Vec<String> = t.get_file_uris().unwrap().collect();
    assert_eq!(files.len(), 1, "one compacted file: {files:?}");
    let reader = SerializedFileReader::new(std::fs::File::open(&files[0]).unwrap()).unwrap();
    let groups: Vec<i64> = reader
        .metadata()
        .row_groups()
        .iter()
        .map(|g| g.num_rows())
        .collect();
    let cap = weir_delta::compact::COMPACT_ROW_GROUP_ROWS as i64;
    assert_eq!(groups.iter().sum::<i64>(), 150_000, "{groups:?}");
    assert!(groups.iter().all(|&n| n <= cap), "{groups:?}");
    assert_eq!(table_rows(&at).await.len(), 150_000);
}
