//! The Delta append on three `weir worker`s: the tasks write the data files, the driver
//! commits each batch once with its `txn`, through worker and driver kills; a table the
//! workers cannot write (a CHECK constraint) is written on the driver, exactly too.

use std::path::Path;

use weir_core::datafusion::prelude::SessionContext;
use weir_core::fault::BEFORE_COMMIT_WRITE;
use weir_testkit::{rows, temp_dir};

use crate::cluster::{
    COLS, Worker, cluster_pipeline, refs, run_killing_a_worker, run_through_a_worker_kill,
    s3_cluster_pipeline,
};
use crate::kills::killed_in_batch_2_then_rerun;
use crate::{gen_orders, gen_orders_from, input_rows, last_progress, progress_batches};

/// `cluster_pipeline` with a Delta append to `table` (with `options`) as its sink.
fn delta_pipeline(
    dir: &Path,
    workers: &[&Worker],
    extra: &str,
    max_files: usize,
    table: &str,
    options: &str,
) -> std::path::PathBuf {
    let p = cluster_pipeline(dir, workers, extra, max_files);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "type = \"parquet\"\npath = \"out\"",
        &format!("type = \"delta-append\"\npath = \"{table}\"\n{options}"),
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// The table's rows (`COLS`), sorted.
async fn table_rows(table: &Path) -> Vec<String> {
    let ctx = SessionContext::new();
    let df = weir_delta::read_table(&ctx, &table.into()).await.unwrap();
    rows(df.select_columns(&COLS).unwrap()).await
}

/// Each commit of the table's log, in version order: its `add` paths and its `txn`
/// version, read from the JSON files themselves.
fn commits(table: &Path) -> Vec<(Vec<String>, Option<i64>)> {
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
            let text = std::fs::read_to_string(log.join(n)).unwrap();
            let mut adds = Vec::new();
            let mut txn = None;
            for line in text.lines() {
                let action: serde_json::Value = serde_json::from_str(line).unwrap();
                if let Some(path) = action["add"]["path"].as_str() {
                    adds.push(path.to_string());
                }
                if let Some(v) = action["txn"]["version"].as_i64() {
                    txn = Some(v);
                }
            }
            (adds, txn)
        })
        .collect()
}

#[tokio::test]
async fn delta_files_written_by_workers_commit_once_per_batch_through_a_worker_kill() {
    let mut ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 30, 1000, 400);
    // A table name that is not a plain URL path (`%` is refused for local Delta tables).
    let name = "delta?# [ü]";
    let p = delta_pipeline(
        dir.path(),
        &refs(&ws),
        "max-batch-attempts = 4",
        3,
        name,
        "",
    );
    let progress = dir.path().join("progress.jsonl");
    let stderr = run_through_a_worker_kill(&p, &progress, &mut ws, 2, 10);
    assert!(!stderr.contains("written on the driver"), "{stderr}");
    let table = dir.path().join(name);
    assert_eq!(
        table_rows(&table).await,
        input_rows(&input).await,
        "every input row exactly once"
    );
    // One version per batch, each with its batch id as the txn, and the files of at least
    // three tasks (one process writes one file per batch here).
    let log = commits(&table);
    assert_eq!(log.len(), 10, "{log:?}");
    for (batch, (adds, txn)) in log.iter().enumerate() {
        assert_eq!(*txn, Some(batch as i64), "{log:?}");
        assert!(adds.len() >= 3, "batch {batch}: {adds:?}");
    }
    let last = last_progress(&progress);
    assert_eq!(last["sink"]["numOutputRows"], 3000, "{last}");
    let tasks: u64 = last["cluster"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["tasks"].as_u64().unwrap())
        .sum();
    assert!(tasks >= 3, "{last}");
}

#[tokio::test]
async fn the_driver_killed_around_the_delta_commit_on_workers_replays_exactly() {
    let ws = Worker::three(None);
    for point in [
        weir_delta::POINT_BEFORE_COMMIT,
        weir_delta::POINT_AFTER_COMMIT,
        BEFORE_COMMIT_WRITE,
    ] {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 8, 100, 50);
        // Partitioned by status: the tasks write partition folders.
        let p = delta_pipeline(
            dir.path(),
            &refs(&ws),
            "",
            2,
            "delta",
            "partition-by = [\"status\"]",
        );
        let first = dir.path().join("p1.jsonl");
        let second = dir.path().join("p2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        assert_eq!(progress_batches(&second), vec![2, 3], "{point}");
        let table = dir.path().join("delta");
        assert_eq!(
            table_rows(&table).await,
            input_rows(&input).await,
            "{point}: every row once"
        );
        let log = commits(&table);
        let txns: Vec<Option<i64>> = log.iter().map(|c| c.1).collect();
        assert_eq!(txns, vec![Some(0), Some(1), Some(2), Some(3)], "{point}");
        assert!(
            log.iter()
                .flat_map(|c| &c.0)
                .all(|path| path.starts_with("status=")),
            "{point}: {log:?}"
        );
    }
}

#[tokio::test]
async fn a_table_with_a_check_constraint_is_written_on_the_driver_exactly() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 3, 100, 50);
    let table = dir.path().join("delta");
    // The first run creates the table (on the workers); a constraint is added outside, and
    // three more files arrive.
    let p = delta_pipeline(dir.path(), &refs(&ws), "", 3, "delta", "");
    let progress = dir.path().join("progress.jsonl");
    run_killing_a_worker(&p, &progress, &[], None);
    weir_delta::open(&table.clone().into(), 0)
        .await
        .unwrap()
        .add_constraint()
        .with_constraint("amount_known", "amount IS NOT NULL OR amount IS NULL")
        .await
        .unwrap();
    gen_orders_from(&input, 3, 3, 100, 50);
    let stderr = run_killing_a_worker(&p, &progress, &[], None);
    assert!(
        stderr.contains("written on the driver, not the workers: the table has CHECK constraints"),
        "{stderr}"
    );
    assert_eq!(table_rows(&table).await, input_rows(&input).await);
}

/// The input and the table on the S3 server, three workers: the tasks write the data files
/// to S3 and the driver commits them. The driver killed before a commit and after one, run
/// again: every row once, one version per batch with its txn, nothing left to replay.
#[tokio::test]
async fn delta_files_written_by_workers_to_s3_commit_once_after_driver_kills() {
    use weir_core::connector::{QueryIdentity, SinkVerifier, compare_append};
    use weir_testkit::run_weir;
    let ws = Worker::three(None);
    let dir = temp_dir();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let root = crate::storage::s3_location(&format!("weir-cluster/{id}"));
    let local_in = dir.path().join("in");
    gen_orders(&local_in, 8, 300, 100);
    crate::storage::upload_orders(&local_in, &root.join("in")).await;
    let sink = format!(
        "type = \"delta-append\"\npath = \"{}\"\npartition-by = [\"status\"]",
        root.join("delta").url_string()
    );
    let p = s3_cluster_pipeline(dir.path(), &ws, "delta-on-s3", &root, &sink);
    for fault in [
        format!("{}@1", weir_delta::POINT_BEFORE_COMMIT),
        format!("{}@2", weir_delta::POINT_AFTER_COMMIT),
    ] {
        let out = run_weir(&crate::bin(), &["run", p.to_str().unwrap()], Some(&fault));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{fault}: {err}");
    }
    let out = run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("written on the driver"), "{err}");
    let schema = crate::orders_schema();
    let input = crate::input_batches(&local_in).await;
    let delta = weir_delta::DeltaReader {
        at: root.join("delta"),
        app_id: None,
        strict_versions: true,
    };
    let got = delta.rows(&schema).await.unwrap();
    let mut all = compare_append("delta", &got, &input, &schema).unwrap();
    let cp = weir_core::checkpoint::Checkpoint::inspect(dir.path().join("chk").into())
        .await
        .unwrap()
        .unwrap();
    let query = QueryIdentity::of(&cp, "delta-on-s3");
    all.merge(delta.check_bookkeeping(&query, 3).await.unwrap());
    assert!(all.mismatches.is_empty(), "{:?}", all.mismatches);
    assert_eq!(all.rows, 2400);
}

/// A local table on a folder the workers do not share (each sees an empty tmpfs of its own
/// there): the driver finds the tasks' files missing and fails the batch, naming the file,
/// before committing anything.
#[tokio::test]
async fn a_local_table_the_workers_do_not_share_fails_the_batch_and_commits_nothing() {
    let dir = temp_dir();
    let table = dir.path().join("delta");
    std::fs::create_dir_all(&table).unwrap();
    let ws: Vec<Worker> = (0..3).map(|_| Worker::start_with_private(&table)).collect();
    gen_orders(&dir.path().join("in"), 6, 100, 50);
    let p = delta_pipeline(dir.path(), &refs(&ws), "", 3, "delta", "");
    let out = weir_testkit::run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("batch 0")
            && stderr.contains("that a worker wrote is not in the table's folder here"),
        "{stderr}"
    );
    assert!(!table.join("_delta_log").exists(), "nothing committed");
    assert_eq!(
        std::fs::read_dir(&table).unwrap().count(),
        0,
        "no file here"
    );
}

/// A value that does not fit the table's column, in every task: the batch fails with the
/// cause (column and value), whichever task's error reaches the driver, and nothing is
/// committed.
#[tokio::test]
async fn a_value_the_table_cannot_take_fails_on_the_workers_naming_column_and_value() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 3, 100, 50);
    let p = delta_pipeline(dir.path(), &refs(&ws), "", 3, "delta", "");
    run_killing_a_worker(&p, &dir.path().join("p1.jsonl"), &[], None);
    gen_orders_from(&input, 3, 3, 100, 50);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "SELECT order_id, status, amount, updated_at FROM batch",
        "SELECT order_id, status, 'oops' AS amount, updated_at FROM batch",
    ) + "max-batch-attempts = 1\n";
    std::fs::write(&p, text).unwrap();
    let out = weir_testkit::run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("batch 1") && stderr.contains("amount") && stderr.contains("'oops'"),
        "{stderr}"
    );
    assert_eq!(commits(&dir.path().join("delta")).len(), 1, "only batch 0");
}

/// A partition value that delta-rs escapes in its folder's name (`ü ß [x]` is written as
/// `status=%C3%BC%20...`): the driver finds the tasks' files where they are and commits.
#[tokio::test]
async fn an_escaped_partition_folder_written_by_the_workers_is_found_and_committed() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 3, 100, 50);
    std::fs::write(
        input.join("odd [1].json"),
        "{\"order_id\": 7, \"status\": \"ü ß [x]\", \"amount\": 1.5, \"updated_at\": \"2026-01-01T00:00:00Z\"}\n\
         {\"order_id\": 8, \"status\": null, \"amount\": null, \"updated_at\": null}\n",
    )
    .unwrap();
    let p = delta_pipeline(
        dir.path(),
        &refs(&ws),
        "",
        2,
        "delta",
        "partition-by = [\"status\"]",
    );
    run_killing_a_worker(&p, &dir.path().join("p.jsonl"), &[], None);
    assert_eq!(
        table_rows(&dir.path().join("delta")).await,
        input_rows(&input).await
    );
}
