//! The PostgreSQL upsert on three `weir worker`s: the tasks COPY the batch's rows into the
//! staging table, the driver's ledger transaction dedupes and upserts them; exact through
//! worker and driver kills, equal to the same pipeline in one process, NULL rules counted
//! over every task.

use std::path::Path;

use weir_core::datafusion::prelude::{JsonReadOptions, SessionContext, col, lit};
use weir_core::fault::BEFORE_COMMIT_WRITE;
use weir_testkit::{pg_rows, rows, run_weir, temp_dir};

use crate::cluster::{
    Worker, cluster_pipeline, progress_reports, refs, run_killing_a_worker,
    run_through_a_worker_kill, tasks_of,
};
use crate::kills::killed_in_batch_2_then_rerun;
use crate::{bin, last_progress, weir_cli_schema};

/// `files` order files of `rows` rows over `keys` keys, with ties on the timestamp and
/// NULL statuses and amounts (`weir gen --odd`).
pub(crate) fn gen_odd_orders(input: &Path, files: usize, rows: usize, keys: u64) {
    crate::weir_gen(input, files, rows, &["--keys", &keys.to_string(), "--odd"]);
    // Plain names, in the same order, for the reference's reader (the odd names hold tabs).
    let mut names: Vec<_> = std::fs::read_dir(input)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        std::fs::rename(name, input.join(format!("orders-{i:05}.json"))).unwrap();
    }
}

/// `cluster_pipeline` with an upsert into `table` by `order_id`, newest `updated_at`, and
/// `options`; without its `[cluster]` table when `cluster` is false.
fn pg_pipeline(
    dir: &Path,
    workers: &[&Worker],
    max_files: usize,
    table: &str,
    options: &str,
    cluster: bool,
) -> std::path::PathBuf {
    let url = &weir_testkit::postgres().url;
    pg_pipeline_at(url, dir, workers, max_files, table, options, cluster)
}

fn pg_pipeline_at(
    url: &str,
    dir: &Path,
    workers: &[&Worker],
    max_files: usize,
    table: &str,
    options: &str,
    cluster: bool,
) -> std::path::PathBuf {
    let p = cluster_pipeline(dir, workers, "max-batch-attempts = 4", max_files);
    let mut text = std::fs::read_to_string(&p).unwrap().replace(
        "type = \"parquet\"\npath = \"out\"",
        &format!(
            "type = \"postgres-upsert\"\nurl = \"{url}\"\ntable = \"{table}\"\n\
             keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n{options}"
        ),
    );
    if !cluster {
        text = text[..text.find("[cluster]").unwrap()].to_string();
    }
    std::fs::write(&p, text).unwrap();
    p
}

/// Every row of `table`, every column as text.
async fn table_rows(table: &str) -> Vec<String> {
    pg_rows(
        &weir_testkit::postgres().url,
        &format!("SELECT order_id::text, status, amount::text, updated_at::text FROM \"{table}\""),
    )
    .await
}

/// Rows as `a|b|c` texts from two printers (DataFusion, PostgreSQL) in one form: NULL and
/// the empty text as `NULL`, numbers as Rust prints an `f64`; sorted.
pub(crate) fn same_form(rows: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = rows
        .iter()
        .map(|r| {
            r.split('|')
                .map(|f| match f {
                    "" | "NULL" => "NULL".to_string(),
                    f => f.parse::<f64>().map_or(f.to_string(), |n| n.to_string()),
                })
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect();
    out.sort();
    out
}

/// The newest row per key over all of `input` whose key passes `keep`: `order_id|status|
/// amount`, sorted.
pub(crate) async fn newest_per_key(input: &Path, keep: Option<i64>) -> Vec<String> {
    let ctx = SessionContext::new();
    let mut all = ctx
        .read_json(
            input.to_str().unwrap(),
            JsonReadOptions::default()
                .schema(&weir_cli_schema())
                .file_extension(".json"),
        )
        .await
        .unwrap()
        .filter(col("order_id").is_not_null())
        .unwrap();
    if let Some(m) = keep {
        all = all
            .filter((col("order_id") % lit(7i64)).not_eq(lit(m)))
            .unwrap();
    }
    let newest = weir_core::dedupe_latest(all, &["order_id".to_string()], "updated_at")
        .unwrap()
        .select_columns(&["order_id", "status", "amount"])
        .unwrap();
    same_form(rows(newest).await)
}

/// The input rows whose `order_id % 7` is `m`.
pub(crate) async fn count_where(input: &Path, m: i64) -> usize {
    SessionContext::new()
        .read_json(
            input.to_str().unwrap(),
            JsonReadOptions::default()
                .schema(&weir_cli_schema())
                .file_extension(".json"),
        )
        .await
        .unwrap()
        .filter((col("order_id") % lit(7i64)).eq(lit(m)))
        .unwrap()
        .count()
        .await
        .unwrap()
}

/// `order_id|status|amount` of `table`, sorted.
async fn key_rows(table: &str) -> Vec<String> {
    same_form(
        pg_rows(
            &weir_testkit::postgres().url,
            &format!("SELECT order_id::text, status, amount::text FROM \"{table}\""),
        )
        .await,
    )
}

/// The batch ids in the ledger for the sink's app id (one query writes the table), and the
/// rows left in its staging table.
async fn bookkeeping(table: &str) -> (Vec<u64>, usize) {
    let url = &weir_testkit::postgres().url;
    let mut ledger: Vec<u64> = pg_rows(
        url,
        &format!(
            "SELECT batch_id::text FROM {} WHERE app_id LIKE '%/{table}'",
            weir_postgres::DEFAULT_LEDGER
        ),
    )
    .await
    .iter()
    .map(|b| b.parse().unwrap())
    .collect();
    ledger.sort();
    let staged = pg_rows(
        url,
        &format!("SELECT count(*)::text FROM \"{table}_weir_staging\""),
    )
    .await;
    (ledger, staged[0].parse().unwrap())
}

#[tokio::test]
async fn an_upsert_staged_by_workers_equals_one_process_through_a_worker_kill() {
    let mut ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_odd_orders(&input, 30, 1000, 400);
    let table = "cluster_pg_kill";
    let p = pg_pipeline(dir.path(), &refs(&ws), 3, table, "", true);
    let progress = dir.path().join("progress.jsonl");
    run_through_a_worker_kill(&p, &progress, &mut ws, 2, 10);
    assert_eq!(
        key_rows(table).await,
        newest_per_key(&input, None).await,
        "the table holds the newest row of every key over all input"
    );
    assert_eq!(bookkeeping(table).await, ((0..10).collect(), 0));
    // The workers ran tasks (a batch of one file runs in the driver: `--odd` makes some
    // batches so), and each batch's output is its rows after the in-batch dedupe.
    let reports = progress_reports(&progress);
    assert!(tasks_of(&reports) >= 3 * 5, "{reports:?}");
    for r in &reports {
        let out = r["sink"]["numOutputRows"].as_u64().unwrap();
        assert!(out > 0 && out <= 400, "{r}");
    }

    // The same pipeline in one process: the same table, every column (the ties on the
    // timestamp are decided by the other columns in the same order in both).
    let alone = temp_dir();
    std::fs::rename(&input, alone.path().join("in")).unwrap();
    let p = pg_pipeline(alone.path(), &[], 3, "cluster_pg_alone", "", false);
    run_killing_a_worker(&p, &alone.path().join("progress.jsonl"), &[], None);
    assert_eq!(
        table_rows(table).await,
        table_rows("cluster_pg_alone").await
    );
}

#[tokio::test]
async fn the_driver_killed_around_the_staged_upsert_replays_exactly() {
    let ws = Worker::three(None);
    for (i, point) in [
        weir_postgres::POINT_AFTER_STAGING,
        weir_postgres::POINT_BEFORE_COMMIT,
        weir_postgres::POINT_AFTER_COMMIT,
        BEFORE_COMMIT_WRITE,
    ]
    .into_iter()
    .enumerate()
    {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_odd_orders(&input, 8, 100, 50);
        let table = format!("cluster_pg_driver_{i}");
        let p = pg_pipeline(dir.path(), &refs(&ws), 2, &table, "", true);
        let first = dir.path().join("p1.jsonl");
        let second = dir.path().join("p2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &first, &second);
        assert_eq!(
            key_rows(&table).await,
            newest_per_key(&input, None).await,
            "{point}"
        );
        assert_eq!(
            bookkeeping(&table).await,
            (vec![0, 1, 2, 3], 0),
            "{point}: one ledger row per batch, nothing left staged"
        );
    }
}

/// Keys made NULL in one row of 7: counted over every task, the batch fails naming the
/// column and the rows of all of them; with `null-keys = "drop"` they are dropped and
/// counted in the progress.
#[tokio::test]
async fn null_keys_are_counted_over_every_task() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    let table = "cluster_pg_nulls";
    null_keys_counted(&input, &dir.path().join("progress.jsonl"), &|options| {
        pg_pipeline(dir.path(), &refs(&ws), 6, table, options, true)
    })
    .await;
    assert_eq!(key_rows(table).await, newest_per_key(&input, Some(3)).await);
    assert_eq!(bookkeeping(table).await, (vec![0], 0));
}

/// 6 odd order files into `input` and one batch of them, whose keys SQL makes NULL in one
/// row of 7, through the pipeline `pipeline` gives for sink options. With the default rule
/// the run fails naming the batch, the column and the batch's NULL rows; with
/// `null-keys = "drop"` it succeeds (progress in `progress`) and reports them dropped.
pub(crate) async fn null_keys_counted(
    input: &Path,
    progress: &Path,
    pipeline: &dyn Fn(&str) -> std::path::PathBuf,
) {
    gen_odd_orders(input, 6, 200, 300);
    let nulls = count_where(input, 3).await;
    assert!(nulls > 0);
    let with = |options: &str| {
        let p = pipeline(options);
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "SELECT order_id, status, amount, updated_at FROM batch WHERE order_id IS NOT NULL",
            "SELECT CASE WHEN order_id % 7 = 3 THEN NULL ELSE order_id END AS order_id, \
             status, amount, updated_at FROM batch WHERE order_id IS NOT NULL",
        );
        std::fs::write(&p, text).unwrap();
        p
    };
    let p = with("");
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("batch 0")
            && err.contains("order_id")
            && err.contains(&format!("{nulls} row(s)")),
        "the error counts the NULL keys of the batch over every task ({nulls}): {err}"
    );
    let p = with("null-keys = \"drop\"");
    run_killing_a_worker(&p, progress, &[], None);
    let last = last_progress(progress);
    let dropped = last["sink"]["metrics"]
        .as_object()
        .and_then(|m| m.iter().find(|(k, _)| k.ends_with(".dropped")))
        .map(|(_, v)| v.to_string());
    assert_eq!(dropped, Some(format!("\"{nulls}\"")), "{last}");
    assert_eq!(
        last["numInputRows"].as_u64().unwrap() as usize,
        crate::input_rows(input).await.len(),
        "{last}"
    );
}

/// The sink's URL names a host that the driver resolves to one server and the workers (other
/// machines, each with its own `/etc/hosts`) to another one on the same port, which has a
/// staging table of the same shape: the tasks' COPYs succeed there, and the driver, counting
/// the staged rows in its own transaction, fails the batch before upserting anything.
#[tokio::test]
async fn workers_that_reach_another_server_fail_the_batch_before_anything_is_upserted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let here = weir_testkit::start_postgres("127.0.0.1", port);
    let there = weir_testkit::start_postgres("127.0.0.2", port);
    let dir = temp_dir();
    let hosts = |name: &str, addr: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, format!("127.0.0.1 localhost\n{addr} weir-pg.test\n")).unwrap();
        p
    };
    let driver_hosts = hosts("driver-hosts", "127.0.0.1");
    let worker_hosts = hosts("worker-hosts", "127.0.0.2");
    let ws: Vec<Worker> = (0..3)
        .map(|_| Worker::start_with_hosts(&worker_hosts))
        .collect();
    let input = dir.path().join("in");
    gen_odd_orders(&input, 6, 100, 50);
    let url = format!("host=weir-pg.test port={port} user=postgres dbname=postgres");
    let p = pg_pipeline_at(&url, dir.path(), &refs(&ws), 6, "elsewhere", "", true);
    weir_testkit::pg_exec(
        &there.url,
        "CREATE UNLOGGED TABLE elsewhere_weir_staging (order_id bigint, status text, \
         amount double precision, updated_at timestamptz, weir_app_id text NOT NULL, \
         weir_batch_id bigint NOT NULL, weir_task text)",
    )
    .await;
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg("mount --bind \"$0\" /etc/hosts && exec \"$1\" run \"$2\"")
        .arg(&driver_hosts)
        .arg(bin())
        .arg(&p)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("batch 0")
            && err.contains("finds 0 there")
            && err.contains("must reach the same PostgreSQL server"),
        "{err}"
    );
    let count = |url: String, sql: &'static str| async move { pg_rows(&url, sql).await };
    assert_eq!(
        count(here.url.clone(), "SELECT count(*)::text FROM elsewhere").await,
        vec!["0"],
        "nothing upserted on the driver's server"
    );
    assert_eq!(
        count(here.url.clone(), "SELECT count(*)::text FROM weir_batches").await,
        vec!["0"],
        "nothing claimed in the ledger"
    );
    let staged: u64 = count(
        there.url.clone(),
        "SELECT count(*)::text FROM elsewhere_weir_staging",
    )
    .await[0]
        .parse()
        .unwrap();
    assert!(staged > 0, "the tasks wrote to the workers' server");
}

/// The staging table is weir's: one of another shape (left by an earlier version of the
/// query) is made again, and a batch with a column of its own names is refused before
/// anything is made or written.
#[tokio::test]
async fn the_staging_table_takes_the_batch_s_shape_and_keeps_its_names() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_odd_orders(&input, 6, 100, 50);
    let url = &weir_testkit::postgres().url;
    weir_testkit::pg_exec(
        url,
        "CREATE UNLOGGED TABLE cluster_pg_shape_weir_staging (order_id bigint, amount numeric(30,15))",
    )
    .await;
    let p = pg_pipeline(dir.path(), &refs(&ws), 2, "cluster_pg_shape", "", true);
    let stderr = run_killing_a_worker(&p, &dir.path().join("p.jsonl"), &[], None);
    assert!(stderr.contains("making it again"), "{stderr}");
    assert_eq!(
        key_rows("cluster_pg_shape").await,
        newest_per_key(&input, None).await
    );
    assert_eq!(bookkeeping("cluster_pg_shape").await, (vec![0, 1, 2], 0));

    let other = temp_dir();
    gen_odd_orders(&other.path().join("in"), 2, 50, 20);
    let p = pg_pipeline(other.path(), &refs(&ws), 2, "cluster_pg_names", "", true);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "SELECT order_id, status, amount, updated_at FROM batch WHERE order_id IS NOT NULL",
        "SELECT order_id, status, amount, updated_at, order_id * 10 AS weir_batch_id \
         FROM batch WHERE order_id IS NOT NULL",
    );
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("'weir_batch_id', a name the staging table keeps for itself"),
        "{err}"
    );
    assert_eq!(
        pg_rows(
            url,
            "SELECT count(*)::text FROM pg_tables WHERE tablename LIKE 'cluster_pg_names%'"
        )
        .await,
        vec!["0"],
        "nothing made"
    );
}

/// A value the server refuses (a NUL byte in a text) fails the same way on any worker: the
/// batch fails at its first attempt, naming the table and the batch, and nothing lands.
#[tokio::test]
async fn a_value_the_server_refuses_fails_the_batch_without_running_it_again() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    gen_odd_orders(&dir.path().join("in"), 4, 100, 50);
    let p = pg_pipeline(dir.path(), &refs(&ws), 4, "cluster_pg_nul", "", true);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "SELECT order_id, status, amount, updated_at FROM batch WHERE order_id IS NOT NULL",
        "SELECT order_id, concat(status, chr(0)) AS status, amount, updated_at FROM batch \
         WHERE order_id IS NOT NULL",
    );
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("PostgreSQL table cluster_pg_nul: batch 0")
            && err.contains("running it again would fail the same way"),
        "{err}"
    );
    assert!(
        !err.contains("attempt 1 of 4 on the cluster failed"),
        "{err}"
    );
    assert_eq!(
        key_rows("cluster_pg_nul").await,
        Vec::<String>::new(),
        "nothing upserted"
    );
}
