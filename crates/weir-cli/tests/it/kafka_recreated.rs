//! A Kafka topic deleted and made again with more records than the query had read: the
//! recorded offsets lie inside the new topic, so no offset check sees it, and Spark skips
//! the new topic's first records silently. weir compares the record before each batch's
//! start with the one an earlier run read there (kept in the checkpoint), and stops with
//! data loss, or reads on with `fail-on-data-loss = false`, saying so.

use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use weir_testkit::{parquet_rows, run_weir, temp_dir};

use crate::tombstones::new_topic;
use crate::{SCHEMA, bin};

/// Records `ids` into `topic`, record `i` into partition `i % parts`.
async fn produce(
    p: &FutureProducer,
    topic: &str,
    ids: std::ops::Range<i64>,
    status: &str,
    parts: i64,
) {
    for id in ids {
        let v = format!(
            "{{\"order_id\":{id},\"status\":\"{status}\",\"amount\":1.5,\"updated_at\":\"2026-01-01T00:00:00Z\"}}"
        );
        let r = FutureRecord::<str, str>::to(topic)
            .payload(&v)
            .partition((id % parts) as i32);
        p.send(r, std::time::Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
}

#[tokio::test]
async fn a_topic_made_again_with_more_records_is_data_loss_not_a_silent_skip() {
    made_again(&[]).await;
}

/// The same with the reads on three workers: the plan carries the driver's marks, each
/// task checks its ranges, and the driver keeps the marks of the ranges read there.
#[tokio::test]
async fn a_topic_made_again_is_data_loss_on_a_cluster_s_workers_too() {
    let ws = crate::cluster::Worker::three(None);
    made_again(&crate::cluster::refs(&ws)).await;
}

/// Reads a topic, deletes and makes it again with more records, and runs again on the
/// same checkpoint: data loss, then with `fail-on-data-loss = false` a warning and the
/// new records read; on `workers` when there are any.
async fn made_again(workers: &[&crate::cluster::Worker]) {
    let cluster = match workers {
        [] => String::new(),
        ws => {
            let urls: Vec<String> = ws.iter().map(|w| format!("\"{}\"", w.url)).collect();
            format!("\n[cluster]\nworkers = [{}]\n", urls.join(", "))
        }
    };
    // On a cluster two partitions have records, so each batch's read is two tasks (one
    // task would run in the driver): the old topic's offsets 0..5 in each.
    let parts = if workers.is_empty() { 1 } else { 2 };
    let (bootstrap, topic, producer) = new_topic("remade").await;
    produce(&producer, &topic, 0..10, "old", parts).await;
    let dir = temp_dir();
    let p = dir.path().join("pipeline.toml");
    let write = |extra: &str| {
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"remade\"\ncheckpoint = \"chk\"\ntrigger = \"available-now\"\n\n\
                 [source]\ntype = \"kafka\"\nbootstrap-servers = \"{bootstrap}\"\n\
                 subscribe = [\"{topic}\"]\nmax-offsets-per-trigger = 4\nvalue-format = \"json\"\n\
                 schema = {SCHEMA}\n{extra}\n\n\
                 [[sink]]\ntype = \"parquet\"\npath = \"out\"\n{cluster}"
            ),
        )
        .unwrap();
    };
    write("");
    let run = || run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let out = run();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out_dir = dir.path().join("out");
    assert_eq!(parquet_rows(&out_dir, &["order_id"]).await.len(), 10);

    // The topic goes and comes back with 25 records (a new run: the marks come from the
    // checkpoint).
    weir_kafka::delete_topic(&bootstrap, &topic).await.unwrap();
    let mut made = false;
    for _ in 0..50 {
        if weir_kafka::create_topic(&bootstrap, &topic, 3)
            .await
            .is_ok()
        {
            made = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(made, "the topic could not be made again");
    produce(&producer, &topic, 100..125, "new", parts).await;

    let out = run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a silent skip: {stderr}");
    assert!(
        stderr.contains("data loss")
            && stderr.contains(&format!("topic {topic} partition "))
            && stderr.contains(&format!("the record at offset {}", 10 / parts - 1))
            && stderr.contains("deleted and made again"),
        "{stderr}"
    );
    assert_eq!(
        parquet_rows(&out_dir, &["order_id"]).await.len(),
        10,
        "nothing of the new topic was written"
    );

    // Told to carry on, the query reads on from its offsets, warning.
    write("fail-on-data-loss = false");
    let out = run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The warning is the reader's: the driver's, or on a cluster the worker's that read.
    let said = match workers {
        [] => stderr.to_string(),
        ws => ws
            .iter()
            .flat_map(|w| w.log_lines())
            .collect::<Vec<_>>()
            .join("\n"),
    };
    assert!(said.contains("deleted and made again"), "{said}");
    let got = parquet_rows(&out_dir, &["order_id", "status"]).await;
    assert_eq!(got.len(), 10 + 15, "{got:?}");
    assert_eq!(got.iter().filter(|r| r.ends_with("|new")).count(), 15);
}
