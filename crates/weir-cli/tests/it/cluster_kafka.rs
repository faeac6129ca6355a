//! `weir run` with `[cluster]` reading Kafka: each batch's recorded offset ranges are read
//! on the workers, and every record lands once through kills of the driver and of a worker.

use std::path::Path;

use weir_core::fault::{AFTER_OFFSETS_WRITE, AFTER_USER_FN, BEFORE_COMMIT_WRITE};
use weir_testkit::{parquet_rows, temp_dir};

use crate::cluster::*;
use crate::kills::{kafka_topic_with_orders, killed_in_batch_2_then_rerun};
use crate::{SCHEMA, progress_batches};

/// A Kafka pipeline on `workers`: JSON orders of `topic`, `per_batch` records a batch, into
/// Parquet.
pub(crate) fn kafka_cluster_pipeline(
    dir: &Path,
    topic: &str,
    per_batch: u64,
    workers: &[&Worker],
    extra: &str,
) -> std::path::PathBuf {
    let urls: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.url)).collect();
    let p = dir.join("pipeline.toml");
    std::fs::write(
        &p,
        format!(
            r#"[query]
name = "orders"
checkpoint = "chk"
trigger = "available-now"

[source]
type = "kafka"
bootstrap-servers = "{}"
subscribe = ["{topic}"]
max-offsets-per-trigger = {per_batch}
value-format = "json"
schema = {SCHEMA}

[[sink]]
type = "parquet"
path = "out"

[cluster]
workers = [{}]
connect-timeout = "2s"
{extra}
"#,
            weir_testkit::kafka().bootstrap,
            urls.join(", ")
        ),
    )
    .unwrap();
    p
}

/// Each batch's Kafka ranges are read on the workers, a partition per task; the driver
/// killed at its fault points replays the same ranges there, and every record lands once.
#[tokio::test]
async fn kafka_ranges_are_read_on_the_workers_and_a_killed_driver_replays_them_exactly() {
    let ws = Worker::three(None);
    for (n, point) in [AFTER_OFFSETS_WRITE, AFTER_USER_FN, BEFORE_COMMIT_WRITE]
        .into_iter()
        .enumerate()
    {
        let topic = format!("cluster_orders_{n}");
        let sent = kafka_topic_with_orders(&topic, 20).await;
        let dir = temp_dir();
        let p = kafka_cluster_pipeline(dir.path(), &topic, 15, &refs(&ws), "");
        let first = dir.path().join("p1.jsonl");
        let second = dir.path().join("p2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        assert_eq!(progress_batches(&first), vec![0, 1], "{point}");
        assert_eq!(
            progress_batches(&second),
            vec![2, 3],
            "{point}: same ids again"
        );
        let got = parquet_rows(&dir.path().join("out"), &["order_id", "status"]).await;
        assert_eq!(got, sent, "{point}: each record exactly once");
        // 15 records a batch over 3 partitions: three tasks, one per worker, 5 rows each.
        let text = std::fs::read_to_string(&first).unwrap();
        for line in text.lines() {
            let report: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(report["numInputRows"], 15, "{report}");
            let workers = report["cluster"]["workers"].as_array().unwrap().clone();
            assert_eq!(workers.len(), 3, "{report}");
            for w in &workers {
                assert_eq!(w["tasks"], 1, "{report}");
                assert_eq!(w["inputRows"], 5, "{report}");
            }
        }
    }
}

#[tokio::test]
async fn a_worker_killed_mid_run_on_kafka_loses_and_repeats_no_record() {
    let mut ws = Worker::three(None);
    let sent = kafka_topic_with_orders("cluster_worker_kill", 1500).await;
    let dir = temp_dir();
    let p = kafka_cluster_pipeline(
        dir.path(),
        "cluster_worker_kill",
        300,
        &refs(&ws),
        "max-batch-attempts = 4",
    );
    let progress = dir.path().join("progress.jsonl");
    let stderr = run_through_a_worker_kill(&p, &progress, &mut ws, 2, 15);
    let got = parquet_rows(&dir.path().join("out"), &["order_id", "status"]).await;
    assert_eq!(got.len(), 4500, "{stderr}");
    assert_eq!(got, sent, "every record exactly once");
}
