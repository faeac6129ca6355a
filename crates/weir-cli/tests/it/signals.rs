//! SIGTERM and Ctrl-C: the batch in progress is finished and committed; a second signal,
//! or the grace period running out, stops at once and leaves the batch to run again.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir_core::datafusion::prelude::SessionContext;
use weir_testkit::{parquet_rows, rows, temp_dir};

use crate::{bin, gen_orders, gen_orders_from, input_rows, pipeline};

/// Starts `weir run` on a pipeline that runs one file per 100 ms, with batch 1 held for
/// `hold_ms` before the user function.
fn start(p: &Path, hold_ms: u64, extra: &[&str]) -> Child {
    let text = std::fs::read_to_string(p)
        .unwrap()
        .replace("\"available-now\"", "\"100ms\"");
    std::fs::write(p, text).unwrap();
    let mut args = vec!["run", p.to_str().unwrap(), "--quiet"];
    args.extend_from_slice(extra);
    Command::new(bin())
        .args(&args)
        .env("WEIR_FAULT", format!("before-user-fn@1:sleep={hold_ms}"))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

fn finish(child: Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Delta append, PostgreSQL upsert into `table` and Parquet.
fn sinks(table: &str) -> String {
    let url = &weir_testkit::postgres().url;
    format!(
        "[[sink]]\ntype = \"delta-append\"\npath = \"delta\"\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{url}\"\ntable = \"{table}\"\n\
         keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
         [[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
    )
}

/// Every sink holds the input exactly once: Delta and Parquet every row, PostgreSQL one row
/// per key; one Delta commit and one ledger row per batch (none written twice or skipped).
async fn check_sinks(dir: &Path, table: &str, batches: u64) {
    let cols = ["order_id", "status", "amount", "updated_at"];
    let input = input_rows(&dir.join("in")).await;
    assert_eq!(parquet_rows(&dir.join("out"), &cols).await, input);
    let ctx = SessionContext::new();
    let delta = weir_delta::read_table(&ctx, &dir.join("delta").into())
        .await
        .unwrap();
    assert_eq!(rows(delta.select_columns(&cols).unwrap()).await, input);
    let version = weir_delta::table_version(&dir.join("delta").into())
        .await
        .unwrap();
    assert_eq!(version, Some(batches - 1), "one Delta commit per batch");
    let url = &weir_testkit::postgres().url;
    let keys: std::collections::BTreeSet<&str> =
        input.iter().map(|r| r.split('|').next().unwrap()).collect();
    let got = weir_testkit::pg_rows(url, &format!("SELECT order_id::text FROM {table}")).await;
    assert_eq!(got.len(), keys.len(), "one PostgreSQL row per key");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("chk/metadata")).unwrap()).unwrap();
    let ledger = weir_testkit::pg_rows(
        url,
        &format!(
            "SELECT batch_id::text FROM {} WHERE app_id LIKE '%{}%'",
            weir_postgres::DEFAULT_LEDGER,
            meta["id"].as_str().unwrap()
        ),
    )
    .await;
    assert_eq!(
        ledger.len() as u64,
        batches,
        "one ledger row per batch: {ledger:?}"
    );
}

/// Points the pipeline back at available-now and runs it to the end (printing its lines).
fn restart(p: &Path) -> String {
    let text = std::fs::read_to_string(p)
        .unwrap()
        .replace("\"100ms\"", "\"available-now\"");
    std::fs::write(p, text).unwrap();
    let out = weir_testkit::run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn sigterm_finishes_and_commits_the_batch_in_progress_then_exits_0() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 4, 5, 3);
    let p = pipeline(dir.path(), &sinks("sigterm_orders"));
    let child = start(&p, 1500, &[]);
    wait_for(&dir.path().join("chk/offsets/1"));
    signal(&child, "-TERM");
    let (code, err) = finish(child);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("SIGTERM: stopping after the current batch"),
        "{err}"
    );
    let chk = dir.path().join("chk");
    assert!(chk.join("commits/1").exists(), "{err}");
    assert!(!chk.join("offsets/2").exists(), "{err}");
    // Two of four files were read, each once; the restart goes on from batch 2 (batch 1 is
    // not run again) and reads the rest.
    let cols = ["order_id"];
    assert_eq!(parquet_rows(&dir.path().join("out"), &cols).await.len(), 10);
    let stdout = restart(&p);
    assert!(
        stdout.contains("batch 2:") && !stdout.contains("batch 1:"),
        "{stdout}"
    );
    check_sinks(dir.path(), "sigterm_orders", 4).await;
}

#[tokio::test]
async fn a_second_signal_or_the_grace_period_stops_at_once_and_the_batch_runs_again() {
    let cases = [(&[][..], true), (&["--stop-grace", "300ms"][..], false)];
    for (i, (extra, second)) in cases.into_iter().enumerate() {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 3, 5, 3);
        let table = format!("hard_stop_orders_{i}");
        let p = pipeline(dir.path(), &sinks(&table));
        let child = start(&p, 30_000, extra);
        let chk = dir.path().join("chk");
        wait_for(&chk.join("offsets/1"));
        let t = Instant::now();
        signal(&child, "-INT");
        if second {
            std::thread::sleep(Duration::from_millis(200));
            signal(&child, "-TERM");
        }
        let (code, err) = finish(child);
        assert!(t.elapsed() < Duration::from_secs(20), "{err}");
        assert_eq!(code, Some(130), "{err}");
        let why = if second {
            "SIGTERM again"
        } else {
            "did not finish within 300ms"
        };
        assert!(err.contains(why) && err.contains("runs again"), "{err}");
        assert!(!chk.join("commits/1").exists(), "{err}");
        // The next start runs batch 1 again with the same file, and nothing is doubled.
        let stdout = restart(&p);
        assert!(stdout.contains("batch 1:"), "batch 1 runs again: {stdout}");
        check_sinks(dir.path(), &table, 3).await;
    }
}

/// `--log-format json`: one JSON object per line; a line about a batch (here the Delta sink
/// skipping the replayed batch it already holds) carries the query and the batch id.
#[test]
fn json_logs_carry_the_query_and_batch_id() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 3, 5, 3);
    let p = pipeline(
        dir.path(),
        "[[sink]]\ntype = \"delta-append\"\npath = \"delta\"\n",
    );
    let crash = weir_testkit::run_weir(
        &bin(),
        &["run", p.to_str().unwrap()],
        Some(&format!("{}@1", weir_delta::POINT_AFTER_COMMIT)),
    );
    assert!(!crash.status.success());
    let out = Command::new(bin())
        .args([
            "--log-format",
            "json",
            "run",
            p.to_str().unwrap(),
            "--quiet",
        ])
        .env_remove("WEIR_FAULT")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let skipped = lines
        .iter()
        .find(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("skipped"))
        })
        .unwrap_or_else(|| panic!("no line about the skipped batch: {err}"));
    assert_eq!(skipped["span"]["query"], "orders", "{skipped}");
    assert_eq!(skipped["span"]["batch_id"], 1, "{skipped}");

    // A run that fails, with the monitoring endpoint on: every line is JSON too, the
    // binary's own (where it serves, the final error and its causes) included, and the
    // error names its batch in a field.
    let more = dir.path().join("in");
    gen_orders_from(&more, 3, 2, 5, 3);
    let out = weir_testkit::run_weir(
        &bin(),
        &[
            "--log-format",
            "json",
            "run",
            p.to_str().unwrap(),
            "--quiet",
            "--http",
            "127.0.0.1:0",
        ],
        Some("after-user-fn@3:error"),
    );
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("monitoring at"))),
        "{err}"
    );
    let last = lines.last().unwrap();
    assert_eq!(last["level"], "ERROR", "{last}");
    assert_eq!(last["fields"]["batch_id"], 3, "{last}");
    assert!(
        last["fields"]["causes"].to_string().contains("batch 3"),
        "{last}"
    );
}

/// A query holding its checkpoint (batches of 1.5 s), and a second start of it with
/// `lease-wait = "60s"`, waiting: the folder, the holder and the waiting start.
fn a_start_waiting_for_a_holder() -> (tempfile::TempDir, Child, Child) {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 4, 5, 3);
    let p = pipeline(dir.path(), "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let text = std::fs::read_to_string(&p).unwrap();
    let next = dir.path().join("next.toml");
    std::fs::write(
        &next,
        text.replace("[query]\n", "[query]\nlease-wait = \"60s\"\n"),
    )
    .unwrap();
    let old = start(&p, 1500, &[]);
    wait_for(&dir.path().join("chk/offsets/1"));
    let new = Command::new(bin())
        .args(["run", next.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    (dir, old, new)
}

/// A new process started with `lease-wait` while the old one still holds the checkpoint
/// waits for it instead of refusing, then goes on from where the old one stopped.
#[tokio::test]
async fn a_start_with_lease_wait_takes_over_when_the_holder_stops() {
    let (dir, old, mut new) = a_start_waiting_for_a_holder();
    assert!(
        new.try_wait().unwrap().is_none(),
        "the new process waits while the old one holds the checkpoint"
    );
    signal(&old, "-TERM");
    let (code, err) = finish(old);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = finish(new);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("lease-wait"), "{err}");
    let cols = ["order_id", "status", "amount", "updated_at"];
    assert_eq!(
        parquet_rows(&dir.path().join("out"), &cols).await,
        input_rows(&dir.path().join("in")).await
    );
}

/// A stop signal while a start waits for the checkpoint (`lease-wait`) ends that start at
/// once and cleanly (exit 0, no batch begun), not with "in use" after the wait.
#[tokio::test]
async fn a_sigterm_during_lease_wait_stops_the_waiting_start_cleanly() {
    let (_dir, old, mut new) = a_start_waiting_for_a_holder();
    assert!(new.try_wait().unwrap().is_none(), "the new process waits");
    let asked = std::time::Instant::now();
    signal(&new, "-TERM");
    let (code, err) = finish(new);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "stopped at once, not after the wait"
    );
    assert!(err.contains("SIGTERM while starting"), "{err}");
    signal(&old, "-TERM");
    let (code, err) = finish(old);
    assert_eq!(code, Some(0), "{err}");
}
