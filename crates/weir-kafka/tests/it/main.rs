//! The Kafka source against a Kafka-protocol broker (noida-db, started by the test kit).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use weir_core::datafusion::arrow::array::{Array, AsArray, Int64Array};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Int32Type, Int64Type, Schema};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::{BatchContext, BoxError, Trigger, WeirSession};
use weir_kafka::{BadRecordMode, KafkaOptions, KafkaSource, ValueFormat, rdkafka};
use weir_testkit::kafka;

fn admin() -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", &kafka().bootstrap)
        .create()
        .unwrap()
}

async fn topic(name: &str, partitions: i32) {
    weir_kafka::create_topic(&kafka().bootstrap, name, partitions)
        .await
        .unwrap();
}

async fn produce(topic: &str, partition: i32, values: &[String]) {
    produce_with(topic, partition, values, &[]).await;
}

type Batches = Arc<Mutex<Vec<(u64, Vec<(i32, i64)>)>>>;

async fn run(
    opts: KafkaOptions,
    chk: &std::path::Path,
    max: Option<u64>,
    seen: Batches,
) -> weir_core::Result<weir_core::StreamingQuery> {
    let mut r = WeirSession::new()
        .read_stream()
        .source(Arc::new(KafkaSource::new(opts)?));
    if let Some(m) = max {
        r = r.max_offsets_per_trigger(m);
    }
    let q = r
        .load()
        .await?
        .write_stream()
        .checkpoint(chk)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, ctx: BatchContext| {
            let seen = seen.clone();
            async move {
                let got = records(&b.collect().await?)
                    .into_iter()
                    .map(|(p, o, _)| (p, o))
                    .collect();
                seen.lock().unwrap().push((ctx.batch_id, got));
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await?;
    q.await_termination().await?;
    Ok(q)
}

fn values(n: usize, tag: &str) -> Vec<String> {
    (0..n)
        .map(|i| format!("{{\"id\":{i},\"tag\":\"{tag}\"}}"))
        .collect()
}

#[tokio::test]
async fn batches_read_exact_ranges_over_three_partitions_and_the_limit_is_split_by_backlog() {
    topic("ranges", 3).await;
    produce("ranges", 0, &values(10, "a")).await;
    produce("ranges", 1, &values(30, "b")).await;
    produce("ranges", 2, &values(0, "c")).await;
    let dir = tempfile::tempdir().unwrap();
    let seen: Batches = Arc::default();
    let q = run(
        KafkaOptions::new(&kafka().bootstrap, ["ranges"]),
        dir.path(),
        Some(20),
        seen.clone(),
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    // Backlog 10 + 30, limit 20: 5 from partition 0 and 15 from partition 1, then again.
    let counts: Vec<(usize, usize)> = seen
        .iter()
        .map(|(_, rows)| {
            (
                rows.iter().filter(|r| r.0 == 0).count(),
                rows.iter().filter(|r| r.0 == 1).count(),
            )
        })
        .collect();
    assert_eq!(counts, vec![(5, 15), (5, 15)]);
    let all: Vec<(i32, i64)> = seen.iter().flat_map(|(_, r)| r.clone()).collect();
    let mut expect: Vec<(i32, i64)> = (0..10)
        .map(|o| (0, o))
        .chain((0..30).map(|o| (1, o)))
        .collect();
    expect.sort();
    let mut got = all.clone();
    got.sort();
    assert_eq!(got, expect, "each record once");
    let offsets = std::fs::read_to_string(dir.path().join("offsets/0")).unwrap();
    assert!(
        offsets.ends_with(r#"{"ranges":{"0":5,"1":15,"2":0}}"#),
        "{offsets}"
    );
    let p = q.last_progress().unwrap();
    assert_eq!(
        p.sources[0]
            .metrics
            .get("maxOffsetsBehindLatest")
            .map(String::as_str),
        Some("0")
    );
    assert!(
        dir.path().join("sources/0/0").exists(),
        "the initial offsets are recorded"
    );
}

#[tokio::test]
async fn a_replayed_batch_reads_the_same_records_after_more_arrive() {
    topic("replay", 2).await;
    produce("replay", 0, &values(4, "a")).await;
    produce("replay", 1, &values(4, "b")).await;
    let dir = tempfile::tempdir().unwrap();
    // Plan batch 0, then fail it.
    let fail_seen: Batches = Arc::default();
    let s2 = fail_seen.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(
            KafkaSource::new(KafkaOptions::new(&kafka().bootstrap, ["replay"])).unwrap(),
        ))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, ctx: BatchContext| {
            let s2 = s2.clone();
            async move {
                let n = b.count().await?;
                s2.lock().unwrap().push((ctx.batch_id, vec![(0, n as i64)]));
                Err::<(), BoxError>("fail".into())
            }
        })
        .start()
        .await
        .unwrap();
    assert!(q.await_termination().await.is_err());
    produce("replay", 0, &values(3, "late")).await;
    let seen: Batches = Arc::default();
    run(
        KafkaOptions::new(&kafka().bootstrap, ["replay"]),
        dir.path(),
        None,
        seen.clone(),
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].0, 0);
    assert_eq!(
        seen[0].1.len(),
        8,
        "batch 0 again with its recorded 8 records"
    );
    assert_eq!(seen[1].1, vec![(0, 4), (0, 5), (0, 6)], "then the new ones");
}

#[tokio::test]
async fn a_partition_added_mid_stream_is_read_from_its_start() {
    topic("grow", 1).await;
    produce("grow", 0, &values(3, "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let opts = || KafkaOptions::new(&kafka().bootstrap, ["grow"]);
    run(opts(), dir.path(), None, Arc::default()).await.unwrap();
    let r = admin()
        .create_partitions(&[NewPartitions::new("grow", 2)], &AdminOptions::new())
        .await
        .unwrap();
    for x in r {
        x.unwrap();
    }
    produce("grow", 1, &values(2, "new")).await;
    produce("grow", 0, &values(1, "more")).await;
    let seen: Batches = Arc::default();
    run(opts(), dir.path(), None, seen.clone()).await.unwrap();
    let mut got = seen.lock().unwrap()[0].1.clone();
    got.sort();
    assert_eq!(got, vec![(0, 3), (1, 0), (1, 1)]);
}

#[tokio::test]
async fn lost_offsets_stop_the_query_or_are_skipped_with_fail_on_data_loss_false() {
    topic("loss", 1).await;
    produce("loss", 0, &values(5, "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = KafkaOptions::new(&kafka().bootstrap, ["loss"]);
    // The recorded position says 100 but the partition ends at 5: the topic was recreated.
    opts.starting_offsets =
        weir_kafka::StartingOffsets::Explicit([("loss".to_string(), [(0, 100)].into())].into());
    let err = run(opts.clone(), dir.path(), None, Arc::default())
        .await
        .unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("data loss")
            && chain.contains("topic loss partition 0")
            && chain.contains("100"),
        "{chain}"
    );
    let dir2 = tempfile::tempdir().unwrap();
    opts.fail_on_data_loss = false;
    let seen: Batches = Arc::default();
    run(opts, dir2.path(), None, seen.clone()).await.unwrap();
    assert_eq!(
        seen.lock().unwrap()[0].1.len(),
        5,
        "read on from the earliest offset"
    );
}

#[tokio::test]
async fn malformed_json_fails_fast_naming_the_offset_or_is_kept_in_permissive_mode() {
    topic("json", 1).await;
    let mut vals = values(3, "ok");
    vals.insert(1, "{not json".into());
    produce("json", 0, &vals).await;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("tag", DataType::Utf8, true),
    ]));
    let opts = |mode| {
        let mut o = KafkaOptions::new(&kafka().bootstrap, ["json"]);
        o.value_format = ValueFormat::Json {
            schema: schema.clone(),
            mode,
        };
        o
    };
    let dir = tempfile::tempdir().unwrap();
    let (ended, _) = read_all(opts(BadRecordMode::FailFast), &dir.path().join("failfast")).await;
    let chain = weir_core::sink::error_chain(&ended.unwrap_err());
    assert!(
        chain.contains("malformed record in topic json partition 0 at offset 1"),
        "{chain}"
    );

    let (ended, rows) = read_all(
        opts(BadRecordMode::Permissive),
        &dir.path().join("permissive"),
    )
    .await;
    ended.unwrap();
    let mut got = Vec::new();
    for r in &rows {
        let id = r.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let bad = r.column(2).as_string::<i32>();
        for i in 0..r.num_rows() {
            got.push((
                (!id.is_null(i)).then(|| id.value(i)),
                (!bad.is_null(i)).then(|| bad.value(i).to_string()),
            ));
        }
    }
    assert_eq!(
        got,
        vec![
            (Some(0), None),
            (None, Some("{not json".to_string())),
            (Some(1), None),
            (Some(2), None)
        ]
    );
}

#[tokio::test]
async fn min_offsets_per_trigger_waits_for_enough_records_or_the_max_trigger_delay() {
    topic("minoffsets", 1).await;
    produce("minoffsets", 0, &values(3, "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let opts = KafkaOptions::new(&kafka().bootstrap, ["minoffsets"]);
    let started = std::time::Instant::now();
    let first = Arc::new(Mutex::new(None));
    let f = first.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(KafkaSource::new(opts).unwrap()))
        .min_offsets_per_trigger(100, Duration::from_millis(1500))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::ProcessingTime(Duration::from_millis(200)))
        .foreach_batch(move |b: DataFrame, _c: BatchContext| {
            let f = f.clone();
            async move {
                let n = b.count().await?;
                f.lock().unwrap().get_or_insert((started.elapsed(), n));
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    q.stop().await.unwrap();
    let (after, n) = first
        .lock()
        .unwrap()
        .expect("a batch after maxTriggerDelay");
    assert_eq!(n, 3);
    assert!(
        after >= Duration::from_millis(1400),
        "3 < 100 records: no batch before the delay ({after:?})"
    );
}

/// Produces `values` to `topic` partition `partition` with `extra` producer settings.
async fn produce_with(topic: &str, partition: i32, values: &[String], extra: &[(&str, &str)]) {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka().bootstrap);
    for (k, v) in extra {
        cfg.set(*k, *v);
    }
    let p: FutureProducer = cfg.create().unwrap();
    for v in values {
        p.send(
            FutureRecord::<(), _>::to(topic)
                .partition(partition)
                .payload(v),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    }
}

#[tokio::test]
async fn topics_produced_with_every_codec_are_read() {
    for codec in ["gzip", "snappy", "lz4", "zstd"] {
        let name = format!("codec_{codec}");
        topic(&name, 1).await;
        produce_with(
            &name,
            0,
            &values(40, codec),
            &[("compression.type", codec), ("linger.ms", "20")],
        )
        .await;
        let dir = tempfile::tempdir().unwrap();
        let seen: Batches = Arc::default();
        run(
            KafkaOptions::new(&kafka().bootstrap, [name.as_str()]),
            dir.path(),
            None,
            seen.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("{codec}: {}", weir_core::sink::error_chain(&e)));
        let n: usize = seen.lock().unwrap().iter().map(|b| b.1.len()).sum();
        assert_eq!(n, 40, "{codec}");
    }
}

#[tokio::test]
async fn small_partitions_are_not_starved_by_a_tiny_limit_and_available_now_drains_them() {
    topic("starve", 3).await;
    for p in 0..3 {
        produce("starve", p, &values(1, "x")).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let seen: Batches = Arc::default();
    run(
        KafkaOptions::new(&kafka().bootstrap, ["starve"]),
        dir.path(),
        Some(2),
        seen.clone(),
    )
    .await
    .unwrap();
    let mut got: Vec<(i32, i64)> = seen
        .lock()
        .unwrap()
        .iter()
        .flat_map(|b| b.1.clone())
        .collect();
    got.sort();
    assert_eq!(got, vec![(0, 0), (1, 0), (2, 0)], "every record once");

    // min-offsets-per-trigger does not hold back an available-now query.
    topic("drain_min", 1).await;
    produce("drain_min", 0, &values(5, "y")).await;
    let dir = tempfile::tempdir().unwrap();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(
            KafkaSource::new(KafkaOptions::new(&kafka().bootstrap, ["drain_min"])).unwrap(),
        ))
        .min_offsets_per_trigger(1000, Duration::from_secs(3600))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(|_b, _c| async { Ok(()) })
        .start()
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), q.await_termination())
        .await
        .expect("available-now ends")
        .unwrap();
    let rows: u64 = q.recent_progress().iter().map(|p| p.num_input_rows).sum();
    assert_eq!(rows, 5);
    // latestOffset in progress is the topic's latest, not the capped end.
    let p = q.last_progress().unwrap();
    assert_eq!(
        p.sources[0].latest_offset,
        Some(serde_json::json!({"drain_min": {"0": 5}}))
    );
}

#[tokio::test]
async fn a_subscribed_topic_missing_from_the_metadata_fails_the_batch_instead_of_vanishing() {
    topic("meta_ok", 1).await;
    produce("meta_ok", 0, &values(2, "z")).await;
    let dir = tempfile::tempdir().unwrap();
    let err = run(
        KafkaOptions::new(&kafka().bootstrap, ["meta_ok", "meta_missing"]),
        dir.path(),
        None,
        Arc::default(),
    )
    .await
    .unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("topic meta_missing") && chain.contains("metadata"),
        "{chain}"
    );
}

#[tokio::test]
async fn headers_come_as_spark_s_headers_column_when_asked_for() {
    use rdkafka::message::{Header, OwnedHeaders};
    topic("headers", 1).await;
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &kafka().bootstrap)
        .create()
        .unwrap();
    p.send(
        FutureRecord::<(), _>::to("headers")
            .partition(0)
            .payload("v")
            .headers(OwnedHeaders::new().insert(Header {
                key: "trace",
                value: Some("abc"),
            })),
        Duration::from_secs(10),
    )
    .await
    .map_err(|(e, _)| e)
    .unwrap();
    let mut opts = KafkaOptions::new(&kafka().bootstrap, ["headers"]);
    opts.include_headers = true;
    let dir = tempfile::tempdir().unwrap();
    let (ended, batches) = read_all(opts, dir.path()).await;
    ended.unwrap();
    let ctx = weir_core::datafusion::prelude::SessionContext::new();
    let headers = ctx
        .read_batches(batches)
        .unwrap()
        .select_columns(&["headers"])
        .unwrap();
    let got = weir_testkit::rows(headers).await;
    assert_eq!(got.len(), 1);
    assert!(
        got[0].contains("trace") && got[0].contains("616263"),
        "{got:?}"
    );
}

/// TLS and SASL end to end, against the broker behind a TLS front: SSL, SASL_SSL with
/// PLAIN, produced and read with the same settings.
#[tokio::test]
async fn a_topic_is_read_over_tls_and_sasl_ssl() {
    let tls = weir_testkit::kafka_tls();
    let ca = tls.ca.to_string_lossy().to_string();
    let modes: [&[(&str, &str)]; 2] = [
        &[("security.protocol", "SSL"), ("ssl.ca.location", &ca)],
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &ca),
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", "weir"),
            ("sasl.password", "s3cr3t-pw"),
        ],
    ];
    for (i, settings) in modes.iter().enumerate() {
        let name = format!("tls_{i}");
        let mut admin = ClientConfig::new();
        admin.set("bootstrap.servers", &tls.bootstrap);
        for (k, v) in settings.iter() {
            admin.set(*k, *v);
        }
        let a: AdminClient<DefaultClientContext> = admin.create().unwrap();
        a.create_topics(
            &[rdkafka::admin::NewTopic::new(
                &name,
                1,
                rdkafka::admin::TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
        let p: FutureProducer = admin.create().unwrap();
        for v in values(7, "tls") {
            p.send(
                FutureRecord::<(), _>::to(&name).partition(0).payload(&v),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        }
        let mut opts = KafkaOptions::new(&tls.bootstrap, [name.as_str()]);
        for (k, v) in settings.iter() {
            opts.kafka.insert(k.to_string(), v.to_string());
        }
        // The settings (passwords included) never show in the options' Debug.
        assert!(!format!("{opts:?}").contains("s3cr3t"));
        let dir = tempfile::tempdir().unwrap();
        let seen: Batches = Arc::default();
        run(opts, dir.path(), None, seen.clone())
            .await
            .unwrap_or_else(|e| panic!("{settings:?}: {}", weir_core::sink::error_chain(&e)));
        let n: usize = seen.lock().unwrap().iter().map(|b| b.1.len()).sum();
        assert_eq!(n, 7, "{settings:?}");
    }
}

/// With `commit_to_group`, each committed batch's end offsets are committed to the consumer
/// group, where the lag tools people already run read them.
#[tokio::test]
async fn committed_end_offsets_are_committed_to_the_consumer_group() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    topic("grouped", 2).await;
    produce("grouped", 0, &values(7, "a")).await;
    produce("grouped", 1, &values(4, "b")).await;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = KafkaOptions::new(&kafka().bootstrap, ["grouped"]);
    opts.commit_to_group = Some("weir-lag-test".into());
    run(opts, dir.path(), Some(5), Arc::default())
        .await
        .unwrap();
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &kafka().bootstrap)
        .set("group.id", "weir-lag-test")
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition("grouped", 0);
    tpl.add_partition("grouped", 1);
    let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
    let offsets: Vec<(i32, rdkafka::Offset)> = got
        .elements()
        .iter()
        .map(|e| (e.partition(), e.offset()))
        .collect();
    assert_eq!(
        offsets,
        vec![
            (0, rdkafka::Offset::Offset(7)),
            (1, rdkafka::Offset::Offset(4))
        ]
    );
}

/// (partition, offset, the value's `id` or -1) of every record of Kafka's raw columns.
fn records(rows: &[RecordBatch]) -> Vec<(i32, i64, i64)> {
    let mut out = Vec::new();
    for r in rows {
        let p = r
            .column_by_name("partition")
            .unwrap()
            .as_primitive::<Int32Type>();
        let o = r
            .column_by_name("offset")
            .unwrap()
            .as_primitive::<Int64Type>();
        let v = r.column_by_name("value").unwrap().as_binary::<i32>();
        for i in 0..r.num_rows() {
            let id = v
                .is_valid(i)
                .then(|| serde_json::from_slice::<serde_json::Value>(v.value(i)).ok())
                .flatten()
                .and_then(|j| j["id"].as_i64())
                .unwrap_or(-1);
            out.push((p.value(i), o.value(i), id));
        }
    }
    out
}

#[tokio::test]
async fn one_consumer_reads_every_range_exactly_forwards_backwards_and_after_prefetching() {
    use weir_core::{ReadLimit, Source, SourceOffset};
    topic("reuse", 2).await;
    produce("reuse", 0, &values(3000, "a")).await;
    produce("reuse", 1, &values(500, "b")).await;
    let source = KafkaSource::new(KafkaOptions::new(&kafka().bootstrap, ["reuse"])).unwrap();
    let ctx = weir_core::datafusion::prelude::SessionContext::new();
    let at = |p0: i64, p1: i64| SourceOffset::new(serde_json::json!({"reuse": {"0": p0, "1": p1}}));
    let want = |p0: std::ops::Range<i64>, p1: std::ops::Range<i64>| -> Vec<(i32, i64, i64)> {
        p0.map(|o| (0, o, o)).chain(p1.map(|o| (1, o, o))).collect()
    };
    // The same source (one consumer) reads small ranges of a partition it has fetched far
    // beyond, a range behind the last (a replay), an empty partition range, and the tail:
    // each exactly, nothing left over from the range before.
    let ranges = [
        ((0, 0), (10, 10)),
        ((10, 10), (20, 10)),
        ((5, 0), (15, 3)),
        ((2990, 3), (3000, 500)),
        ((20, 10), (2000, 10)),
        ((0, 0), (3000, 500)),
        ((1, 499), (2, 500)),
    ];
    for ((b0, b1), (e0, e1)) in ranges {
        let df = source
            .read_range(&ctx, Some(&at(b0, b1)), &at(e0, e1))
            .await
            .unwrap();
        assert_eq!(
            records(&df.collect().await.unwrap()),
            want(b0..e0, b1..e1),
            "[{b0}, {e0}) and [{b1}, {e1})"
        );
        // Planning in between uses the same consumer.
        let end = source
            .latest_offset(Some(&at(b0, b1)), ReadLimit::ALL)
            .await
            .unwrap();
        assert_eq!(end, Some(at(3000, 500)));
    }
}

/// Produces `values` (`None`: a record without a value) to `topic` partition `partition`
/// without waiting for each delivery.
fn produce_fast(topic: &str, partition: i32, values: &[Option<String>]) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &kafka().bootstrap)
        .set("linger.ms", "20")
        // In order even when a request is retried.
        .set("max.in.flight.requests.per.connection", "1")
        .create()
        .unwrap();
    for v in values {
        let mut r = BaseRecord::<(), str>::to(topic).partition(partition);
        if let Some(v) = v {
            r = r.payload(v.as_str());
        }
        while let Err((e, back)) = p.send(r) {
            assert!(
                matches!(
                    e.rdkafka_error_code(),
                    Some(rdkafka::types::RDKafkaErrorCode::QueueFull)
                ),
                "{e}"
            );
            p.poll(Duration::from_millis(10));
            r = back;
        }
        p.poll(Duration::ZERO);
    }
    p.flush(Duration::from_secs(30)).unwrap();
}

/// Runs `opts` available-now with a new checkpoint at `dir`: how the query ended, and the
/// rows of every batch its function was given.
async fn read_all(
    opts: KafkaOptions,
    dir: &std::path::Path,
) -> (weir_core::Result<()>, Vec<RecordBatch>) {
    let rows = Arc::new(Mutex::new(Vec::new()));
    let r = rows.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(KafkaSource::new(opts).unwrap()))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, _c: BatchContext| {
            let r = r.clone();
            async move {
                let got = b.collect().await?;
                r.lock().unwrap().extend(got);
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    let ended = q.await_termination().await;
    let rows = std::mem::take(&mut *rows.lock().unwrap());
    (ended, rows)
}

/// Batches of more JSON values than one parse takes (they are parsed in chunks, some beside
/// the poll): every record once, null values and values with newlines kept, and the first
/// bad record in (partition, offset) order named in FAILFAST mode.
#[tokio::test]
async fn json_values_parsed_in_chunks_are_each_read_once_and_the_first_bad_offset_named() {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("tag", DataType::Utf8, true),
    ]));
    let value = |i: usize| Some(format!("{{\"id\":{i},\"tag\":\"t\"}}"));
    // Partition 0: 40,000 (two full chunks and a rest), a bad record in the second chunk, a
    // null value and one spread over lines; 1: ten; 2: bad records in its first chunk and in
    // the rest.
    let mut p0: Vec<Option<String>> = (0..40_000).map(value).collect();
    p0[17_000] = Some("{\"id\":17000,".into());
    p0[20_000] = None;
    p0[30_000] = Some("{\"id\":30000,\n \"tag\":\n\"t\"}".into());
    let p1: Vec<Option<String>> = (0..10).map(value).collect();
    let mut p2: Vec<Option<String>> = (0..33_000).map(value).collect();
    p2[100] = Some("{\"id\":100,}".into());
    p2[32_900] = Some("not json".into());
    topic("chunks", 3).await;
    produce_fast("chunks", 0, &p0);
    produce_fast("chunks", 1, &p1);
    produce_fast("chunks", 2, &p2);
    let opts = |mode| {
        let mut o = KafkaOptions::new(&kafka().bootstrap, ["chunks"]);
        o.value_format = ValueFormat::Json {
            schema: schema.clone(),
            mode,
        };
        o
    };
    let dir = tempfile::tempdir().unwrap();
    let (ended, rows) = read_all(opts(BadRecordMode::FailFast), &dir.path().join("failfast")).await;
    let chain = weir_core::sink::error_chain(&ended.unwrap_err());
    assert!(
        chain.contains("malformed record in topic chunks partition 0 at offset 17000"),
        "{chain}"
    );
    assert!(rows.is_empty());

    let (ended, rows) =
        read_all(opts(BadRecordMode::DropMalformed), &dir.path().join("drop")).await;
    ended.unwrap();
    let mut want: Vec<(Option<i64>, bool)> = Vec::new();
    for (n, bad) in [
        (40_000, [17_000, 17_000]),
        (10, [10, 10]),
        (33_000, [100, 32_900]),
    ] {
        for i in 0..n {
            if bad.contains(&i) {
                continue;
            }
            want.push(if n == 40_000 && i == 20_000 {
                (None, false)
            } else {
                (Some(i as i64), true)
            });
        }
    }
    // Each record once (a DataFrame's rows come in no promised order, as in Spark).
    let mut got: Vec<(Option<i64>, bool)> = Vec::new();
    for r in &rows {
        let id = r.column(0).as_primitive::<Int64Type>();
        let tag = r.column(1).as_string::<i32>();
        for i in 0..r.num_rows() {
            got.push((id.is_valid(i).then(|| id.value(i)), tag.is_valid(i)));
        }
    }
    got.sort();
    want.sort();
    assert_eq!(got.len(), want.len());
    let first = got.iter().zip(&want).position(|(g, w)| g != w);
    assert_eq!(first, None, "a record lost, doubled or changed");
}

/// Retention removing records the query already read is no data loss: an available-now
/// run on such a topic reads the new records (it failed, naming "offsets 0..4", when the
/// run's target was checked from offset 0).
#[tokio::test]
async fn records_deleted_behind_the_query_are_not_a_loss() {
    use rdkafka::{Offset, TopicPartitionList};
    topic("trimmed", 1).await;
    produce("trimmed", 0, &values(6, "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let opts = || KafkaOptions::new(&kafka().bootstrap, ["trimmed"]);
    run(opts(), dir.path(), None, Arc::default()).await.unwrap();
    let mut before = TopicPartitionList::new();
    before
        .add_partition_offset("trimmed", 0, Offset::Offset(4))
        .unwrap();
    admin()
        .delete_records(&before, &AdminOptions::new())
        .await
        .unwrap();
    produce("trimmed", 0, &values(2, "b")).await;
    let seen: Batches = Arc::default();
    run(opts(), dir.path(), None, seen.clone()).await.unwrap();
    assert_eq!(seen.lock().unwrap()[0].1, vec![(0, 6), (0, 7)]);
}
