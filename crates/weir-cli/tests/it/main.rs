//! The `weir` binary end to end: kills at every fault point, bad configs, the demo.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use weir_core::datafusion::prelude::{JsonReadOptions, SessionContext};
use weir_core::fault::RUNNER_POINTS;
use weir_testkit::{parquet_rows, rows, run_weir, temp_dir};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_weir"))
}

fn gen_orders(input: &Path, files: usize, rows_per_file: usize, keys: u64) {
    let out = run_weir(
        &bin(),
        &[
            "gen",
            "--dir",
            input.to_str().unwrap(),
            "--files",
            &files.to_string(),
            "--rows-per-file",
            &rows_per_file.to_string(),
            "--keys",
            &keys.to_string(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const SCHEMA: &str =
    r#"["order_id bigint", "status string", "amount double", "updated_at timestamp"]"#;

fn pipeline(dir: &Path, sinks: &str) -> PathBuf {
    let p = dir.join("pipeline.toml");
    let text = format!(
        r#"[query]
name = "orders"
checkpoint = "chk"
trigger = "available-now"

[source]
type = "files"
path = "in"
format = "json"
schema = {SCHEMA}
max-files-per-trigger = 1

{sinks}
"#
    );
    std::fs::write(&p, text).unwrap();
    p
}

async fn input_rows(input: &Path) -> Vec<String> {
    let ctx = SessionContext::new();
    let schema = weir_cli_schema();
    let df = ctx
        .read_json(
            input.to_str().unwrap(),
            JsonReadOptions::default()
                .schema(&schema)
                .file_extension(".json"),
        )
        .await
        .unwrap();
    rows(df).await
}

fn weir_cli_schema() -> weir_core::datafusion::arrow::datatypes::Schema {
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
    Schema::new(vec![
        Field::new("order_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ])
}

fn progress_batches(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["batchId"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[tokio::test]
async fn a_kill_at_every_fault_point_leaves_each_input_row_in_the_parquet_output_once() {
    let points: Vec<&str> = RUNNER_POINTS
        .iter()
        .copied()
        .chain(["parquet-before-rename", "parquet-after-rename"])
        .collect();
    for point in points {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 5, 20, 50);
        let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
        let prog1 = dir.path().join("progress1.jsonl");
        let fault = format!("{point}@2");
        let out = run_weir(
            &bin(),
            &[
                "run",
                p.to_str().unwrap(),
                "--progress",
                prog1.to_str().unwrap(),
            ],
            Some(&fault),
        );
        assert!(
            !out.status.success(),
            "{point}: the fault must kill the run"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("fault point {point} reached in batch 2")),
            "{point}: {stderr}"
        );
        assert_eq!(progress_batches(&prog1), vec![0, 1], "{point}");

        let prog2 = dir.path().join("progress2.jsonl");
        let out = run_weir(
            &bin(),
            &[
                "run",
                p.to_str().unwrap(),
                "--progress",
                prog2.to_str().unwrap(),
            ],
            None,
        );
        assert!(
            out.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
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

#[tokio::test]
async fn a_kill_around_the_delta_commit_leaves_the_table_equal_to_the_reference_with_one_version_per_batch()
 {
    for point in [
        "delta-before-commit",
        "delta-after-commit",
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
        if point == "delta-after-commit" || point == "before-commit-write" {
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

#[test]
fn bad_pipelines_are_refused_naming_the_key() {
    let dir = temp_dir();
    let cases = [
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\ncolour = \"red\"\n",
            "colour",
        ),
        ("[[sink]]\ntype = \"parqet\"\npath = \"out\"\n", "parqet"),
    ];
    for (sinks, want) in cases {
        let p = pipeline(dir.path(), sinks);
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{want}: {err}");
    }
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("available-now", "soonish");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("query.")
            && err.contains("trigger")
            && err.contains("soonish"),
        "{err}"
    );
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("soonish", "once")
        .replace("amount double", "amount dbl");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("source.schema[2]") && err.contains("dbl"),
        "{err}"
    );
}

#[test]
fn checkpoint_show_names_the_pending_batch_and_its_files() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 3, 5, 5);
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let out = run_weir(
        &bin(),
        &["run", p.to_str().unwrap()],
        Some("before-commit-write@1"),
    );
    assert!(!out.status.success());
    let chk = dir.path().join("chk");
    let out = run_weir(&bin(), &["checkpoint", "show", chk.to_str().unwrap()], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("batch 1 is not committed"), "{text}");
    assert!(text.contains("orders-00001.json"), "{text}");
}

#[test]
fn the_demo_runs_on_embedded_defaults_and_checks_its_table() {
    let dir = temp_dir();
    let work = dir.path().join("demo");
    let out = run_weir(&bin(), &["demo", "--dir", work.to_str().unwrap()], None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("0 rows missing, 0 rows extra"), "{stdout}");
    assert!(stdout.contains("batch 4:"), "{stdout}");
    // A second run starts over in its own folder.
    let again = run_weir(&bin(), &["demo", "--dir", work.to_str().unwrap()], None);
    assert!(again.status.success());
}

#[tokio::test]
async fn a_kill_around_the_postgres_transaction_leaves_the_table_equal_to_the_reference() {
    let url = weir_testkit::postgres().url.clone();
    for (i, point) in [
        "pg-before-begin",
        "pg-after-copy",
        "pg-after-commit",
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
        let app_id = format!("orders-{}/{table}", meta["id"].as_str().unwrap());
        let ledger = weir_testkit::pg_rows(
            &url,
            &format!("SELECT batch_id::text FROM weir_batches WHERE app_id = '{app_id}'"),
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

async fn kafka_topic_with_orders(name: &str, per_partition: usize) -> Vec<String> {
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
        .chain(["parquet-before-rename"].iter())
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

/// The value column of a row of `weir chaos`'s table.
fn chaos_row(stdout: &str, name: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with(&format!("| {name} ")))
        .unwrap_or_else(|| panic!("no '{name}' row in:\n{stdout}"))
        .split('|')
        .nth(2)
        .unwrap()
        .trim()
        .to_string()
}

/// `weir chaos` on the worked example (Kafka -> newest per key -> Delta MERGE + PostgreSQL
/// upsert through staging + ledger), short: kills at random moments and at fault points,
/// restarts, then every sink against the reference. The long run (`--kills 100`) is in the
/// closing notes.
#[test]
fn chaos_on_the_worked_example_finds_no_mismatch() {
    let dir = temp_dir();
    let work = dir.path().join("chaos");
    let out = run_weir(
        &bin(),
        &[
            "chaos",
            "--kills",
            "6",
            "--seed",
            "11",
            "--batch-rows",
            "200",
            "--keys",
            "300",
            "--dir",
            work.to_str().unwrap(),
            "--kafka",
            &weir_testkit::kafka().bootstrap,
            "--postgres",
            &weir_testkit::postgres().url,
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let field = |name: &str| chaos_row(&stdout, name);
    assert_eq!(field("mismatches"), "0", "{stdout}");
    assert!(field("kills").starts_with("6 "), "{stdout}");
    let committed: u64 = field("batches committed").parse().unwrap();
    // At least the 2 files of 200 orders added before each of the 6 killed runs.
    assert!(committed >= 12, "{stdout}");
    let records: u64 = field("input records").parse().unwrap();
    // Batches hold at most 200 records (max-offsets-per-trigger), and all were read.
    assert!(records >= 2400 && committed * 200 >= records, "{stdout}");
    let checked = field("rows checked");
    assert!(checked.contains("delta-merge"), "{checked}");
    assert!(
        checked.contains(&format!("ledger {committed} rows")),
        "{checked}"
    );
}

/// `weir chaos` on a files pipeline with an append sink of each kind and a MERGE: no
/// services needed; the append sinks must hold every input row exactly once.
#[test]
fn chaos_on_a_files_pipeline_checks_append_and_merge_sinks() {
    let dir = temp_dir();
    let p = dir.path().join("files.toml");
    std::fs::write(
        &p,
        format!(
            r#"[query]
name = "orders-files"
checkpoint = "chk"

[source]
type = "files"
path = "in"
format = "json"
schema = {SCHEMA}

[[sink]]
type = "delta-append"
path = "a"

[[sink]]
type = "parquet"
path = "p"

[[sink]]
type = "delta-merge"
path = "m"
keys = ["order_id"]
ordering = "updated_at"
"#
        ),
    )
    .unwrap();
    let work = dir.path().join("chaos");
    let out = run_weir(
        &bin(),
        &[
            "chaos",
            "--pipeline",
            p.to_str().unwrap(),
            "--kills",
            "8",
            "--seed",
            "5",
            "--batch-rows",
            "100",
            "--keys",
            "200",
            "--dir",
            work.to_str().unwrap(),
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |name: &str| chaos_row(&stdout, name);
    assert_eq!(row("mismatches"), "0", "{stdout}");
    let records = row("input records");
    let checked = row("rows checked");
    // Both append sinks hold exactly as many rows as the input had.
    assert!(
        checked.contains(&format!(
            "delta-append {}: {records} rows",
            work.join("delta_append_0").display()
        )),
        "{checked}"
    );
    assert!(
        checked.contains(&format!(
            "parquet {}: {records} rows",
            work.join("parquet_1").display()
        )),
        "{checked}"
    );
}

/// What `weir chaos` cannot run or check is refused before anything runs, naming the flag
/// or the sink.
#[test]
fn chaos_refuses_what_it_cannot_run_or_check() {
    let dir = temp_dir();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin())
            .arg("chaos")
            .args(args)
            .env_remove("KAFKA_BOOTSTRAP")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // The worked example reads Kafka.
    let work = dir.path().join("w1");
    let err = run(&["--dir", work.to_str().unwrap()]);
    assert!(err.contains("give the brokers with --kafka"), "{err}");
    // An append sink after a transform has no reference to compare with.
    let p = dir.path().join("bad.toml");
    std::fs::write(
        &p,
        format!(
            r#"[query]
name = "x"
checkpoint = "chk"

[source]
type = "files"
path = "in"
format = "json"
schema = {SCHEMA}

[transform]
sql = "SELECT * FROM batch WHERE amount > 10"

[[sink]]
type = "delta-append"
path = "a"
"#
        ),
    )
    .unwrap();
    let work = dir.path().join("w2");
    let err = run(&[
        "--pipeline",
        p.to_str().unwrap(),
        "--kills",
        "1",
        "--dir",
        work.to_str().unwrap(),
    ]);
    assert!(
        err.contains("an append sink after a transform has no reference to check"),
        "{err}"
    );
}
