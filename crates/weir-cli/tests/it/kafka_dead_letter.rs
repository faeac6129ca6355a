//! The Kafka source's dead letter (`dead-letter = "folder"`): each bad record (a value
//! that is not JSON of the schema, or a tombstone whose key cannot be a delete) goes to a
//! Parquet folder once, with its topic, partition, offset, error and batch id, through a
//! kill at every point of the batch while the next batch is read ahead; the sinks get every
//! sound record once, and the tombstones after a bad record in their partition still delete
//! the right key.

use std::collections::BTreeSet;

use weir_core::datafusion::prelude::SessionContext;
use weir_core::fault::RUNNER_POINTS;
use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use weir_testkit::{parquet_rows, rows, temp_dir};

use crate::kills::killed_in_batch_2_then_rerun;
use crate::tombstones::{an_hour_ago, at, new_topic};
use crate::{SCHEMA, bin};

/// Sends `value` (`None`: a tombstone) with `key` to `partition`; the record's offset.
async fn send(
    p: &FutureProducer,
    topic: &str,
    partition: i32,
    key: &str,
    value: Option<&str>,
    ts: i64,
) -> i64 {
    let mut r = FutureRecord::<str, str>::to(topic)
        .key(key)
        .partition(partition)
        .timestamp(ts);
    if let Some(v) = value {
        r = r.payload(v);
    }
    p.send(r, std::time::Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .unwrap()
        .offset
}

fn order(id: i64, status: &str, ms: i64) -> String {
    format!(
        "{{\"order_id\":{id},\"status\":\"{status}\",\"amount\":1.5,\"updated_at\":\"{}\"}}",
        at(ms)
    )
}

#[tokio::test]
async fn a_kafka_dead_letter_holds_each_bad_record_once_with_its_offset_through_kills() {
    let (bootstrap, topic, producer) = new_topic("dead_letter").await;
    let t0 = an_hour_ago();
    // Orders 0..30 (id % 3 is the partition); in each partition a cut value after its
    // third order and a number in quotes after its sixth; then a tombstone of 3 (deletes
    // it) and one whose key is not JSON, both in partition 0 after its bad values.
    let mut bad = BTreeSet::new();
    for id in 0..30 {
        let p = (id % 3) as i32;
        send(
            &producer,
            &topic,
            p,
            &format!("{{\"order_id\":{id}}}"),
            Some(&order(id, "new", t0 + id * 1000)),
            t0 + id * 1000,
        )
        .await;
        if id / 3 == 2 {
            let o = send(
                &producer,
                &topic,
                p,
                "k",
                Some("{\"order_id\": 5, \"sta"),
                t0,
            )
            .await;
            bad.insert(format!("{topic}|{p}|{o}|{{\"order_id\": 5, \"sta"));
        }
        if id / 3 == 5 {
            let v = "{\"order_id\": 6, \"amount\": \"7.25\"}";
            let o = send(&producer, &topic, p, "k", Some(v), t0).await;
            bad.insert(format!("{topic}|{p}|{o}|{v}"));
        }
    }
    send(&producer, &topic, 0, "{\"order_id\":3}", None, t0 + 60_000).await;
    let o = send(&producer, &topic, 0, "not json", None, t0 + 60_000).await;
    bad.insert(format!("{topic}|0|{o}|not json"));
    let mut want: Vec<String> = (0..30)
        .filter(|&id| id != 3)
        .map(|id| format!("{id}|new"))
        .collect();
    want.sort();

    for point in RUNNER_POINTS {
        let dir = temp_dir();
        let p = dir.path().join("pipeline.toml");
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"dead\"\ncheckpoint = \"chk\"\ntrigger = \"available-now\"\n\n\
                 [source]\ntype = \"kafka\"\nbootstrap-servers = \"{bootstrap}\"\n\
                 subscribe = [\"{topic}\"]\nmax-offsets-per-trigger = 8\nvalue-format = \"json\"\n\
                 schema = {SCHEMA}\ntombstones = \"delete\"\ntombstone-timestamp = \"updated_at\"\n\
                 dead-letter = \"dead letters ü\"\n\n\
                 [[sink]]\ntype = \"delta-merge\"\npath = \"merge\"\nkeys = [\"order_id\"]\n\
                 ordering = \"updated_at\"\n\n\
                 [[sink]]\ntype = \"parquet\"\npath = \"log\"\n"
            ),
        )
        .unwrap();
        let prog1 = dir.path().join("progress1.jsonl");
        let prog2 = dir.path().join("progress2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &prog1, &prog2);

        let merged =
            weir_delta::read_table(&SessionContext::new(), &dir.path().join("merge").into())
                .await
                .unwrap();
        let merged = rows(merged.select_columns(&["order_id", "status"]).unwrap()).await;
        assert_eq!(merged, want, "{point}: Delta MERGE");
        // The log holds every sound record once: 30 orders and the delete of 3.
        let log = parquet_rows(&dir.path().join("log"), &["order_id", "_deleted"]).await;
        assert_eq!(log.len(), 31, "{point}: {log:?}");
        assert_eq!(
            log.iter()
                .filter(|r| r.ends_with("|true"))
                .collect::<Vec<_>>(),
            ["3|true"],
            "{point}"
        );

        let dead = dir.path().join("dead letters ü");
        let letters = parquet_rows(&dead, &["topic", "partition", "offset", "record"]).await;
        assert_eq!(
            letters.len(),
            bad.len(),
            "{point}: each bad record once: {letters:?}"
        );
        assert_eq!(
            letters.iter().cloned().collect::<BTreeSet<_>>(),
            bad,
            "{point}"
        );
        let errors = parquet_rows(&dead, &["record", "error", "file", "line"]).await;
        for r in &errors {
            assert!(r.ends_with("||"), "{point}: no file for Kafka: {r}");
            if r.starts_with("not json") {
                assert!(r.contains("tombstone's key"), "{r}");
            } else if r.contains("7.25") {
                assert!(r.contains("cannot hold the string \"7.25\""), "{r}");
            }
        }
        // One file per batch that had bad records, each batch id the batch's.
        let ids = parquet_rows(&dead, &["batch_id"]).await;
        let batches: BTreeSet<&String> = ids.iter().collect();
        let files = std::fs::read_dir(&dead).unwrap().count();
        assert_eq!(batches.len(), files, "{point}: {ids:?}");
    }
}

/// A dead letter needs JSON values under DROPMALFORMED, and reads on this process only.
#[test]
fn a_kafka_dead_letter_is_refused_where_it_cannot_work() {
    let dir = temp_dir();
    let p = dir.path().join("pipeline.toml");
    for (extra, key) in [
        (
            "value-format = \"json\"\nschema = [\"id bigint\"]\nmode = \"PERMISSIVE\"\n\
             dead-letter = \"dead\"",
            "source.mode",
        ),
        (
            "value-format = \"raw\"\ndead-letter = \"dead\"",
            "source.dead-letter",
        ),
        // A folder of its own: not a sink's, nor in the checkpoint.
        (
            "value-format = \"json\"\nschema = [\"id bigint\"]\ndead-letter = \"out/dead\"",
            "source.dead-letter",
        ),
        (
            "value-format = \"json\"\nschema = [\"id bigint\"]\ndead-letter = \"chk/dead\"",
            "source.dead-letter",
        ),
    ] {
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"dead\"\ncheckpoint = \"chk\"\n\n\
                 [source]\ntype = \"kafka\"\nbootstrap-servers = \"127.0.0.1:1\"\n\
                 subscribe = [\"t\"]\n{extra}\n\n\
                 [[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
            ),
        )
        .unwrap();
        let out = weir_testkit::run_weir(&bin(), &["check", p.to_str().unwrap()], None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(key),
            "{extra}: {stderr}"
        );
    }
}

/// Two queries writing bad records to one dead-letter folder, or a new checkpoint over an
/// old folder, keep every query's letters: the files carry the query id.
#[tokio::test]
async fn queries_sharing_a_dead_letter_folder_keep_each_others_letters() {
    let dir = temp_dir();
    let mut bad = BTreeSet::new();
    let mut pipelines = Vec::new();
    for q in ["a", "b"] {
        let (bootstrap, topic, producer) = new_topic(&format!("shared_{q}")).await;
        let t0 = an_hour_ago();
        send(&producer, &topic, 0, "k", Some(&order(1, "new", t0)), t0).await;
        let o = send(&producer, &topic, 0, "k", Some("bad!"), t0).await;
        bad.insert(format!("{topic}|0|{o}"));
        let p = dir.path().join(format!("{q}.toml"));
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"{q}\"\ncheckpoint = \"chk-{q}\"\ntrigger = \"available-now\"\n\n\
                 [source]\ntype = \"kafka\"\nbootstrap-servers = \"{bootstrap}\"\n\
                 subscribe = [\"{topic}\"]\nvalue-format = \"json\"\nschema = {SCHEMA}\n\
                 dead-letter = \"dead\"\n\n[[sink]]\ntype = \"parquet\"\npath = \"out-{q}\"\n"
            ),
        )
        .unwrap();
        pipelines.push(p);
    }
    let run = |p: &std::path::Path| {
        let out = weir_testkit::run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for p in &pipelines {
        run(p);
    }
    // Query a starts over on a new checkpoint: its batch 0 again, its letter again.
    std::fs::remove_dir_all(dir.path().join("chk-a")).unwrap();
    std::fs::remove_dir_all(dir.path().join("out-a")).unwrap();
    run(&pipelines[0]);
    let letters = parquet_rows(&dir.path().join("dead"), &["topic", "partition", "offset"]).await;
    let a = bad.iter().next().unwrap().clone();
    let mut want: Vec<String> = bad.into_iter().chain([a]).collect();
    want.sort();
    assert_eq!(letters, want);
}
