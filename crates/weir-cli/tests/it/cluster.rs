//! `weir run` with `[cluster]` on three `weir worker` processes on this machine: every
//! input row lands once with workers killed and restarted mid-run and with the driver
//! killed at its fault points; workers of the wrong token, or none reachable, are refused
//! before batch 0 naming the worker.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir_core::fault::{AFTER_OFFSETS_WRITE, AFTER_USER_FN, BEFORE_COMMIT_WRITE};
use weir_core::sink::{PARQUET_BETWEEN_MOVES, PARQUET_POINTS};
use weir_testkit::{parquet_rows, run_weir, temp_dir};

use crate::kills::killed_in_batch_2_then_rerun;
use crate::{
    SCHEMA, bin, gen_orders, input_rows, last_progress, pipeline_with, progress_batches, run_to_end,
};

/// The workers as the pipeline helpers take them.
pub(crate) fn refs(ws: &[Worker]) -> Vec<&Worker> {
    ws.iter().collect()
}

/// A `weir worker` process, killed when dropped.
pub(crate) struct Worker {
    pub(crate) child: Child,
    pub(crate) url: String,
    /// Its log lines so far (warnings, and the state partitions it committed).
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Worker {
    /// Starts a worker on `listen` (`127.0.0.1:0`: a free port) and waits for its address.
    pub(crate) fn start(listen: &str, token: Option<&str>) -> Worker {
        Worker::start_in(None, listen, token)
    }

    /// Starts a worker in network namespace `ns` (`ip netns exec`), or in this one.
    pub(crate) fn start_in(ns: Option<&str>, listen: &str, token: Option<&str>) -> Worker {
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        cmd.args(["worker", "--listen", listen]);
        if let Some(t) = token {
            cmd.args(["--token", t]);
        }
        Worker::spawn(cmd)
    }

    /// Starts a worker that sees an empty folder of its own at `folder` (a tmpfs mounted
    /// there in a mount namespace of its own): a folder the driver and it do not share.
    pub(crate) fn start_with_private(folder: &Path) -> Worker {
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg("mount -t tmpfs weir-private \"$0\" && exec \"$1\" worker --listen 127.0.0.1:0")
            .arg(folder)
            .arg(bin());
        Worker::spawn(cmd)
    }

    /// Starts a worker that resolves host names with `hosts` as its `/etc/hosts`
    /// (bind-mounted in a mount namespace of its own): a machine whose names point
    /// elsewhere than the driver's.
    pub(crate) fn start_with_hosts(hosts: &Path) -> Worker {
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg("mount --bind \"$0\" /etc/hosts && exec \"$1\" worker --listen 127.0.0.1:0")
            .arg(hosts)
            .arg(bin());
        Worker::spawn(cmd)
    }

    /// Runs `cmd` (a `weir worker` command) and waits for the address it listens on.
    pub(crate) fn spawn(mut cmd: Command) -> Worker {
        cmd.env(
            "RUST_LOG",
            "warn,weir_core::engine::stateful::on_workers=info",
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("starting weir worker");
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let first = lines
            .next()
            .expect("the worker says where it listens")
            .unwrap();
        let url = first
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in: {first}"))
            .to_string();
        // Keep draining its stderr so it never blocks on a full pipe.
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        Worker { child, url, log }
    }

    /// Its log lines so far.
    pub(crate) fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Three workers on free ports, with `token`.
    pub(crate) fn three(token: Option<&str>) -> [Worker; 3] {
        [0, 1, 2].map(|_| Worker::start("127.0.0.1:0", token))
    }

    /// The `host:port` it listens on.
    pub(crate) fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_string()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A worker to SIGKILL mid-run: `workers[index]`, once `after` batches have landed, started
/// again on its address by `restart`.
pub(crate) struct WorkerKill<'a> {
    pub(crate) workers: &'a mut [Worker],
    pub(crate) index: usize,
    pub(crate) after: usize,
    pub(crate) restart: &'a dyn Fn(&str) -> Worker,
}

/// Runs the driver on `p` to the end with progress in `progress`, killing a worker on the
/// way if told. Returns the driver's stderr, after checking it succeeded.
pub(crate) fn run_killing_a_worker(
    p: &Path,
    progress: &Path,
    env: &[(&str, &str)],
    kill: Option<WorkerKill<'_>>,
) -> String {
    let mut cmd = Command::new(bin());
    cmd.args([
        "run",
        p.to_str().unwrap(),
        "--progress",
        progress.to_str().unwrap(),
    ])
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let driver = cmd.spawn().unwrap();
    if let Some(k) = kill {
        let deadline = Instant::now() + Duration::from_secs(120);
        while progress_batches(progress).len() < k.after && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let addr = k.workers[k.index].addr();
        k.workers[k.index].kill();
        std::thread::sleep(Duration::from_millis(200));
        k.workers[k.index] = (k.restart)(&addr);
    }
    let out = driver.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    stderr
}

/// Runs `p` to the end with progress in `progress`, SIGKILLing `ws[index]` once 2 batches
/// have landed and starting it again on its port (no token); checks that the run made
/// batches `0..batches`. Returns the driver's stderr.
pub(crate) fn run_through_a_worker_kill(
    p: &Path,
    progress: &Path,
    ws: &mut [Worker],
    index: usize,
    batches: u64,
) -> String {
    let stderr = run_killing_a_worker(
        p,
        progress,
        &[],
        Some(WorkerKill {
            workers: ws,
            index,
            after: 2,
            restart: &|a| Worker::start(a, None),
        }),
    );
    assert_eq!(
        progress_batches(progress),
        (0..batches).collect::<Vec<u64>>(),
        "{stderr}"
    );
    stderr
}

/// Every progress report of a run, in order.
pub(crate) fn progress_reports(progress: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(progress)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The tasks the workers ran over `reports` (`cluster.workers[].tasks`).
pub(crate) fn tasks_of(reports: &[serde_json::Value]) -> u64 {
    reports
        .iter()
        .flat_map(|r| {
            r["cluster"]["workers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|w| w["tasks"].as_u64().unwrap())
        .sum()
}

pub(crate) fn cluster_pipeline(
    dir: &Path,
    workers: &[&Worker],
    extra: &str,
    max_files: usize,
) -> std::path::PathBuf {
    let urls: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.url)).collect();
    pipeline_with(
        dir,
        max_files,
        &format!(
            r#"[transform]
sql = "SELECT order_id, status, amount, updated_at FROM batch WHERE order_id IS NOT NULL"

[[sink]]
type = "parquet"
path = "out"

[cluster]
workers = [{}]
connect-timeout = "2s"
{extra}
"#,
            urls.join(", ")
        ),
    )
}

/// `cluster_pipeline` with `sql` as its transform, and without its `[cluster]` table when
/// `cluster` is false (the same pipeline in one process).
pub(crate) fn sql_pipeline(
    dir: &Path,
    workers: &[&Worker],
    extra: &str,
    max_files: usize,
    sql: &str,
    cluster: bool,
) -> std::path::PathBuf {
    let p = cluster_pipeline(dir, workers, extra, max_files);
    let mut text = std::fs::read_to_string(&p).unwrap().replace(
        "SELECT order_id, status, amount, updated_at FROM batch WHERE order_id IS NOT NULL",
        sql,
    );
    if !cluster {
        text = text[..text.find("[cluster]").unwrap()].to_string();
    }
    std::fs::write(&p, text).unwrap();
    p
}

/// `sql` over 9 files of 500 orders (`keys` ids), 3 files a batch, on `workers` and in one
/// process: the Parquet rows (`cols`) of each, after checking both ran 3 batches.
pub(crate) async fn on_workers_and_alone(
    workers: &[&Worker],
    extra: &str,
    sql: &str,
    keys: u64,
    cols: &[&str],
) -> [Vec<String>; 2] {
    let mut outputs = Vec::new();
    for cluster in [true, false] {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 9, 500, keys);
        let p = sql_pipeline(dir.path(), workers, extra, 3, sql, cluster);
        let progress = dir.path().join("progress.jsonl");
        let last = run_to_end(&p, &progress);
        assert_eq!(progress_batches(&progress), vec![0, 1, 2]);
        assert_eq!(last["numInputRows"], 1500, "{last}");
        assert_eq!(last["cluster"].is_null(), !cluster, "{last}");
        let got = parquet_rows(&dir.path().join("out"), cols).await;
        assert!(!got.is_empty());
        outputs.push(got);
    }
    [outputs.remove(0), outputs.remove(0)]
}

pub(crate) const COLS: [&str; 4] = ["order_id", "status", "amount", "updated_at"];

#[tokio::test]
async fn three_workers_read_every_file_once_and_each_reports_its_rows() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 6, 200, 50);
    // A folder name that is not a plain URL path: `?`, `#` and `%41` are part of it.
    let out_name = "out?#%41 [ü]";
    let p = cluster_pipeline(dir.path(), &refs(&ws), "", 3);
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("path = \"out\"", &format!("path = \"{out_name}\""));
    std::fs::write(&p, text).unwrap();
    let progress = dir.path().join("progress.jsonl");
    let last = run_to_end(&p, &progress);
    assert_eq!(progress_batches(&progress), vec![0, 1]);
    assert_eq!(last["numInputRows"], 600);

    // Each batch's three files went to three tasks, one per worker, and the rows each
    // worker read add up to the batch's.
    let text = std::fs::read_to_string(&progress).unwrap();
    for line in text.lines() {
        let report: serde_json::Value = serde_json::from_str(line).unwrap();
        let workers = report["cluster"]["workers"].as_array().unwrap().clone();
        assert_eq!(workers.len(), 3, "{report}");
        let tasks: u64 = workers.iter().map(|w| w["tasks"].as_u64().unwrap()).sum();
        assert_eq!(tasks, 3, "{report}");
        let rows: u64 = workers
            .iter()
            .map(|w| w["inputRows"].as_u64().unwrap())
            .sum();
        assert_eq!(rows, 600, "{report}");
        for w in &workers {
            assert_eq!(w["inputRows"], 200, "one file of 200 rows each: {report}");
            assert!(
                ws.iter()
                    .any(|x| x.url == w["url"].as_str().unwrap().trim_end_matches('/')),
                "{report}"
            );
        }
    }
    // DataFusion's reader takes a URL: it reads the folder under a plain name.
    let out = dir.path().join("read-back");
    std::fs::rename(dir.path().join(out_name), &out).unwrap();
    let got = parquet_rows(&out, &COLS).await;
    assert_eq!(got.len(), 1200);
    assert_eq!(
        got,
        input_rows(&input).await,
        "every input row exactly once"
    );
    // Nothing was written anywhere else (`out` is where a name cut at `?` would lead, `outA`
    // where `%41` decoded would).
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("out"))
        .collect();
    names.sort();
    assert_eq!(names, Vec::<String>::new());
    // The workers wrote the parts, at least one per task (one process writes one part per
    // batch), and the driver moved every one of them into place.
    for batch in 0..2 {
        let parts = parts_of(&out, batch);
        assert!(parts >= 3, "batch {batch}: {parts} part(s)");
    }
    assert_eq!(staged(&out), Vec::<String>::new());
}

/// How many parts of batch `batch` the Parquet folder `out` holds.
fn parts_of(out: &Path, batch: u64) -> usize {
    let prefix = format!("batch-{batch:010}-part-");
    std::fs::read_dir(out)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.starts_with(&prefix) && name.ends_with(".parquet")
        })
        .count()
}

/// What the Parquet folder `out`'s staging still holds.
fn staged(out: &Path) -> Vec<String> {
    match std::fs::read_dir(out.join("_weir_staging")) {
        Ok(it) => it
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// A grouping shuffles rows between the workers (a worker reads another's output, with the
/// token): its result equals the same pipeline's in one process, batch for batch.
#[tokio::test]
async fn a_grouping_shuffled_between_token_workers_equals_a_single_process_run() {
    let ws = Worker::three(Some("t0k"));
    let sql = "SELECT status, count(*) AS n, sum(order_id) AS s, min(updated_at) AS first \
               FROM batch GROUP BY status";
    let [cluster, alone] = on_workers_and_alone(
        &refs(&ws),
        "token = \"t0k\"",
        sql,
        100,
        &["status", "n", "s", "first"],
    )
    .await;
    assert_eq!(
        cluster, alone,
        "the cluster's groups are the single process's"
    );
}

/// The seed's dedupe (newest row per order by a row_number() window) on three workers:
/// the rows are shuffled by key and the top-one rule's node runs on the workers after the
/// shuffle; batch for batch the result is the single process's.
#[tokio::test]
async fn the_newest_row_per_key_on_workers_equals_a_single_process_run() {
    let ws = Worker::three(None);
    let sql = "SELECT order_id, status, amount, updated_at FROM (SELECT *, row_number() OVER \
               (PARTITION BY order_id ORDER BY updated_at DESC, status DESC, amount DESC) \
               AS rn FROM batch) WHERE rn = 1";
    let [cluster, alone] = on_workers_and_alone(&refs(&ws), "", sql, 120, &COLS).await;
    // At most one row per order and batch: 120 orders.
    assert!(cluster.len() <= 3 * 120, "{}", cluster.len());
    assert_eq!(
        cluster, alone,
        "the cluster's newest rows are the single process's"
    );
}

#[tokio::test]
async fn a_worker_killed_and_restarted_mid_run_loses_and_repeats_no_row() {
    let mut ws = Worker::three(Some("s3cret"));
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 60, 2000, 500);
    let p = cluster_pipeline(
        dir.path(),
        &refs(&ws),
        "token = \"env:WEIR_TEST_CLUSTER_TOKEN\"\nmax-batch-attempts = 4",
        3,
    );
    let progress = dir.path().join("progress.jsonl");
    // Kill worker 1 once a batch or two have landed, then start it again on its port.
    let addr = ws[1].addr();
    let stderr = run_killing_a_worker(
        &p,
        &progress,
        &[("WEIR_TEST_CLUSTER_TOKEN", "s3cret")],
        Some(WorkerKill {
            workers: &mut ws,
            index: 1,
            after: 2,
            restart: &|a| Worker::start(a, Some("s3cret")),
        }),
    );

    let batches = progress_batches(&progress);
    assert_eq!(batches, (0..20).collect::<Vec<u64>>(), "{stderr}");
    let got = parquet_rows(&dir.path().join("out"), &COLS).await;
    assert_eq!(got.len(), 120_000, "{stderr}");
    assert_eq!(
        got,
        input_rows(&input).await,
        "every input row exactly once"
    );
    // What the lost attempt staged was cleared by a later commit.
    assert_eq!(staged(&dir.path().join("out")), Vec::<String>::new());
    // The restarted worker took tasks again after it came back.
    let last = last_progress(&progress);
    let urls: Vec<&str> = last["cluster"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap())
        .collect();
    assert!(
        urls.iter().any(|u| u.contains(&addr)),
        "the restarted worker {addr} runs tasks again: {last}"
    );
}

#[tokio::test]
async fn the_driver_killed_at_its_fault_points_replays_on_the_workers_exactly() {
    let ws = Worker::three(None);
    // The runner's points, and the Parquet sink's on the driver: before the staged parts
    // are moved, after the first of them, after all.
    let points = [AFTER_OFFSETS_WRITE, AFTER_USER_FN, BEFORE_COMMIT_WRITE]
        .into_iter()
        .chain(PARQUET_POINTS.iter().copied())
        .chain([PARQUET_BETWEEN_MOVES]);
    for point in points {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 8, 100, 50);
        let p = cluster_pipeline(dir.path(), &refs(&ws), "", 2);
        let first = dir.path().join("p1.jsonl");
        let second = dir.path().join("p2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        assert_eq!(progress_batches(&first), vec![0, 1], "{point}");
        assert_eq!(
            progress_batches(&second),
            vec![2, 3],
            "{point}: same ids again"
        );
        let got = parquet_rows(&dir.path().join("out"), &COLS).await;
        assert_eq!(got, input_rows(&input).await, "{point}: every row once");
        assert_eq!(
            staged(&dir.path().join("out")),
            Vec::<String>::new(),
            "{point}"
        );
    }
}

/// A pipeline `name` reading the order files under `root`/in on the S3 server, with `sink`
/// (its `[[sink]]` keys) and `workers`, its checkpoint in `dir`.
pub(crate) fn s3_cluster_pipeline(
    dir: &Path,
    workers: &[Worker],
    name: &str,
    root: &weir_core::storage::Location,
    sink: &str,
) -> std::path::PathBuf {
    let urls: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.url)).collect();
    let text = format!(
        r#"[query]
name = "{name}"
checkpoint = "{chk}"

[storage]
{storage}
[source]
type = "files"
path = "{input}"
format = "json"
schema = {SCHEMA}
max-files-per-trigger = 3

[[sink]]
{sink}

[cluster]
workers = [{workers}]
connect-timeout = "2s"
"#,
        chk = dir.join("chk").display(),
        storage = crate::storage::storage_table(&weir_testkit::s3().options()),
        input = root.join("in").url_string(),
        workers = urls.join(", "),
    );
    let p = dir.join("s3.toml");
    std::fs::write(&p, &text).unwrap();
    p
}

/// The input and the Parquet folder on the S3 server, three workers: the workers write the
/// parts to S3 and the driver copies them into place. Killed after the first of a batch's
/// moves and after all of them, run again: every row once, staging empty.
#[tokio::test]
async fn parquet_parts_written_by_workers_to_s3_land_once_after_kills_between_moves() {
    use weir_core::connector::{QueryIdentity, SinkVerifier, compare_append};
    let ws = Worker::three(None);
    let dir = temp_dir();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let root = crate::storage::s3_location(&format!("weir-cluster/{id}"));
    let local_in = dir.path().join("in");
    gen_orders(&local_in, 8, 300, 100);
    crate::storage::upload_orders(&local_in, &root.join("in")).await;
    let p = s3_cluster_pipeline(
        dir.path(),
        &ws,
        "parts-on-s3",
        &root,
        &format!(
            "type = \"parquet\"\npath = \"{}\"",
            root.join("parquet").url_string()
        ),
    );
    for fault in [
        format!("{PARQUET_BETWEEN_MOVES}@1"),
        format!("{}@2", PARQUET_POINTS[1]),
    ] {
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], Some(&fault));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{fault}: {err}");
    }
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let schema = crate::orders_schema();
    let input = crate::input_batches(&local_in).await;
    let parquet = weir_core::connector::ParquetReader {
        dir: root.join("parquet"),
    };
    let got = parquet.rows(&schema).await.unwrap();
    let mut all = compare_append("parquet", &got, &input, &schema).unwrap();
    let cp = weir_core::checkpoint::Checkpoint::inspect(dir.path().join("chk").into())
        .await
        .unwrap()
        .unwrap();
    let query = QueryIdentity::of(&cp, "parts-on-s3");
    all.merge(parquet.check_bookkeeping(&query, 3).await.unwrap());
    assert!(all.mismatches.is_empty(), "{:?}", all.mismatches);
    assert_eq!(all.rows, 2400);
    let staged = root
        .join("parquet")
        .join("_weir_staging")
        .list_names()
        .await
        .unwrap();
    assert!(staged.is_empty(), "{staged:?}");
}

/// An `ORDER BY` on a cluster is written sorted, as one process writes it: the write keeps
/// its input's order, so the optimizer keeps the sort under it.
#[tokio::test]
async fn an_order_by_on_workers_is_written_sorted() {
    let ws = Worker::three(None);
    let sql = "SELECT order_id, status, amount, updated_at FROM batch ORDER BY order_id DESC, \
               updated_at";
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 6, 300, 1000);
    let p = sql_pipeline(dir.path(), &refs(&ws), "", 3, sql, true);
    run_to_end(&p, &dir.path().join("progress.jsonl"));
    let out = dir.path().join("out");
    let ctx = weir_core::datafusion::prelude::SessionContext::new();
    let mut parts = 0;
    for e in std::fs::read_dir(&out).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "parquet") {
            continue;
        }
        parts += 1;
        let df = ctx
            .read_parquet(
                path.to_string_lossy().to_string(),
                weir_core::datafusion::prelude::ParquetReadOptions::default(),
            )
            .await
            .unwrap();
        let ids: Vec<i64> = df
            .select_columns(&["order_id"])
            .unwrap()
            .collect()
            .await
            .unwrap()
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<weir_core::datafusion::arrow::array::Int64Array>()
                    .unwrap()
                    .iter()
                    .flatten()
                    .collect::<Vec<_>>()
            })
            .collect();
        assert!(
            ids.windows(2).all(|w| w[0] >= w[1]),
            "{} is not in order_id DESC order",
            path.display()
        );
    }
    assert!(parts >= 2, "{parts} part(s)");
    let got = parquet_rows(&out, &COLS).await;
    assert_eq!(got, input_rows(&input).await, "every row once");
}

/// A cluster run killed between the driver's moves, replayed by one process (the
/// `[cluster]` table removed): the replay clears what the workers staged.
#[tokio::test]
async fn a_single_process_replay_clears_what_a_crashed_cluster_run_staged() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 6, 100, 50);
    let p = cluster_pipeline(dir.path(), &refs(&ws), "", 3);
    let progress = dir.path().join("p1.jsonl");
    let out = crate::run_with_progress(&p, &progress, Some(&format!("{PARQUET_BETWEEN_MOVES}@1")));
    assert!(!out.status.success());
    let out_dir = dir.path().join("out");
    assert!(!staged(&out_dir).is_empty(), "the kill left staged parts");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, &text[..text.find("[cluster]").unwrap()]).unwrap();
    run_to_end(&p, &dir.path().join("p2.jsonl"));
    assert_eq!(staged(&out_dir), Vec::<String>::new());
    let got = parquet_rows(&out_dir, &COLS).await;
    assert_eq!(got, input_rows(&input).await, "every row once");
}

#[tokio::test]
async fn workers_that_cannot_take_the_plan_are_refused_before_batch_0_naming_them() {
    let w = Worker::start("127.0.0.1:0", Some("right"));
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 2, 10, 5);

    // Wrong token.
    let p = cluster_pipeline(dir.path(), &[&w], "token = \"wrong\"", 1);
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&w.url), "names the worker: {stderr}");
    assert!(stderr.contains("token does not match"), "{stderr}");
    assert!(
        !dir.path().join("chk/offsets/0").exists(),
        "nothing recorded"
    );

    // No token at all.
    let p = cluster_pipeline(dir.path(), &[&w], "", 1);
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("has none"), "{stderr}");

    // Nobody listening there.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = format!("http://{}", free.local_addr().unwrap());
    drop(free);
    let p = dir.path().join("gone.toml");
    let text = std::fs::read_to_string(dir.path().join("pipeline.toml"))
        .unwrap()
        .replace(&w.url, &gone);
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no usable worker"), "{stderr}");
    assert!(stderr.contains(&gone), "{stderr}");

    // A source whose reads cannot go to workers yet is refused by `weir check`, naming it.
    let p = dir.path().join("rate.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"r\"\ncheckpoint = \"chk-rate\"\n[source]\ntype = \"rate\"\n\
             rows-per-second = 10\n[[sink]]\ntype = \"parquet\"\npath = \"out-rate\"\n\
             [cluster]\nworkers = [\"{}\"]\n",
            w.url
        ),
    )
    .unwrap();
    let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the rate source does not run on a cluster yet"),
        "{stderr}"
    );
}
