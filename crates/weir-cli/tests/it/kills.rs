//! `weir run` killed at the fault points its connectors declare, then run again: every
//! sink holds each input row (or the newest row per key) once.

use std::path::Path;

use weir_core::datafusion::prelude::{JsonReadOptions, SessionContext};
use weir_core::fault::{RUNNER_POINTS, STATE_POINTS};
use weir_core::sink::PARQUET_POINTS;
use weir_testkit::{parquet_rows, rows, run_weir, temp_dir};

use crate::{
    SCHEMA, bin, gen_orders, gen_orders_from, input_rows, last_progress, pipeline,
    progress_batches, run_to_end, run_with_progress, weir_cli_schema,
};

/// Runs the pipeline `p` with a kill at `point` in batch 2 (the run must fail there, saying
/// so), then again to its end (which must succeed); their progress lines go to `first` and
/// `second`.
pub(crate) fn killed_in_batch_2_then_rerun(p: &Path, point: &str, first: &Path, second: &Path) {
    let out = run_with_progress(p, first, Some(&format!("{point}@2")));
    assert!(
        !out.status.success(),
        "{point}: the fault must kill the run"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("fault point {point} reached in batch 2")),
        "{point}: {stderr}"
    );
    let out = run_with_progress(p, second, None);
    assert!(
        out.status.success(),
        "{point}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_kill_at_every_fault_point_leaves_each_input_row_in_the_parquet_output_once() {
    let points: Vec<&str> = RUNNER_POINTS
        .iter()
        .copied()
        .chain(PARQUET_POINTS.iter().copied())
        .collect();
    for point in points {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 5, 20, 50);
        let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
        let prog1 = dir.path().join("progress1.jsonl");
        let prog2 = dir.path().join("progress2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &prog1, &prog2);
        assert_eq!(progress_batches(&prog1), vec![0, 1], "{point}");
        let expect_first = if point == "after-commit-write" { 3 } else { 2 };
        let second = progress_batches(&prog2);
        assert_eq!(
            second.first().copied(),
            Some(expect_first),
            "{point}: batch ids reused: {second:?}"
        );
        assert_eq!(second.last().copied(), Some(4), "{point}");

        let cols = ["order_id", "status", "amount", "updated_at"];
        let got = parquet_rows(&dir.path().join("out"), &cols).await;
        let want = input_rows(&input).await;
        assert_eq!(got.len(), 100, "{point}");
        assert_eq!(got, want, "{point}: every input row exactly once");
        for b in 0..5 {
            assert!(
                dir.path().join(format!("chk/commits/{b}")).exists(),
                "{point}: commits/{b}"
            );
        }
    }
}

/// A function that fails after its sink wrote (an error, not a kill): batch 2 is not
/// committed and `commits/` holds nothing of it, not even the entry's temp file (written
/// while the function ran); the next run replays batch 2 and every row lands once.
#[tokio::test]
async fn a_failed_function_leaves_no_commit_entry_behind_and_the_replay_lands_each_row_once() {
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 5, 20, 50);
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let commits = || {
        let mut v: Vec<String> = std::fs::read_dir(dir.path().join("chk/commits"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let prog = dir.path().join("progress1.jsonl");
    let point = "parquet-after-rename";
    assert!(PARQUET_POINTS.contains(&point));
    let out = run_with_progress(&p, &prog, Some(&format!("{point}@2:error")));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("batch 2"),
        "{stderr}"
    );
    assert_eq!(commits(), vec!["0", "1"]);
    let prog = dir.path().join("progress2.jsonl");
    let out = run_with_progress(&p, &prog, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(progress_batches(&prog), vec![2, 3, 4]);
    assert_eq!(commits(), vec!["0", "1", "2", "3", "4"]);
    let cols = ["order_id", "status", "amount", "updated_at"];
    let got = parquet_rows(&dir.path().join("out"), &cols).await;
    assert_eq!(got.len(), 100);
    assert_eq!(
        got,
        input_rows(&input).await,
        "every input row exactly once"
    );
}

/// Streaming deduplication, killed at every runner point and around the state commit of
/// batch 2, then run again: one row per key, taken from the first file (batch) holding the
/// key, and nothing of a key seen in an earlier batch passes again.
#[tokio::test]
async fn a_kill_around_the_state_commit_passes_each_key_once_from_its_first_batch() {
    let points: Vec<&str> = RUNNER_POINTS.iter().chain(STATE_POINTS).copied().collect();
    for point in points {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 5, 20, 30);
        let p = pipeline(
            dir.path(),
            "[transform]\ndrop-duplicates = [\"order_id\"]\n\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n",
        );
        let prog = dir.path().join("progress.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &dir.path().join("progress0.jsonl"), &prog);

        // The reference: files in name order (one per batch), each key's rows in its first.
        let mut names: Vec<_> = std::fs::read_dir(&input)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        names.sort();
        assert_eq!(names.len(), 5);
        let mut first: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for f in &names {
            let mut this: std::collections::BTreeMap<String, Vec<String>> = Default::default();
            for row in input_rows(f).await {
                let key = row.split('|').next().unwrap().to_string();
                this.entry(key).or_default().push(row);
            }
            for (k, rows) in this {
                first.entry(k).or_insert(rows);
            }
        }
        let cols = ["order_id", "status", "amount", "updated_at"];
        let got = parquet_rows(&dir.path().join("out"), &cols).await;
        assert_eq!(got.len(), first.len(), "{point}: one row per key: {got:?}");
        for row in &got {
            let key = row.split('|').next().unwrap();
            assert!(
                first[key].contains(row),
                "{point}: {row} is not from the first batch with key {key}"
            );
        }
        let last = last_progress(&prog);
        let op = &last["stateOperators"][0];
        assert_eq!(op["operatorName"], "dedupe", "{point}: {last}");
        assert_eq!(op["numRowsTotal"], first.len() as u64, "{point}: {last}");
        let state = dir.path().join("chk/state/0");
        assert!(state.join("_metadata/metadata").exists(), "{point}");
        assert!(
            state.join("0/5.delta").exists(),
            "{point}: version 5 after batch 4"
        );
    }
}

/// Dedupe keys are checked against the source's columns before anything runs (no input
/// yet), and a query without the operator its checkpoint has state for is refused.
#[tokio::test]
async fn drop_duplicates_keys_are_checked_at_start_and_the_operator_cannot_be_removed() {
    let dir = temp_dir();
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    let with = |keys: &str| {
        pipeline(
            dir.path(),
            &format!(
                "[transform]\ndrop-duplicates = {keys}\n\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
            ),
        )
    };
    let out = run_weir(
        &bin(),
        &["run", with(r#"["order_idd"]"#).to_str().unwrap()],
        None,
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("transform.drop-duplicates") && stderr.contains("`order_idd`"),
        "{stderr}"
    );
    let out = run_weir(&bin(), &["check", with("[]").to_str().unwrap()], None);
    assert!(!out.status.success(), "check refuses an empty key list");

    gen_orders_from(&input, 0, 2, 10, 5);
    let p = with(r#"["order_id"]"#);
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let without = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    gen_orders_from(&input, 2, 2, 10, 5);
    let out = run_weir(&bin(), &["run", without.to_str().unwrap()], None);
    assert!(!out.status.success(), "the operator cannot be removed");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("stateful operator 0") && stderr.contains("cannot be removed"),
        "{stderr}"
    );
    // Nothing ran without it: with it, the query goes on.
    let p = with(r#"["order_id"]"#);
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_kill_around_the_delta_commit_leaves_the_table_equal_to_the_reference_with_one_version_per_batch()
 {
    for point in [
        weir_delta::POINT_BEFORE_COMMIT,
        weir_delta::POINT_AFTER_COMMIT,
        "before-user-fn",
        "before-commit-write",
        "after-commit-write",
    ] {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 5, 40, 30);
        let sinks = "[[sink]]\ntype = \"delta-merge\"\npath = \"delta\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n";
        let p = pipeline(dir.path(), sinks);
        let out = run_weir(
            &bin(),
            &["run", p.to_str().unwrap()],
            Some(&format!("{point}@2")),
        );
        assert!(!out.status.success(), "{point}");
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(
            out.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        if point == weir_delta::POINT_AFTER_COMMIT || point == "before-commit-write" {
            assert!(
                stdout.contains("batch 2:") && stdout.contains("skipped as already written"),
                "{point}: {stdout}"
            );
        }

        let ctx = SessionContext::new();
        let table = weir_delta::read_table(&ctx, &dir.path().join("delta").into())
            .await
            .unwrap();
        let got = rows(
            table
                .select_columns(&["order_id", "status", "amount", "updated_at"])
                .unwrap(),
        )
        .await;
        let all = ctx
            .read_json(
                input.to_str().unwrap(),
                JsonReadOptions::default()
                    .schema(&weir_cli_schema())
                    .file_extension(".json"),
            )
            .await
            .unwrap();
        let reference =
            weir_core::dedupe_latest(all, &["order_id".to_string()], "updated_at").unwrap();
        assert_eq!(
            got,
            rows(reference).await,
            "{point}: table = newest row per key over all input"
        );
        let version = weir_delta::table_version(&dir.path().join("delta").into())
            .await
            .unwrap();
        assert_eq!(
            version,
            Some(4),
            "{point}: five batches, five commits (versions 0..=4), no double write"
        );
    }
}

#[tokio::test]
async fn a_kill_around_the_postgres_transaction_leaves_the_table_equal_to_the_reference() {
    let url = weir_testkit::postgres().url.clone();
    for (i, point) in [
        weir_postgres::POINT_BEFORE_BEGIN,
        weir_postgres::POINT_AFTER_COPY,
        weir_postgres::POINT_AFTER_COMMIT,
        "after-user-fn",
        "after-commit-write",
    ]
    .iter()
    .enumerate()
    {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 5, 40, 30);
        let table = format!("kill_orders_{i}");
        let sinks = format!(
            "[[sink]]\ntype = \"delta-merge\"\npath = \"delta\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n\n\
             [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{url}\"\ntable = \"{table}\"\nkeys = [\"order_id\"]\n\
             ordering = \"updated_at\"\ncreate-table = true\n"
        );
        let p = pipeline(dir.path(), &sinks);
        let out = run_weir(
            &bin(),
            &["run", p.to_str().unwrap()],
            Some(&format!("{point}@2")),
        );
        assert!(!out.status.success(), "{point}");
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(
            out.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        let ctx = SessionContext::new();
        let all = ctx
            .read_json(
                input.to_str().unwrap(),
                JsonReadOptions::default()
                    .schema(&weir_cli_schema())
                    .file_extension(".json"),
            )
            .await
            .unwrap();
        let reference = weir_core::dedupe_latest(all, &["order_id".to_string()], "updated_at")
            .unwrap()
            .select_columns(&["order_id", "status", "amount"])
            .unwrap();
        let want = rows(reference).await;
        let got = weir_testkit::pg_rows(
            &url,
            &format!("SELECT order_id::text, status, amount::text FROM {table}"),
        )
        .await;
        assert_eq!(
            got, want,
            "{point}: PostgreSQL table = newest row per key over all input"
        );
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("chk/metadata")).unwrap(),
        )
        .unwrap();
        let query = weir_core::connector::QueryIdentity {
            query_id: meta["id"].as_str().unwrap().parse().unwrap(),
            app_name: "orders".into(),
        };
        let app_id = weir_postgres::PostgresUpsert::new(&url, &table, ["order_id"], "updated_at")
            .ledger_key(&query);
        let ledger = weir_testkit::pg_rows(
            &url,
            &format!(
                "SELECT batch_id::text FROM {} WHERE app_id = '{app_id}'",
                weir_postgres::DEFAULT_LEDGER
            ),
        )
        .await;
        assert_eq!(
            ledger,
            vec!["0", "1", "2", "3", "4"],
            "{point}: one ledger row per batch"
        );
        let version = weir_delta::table_version(&dir.path().join("delta").into())
            .await
            .unwrap();
        assert_eq!(version, Some(4), "{point}: one Delta commit per batch");
    }
}

/// A topic of 3 partitions with `per_partition` JSON orders each; the `order_id|status` of
/// every record sent, sorted.
pub(crate) async fn kafka_topic_with_orders(name: &str, per_partition: usize) -> Vec<String> {
    use weir_kafka::rdkafka::ClientConfig;
    use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let bootstrap = &weir_testkit::kafka().bootstrap;
    weir_kafka::create_topic(bootstrap, name, 3).await.unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let mut sent = Vec::new();
    for p in 0..3 {
        for i in 0..per_partition {
            let id = p * 1000 + i as i32;
            let v = format!(
                "{{\"order_id\":{id},\"status\":\"s{i}\",\"amount\":{i}.5,\"updated_at\":\"2026-01-01T00:00:{:02}.000000Z\"}}",
                i % 60
            );
            producer
                .send(
                    FutureRecord::<(), _>::to(name).partition(p).payload(&v),
                    std::time::Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)
                .unwrap();
            sent.push(format!("{id}|s{i}"));
        }
    }
    sent.sort();
    sent
}

#[tokio::test]
async fn a_kill_at_every_fault_point_reads_each_kafka_record_exactly_once_into_parquet() {
    for (n, point) in RUNNER_POINTS
        .iter()
        .chain(PARQUET_POINTS[..1].iter())
        .enumerate()
    {
        let name = format!("orders_kill_{n}");
        let sent = kafka_topic_with_orders(&name, 20).await;
        let dir = temp_dir();
        let p = dir.path().join("pipeline.toml");
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
subscribe = ["{name}"]
max-offsets-per-trigger = 15
value-format = "json"
schema = {SCHEMA}

[[sink]]
type = "parquet"
path = "out"
"#,
                weir_testkit::kafka().bootstrap
            ),
        )
        .unwrap();
        let out = run_weir(
            &bin(),
            &["run", p.to_str().unwrap()],
            Some(&format!("{point}@2")),
        );
        assert!(
            !out.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(
            out.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = parquet_rows(&dir.path().join("out"), &["order_id", "status"]).await;
        assert_eq!(got, sent, "{point}: each record exactly once");
        assert!(
            dir.path().join("chk/commits/3").exists() && !dir.path().join("chk/offsets/4").exists(),
            "{point}: 60 records in 4 batches of 15"
        );
    }
}

/// A windowed aggregation (watermark, tumbling window, update mode) into Parquet (every
/// update) and a Delta MERGE (each window's newest), killed at every runner and state
/// point in batch 2 and run again: both sinks and the state end equal to a clean run's,
/// and the Parquet output holds each update once.
#[tokio::test]
async fn a_kill_around_the_state_commit_leaves_windowed_counts_equal_to_a_clean_run() {
    const BODY: &str = "[transform]\n\
        with-watermark = { column = \"updated_at\", delay = \"500 milliseconds\" }\n\n\
        [transform.aggregate]\ngroup-by = [\"status\"]\n\
        window = { column = \"updated_at\", size = \"1 second\" }\n\
        aggregates = [\"count(*) AS n\", \"sum(amount) AS total\", \"max(order_id)\"]\n\
        output-mode = \"update\"\n\n\
        [[sink]]\ntype = \"parquet\"\npath = \"out\"\n\n\
        [[sink]]\ntype = \"delta-merge\"\npath = \"delta\"\nkeys = [\"status\", \"window_start\"]\n\
        ordering = \"n\"\n";
    let cols = [
        "status",
        "window_start",
        "window_end",
        "n",
        "total",
        "max(order_id)",
    ];
    let outputs = |dir: std::path::PathBuf| async move {
        let ctx = SessionContext::new();
        let table = weir_delta::read_table(&ctx, &dir.join("delta").into())
            .await
            .unwrap();
        let delta = rows(table.select_columns(&cols).unwrap()).await;
        (parquet_rows(&dir.join("out"), &cols).await, delta)
    };
    let last_state = |prog: &Path| {
        let last = last_progress(prog);
        (
            last["stateOperators"][0]["numRowsTotal"].clone(),
            last["eventTime"]["watermark"].clone(),
        )
    };
    let clean = temp_dir();
    gen_orders(&clean.path().join("in"), 5, 40, 30);
    let p = pipeline(clean.path(), BODY);
    let prog = clean.path().join("progress.jsonl");
    run_to_end(&p, &prog);
    let (want_pq, want_delta) = outputs(clean.path().to_path_buf()).await;
    let want_state = last_state(&prog);
    // Windows of 1 s over 20 s of orders, 4 statuses: many windows, each updated more than
    // once, and a no-data batch at the end (5 files, 6 batches).
    assert!(want_delta.len() > 40, "{want_delta:?}");
    assert!(want_pq.len() > want_delta.len());
    assert_eq!(progress_batches(&prog), vec![0, 1, 2, 3, 4, 5]);

    let points: Vec<&str> = RUNNER_POINTS.iter().chain(STATE_POINTS).copied().collect();
    for point in points {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 5, 40, 30);
        let p = pipeline(dir.path(), BODY);
        let prog = dir.path().join("progress.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &dir.path().join("progress0.jsonl"), &prog);
        let (pq, delta) = outputs(dir.path().to_path_buf()).await;
        assert_eq!(pq, want_pq, "{point}: Parquet holds each update once");
        assert_eq!(
            delta, want_delta,
            "{point}: Delta holds each window's newest"
        );
        assert_eq!(
            last_state(&prog),
            want_state,
            "{point}: state as a clean run's"
        );
    }
}
