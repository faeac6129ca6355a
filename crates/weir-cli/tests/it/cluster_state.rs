//! Stateful steps with `[cluster]`: the reads and the steps before the first stateful one
//! run on three `weir worker` processes, and so do the state partitions of a deduplication
//! and of an aggregation. Every key passes once through a worker SIGKILLed and
//! restarted mid-run, a deduplication within the watermark and a windowed count give what
//! an uninterrupted run gives through kills of the driver at its fault points.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use weir_core::fault::{AFTER_STATE_COMMIT, AFTER_USER_FN, BEFORE_STATE_COMMIT};
use weir_testkit::{parquet_rows, temp_dir};

use crate::cluster::{COLS, Worker, progress_reports, refs, run_through_a_worker_kill, tasks_of};
use crate::kills::killed_in_batch_2_then_rerun;
use crate::{gen_orders, input_rows, pipeline_with, progress_batches, run_to_end};

/// The orders pipeline with `transform` and a Parquet sink, `state-partitions = 4`, on
/// `workers` (in one process when there are none).
fn stateful_pipeline(
    dir: &Path,
    workers: &[&Worker],
    transform: &str,
    max_files: usize,
) -> std::path::PathBuf {
    let cluster = if workers.is_empty() {
        String::new()
    } else {
        let urls: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.url)).collect();
        format!(
            "[cluster]\nworkers = [{}]\nconnect-timeout = \"2s\"\nmax-batch-attempts = 4\n",
            urls.join(", ")
        )
    };
    let p = pipeline_with(
        dir,
        max_files,
        &format!("{transform}\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n\n{cluster}"),
    );
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "trigger = \"available-now\"\n",
        "trigger = \"available-now\"\nstate-partitions = 4\n",
    );
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn a_dedupe_on_a_cluster_passes_each_key_once_through_a_worker_kill() {
    let mut ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 30, 2000, 20_000);
    let p = stateful_pipeline(
        dir.path(),
        &refs(&ws),
        "[transform]\ndrop-duplicates = [\"order_id\"]\n",
        3,
    );
    let progress = dir.path().join("progress.jsonl");
    run_through_a_worker_kill(&p, &progress, &mut ws, 1, 10);

    let all = input_rows(&input).await;
    let inputs: BTreeSet<&str> = all.iter().map(String::as_str).collect();
    let keys: BTreeSet<&str> = all.iter().map(|r| r.split('|').next().unwrap()).collect();
    let got = parquet_rows(&dir.path().join("out"), &COLS).await;
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for row in &got {
        assert!(inputs.contains(row.as_str()), "{row} is not an input row");
        *per_key.entry(row.split('|').next().unwrap()).or_default() += 1;
    }
    assert_eq!(got.len(), keys.len(), "one row per key");
    assert!(per_key.values().all(|n| *n == 1));
    assert_eq!(per_key.keys().copied().collect::<BTreeSet<_>>(), keys);

    // Another run on the same input, without kills, passes the very same rows: the
    // workers' rows are put in a fixed order before the state sees them.
    // (The same files written in the same order: the source takes them by time, then name.)
    let again = temp_dir();
    gen_orders(&again.path().join("in"), 30, 2000, 20_000);
    let p2 = stateful_pipeline(
        again.path(),
        &refs(&ws),
        "[transform]\ndrop-duplicates = [\"order_id\"]\n",
        3,
    );
    run_to_end(&p2, &again.path().join("progress.jsonl"));
    let second = parquet_rows(&again.path().join("out"), &COLS).await;
    let differ: Vec<(&String, &String)> = got.iter().zip(&second).filter(|(a, b)| a != b).collect();
    assert!(
        second.len() == got.len() && differ.is_empty(),
        "two runs pass the same row of each key: {} and {} rows, {} differ, e.g. {:?}",
        got.len(),
        second.len(),
        differ.len(),
        &differ[..differ.len().min(3)]
    );

    let reports = progress_reports(&progress);
    let read: u64 = reports
        .iter()
        .map(|r| r["numInputRows"].as_u64().unwrap())
        .sum();
    assert_eq!(read, 60_000, "the workers read every row once");
    assert!(tasks_of(&reports) > 0, "the workers ran the reads");
    let op = &reports.last().unwrap()["stateOperators"][0];
    assert_eq!(op["numRowsTotal"], keys.len() as u64, "{op}");
    assert_eq!(op["numStateStoreInstances"], 4, "{op}");
}

/// A deduplication within the watermark runs its state partitions on the workers: each
/// partition is loaded and committed by one worker's task every batch, and kills of the
/// driver around its state commit (after the workers committed version N+1) replay the
/// batch to the very rows, state and watermark of an uninterrupted run.
#[tokio::test]
async fn a_dedupe_within_the_watermark_keeps_its_state_on_the_workers_through_driver_kills() {
    let ws = Worker::three(None);
    let transform = r#"[transform]
with-watermark = { column = "updated_at", delay = "30 seconds" }
drop-duplicates-within-watermark = ["order_id"]
"#;
    let run = |kill: Option<&str>| {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 8, 400, 300);
        let p = stateful_pipeline(dir.path(), &refs(&ws), transform, 2);
        let (first, second) = (dir.path().join("p1.jsonl"), dir.path().join("p2.jsonl"));
        match kill {
            Some(point) => {
                killed_in_batch_2_then_rerun(&p, point, &first, &second);
                assert_eq!(progress_batches(&second).first(), Some(&2), "{point}");
            }
            None => {
                run_to_end(&p, &second);
            }
        }
        let last = progress_reports(&second).pop().unwrap();
        (dir, last)
    };
    let (alone, last) = run(None);
    let want = parquet_rows(&alone.path().join("out"), &COLS).await;
    let op = &last["stateOperators"][0];
    assert_eq!(op["operatorName"], "dedupeWithinWatermark", "{op}");
    assert!(
        op["numRowsRemoved"].as_u64().unwrap() > 0,
        "keys expired: {op}"
    );
    // Every batch, each of the 4 partitions was committed by a worker, once: the last one
    // (no rows: the watermark moved) too. And each stays on one worker from batch to
    // batch (where it is kept in memory) while no worker changes.
    let mut by_batch: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut owners: BTreeMap<u32, BTreeSet<usize>> = BTreeMap::new();
    for (w, worker) in ws.iter().enumerate() {
        for line in worker.log_lines() {
            let Some(rest) = line.split("batch ").nth(1) else {
                continue;
            };
            let Some((batch, list)) = rest.split_once(": state partitions [") else {
                continue;
            };
            let list = list.split(']').next().unwrap();
            for p in list.split(", ").filter(|p| !p.is_empty()) {
                let p: u32 = p.parse().unwrap();
                by_batch.entry(batch.parse().unwrap()).or_default().push(p);
                owners.entry(p).or_default().insert(w);
            }
        }
    }
    let last_id = last["batchId"].as_u64().unwrap();
    assert_eq!(by_batch.len() as u64, last_id + 1, "{by_batch:?}");
    for (batch, mut parts) in by_batch {
        parts.sort_unstable();
        assert_eq!(parts, [0, 1, 2, 3], "batch {batch}");
    }
    assert!(owners.values().all(|w| w.len() == 1), "{owners:?}");
    let keys = want.len();
    for point in [AFTER_USER_FN, BEFORE_STATE_COMMIT, AFTER_STATE_COMMIT] {
        let (dir, again) = run(Some(point));
        let got = parquet_rows(&dir.path().join("out"), &COLS).await;
        assert_eq!(got, want, "{point}: the rows of an uninterrupted run");
        let op2 = &again["stateOperators"][0];
        assert_eq!(op2["numRowsTotal"], op["numRowsTotal"], "{point}: {op2}");
        assert_eq!(again["eventTime"], last["eventTime"], "{point}");
        assert_eq!(got.len(), keys);
    }
}

/// A windowed count and max (order-free aggregates) on the cluster, its state partitions
/// on the workers and the driver killed in batch 2 around its state commit, equals one
/// process's uninterrupted run.
#[tokio::test]
async fn a_windowed_count_on_a_cluster_through_driver_kills_equals_one_process() {
    let ws = Worker::three(None);
    let transform = r#"[transform]
with-watermark = { column = "updated_at", delay = "30 seconds" }

[transform.aggregate]
group-by = ["status"]
window = { column = "updated_at", size = "1 minute" }
aggregates = ["count(*) AS n", "max(amount) AS top", "min(updated_at) AS first"]
output-mode = "append"
"#;
    let cols = ["status", "window_start", "window_end", "n", "top", "first"];
    let alone = {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 8, 400, 300);
        let p = stateful_pipeline(dir.path(), &[], transform, 2);
        let last = run_to_end(&p, &dir.path().join("p.jsonl"));
        assert!(last["cluster"].is_null(), "{last}");
        parquet_rows(&dir.path().join("out"), &cols).await
    };
    assert!(alone.len() > 4, "windows closed: {alone:?}");
    for point in [AFTER_USER_FN, BEFORE_STATE_COMMIT, AFTER_STATE_COMMIT] {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 8, 400, 300);
        let p = stateful_pipeline(dir.path(), &refs(&ws), transform, 2);
        let (first, second) = (dir.path().join("p1.jsonl"), dir.path().join("p2.jsonl"));
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        assert_eq!(
            progress_batches(&second).first(),
            Some(&2),
            "{point}: batch 2 again"
        );
        let reports = progress_reports(&second);
        assert!(tasks_of(&reports) > 0, "{point}: the workers ran the reads");
        let got = parquet_rows(&dir.path().join("out"), &cols).await;
        assert_eq!(
            got, alone,
            "{point}: the cluster's windows are one process's"
        );
    }
    // The aggregation's state partitions were worked and committed on the workers.
    let lines: Vec<String> = ws.iter().flat_map(Worker::log_lines).collect();
    let batch_2: BTreeSet<u32> = lines
        .iter()
        .filter_map(|l| l.split("batch 2: state partitions [").nth(1))
        .flat_map(|rest| {
            let list = rest.split(']').next().unwrap_or_default();
            list.split(", ")
                .filter(|p| !p.is_empty())
                .map(|p| p.parse::<u32>().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(batch_2, BTreeSet::from([0, 1, 2, 3]), "{lines:?}");
}

/// A sliding-window aggregation in update mode on three workers, one of them SIGKILLed
/// and started again mid-run, gives every row one process gives: the partitions the dead
/// worker held are loaded again from the checkpoint by the attempt that follows.
#[tokio::test]
async fn a_sliding_window_aggregation_through_a_worker_kill_equals_one_process() {
    let mut ws = Worker::three(None);
    let transform = r#"[transform]
with-watermark = { column = "updated_at", delay = "30 seconds" }

[transform.aggregate]
group-by = ["status"]
window = { column = "updated_at", size = "2 minutes", slide = "1 minute" }
aggregates = ["count(*) AS n", "max(amount) AS top", "approx_count_distinct(order_id) AS ids"]
output-mode = "update"
"#;
    // Order-free aggregates: a floating-point sum's last bits depend on the order it adds
    // in, which a shuffle does not keep (each task sorts its rows, so a replay on the
    // cluster gives the same bits; one process adds in file order).
    let cols = ["status", "window_start", "window_end", "n", "top", "ids"];
    let run = |workers: &[&Worker]| {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 12, 400, 300);
        let p = stateful_pipeline(dir.path(), workers, transform, 2);
        (dir, p)
    };
    let (alone, p) = run(&[]);
    let last = run_to_end(&p, &alone.path().join("p.jsonl"));
    let want = parquet_rows(&alone.path().join("out"), &cols).await;
    let batches = last["batchId"].as_u64().unwrap() + 1;
    let (dir, p) = run(&refs(&ws));
    let progress = dir.path().join("p.jsonl");
    run_through_a_worker_kill(&p, &progress, &mut ws, 2, batches);
    let got = parquet_rows(&dir.path().join("out"), &cols).await;
    assert_eq!(got, want, "the cluster's rows are one process's");
    let again = progress_reports(&progress).pop().unwrap();
    assert_eq!(
        again["stateOperators"][0]["numRowsTotal"], last["stateOperators"][0]["numRowsTotal"],
        "{again}"
    );
}

/// A query refused for its `state-partitions` touches no sink: a new Parquet folder is not
/// claimed (a fresh checkpoint could not write to it afterwards).
#[tokio::test]
async fn a_query_refused_for_its_state_partitions_touches_no_sink() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 4, 100, 50);
    let p = stateful_pipeline(
        dir.path(),
        &[],
        "[transform]\ndrop-duplicates = [\"order_id\"]\n",
        2,
    );
    run_to_end(&p, &dir.path().join("p1.jsonl"));
    let chk = dir.path().join("chk");
    let shown = weir_testkit::run_weir(
        &crate::bin(),
        &["checkpoint", "show", chk.to_str().unwrap()],
        None,
    );
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("operator 0: dedupe, 4 partition(s)"),
        "{shown}"
    );
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("state-partitions = 4", "state-partitions = 5")
        .replace("path = \"out\"", "path = \"out_new\"");
    std::fs::write(&p, text).unwrap();
    // `weir check --connect` reads the state's metadata and says so before any run.
    let out = weir_testkit::run_weir(
        &crate::bin(),
        &["check", "--connect", p.to_str().unwrap()],
        None,
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("FAILED   checkpoint")
            && said.contains("query.state-partitions")
            && said.contains("written in 4 partition"),
        "{said}"
    );
    let out = weir_testkit::run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("query.state-partitions") && err.contains("4 partition"),
        "{err}"
    );
    let claimed = std::fs::read_dir(dir.path().join("out_new"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(claimed, 0, "the refused query wrote into out_new");
}

/// A malformed record read on a worker is the file's: the batch fails at once, naming it,
/// instead of running again on the other workers.
#[tokio::test]
async fn a_malformed_record_on_a_worker_fails_the_batch_without_retries() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 4, 100, 50);
    std::fs::write(
        input.join("orders-00002.json"),
        "{\"order_id\": 1, \"status\": \"new\", \"amount\": NaN}\n",
    )
    .unwrap();
    let p = stateful_pipeline(
        dir.path(),
        &refs(&ws),
        "[transform]\ndrop-duplicates = [\"order_id\"]\n",
        4,
    );
    let out = weir_testkit::run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("orders-00002.json"), "{err}");
    assert!(err.contains("attempt 1 of 4"), "{err}");
    assert!(
        !err.contains("attempt 2"),
        "a data error is not retried: {err}"
    );
}

/// The same for a malformed Kafka value read on a worker: it is the topic's, and the batch
/// fails at its first attempt naming the topic, partition and offset.
#[tokio::test]
async fn a_malformed_kafka_value_on_a_worker_fails_the_batch_without_retries() {
    use weir_kafka::rdkafka::ClientConfig;
    use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let ws = Worker::three(None);
    let dir = temp_dir();
    let topic = "cluster_malformed";
    crate::kills::kafka_topic_with_orders(topic, 50).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &weir_testkit::kafka().bootstrap)
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<(), _>::to(topic)
                .partition(1)
                .payload("{not json"),
            std::time::Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let p = crate::cluster_kafka::kafka_cluster_pipeline(
        dir.path(),
        topic,
        1000,
        &refs(&ws),
        "max-batch-attempts = 4",
    );
    let out = weir_testkit::run_weir(&crate::bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("malformed record in topic cluster_malformed partition 1 at offset 50"),
        "{err}"
    );
    assert!(err.contains("attempt 1 of 4"), "{err}");
    assert!(
        !err.contains("attempt 2"),
        "a data error is not retried: {err}"
    );
}
