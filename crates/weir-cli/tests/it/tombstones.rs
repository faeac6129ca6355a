//! Kafka tombstones (`tombstones = "delete"`): a null value deletes its key in the Delta
//! MERGE and PostgreSQL upsert sinks, ordered like any other change (by the record's Kafka
//! timestamp in the ordering column), across batches and through kills between the sinks'
//! durable steps.

use weir_core::datafusion::prelude::SessionContext;
use weir_kafka::rdkafka::ClientConfig;
use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use weir_testkit::{rows, run_weir, temp_dir};

use crate::{SCHEMA, bin};

/// An hour ago, to the second (the broker's retention drops records with old timestamps).
pub(crate) fn an_hour_ago() -> i64 {
    (chrono::Utc::now().timestamp() - 3600) * 1000
}

pub(crate) fn at(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A new topic of 3 partitions named from `prefix` on the test broker, and a producer:
/// the broker's address, the topic and the producer.
pub(crate) async fn new_topic(prefix: &str) -> (String, String, FutureProducer) {
    let bootstrap = weir_testkit::kafka().bootstrap.clone();
    let topic = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    weir_kafka::create_topic(&bootstrap, &topic, 3)
        .await
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    (bootstrap, topic, producer)
}

async fn send(p: &FutureProducer, topic: &str, id: i64, value: Option<(&str, i64)>, ts: i64) {
    let key = format!("{{\"order_id\":{id}}}");
    let body = value.map(|(status, updated)| {
        format!(
            "{{\"order_id\":{id},\"status\":\"{status}\",\"amount\":1.5,\"updated_at\":\"{}\"}}",
            at(updated)
        )
    });
    let mut r = FutureRecord::<str, str>::to(topic)
        .key(&key)
        .partition((id % 3) as i32)
        .timestamp(ts);
    if let Some(b) = &body {
        r = r.payload(b);
    }
    p.send(r, std::time::Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

#[tokio::test]
async fn tombstones_delete_their_keys_in_delta_merge_and_postgres_through_kills() {
    let (bootstrap, topic, producer) = new_topic("tomb").await;
    // Upserts of 0..30 at t0 + id s; tombstones of 0..10 and 20 half an hour later; 25's
    // tombstone at exactly its upsert's time (a delete wins a tie); 5..8 come back at 40
    // minutes; 12 gets a tombstone older than its upsert (which therefore stays).
    let t0 = an_hour_ago();
    for id in 0..30 {
        send(
            &producer,
            &topic,
            id,
            Some(("new", t0 + id * 1000)),
            t0 + id * 1000,
        )
        .await;
    }
    for id in (0..10).chain([20]) {
        send(&producer, &topic, id, None, t0 + 1_800_000).await;
    }
    send(&producer, &topic, 25, None, t0 + 25_000).await;
    send(&producer, &topic, 12, None, t0).await;
    for id in 5..8 {
        send(
            &producer,
            &topic,
            id,
            Some(("back", t0 + 2_400_000)),
            t0 + 2_400_000,
        )
        .await;
    }
    let mut want: Vec<String> = (10..30)
        .filter(|id| ![20, 25].contains(id))
        .map(|id| format!("{id}|new"))
        .chain((5..8).map(|id| format!("{id}|back")))
        .collect();
    want.sort();

    let dir = temp_dir();
    let pg = &weir_testkit::postgres().url;
    let table = format!("tomb_{}", &topic[5..17]);
    let p = dir.path().join("pipeline.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"tombstones\"\ncheckpoint = \"chk\"\ntrigger = \"available-now\"\n\n\
             [source]\ntype = \"kafka\"\nbootstrap-servers = \"{bootstrap}\"\nsubscribe = [\"{topic}\"]\n\
             max-offsets-per-trigger = 7\nvalue-format = \"json\"\nschema = {SCHEMA}\n\
             tombstones = \"delete\"\ntombstone-timestamp = \"updated_at\"\n\n\
             [[sink]]\ntype = \"delta-merge\"\npath = \"merge\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n\n\
             [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{pg}\"\ntable = \"{table}\"\n\
             keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
             [[sink]]\ntype = \"parquet\"\npath = \"log\"\n"
        ),
    )
    .unwrap();
    for fault in [
        format!("{}@1", weir_delta::POINT_AFTER_COMMIT),
        format!("{}@3", weir_postgres::POINT_BEFORE_COMMIT),
        format!("{}@4", weir_postgres::POINT_AFTER_COMMIT),
    ] {
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], Some(&fault));
        assert!(
            !out.status.success(),
            "{fault}: the fault was not reached: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ctx = SessionContext::new();
    let merged = weir_delta::read_table(&ctx, &dir.path().join("merge").into())
        .await
        .unwrap();
    let names: Vec<String> = merged
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    assert!(!names.contains(&"_deleted".to_string()), "{names:?}");
    let delta = rows(merged.select_columns(&["order_id", "status"]).unwrap()).await;
    assert_eq!(delta, want, "Delta MERGE");
    let stored =
        weir_testkit::pg_rows(pg, &format!("SELECT order_id::text, status FROM {table}")).await;
    assert_eq!(stored, want, "PostgreSQL upsert");
    let columns = weir_testkit::pg_rows(
        pg,
        &format!(
            "SELECT column_name::text FROM information_schema.columns WHERE table_name = '{table}'"
        ),
    )
    .await;
    assert!(!columns.contains(&"_deleted".to_string()), "{columns:?}");
    // The Parquet log holds every record once, the tombstones with `_deleted` true.
    let log = weir_testkit::parquet_rows(&dir.path().join("log"), &["order_id", "_deleted"]).await;
    assert_eq!(log.len(), 30 + 11 + 2 + 3, "{log:?}");
    assert_eq!(log.iter().filter(|r| r.ends_with("|true")).count(), 13);
}

/// `tombstones = "skip"` drops them and counts them in the progress; `"row"` (the default)
/// keeps Spark's row of NULLs; a delete whose key is not a JSON object stops the query
/// under FAILFAST, naming the record.
#[tokio::test]
async fn tombstones_are_skipped_and_counted_kept_as_null_rows_or_refused_without_a_key_object() {
    let (bootstrap, topic, producer) = new_topic("tomb_modes").await;
    let t0 = an_hour_ago();
    for id in 0..6 {
        send(&producer, &topic, id, Some(("new", t0)), t0).await;
    }
    for id in [1, 4] {
        send(&producer, &topic, id, None, t0).await;
    }
    let bad = FutureRecord::<str, str>::to(&topic)
        .key("not json")
        .partition(0);
    producer
        .send(bad, std::time::Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let dir = temp_dir();
    let p = dir.path().join("pipeline.toml");
    for (mode, rows_out, nulls) in [
        ("skip", Some(6), 0),
        ("row", Some(9), 3),
        ("delete", None, 0),
        // A key that cannot be a delete is a bad record like any other: dropped, or kept
        // with its key in _corrupt_record.
        ("delete\"\nmode = \"DROPMALFORMED", Some(8), 0),
        ("delete\"\nmode = \"PERMISSIVE", Some(9), 1),
    ] {
        let tag = mode.len();
        let out_dir = dir.path().join(format!("out_{tag}"));
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"t\"\ncheckpoint = \"chk_{tag}\"\n\n\
                 [source]\ntype = \"kafka\"\nbootstrap-servers = \"{bootstrap}\"\nsubscribe = [\"{topic}\"]\n\
                 value-format = \"json\"\nschema = {SCHEMA}\ntombstones = \"{mode}\"\n\n\
                 [[sink]]\ntype = \"parquet\"\npath = \"{}\"\n",
                out_dir.display()
            ),
        )
        .unwrap();
        let progress = dir.path().join(format!("progress_{tag}.jsonl"));
        let out = run_weir(
            &bin(),
            &[
                "run",
                p.to_str().unwrap(),
                "--progress",
                progress.to_str().unwrap(),
            ],
            None,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        match rows_out {
            Some(n) => {
                assert!(out.status.success(), "{mode}: {err}");
                let got = weir_testkit::parquet_rows(&out_dir, &["order_id", "status"]).await;
                assert_eq!(got.len(), n, "{mode}: {got:?}");
                assert_eq!(got.iter().filter(|r| r.as_str() == "|").count(), nulls);
                if mode.ends_with("PERMISSIVE") {
                    let kept = weir_testkit::parquet_rows(&out_dir, &["_corrupt_record"]).await;
                    assert!(kept.iter().any(|r| r == "not json"), "{kept:?}");
                }
                if mode == "skip" {
                    let last = crate::last_progress(&progress);
                    assert_eq!(
                        last["sources"][0]["metrics"]["tombstonesSkipped"], "3",
                        "{last}"
                    );
                }
            }
            None => {
                assert!(
                    !out.status.success(),
                    "{mode}: a key that is not JSON passed"
                );
                assert!(
                    err.contains("partition 0 at offset") && err.contains("must be a JSON object"),
                    "{err}"
                );
            }
        }
    }
}
