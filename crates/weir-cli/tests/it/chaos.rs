//! `weir chaos` end to end, its refusals, and the fault points it uses.

use weir_testkit::{run_weir, temp_dir};

use crate::{SCHEMA, bin, gen_orders, pipeline};

/// Chaos runs on PostgreSQL drop and recreate the `weir_chaos_*` tables: one at a time.
static POSTGRES_CHAOS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `weir chaos --json ARGS` and returns its summary.
fn chaos(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["chaos", "--json"];
    all.extend_from_slice(args);
    let out = run_weir(&bin(), &all, None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// `weir chaos` on the worked example (Kafka, PostgreSQL), 6 kills, batches of 200 records
/// over 300 keys, in `work`, with `extra` arguments.
fn worked_example_chaos(work: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "--kills",
        "6",
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
    ];
    args.extend_from_slice(extra);
    chaos(&args)
}

fn checked(s: &serde_json::Value) -> String {
    s["checked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `weir chaos` on the worked example (Kafka -> newest per key -> Delta MERGE + PostgreSQL
/// upsert through staging + ledger), short, on input with awkward values and skewed
/// partitions: kills at random moments and at fault points, restarts, then every sink and
/// the source against the reference. The long runs are in the closing notes.
#[test]
fn chaos_on_the_worked_example_finds_no_mismatch() {
    let _one = POSTGRES_CHAOS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir();
    let work = dir.path().join("chaos");
    let s = worked_example_chaos(&work, &["--seed", "11", "--odd"]);
    assert_eq!(s["mismatches"], serde_json::json!([]), "{s}");
    assert_eq!(s["kills"], 6, "{s}");
    let committed = s["batches_committed"].as_u64().unwrap();
    let records = s["input_records"].as_u64().unwrap();
    // Batches hold at most 200 records (max-offsets-per-trigger; small skewed partitions
    // may round up by one record each), and all were read.
    assert!(records >= 2000 && committed * 203 >= records, "{s}");
    let checked = checked(&s);
    assert!(checked.contains("delta"), "{checked}");
    assert!(
        checked.contains(&format!("ledger {committed} rows")),
        "{checked}"
    );
    assert!(checked.contains("all committed"), "{checked}");
}

/// `weir chaos --workers 3` on the worked example: the batches' Kafka reads and the
/// newest-per-key window run on three `weir worker`s, and the kills hit the driver (at
/// random moments and fault points) and the workers (SIGKILL at random moments, restarted
/// after); every sink and the source are checked as without a cluster.
#[test]
fn chaos_with_workers_killed_too_finds_no_mismatch() {
    let _one = POSTGRES_CHAOS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir();
    let work = dir.path().join("chaos");
    let s = worked_example_chaos(&work, &["--seed", "5", "--workers", "3"]);
    assert_eq!(s["mismatches"], serde_json::json!([]), "{s}");
    assert_eq!(s["kills"], 6, "{s}");
    assert!(s["worker_kills"].as_u64().unwrap() >= 1, "{s}");
    let checked = checked(&s);
    assert!(checked.contains("all committed"), "{checked}");
    // The reports came from the cluster.
    let runs = std::fs::read_dir(work.join("runs")).unwrap();
    let mut on_workers = 0;
    for e in runs.flatten() {
        if e.path().extension().is_some_and(|x| x == "jsonl") {
            let text = std::fs::read_to_string(e.path()).unwrap();
            on_workers += text.lines().filter(|l| l.contains("\"cluster\"")).count();
        }
    }
    assert!(on_workers > 0, "progress reports name the workers");
}

/// `weir chaos` on the stateful example (watermark, dedupe within it, sliding-window
/// counts in update mode into Delta MERGE and PostgreSQL): kills at random moments and at
/// every fault point including the state commit; each batch is replayed from the
/// checkpoint through a reference written from Spark's rules, and both tables, the
/// recorded watermarks and the state sizes must agree with it.
#[test]
fn chaos_on_the_stateful_example_finds_no_mismatch() {
    let _one = POSTGRES_CHAOS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir();
    let work = dir.path().join("chaos");
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/orders_windowed.toml"
    );
    let s = chaos(&[
        "--pipeline",
        example,
        "--kills",
        "12",
        "--seed",
        "5",
        "--dir",
        work.to_str().unwrap(),
        "--postgres",
        &weir_testkit::postgres().url,
    ]);
    assert_eq!(s["mismatches"], serde_json::json!([]), "{s}");
    let checked = checked(&s);
    assert!(checked.contains("under the watermark rules"), "{checked}");
    assert!(checked.contains("state after batch"), "{checked}");
    let committed = s["batches_committed"].as_u64().unwrap();
    assert!(
        checked.contains(&format!("ledger {committed} rows")),
        "{checked}"
    );
}

/// `weir chaos` on a files pipeline with an append sink of each kind and a MERGE, on files
/// with awkward names, empty files, NULLs and ties, and retention of 3 batches so purging
/// and compaction run under the kills, each run followed by a simulated power cut: no
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
    let s = chaos(&[
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
        "--odd",
        "--retain",
        "3",
        "--dir",
        work.to_str().unwrap(),
        "--power-loss",
    ]);
    // Every run ended in a power cut that dropped what was not yet durable.
    assert_eq!(
        s["power_cuts"].as_u64().unwrap() + 1,
        s["runs"].as_u64().unwrap(),
        "{s}"
    );
    assert_eq!(s["mismatches"], serde_json::json!([]), "{s}");
    let records = s["input_records"].as_u64().unwrap();
    let checked = checked(&s);
    // Both append sinks hold exactly as many rows as the input had.
    for sink in [
        format!("delta-append {}", work.join("delta_append_0").display()),
        format!("parquet {}", work.join("parquet_1").display()),
    ] {
        assert!(
            checked.contains(&format!("{sink}: {records} rows")),
            "{sink}: {checked}"
        );
    }
    assert!(checked.contains("each taken once"), "{checked}");
}

/// The fault points chaos uses are the ones the pipeline's connectors declare, and each
/// of them is reached by a batch: a connector that renames a point is still hit.
#[test]
fn every_fault_point_the_connectors_declare_is_reached() {
    let dir = temp_dir();
    let url = weir_testkit::postgres().url.clone();
    gen_orders(&dir.path().join("in"), 3, 10, 10);
    let sinks = format!(
        "[[sink]]\ntype = \"delta-append\"\npath = \"a\"\n\n\
         [[sink]]\ntype = \"delta-merge\"\npath = \"m\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n\n\
         [[sink]]\ntype = \"parquet\"\npath = \"p\"\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{url}\"\ntable = \"points_t\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{url}\"\ntable = \"points_s\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\nstaging-table = \"points_staging\"\n"
    );
    let p = pipeline(dir.path(), &sinks);
    let work = dir.path().join("w");
    let out = run_weir(
        &bin(),
        &[
            "chaos",
            "--list-points",
            "--pipeline",
            p.to_str().unwrap(),
            "--postgres",
            &url,
            "--dir",
            work.to_str().unwrap(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let points: Vec<String> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(points.len() >= 12, "{points:?}");
    for point in &points {
        let run = dir.path().join(format!("run-{point}"));
        std::fs::create_dir_all(&run).unwrap();
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace(
                "path = \"in\"",
                &format!("path = \"{}\"", dir.path().join("in").display()),
            )
            .replace("points_", &format!("points_{}_", point.replace('-', "_")));
        let rp = run.join("pipeline.toml");
        std::fs::write(&rp, text).unwrap();
        let out = run_weir(
            &bin(),
            &["run", rp.to_str().unwrap()],
            Some(&format!("{point}@1:error")),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains(&format!("fault injected at {point} in batch 1")),
            "{point}: {stderr}"
        );
    }
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

/// `weir chaos` with the checkpoint, a Delta append table, a Delta MERGE table and a
/// Parquet folder on the S3 server: the lease lapses after each kill, every sink is exact.
#[test]
fn chaos_with_everything_on_s3_finds_no_mismatch() {
    let dir = temp_dir();
    let s3 = weir_testkit::s3();
    s3.bucket("weir-chaos");
    let p = dir.path().join("files.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"orders-s3\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"files\"\npath = \"in\"\n\
             format = \"json\"\nschema = {SCHEMA}\n\n[[sink]]\ntype = \"delta-append\"\npath = \"a\"\n\n\
             [[sink]]\ntype = \"delta-merge\"\npath = \"m\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n\n\
             [[sink]]\ntype = \"parquet\"\npath = \"p\"\n"
        ),
    )
    .unwrap();
    let work = dir.path().join("chaos");
    let store = format!("s3://weir-chaos/{}", uuid::Uuid::new_v4().simple());
    let mut args: Vec<String> = [
        "--pipeline",
        p.to_str().unwrap(),
        "--kills",
        "4",
        "--seed",
        "3",
        "--batch-rows",
        "50",
        "--keys",
        "80",
        "--dir",
        work.to_str().unwrap(),
        "--store",
        &store,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (k, v) in s3.options() {
        args.push("--storage".into());
        args.push(format!("{k}={v}"));
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let s = chaos(&refs);
    assert_eq!(s["mismatches"], serde_json::json!([]), "{s}");
    let checked = checked(&s);
    assert!(checked.contains(&format!("{store}/parquet_2")), "{checked}");
}
