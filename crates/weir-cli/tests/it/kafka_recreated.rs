//! A Kafka topic deleted and made again with more records than the query had read: the
//! recorded offsets lie inside the new topic, so no offset check sees it, and Spark skips
//! the new topic's first records silently. weir compares the record before each batch's
//! start with the one an earlier run read there (kept in the checkpoint), and stops with
//! data loss, or reads on with `fail-on-data-loss = false`, saying so.

use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use weir_testkit::{parquet_rows, run_weir, temp_dir};

use crate::tombstones::new_topic;
use crate::{SCHEMA, bin};

async fn produce(p: &FutureProducer, topic: &str, ids: std::ops::Range<i64>, status: &str) {
    for id in ids {
        let v = format!(
            "{{\"order_id\":{id},\"status\":\"{status}\",\"amount\":1.5,\"updated_at\":\"2026-01-01T00:00:00Z\"}}"
        );
        let r = FutureRecord::<str, str>::to(topic).payload(&v).partition(0);
        p.send(r, std::time::Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
}

#[tokio::test]
async fn a_topic_made_again_with_more_records_is_data_loss_not_a_silent_skip() {
    let (bootstrap, topic, producer) = new_topic("remade").await;
    produce(&producer, &topic, 0..10, "old").await;
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
                 [[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
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
    produce(&producer, &topic, 100..125, "new").await;

    let out = run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a silent skip: {stderr}");
    assert!(
        stderr.contains("data loss")
            && stderr.contains(&format!("topic {topic} partition 0"))
            && stderr.contains("the record at offset 9")
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
    assert!(stderr.contains("deleted and made again"), "{stderr}");
    let got = parquet_rows(&out_dir, &["order_id", "status"]).await;
    assert_eq!(got.len(), 10 + 15, "{got:?}");
    assert_eq!(got.iter().filter(|r| r.ends_with("|new")).count(), 15);
}
