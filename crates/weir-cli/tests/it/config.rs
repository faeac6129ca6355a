//! Bad pipelines, `weir checkpoint show`, the demo, and the README's examples.

use weir_testkit::{rows, run_weir, temp_dir};

use crate::{bin, gen_orders, pipeline, run_to_end};

#[test]
fn bad_pipelines_are_refused_naming_the_key() {
    let dir = temp_dir();
    let cases = [
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\ncolour = \"red\"\n",
            "colour",
        ),
        ("[[sink]]\ntype = \"parqet\"\npath = \"out\"\n", "parqet"),
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n\
             [[sink]]\ntype = \"parquet\"\npath = \"out/inner\"\n",
            "same folder",
        ),
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"in\"\n",
            "same folder",
        ),
        (
            "[[sink]]\ntype = \"delta-append\"\npath = \"t\"\ndeleted-file-retention = \"1 week\"\n",
            "'1 week' is not a duration such as 500ms, 30s, 5m, 2h, 7d or 10 minutes\nin `deleted-file-retention`",
        ),
        (
            "[[sink]]\ntype = \"postgres-upsert\"\nurl = \"host=x\"\ntable = \"t\"\nkeys = \"id\"\n",
            "in `keys`",
        ),
        ("[[sink]]\npath = \"out\"\n", "missing field `type`"),
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\ntimeout = \"soon\"\n",
            "in `timeout`",
        ),
        (
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\ntimeout = \"0s\"\n",
            "`timeout` must be more than 0",
        ),
    ];
    for (sinks, want) in cases {
        let p = pipeline(dir.path(), sinks);
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{want}: {err}");
    }
    // The same for the source: the key at fault is named.
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let text = std::fs::read_to_string(&p).unwrap();
    let bad = text.replacen("[source]\n", "[source]\nmax-file-age = \"3x\"\n", 1);
    assert_ne!(bad, text);
    std::fs::write(&p, bad).unwrap();
    let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("'3x'") && err.contains("in `max-file-age`"),
        "{err}"
    );
    // A local source folder that is not there (a typo, a volume not mounted) is refused,
    // as Spark refuses it, not read as an empty stream.
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("path = \"in\"", "path = \"no such folder\"");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("source.path")
            && err.contains("Path does not exist")
            && err.contains("no such folder"),
        "{err}"
    );
    // A retry policy that cannot work, and one with a key it does not know.
    for (retry, want) in [
        ("{ attempts = 0 }", "query.retry.attempts"),
        ("{ initial = \"5s\", max = \"1s\" }", "query.retry.initial"),
        ("{ tries = 3 }", "tries"),
        ("{ initial = \"0s\" }", "query.retry.initial"),
    ] {
        let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "trigger = \"available-now\"",
            &format!("trigger = \"available-now\"\nretry = {retry}"),
        );
        std::fs::write(&p, text).unwrap();
        let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{want}: {err}");
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
        .replace("soonish", "3000000000000000h");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("too long"), "{err}");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("3000000000000000h", "once")
        .replace("amount double", "amount dbl");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("source.schema[2]") && err.contains("dbl"),
        "{err}"
    );
    // A Parquet folder that already holds part files no query claimed is refused before
    // anything is read, and left as it was.
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 2, 5, 3);
    let out_dir = dir.path().join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(out_dir.join("part-old.parquet"), b"not ours").unwrap();
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("part-old.parquet") && err.contains("claims"),
        "{err}"
    );
    let names: Vec<_> = std::fs::read_dir(&out_dir).unwrap().collect();
    assert_eq!(names.len(), 1, "{names:?}");
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
    // The pipeline file names the same checkpoint.
    let by_pipeline = run_weir(&bin(), &["checkpoint", "show", p.to_str().unwrap()], None);
    assert_eq!(String::from_utf8_lossy(&by_pipeline.stdout), text);
    let bad = run_weir(
        &bin(),
        &[
            "checkpoint",
            "show",
            chk.to_str().unwrap(),
            "--storage",
            "novalue",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("give KEY=VALUE"),
        "{err}"
    );
    // A checkpoint the next start would refuse: shown, and exit 1.
    std::fs::write(chk.join("commits/0"), "garbage").unwrap();
    let out = run_weir(&bin(), &["checkpoint", "show", chk.to_str().unwrap()], None);
    let shown = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && shown.contains("problem") && err.contains("would refuse"),
        "{shown}{err}"
    );
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

/// Every pipeline in the README passes `weir check` as written.
#[test]
fn the_readme_pipelines_pass_weir_check() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let dir = temp_dir();
    let mut n = 0;
    for (i, block) in readme.split("```toml\n").skip(1).enumerate() {
        let text = block.split("```").next().unwrap();
        let p = dir.path().join(format!("readme-{i}.toml"));
        std::fs::write(&p, text).unwrap();
        // The secrets the README's pipelines read from the environment.
        let out = std::process::Command::new(bin())
            .args(["check", p.to_str().unwrap()])
            .env("AWS_ACCESS_KEY_ID", "key")
            .env("AWS_SECRET_ACCESS_KEY", "secret")
            .env("KAFKA_PASSWORD", "password")
            .env("WEIR_CLUSTER_TOKEN", "token")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "README pipeline {i}:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        n += 1;
    }
    assert!(n >= 2, "{n} pipelines");
    for example in ["orders_upsert.toml", "orders_windowed.toml"] {
        let path = format!("{}/../../examples/{example}", env!("CARGO_MANIFEST_DIR"));
        let out = std::process::Command::new(bin())
            .args(["check", &path])
            .env("DATABASE_URL", "host=localhost user=postgres")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{example}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The binary tunes glibc's malloc at start-up (fragmentation over millions of batches)
/// unless the environment already does, and says which in its debug log.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn the_binary_tunes_glibc_malloc_unless_the_user_did() {
    let dir = temp_dir();
    let missing = dir.path().join("no checkpoint");
    let run = |tunables: Option<&str>| {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["checkpoint", "show", missing.to_str().unwrap()])
            .env("RUST_LOG", "weir=debug")
            .env_remove("GLIBC_TUNABLES")
            .env_remove("MALLOC_ARENA_MAX");
        if let Some(t) = tunables {
            cmd.env("GLIBC_TUNABLES", t);
        }
        let out = cmd.output().unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let ours = run(None);
    assert!(
        ours.contains("glibc malloc: fixed 128 KiB mmap threshold, one arena per core"),
        "{ours}"
    );
    let theirs = run(Some("glibc.malloc.arena_max=4"));
    assert!(
        theirs.contains("glibc malloc tunables set in the environment: kept"),
        "{theirs}"
    );
}

/// The README's stateful pipeline runs as written on `weir gen` input: every window it
/// wrote is one minute long, on a minute boundary, closed by the final watermark, once per
/// status, and counts no more rows than came in.
#[tokio::test]
async fn the_readme_stateful_pipeline_runs_as_written() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let block = readme
        .split("<!-- stateful-pipeline: tests run this block as written -->\n```toml\n")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let dir = temp_dir();
    let p = dir.path().join("stateful.toml");
    std::fs::write(&p, block).unwrap();
    let out = run_weir(
        &bin(),
        &[
            "gen",
            "--dir",
            dir.path().join("in").to_str().unwrap(),
            "--files",
            "20",
        ],
        None,
    );
    assert!(out.status.success());
    let prog = dir.path().join("progress.jsonl");
    let last = run_to_end(&p, &prog);
    assert_eq!(
        last["numInputRows"], 0,
        "it ends with a no-data batch: {last}"
    );
    let watermark =
        chrono::DateTime::parse_from_rfc3339(last["eventTime"]["watermark"].as_str().unwrap())
            .unwrap()
            .timestamp_micros();
    let ctx = weir_core::datafusion::prelude::SessionContext::new();
    let table = weir_delta::read_table(&ctx, &dir.path().join("orders_per_minute").into())
        .await
        .unwrap();
    let got = rows(
        table
            .select(vec![
                weir_core::datafusion::prelude::col("status"),
                weir_core::datafusion::prelude::cast(
                    weir_core::datafusion::prelude::col("window_start"),
                    weir_core::datafusion::arrow::datatypes::DataType::Int64,
                ),
                weir_core::datafusion::prelude::cast(
                    weir_core::datafusion::prelude::col("window_end"),
                    weir_core::datafusion::arrow::datatypes::DataType::Int64,
                ),
                weir_core::datafusion::prelude::col("orders"),
            ])
            .unwrap(),
    )
    .await;
    assert!(got.len() > 20, "{got:?}");
    let mut seen = std::collections::BTreeSet::new();
    let mut counted = 0;
    for r in &got {
        let f: Vec<&str> = r.split('|').collect();
        let (start, end, n): (i64, i64, i64) = (
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
            f[3].parse().unwrap(),
        );
        assert_eq!(end - start, 60_000_000, "{r}");
        assert_eq!(start % 60_000_000, 0, "{r}");
        assert!(
            end <= watermark,
            "{r}: written before the watermark passed its end"
        );
        assert!(seen.insert((f[0].to_string(), start)), "{r} twice");
        counted += n;
    }
    assert!(counted > 0 && counted <= 20_000, "{counted}");
}

/// `weir check` refuses stateful settings that cannot run, without running anything.
#[test]
fn weir_check_refuses_stateful_settings_that_cannot_run() {
    let dir = temp_dir();
    for (body, want) in [
        (
            "[transform.aggregate]\ngroup-by = [\"status\"]\naggregates = [\"count(*)\"]\n",
            "output mode append needs a watermark",
        ),
        (
            "[transform]\ndrop-duplicates-within-watermark = [\"order_id\"]\n",
            "needs a watermark",
        ),
        (
            "[transform.aggregate]\ngroup-by = [\"status\", \"status\"]\naggregates = [\"count(*)\"]\noutput-mode = \"update\"\n",
            "`status` is twice",
        ),
    ] {
        let p = pipeline(
            dir.path(),
            &format!("{body}\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n"),
        );
        let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{want}: {err}");
    }
    for n in ["0", "1025"] {
        let p = pipeline(
            dir.path(),
            "[transform]\ndrop-duplicates = [\"order_id\"]\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n",
        );
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "trigger = \"available-now\"\n",
            &format!("trigger = \"available-now\"\nstate-partitions = {n}\n"),
        );
        std::fs::write(&p, text).unwrap();
        let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{n}: {err}");
        assert!(
            err.contains("query.state-partitions") && err.contains("1 to 1024"),
            "{err}"
        );
    }
}

/// `weir check` plans the SQL over an empty batch of the source's declared columns, so a
/// misspelt column, function or table is named before anything runs; it connects to
/// nothing, and says when it cannot plan (columns from the data, or after an aggregation).
#[test]
fn weir_check_plans_the_sql_over_the_source_columns() {
    let dir = temp_dir();
    let sink = "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n";
    let check = |p: &std::path::Path| {
        let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let newest = "SELECT order_id, status, amount, updated_at FROM (SELECT *, row_number() \
                  OVER (PARTITION BY order_id ORDER BY updated_at DESC) AS rn FROM batch) \
                  WHERE rn = 1";
    let p = pipeline(
        dir.path(),
        &format!("[transform]\nsql = \"{newest}\"\n\n{sink}"),
    );
    let (ok, out, err) = check(&p);
    assert!(ok, "{err}");
    assert!(
        out.contains("transform planned; the sinks get order_id, status, amount, updated_at"),
        "{out}"
    );
    for (sql, want) in [
        ("SELECT nosuchfn(order_id) FROM batch", "nosuchfn"),
        ("SELECT order_idd FROM batch", "order_idd"),
        (
            "SELECT * FROM batch JOIN other_orders USING (order_id)",
            "other_orders",
        ),
        ("SELECT order_id + status FROM batch", "the SQL transform"),
    ] {
        let p = pipeline(
            dir.path(),
            &format!("[transform]\nsql = \"{sql}\"\n\n{sink}"),
        );
        let (ok, out, err) = check(&p);
        assert!(!ok && err.contains(want), "{sql}: {out}{err}");
        assert!(err.contains(sql), "the error names the SQL: {err}");
    }
    // Statements are not transforms.
    let leak = dir.path().join("leak.json");
    let secret = dir.path().join("secret.csv");
    std::fs::write(&secret, "a,b\n1,2,3\n").unwrap();
    for sql in [
        "DROP TABLE batch".to_string(),
        "CREATE VIEW v AS SELECT * FROM batch".to_string(),
        "INSERT INTO batch SELECT * FROM batch".to_string(),
        format!(
            "COPY (SELECT * FROM batch) TO '{}' STORED AS JSON",
            leak.display()
        ),
        format!(
            "CREATE EXTERNAL TABLE t STORED AS CSV LOCATION '{}'",
            secret.display()
        ),
        "SET datafusion.execution.batch_size = 1".to_string(),
    ] {
        let p = pipeline(
            dir.path(),
            &format!("[transform]\nsql = \"{sql}\"\n\n{sink}"),
        );
        let (ok, out, err) = check(&p);
        assert!(
            !ok && err.contains("must be a query") && !err.contains("unequal lengths"),
            "{sql}: {out}{err}"
        );
    }
    assert!(!leak.exists(), "check ran the COPY");
    // An upsert sink's key and ordering must be among the columns the sinks get.
    let merge = "[[sink]]\ntype = \"delta-merge\"\npath = \"d\"\nkeys = [\"order_id\"]\n\
                 ordering = \"updated_at\"\n";
    for (sql, want) in [
        (
            "SELECT status, updated_at FROM batch",
            "key column `order_id`",
        ),
        (
            "SELECT order_id, status FROM batch",
            "ordering column `updated_at`",
        ),
    ] {
        let p = pipeline(
            dir.path(),
            &format!("[transform]\nsql = \"{sql}\"\n\n{merge}"),
        );
        let (ok, out, err) = check(&p);
        assert!(
            !ok && err.contains(want) && err.contains("sink[0]"),
            "{sql}: {out}{err}"
        );
    }
    let p = pipeline(
        dir.path(),
        &format!("[transform]\nsql = \"SELECT order_id, updated_at FROM batch\"\n\n{merge}"),
    );
    let (ok, out, err) = check(&p);
    assert!(ok, "{out}{err}");
    // A rate source's columns are fixed too.
    let p = dir.path().join("rate.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"r\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"rate\"\n\
             rows-per-second = 5\n\n[transform]\nsql = \"SELECT value * 2 AS v FROM batch\"\n\n{sink}"
        ),
    )
    .unwrap();
    let (ok, out, err) = check(&p);
    assert!(ok && out.contains("the sinks get v"), "{out}{err}");
    // `weir run` refuses it the same way before the checkpoint exists.
    let p = pipeline(
        dir.path(),
        &format!("[transform]\nsql = \"SELECT order_idd FROM batch\"\n\n{sink}"),
    );
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("order_idd"), "{err}");
    assert!(!dir.path().join("chk").exists(), "{err}");
    // The stateful steps' output is known at run time only: checked up to there.
    let p = pipeline(
        dir.path(),
        &format!(
            "[transform]\nsql = \"SELECT nosuch FROM batch\"\n\n[transform.aggregate]\n\
             group-by = [\"status\"]\naggregates = [\"count(*)\"]\noutput-mode = \"update\"\n\n{sink}"
        ),
    );
    let (ok, out, err) = check(&p);
    assert!(ok && out.contains("is planned at run time"), "{out}{err}");
    // Without SQL after it, the aggregation's column names are known: an upsert sink's
    // keys and ordering are looked up among them.
    let agg = "[transform.aggregate]\ngroup-by = [\"status\"]\n\
               aggregates = [\"count(*) AS orders\", \"max(updated_at) AS last\"]\n\
               output-mode = \"complete\"\n\n";
    for (keys, ordering, want) in [
        ("\"status\", \"nope\"", "orders", Some("key column `nope`")),
        ("\"status\"", "count(*)", Some("ordering column `count(*)`")),
        ("\"status\"", "orders", None),
    ] {
        let p = pipeline(
            dir.path(),
            &format!(
                "{agg}[[sink]]\ntype = \"delta-merge\"\npath = \"d\"\nkeys = [{keys}]\n\
                 ordering = \"{ordering}\"\n"
            ),
        );
        let (ok, out, err) = check(&p);
        match want {
            Some(want) => assert!(!ok && err.contains(want), "{want}: {out}{err}"),
            None => assert!(
                ok && out.contains("the sinks get status, orders, last"),
                "{out}{err}"
            ),
        }
    }
    // A Kafka source: its columns are fixed by the settings; no broker is asked.
    let p = dir.path().join("kafka.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"k\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"kafka\"\n\
             bootstrap-servers = \"127.0.0.1:1\"\nsubscribe = [\"t\"]\nvalue-format = \"json\"\n\
             schema = [\"order_id bigint\", \"status string\"]\n\n[transform]\n\
             sql = \"SELECT order_id, upper(status) AS status FROM batch\"\n\n{sink}"
        ),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (ok, out, err) = check(&p);
    assert!(
        ok && out.contains("the sinks get order_id, status"),
        "{out}{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("upper(status)", "upper(statuss)");
    std::fs::write(&p, text).unwrap();
    let (ok, _, err) = check(&p);
    assert!(!ok && err.contains("statuss"), "{err}");
    // Parquet without a declared schema: the columns come from the files.
    let p = dir.path().join("parquet.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"p\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"files\"\n\
             path = \"in\"\nformat = \"parquet\"\n\n[transform]\nsql = \"SELECT nosuch FROM batch\"\n\n{sink}"
        ),
    )
    .unwrap();
    let (ok, out, err) = check(&p);
    assert!(ok && out.contains("transform not planned"), "{out}{err}");
    // CSV says whether its first line is a header; JSON takes no CSV settings.
    let p = pipeline(dir.path(), sink);
    let json = std::fs::read_to_string(&p).unwrap();
    for (text, want) in [
        (json.replace("\"json\"", "\"csv\""), "source.csv-header"),
        (
            json.replace("format = \"json\"", "format = \"json\"\ncsv-header = true"),
            "applies to format = \"csv\"",
        ),
    ] {
        std::fs::write(&p, text).unwrap();
        let (ok, out, err) = check(&p);
        assert!(!ok && err.contains(want), "{want}: {out}{err}");
    }
    std::fs::write(&p, json.replace("\"json\"", "\"csv\"\ncsv-header = false")).unwrap();
    let (ok, out, err) = check(&p);
    assert!(ok, "{out}{err}");
    // PERMISSIVE's column for bad records, declared as something else than text.
    let p = pipeline(dir.path(), sink);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "schema = [",
        "mode = \"PERMISSIVE\"\nschema = [\"_corrupt_record bigint\", ",
    );
    std::fs::write(&p, text).unwrap();
    let (ok, out, err) = check(&p);
    assert!(!ok && err.contains("declare it as string"), "{out}{err}");
}
