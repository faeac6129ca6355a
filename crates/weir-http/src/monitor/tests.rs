use super::*;

#[test]
fn kafka_lag_is_latest_minus_end_per_partition() {
    let end = serde_json::json!({"t": {"0": 10, "1": 5}});
    let latest = serde_json::json!({"t": {"0": 12, "1": 5, "2": 3}});
    let lag = kafka_lag(Some(&end), Some(&latest));
    assert_eq!(
        lag,
        vec![(("t".into(), "0".into()), 2), (("t".into(), "1".into()), 0)]
    );
    assert!(
        kafka_lag(
            Some(&serde_json::json!({"logOffset": 3})),
            Some(&serde_json::json!({"logOffset": 4}))
        )
        .is_empty()
    );
}

#[test]
fn cluster_workers_add_up_per_worker_across_batches() {
    let m = Monitor::new("q", Duration::ZERO, Duration::from_secs(60));
    let mut text = String::new();
    for (batch, rows) in [(0, [5, 7]), (1, [11, 13])] {
        let p: StreamingQueryProgress = serde_json::from_value(serde_json::json!({
            "id": uuid::Uuid::nil(), "runId": uuid::Uuid::nil(), "name": "q",
            "timestamp": "2026-12-06T00:00:00.000Z", "batchId": batch,
            "batchDuration": 1, "numInputRows": rows[0] + rows[1],
            "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0,
            "durationMs": {}, "stateOperators": [], "sources": [],
            "sink": {"description": "ForeachBatchSink", "numOutputRows": -1},
            "cluster": {"workers": [
                {"url": "http://10.0.0.1:7400/", "tasks": 1, "inputRows": rows[0]},
                {"url": "http://10.0.0.2:7400/", "tasks": 2, "inputRows": rows[1]},
            ]},
        }))
        .unwrap();
        m.on_query_progress(&p);
        let mut out = crate::expo::Exposition::new();
        m.render(&mut out);
        text = out.finish();
    }
    for line in [
        "weir_cluster_workers{query=\"q\"} 2",
        "weir_cluster_worker_tasks_total{query=\"q\",worker=\"http://10.0.0.2:7400/\"} 4",
        "weir_cluster_worker_input_rows_total{query=\"q\",worker=\"http://10.0.0.1:7400/\"} 16",
        "weir_cluster_worker_input_rows_total{query=\"q\",worker=\"http://10.0.0.2:7400/\"} 20",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
}

fn started(m: &Monitor) {
    m.on_query_started(&QueryStarted {
        id: uuid::Uuid::nil(),
        run_id: uuid::Uuid::nil(),
        name: "q".into(),
        first_batch_id: 0,
        replay: false,
    });
}

/// A batch that starts after a quiet spell and then hangs (its server frozen) makes the
/// query unready once the stall limit has passed: idle does not excuse a batch in
/// progress.
#[test]
fn a_batch_that_hangs_after_an_idle_spell_fails_readiness_after_the_stall_limit() {
    let m = Monitor::new("q", Duration::ZERO, Duration::from_millis(50));
    started(&m);
    m.on_query_idle(&QueryIdle {
        id: uuid::Uuid::nil(),
        run_id: uuid::Uuid::nil(),
        next_batch_id: 4,
    });
    std::thread::sleep(Duration::from_millis(80));
    assert!(m.status().ready, "idle, waiting for data: {:?}", m.status());
    m.on_batch_started(&BatchStarted {
        id: uuid::Uuid::nil(),
        run_id: uuid::Uuid::nil(),
        batch_id: 4,
    });
    assert!(m.status().ready, "a batch just started");
    std::thread::sleep(Duration::from_millis(80));
    let s = m.status();
    assert!(!s.ready && s.reason.contains("no batch ended"), "{s:?}");
}

/// Between runs of a failing batch the query is up but not ready, and says why and
/// when the next run starts; a batch that commits makes it active again.
#[test]
fn a_retrying_query_is_up_not_ready_and_names_the_batch_error_and_next_run() {
    let m = Monitor::new("q", Duration::ZERO, Duration::from_secs(60));
    started(&m);
    m.on_query_retrying(&QueryRetrying {
        id: uuid::Uuid::nil(),
        run_id: uuid::Uuid::nil(),
        name: "q".into(),
        batch_id: Some(4),
        failed: 2,
        attempts: 10,
        error: "connection refused".into(),
        pause_ms: 30_000,
    });
    let s = m.status();
    assert_eq!(s.phase, Phase::Retrying);
    assert!(!s.ready);
    assert!(
        s.reason
            .contains("batch 4 failed (2 of 10 runs): connection refused")
            && s.reason.contains("next run in 30 s"),
        "{}",
        s.reason
    );
    assert_eq!(s.next_attempt.as_ref().map(|n| n.batch_id), Some(Some(4)));
    let mut out = crate::expo::Exposition::new();
    m.render(&mut out);
    let text = out.finish();
    assert!(
        text.contains("weir_query_retries_total{query=\"q\"} 1"),
        "{text}"
    );
    assert!(text.contains("weir_query_up{query=\"q\"} 1"), "{text}");
    // The run after the pause starts: still retrying until a batch gets through.
    started(&m);
    assert_eq!(m.status().phase, Phase::Retrying);
    m.on_query_idle(&QueryIdle {
        id: uuid::Uuid::nil(),
        run_id: uuid::Uuid::nil(),
        next_batch_id: 5,
    });
    let s = m.status();
    assert!(
        s.ready && s.phase == Phase::Active && s.next_attempt.is_none(),
        "{s:?}"
    );
}

/// A Kafka backlog over `records` turns the query unready, naming the source and the
/// count; a batch that catches up makes it ready again and zeroes the backlog's age.
#[test]
fn records_behind_a_kafka_source_over_the_limit_fail_readiness() {
    let m = Monitor::new("q", Duration::ZERO, Duration::from_secs(60)).with_lag_limits(LagLimits {
        records: Some(10_000),
        seconds: None,
    });
    started(&m);
    let batch = |end: i64, latest: i64| -> StreamingQueryProgress {
        serde_json::from_value(serde_json::json!({
            "id": uuid::Uuid::nil(), "runId": uuid::Uuid::nil(), "name": "q",
            "timestamp": "2026-12-07T00:00:00.000Z", "batchId": 0,
            "batchDuration": 1, "numInputRows": 1,
            "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0,
            "durationMs": {}, "stateOperators": [],
            "sources": [{
                "description": "KafkaV2[Subscribe[orders]]",
                "startOffset": {"orders": {"0": 0, "1": 0}},
                "endOffset": {"orders": {"0": end, "1": end}},
                "latestOffset": {"orders": {"0": latest, "1": latest}},
                "numInputRows": 1, "inputRowsPerSecond": 0.0,
                "processedRowsPerSecond": 0.0, "metrics": {}
            }],
            "sink": {"description": "ForeachBatchSink", "numOutputRows": -1},
        }))
        .unwrap()
    };
    m.on_query_progress(&batch(100, 9_353));
    let s = m.status();
    assert!(
        !s.ready && s.reason == "18506 records behind KafkaV2[Subscribe[orders]] (more than 10000)",
        "{s:?}"
    );
    assert_eq!(
        s.sources_behind["KafkaV2[Subscribe[orders]]"].records,
        Some(18_506)
    );
    let mut out = crate::expo::Exposition::new();
    m.render(&mut out);
    let text = out.finish();
    assert!(
        text.contains(
            "weir_source_records_behind{query=\"q\",source=\"KafkaV2[Subscribe[orders]]\"} 18506"
        ),
        "{text}"
    );
    m.on_query_progress(&batch(9_353, 9_353));
    let s = m.status();
    assert!(s.ready, "{s:?}");
    assert_eq!(
        s.sources_behind["KafkaV2[Subscribe[orders]]"],
        Behind {
            records: Some(0),
            seconds: 0
        }
    );
}
