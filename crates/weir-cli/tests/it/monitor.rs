//! `weir run --http`: a real Prometheus scrapes it, promtool accepts the exposition, and
//! headless Chromium shows the batches that ran on the live page.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_testkit::service::free_port;
use weir_testkit::temp_dir;

use crate::{bin, gen_orders, pipeline};

/// GET `url` with curl: (HTTP status, body).
pub(crate) fn get(url: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", url])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

pub(crate) fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `weir run` on `files` files of 5 orders, one file per 200 ms trigger, serving on a free
/// port; returns the child and the base URL.
fn start(dir: &Path, files: usize) -> (Child, String) {
    start_with(dir, files, &[], &[])
}

/// `start` with more `weir run` arguments and environment variables.
fn start_with(dir: &Path, files: usize, args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    gen_orders(&dir.join("in"), files, 5, 3);
    let p = pipeline(dir, "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"available-now\"", "\"200ms\"");
    std::fs::write(&p, text).unwrap();
    let port = free_port();
    let child = Command::new(bin())
        .args(["run", p.to_str().unwrap(), "--quiet", "--http"])
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    wait_until("the endpoint", Duration::from_secs(60), || {
        get(&format!("{base}/healthz")).0 == 200
    });
    (child, base)
}

fn progress(base: &str) -> Vec<Value> {
    serde_json::from_str(&get(&format!("{base}/api/progress")).1).unwrap()
}

struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_the_batch_counter_and_phase_histogram_and_promtool_accepts_them() {
    let dir = temp_dir();
    let (child, base) = start(dir.path(), 40);
    let _stop = Stop(child);
    wait_until("a batch", Duration::from_secs(60), || {
        !progress(&base).is_empty()
    });
    let (code, ready) = get(&format!("{base}/readyz"));
    assert_eq!(code, 200, "{ready}");
    let (_, metrics) = get(&format!("{base}/metrics"));
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (.ci/run installs the prometheus package)");
    use std::io::Write;
    check
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}\n{metrics}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let sink_rows = format!(
        "weir_sink_rows_total{{query=\"orders\",sink=\"parquet {}\"}}",
        dir.path().join("out").display()
    );
    for name in [
        "weir_build_info{version=",
        "weir_batches_committed_total{query=\"orders\"}",
        "weir_batch_phase_duration_seconds_bucket{query=\"orders\",phase=\"addBatch\",le=\"+Inf\"}",
        sink_rows.as_str(),
        "process_resident_memory_bytes",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }

    // A real Prometheus server scrapes it every second.
    let prom_dir = dir.path().join("prom");
    std::fs::create_dir_all(&prom_dir).unwrap();
    let target = base.trim_start_matches("http://");
    std::fs::write(
        prom_dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: weir\n    \
             static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let prom_port = free_port();
    let prom = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            prom_dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            prom_dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus (.ci/run installs it)");
    let _prom = Stop(prom);
    let query = |q: &str| -> Vec<Value> {
        let url = format!("http://127.0.0.1:{prom_port}/api/v1/query?query={q}");
        let (_, body) = get(&url);
        serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["data"]["result"].as_array().cloned())
            .unwrap_or_default()
    };
    let value = |r: &[Value]| -> f64 {
        r.first()
            .and_then(|s| s["value"][1].as_str())
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    let mut first = -1.0;
    wait_until("a first scrape", Duration::from_secs(90), || {
        first = value(&query("weir_batches_committed_total"));
        first >= 1.0
    });
    wait_until("the counter to increase", Duration::from_secs(60), || {
        value(&query("weir_batches_committed_total")) > first
    });
    let buckets = query("weir_batch_phase_duration_seconds_bucket%7Bphase%3D%22addBatch%22%7D");
    assert!(buckets.len() > 10, "{buckets:?}");
    let count = value(&query(
        "weir_batch_phase_duration_seconds_count%7Bphase%3D%22triggerExecution%22%7D",
    ));
    assert!(count >= first, "{count} < {first}");
}

#[test]
fn the_live_page_shows_the_batches_that_ran_in_headless_chromium() {
    let dir = temp_dir();
    // Six files: six batches, then the query waits for more (the page's figures hold still).
    let (child, base) = start(dir.path(), 6);
    let _stop = Stop(child);
    wait_until("six batches", Duration::from_secs(60), || {
        progress(&base).len() == 6
    });
    let want = progress(&base);
    let chromium = |extra: &[&str]| {
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--window-size=1400,1100",
                "--virtual-time-budget=4000",
            ])
            .args(extra)
            .arg(format!("{base}/"))
            .output()
            .expect("chromium (.ci/run installs it)")
    };
    let out = chromium(&["--dump-dom"]);
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        dom.contains("data-batches=\"6\""),
        "the page did not load the progress: {dom}"
    );
    // Every chart holds a point per batch that ran.
    let ids: Vec<String> = want.iter().map(|p| p["batchId"].to_string()).collect();
    for chart in ["rates", "rows", "phases", "sinks", "interval-chart"] {
        let tag = dom
            .split("<canvas")
            .find(|c| c.contains(&format!("id=\"{chart}\"")))
            .unwrap_or_else(|| panic!("no chart {chart}: {dom}"));
        assert!(tag.contains("data-points=\"6\""), "{chart}: {tag}");
        assert!(
            tag.contains(&format!("data-batches=\"{}\"", ids.join(","))),
            "{chart}: {tag}"
        );
    }
    // The table's numbers are the progress reports' numbers.
    for p in &want {
        let row = dom
            .split("<tr ")
            .find(|r| r.starts_with(&format!("data-batch=\"{}\"", p["batchId"])))
            .unwrap_or_else(|| panic!("no row for batch {}: {dom}", p["batchId"]));
        let cell = |key: &str| {
            let at = row.find(&format!("data-key=\"{key}\">")).unwrap() + key.len() + 12;
            row[at..].split('<').next().unwrap().to_string()
        };
        assert_eq!(cell("numInputRows"), p["numInputRows"].to_string());
        assert_eq!(cell("addBatch"), p["durationMs"]["addBatch"].to_string());
        assert_eq!(
            cell("triggerExecution"),
            p["durationMs"]["triggerExecution"].to_string()
        );
        assert_eq!(cell("timestamp"), p["timestamp"].as_str().unwrap());
    }
    let shot = dir.path().join("page.png");
    let out = chromium(&[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap_or_else(|e| panic!("no screenshot ({e}): {out:?}"));
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    if let Ok(keep) = std::env::var("WEIR_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
}

/// The README's scrape configuration is one Prometheus accepts.
#[test]
fn the_readme_scrape_config_passes_promtool() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let dir = temp_dir();
    let mut n = 0;
    for block in readme.split("```yaml\n").skip(1) {
        let text = block.split("```").next().unwrap();
        let p = dir.path().join(format!("prometheus-{n}.yml"));
        std::fs::write(&p, text).unwrap();
        let out = Command::new("promtool")
            .args(["check", "config"])
            .arg(&p)
            .output()
            .expect("promtool (.ci/run installs the prometheus package)");
        assert!(out.status.success(), "{text}\n{out:?}");
        n += 1;
    }
    assert!(n > 0, "no yaml block in the README");
}

/// The example alert rules pass `promtool check rules` and their unit tests (each alert
/// fires when and only when it should), and every metric they use is one a running query
/// serves.
#[test]
fn the_example_alert_rules_pass_promtool_and_use_metrics_weir_serves() {
    let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs");
    for args in [
        ["check", "rules", "prometheus-alerts.yml"],
        ["test", "rules", "prometheus-alerts.test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(docs)
            .output()
            .expect("promtool (.ci/run installs the prometheus package)");
        assert!(out.status.success(), "promtool {args:?}: {out:?}");
    }
    let rules = std::fs::read_to_string(format!("{docs}/prometheus-alerts.yml")).unwrap();
    let used: std::collections::BTreeSet<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("weir_"))
        .collect();
    assert!(used.len() >= 4, "{used:?}");
    let dir = temp_dir();
    let (child, base) = start(dir.path(), 10);
    let _stop = Stop(child);
    wait_until("a batch", Duration::from_secs(60), || {
        !progress(&base).is_empty()
    });
    let (_, metrics) = get(&format!("{base}/metrics"));
    for name in used {
        assert!(
            metrics.contains(&format!("# HELP {name} ")),
            "{name} is in the rules but not in /metrics:\n{metrics}"
        );
    }
}

/// With `--max-behind`, a query whose every batch ends before the source's newest offset
/// (one file a batch, a backlog of files) turns `/readyz` 503 naming the source once the
/// backlog has lasted longer; the gauge says how long.
#[test]
fn a_backlog_longer_than_max_behind_fails_readiness_naming_the_source() {
    let dir = temp_dir();
    let (child, base) = start_with(dir.path(), 60, &["--max-behind", "1s"], &[]);
    let _stop = Stop(child);
    let mut ready = (0, String::new());
    wait_until(
        "/readyz to fail on the backlog",
        Duration::from_secs(60),
        || {
            ready = get(&format!("{base}/readyz"));
            ready.0 == 503 && ready.1.contains("behind")
        },
    );
    assert!(
        ready.1.contains("FileStreamSource") || ready.1.contains("behind "),
        "{ready:?}"
    );
    let (_, status) = get(&format!("{base}/api/status"));
    let status: Value = serde_json::from_str(&status).unwrap();
    let behind = status["sourcesBehind"].as_object().unwrap();
    assert!(
        behind.values().any(|b| b["seconds"].as_u64().unwrap() >= 1),
        "{status}"
    );
    let (_, metrics) = get(&format!("{base}/metrics"));
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("weir_source_seconds_behind{") && !l.ends_with(" 0")),
        "{metrics}"
    );
}

/// With `--http-token env:VAR`, the figures need the bearer token; `/healthz` and the page
/// itself do not (the page sends the token given in its URL's fragment).
#[test]
fn with_a_token_the_endpoint_answers_401_without_it() {
    let dir = temp_dir();
    let (child, base) = start_with(
        dir.path(),
        10,
        &["--http-token", "env:WEIR_TEST_HTTP_TOKEN"],
        &[("WEIR_TEST_HTTP_TOKEN", "s3cret")],
    );
    let _stop = Stop(child);
    let with = |path: &str, token: &str| -> u16 {
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H"])
            .arg(format!("Authorization: Bearer {token}"))
            .arg(format!("{base}{path}"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
    };
    for path in ["/metrics", "/readyz", "/api/progress", "/api/status"] {
        assert_eq!(
            get(&format!("{base}{path}")).0,
            401,
            "{path} without a token"
        );
        assert_eq!(with(path, "wrong"), 401, "{path} with a wrong token");
        assert_ne!(with(path, "s3cret"), 401, "{path} with the token");
    }
    assert_eq!(get(&format!("{base}/")).0, 200, "the page holds no figures");
    let (_, page) = get(&format!("{base}/"));
    assert!(page.contains("#token") || page.contains("location.hash"));
}
