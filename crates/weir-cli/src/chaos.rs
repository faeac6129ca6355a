//! `weir chaos`: kill a pipeline again and again, then check every sink against the input.
//!
//! The pipeline (the seed's worked example, `examples/orders_upsert.toml`, by default) runs
//! as a child `weir run` on generated orders. Before each run more orders are added to its
//! source; the run is then either killed with SIGKILL from outside after a random delay, or
//! aborted from inside at a named fault point (`WEIR_FAULT=point@batch`) in one of the next
//! batches (one such fault in five fails the batch with an error instead). After `--kills`
//! kills a last run drains the source, and the sinks are compared
//! with the reference computed from the input itself:
//!
//! - MERGE/upsert sinks hold exactly the newest row per `order_id` of all input (no key
//!   missing, none doubled, every value equal);
//! - append sinks (Delta append, Parquet; only without a transform) hold every input row
//!   exactly once;
//! - the Delta table has one version per committed batch and its app transaction is the
//!   last batch id; the PostgreSQL ledger has exactly one row per committed batch and the
//!   staging table is empty;
//! - each replay after a kill ran the pending batch with its recorded id and offsets.
//!
//! Exit code 1 when anything does not match.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use weir_core::checkpoint::{Checkpoint, Recovery, decide, list_ids};
use weir_core::datafusion::arrow::array::{Array, AsArray, RecordBatch};
use weir_core::datafusion::arrow::compute::cast;
use weir_core::datafusion::arrow::datatypes::{DataType, Int64Type, TimeUnit};
use weir_core::datafusion::prelude::{ParquetReadOptions, SessionContext};
use weir_postgres::{quote_ident, tokio_postgres};

use crate::config::{Pipeline, SinkConfig, SourceConfig};
use crate::demo::produce_lines;
use crate::generate::{GenArgs, SplitMix, generate};

/// The worked example, the default pipeline.
pub const EXAMPLE: &str = include_str!("../../../examples/orders_upsert.toml");
const PARTITIONS: i32 = 3;

#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// How many times to kill the pipeline.
    #[arg(long, default_value_t = 20)]
    pub kills: u32,
    /// Seed of the kill schedule and of the generated orders.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The pipeline to kill (default: the worked example, examples/orders_upsert.toml).
    /// Its source must read the generated orders (order_id, status, amount, updated_at):
    /// a Kafka topic or a folder of JSON files; topic, folders and tables are replaced by
    /// the chaos run's own.
    #[arg(long)]
    pub pipeline: Option<PathBuf>,
    /// Kafka brokers, for a Kafka source (a new topic is created); default $KAFKA_BOOTSTRAP.
    #[arg(long)]
    pub kafka: Option<String>,
    /// PostgreSQL, for PostgreSQL sinks (tables `weir_chaos_*` are dropped and recreated);
    /// default $DATABASE_URL.
    #[arg(long)]
    pub postgres: Option<String>,
    /// Working folder (input, checkpoint, tables, run logs). Recreated on each run.
    #[arg(long, default_value = "weir-chaos")]
    pub dir: PathBuf,
    /// Rows per batch (the source's max-offsets-per-trigger, or rows per file with one
    /// file per trigger).
    #[arg(long, default_value_t = 500)]
    pub batch_rows: usize,
    /// Distinct order ids.
    #[arg(long, default_value_t = 2000)]
    pub keys: u64,
    /// The `weir` binary to run (default: this one).
    #[arg(long)]
    pub weir: Option<PathBuf>,
}

/// What happened to one run.
enum Outcome {
    Killed,
    Aborted,
    /// The batch failed with an injected error: the query stopped, nothing committed.
    Failed,
    Finished,
}

#[derive(Default)]
struct Tally {
    runs: u32,
    sigkills: u32,
    points: BTreeMap<String, u32>,
    not_reached: u32,
    failures: u32,
    replays: u32,
    records: u64,
    mismatches: Vec<String>,
    checked: Vec<String>,
    rows_checked: usize,
}

impl Tally {
    fn kills(&self) -> u32 {
        self.sigkills + self.points.values().sum::<u32>()
    }
}

/// The chaos run's input: order files in `dir/input`, and for Kafka a topic holding the
/// same lines.
struct Input {
    files_dir: PathBuf,
    kafka: Option<(String, String)>,
    next_file: usize,
    seed: u64,
    keys: u64,
    rows_per_file: usize,
}

impl Input {
    /// Adds `files` files of orders (and produces them for Kafka).
    async fn add(&mut self, files: usize) -> Result<u64> {
        let paths = generate(&GenArgs {
            dir: self.files_dir.clone(),
            files,
            rows_per_file: self.rows_per_file,
            keys: self.keys,
            seed: self.seed,
            late_ms: 60_000,
            first_file: self.next_file,
        })?;
        self.next_file += files;
        if let Some((brokers, topic)) = &self.kafka {
            let sent = ((self.next_file - files) * self.rows_per_file) as u64;
            produce_lines(brokers, topic, PARTITIONS, &paths, sent).await?;
        }
        Ok((files * self.rows_per_file) as u64)
    }
}

/// One order as the sinks should hold it.
#[derive(Debug, Clone, PartialEq)]
struct Order {
    status: String,
    amount: f64,
    updated_us: i64,
}

/// Where [`rewrite`] points a pipeline.
pub struct Target<'a> {
    pub dir: &'a Path,
    pub kafka: Option<&'a str>,
    pub postgres: Option<&'a str>,
    pub topic: &'a str,
    pub batch_rows: usize,
}

/// Rewrites a pipeline to `t`'s topic, folders and tables (trigger available-now);
/// returns the text.
pub fn rewrite(template: &str, origin: &str, t: &Target<'_>) -> Result<String> {
    let dir = t.dir;
    let mut doc: toml::Table = toml::from_str(template).map_err(|e| anyhow!("{origin}: {e}"))?;
    let abs = |p: PathBuf| p.to_string_lossy().to_string();
    let query = doc
        .get_mut("query")
        .and_then(toml::Value::as_table_mut)
        .ok_or_else(|| anyhow!("{origin}: no [query]"))?;
    query.insert("checkpoint".into(), abs(dir.join("checkpoint")).into());
    query.insert("trigger".into(), "available-now".into());
    let source = doc
        .get_mut("source")
        .and_then(toml::Value::as_table_mut)
        .ok_or_else(|| anyhow!("{origin}: no [source]"))?;
    match source.get("type").and_then(toml::Value::as_str) {
        Some("kafka") => {
            let brokers = t.kafka.ok_or_else(|| {
                anyhow!("{origin} reads Kafka: give the brokers with --kafka (or KAFKA_BOOTSTRAP)")
            })?;
            source.insert("bootstrap-servers".into(), brokers.into());
            source.insert("subscribe".into(), toml::Value::Array(vec![t.topic.into()]));
            source.remove("subscribe-pattern");
            source.insert("starting-offsets".into(), "earliest".into());
            source.insert(
                "max-offsets-per-trigger".into(),
                toml::Value::Integer(t.batch_rows as i64),
            );
            source.remove("min-offsets-per-trigger");
        }
        Some("files") => {
            source.insert("path".into(), abs(dir.join("input")).into());
            source.insert("format".into(), "json".into());
            source.insert("max-files-per-trigger".into(), toml::Value::Integer(1));
        }
        other => bail!(
            "{origin}: weir chaos feeds generated orders to a 'kafka' or 'files' source, not {other:?}"
        ),
    }
    let sinks = doc
        .get_mut("sink")
        .and_then(toml::Value::as_array_mut)
        .ok_or_else(|| anyhow!("{origin}: no [[sink]]"))?;
    for (i, sink) in sinks.iter_mut().enumerate() {
        let sink = sink
            .as_table_mut()
            .ok_or_else(|| anyhow!("{origin}: sink[{i}] is not a table"))?;
        match sink.get("type").and_then(toml::Value::as_str) {
            Some("delta-merge") | Some("delta-append") => {
                sink.insert("path".into(), abs(dir.join(format!("delta_{i}"))).into());
            }
            Some("parquet") => {
                sink.insert("path".into(), abs(dir.join(format!("parquet_{i}"))).into());
            }
            Some("postgres-upsert") => {
                let url = t.postgres.ok_or_else(|| {
                    anyhow!(
                        "{origin} writes to PostgreSQL: give the server with --postgres (or DATABASE_URL)"
                    )
                })?;
                sink.insert("url".into(), url.into());
                sink.insert("table".into(), format!("weir_chaos_orders_{i}").into());
                sink.insert("ledger".into(), "weir_chaos_batches".into());
                sink.insert("create-table".into(), true.into());
                if sink.contains_key("staging-table") {
                    sink.insert(
                        "staging-table".into(),
                        format!("weir_chaos_staging_{i}").into(),
                    );
                }
            }
            Some("console") => {}
            other => bail!("{origin}: sink[{i}] of type {other:?} is not checked by weir chaos"),
        }
    }
    toml::to_string(&doc).map_err(|e| anyhow!("{origin}: {e}"))
}

/// The fault points a batch of this pipeline passes, in order.
fn points(p: &Pipeline) -> Vec<&'static str> {
    let mut out = vec!["after-offsets-write", "before-user-fn"];
    for s in &p.sinks {
        match s {
            SinkConfig::DeltaMerge { .. } | SinkConfig::DeltaAppend { .. } => {
                out.extend(["delta-before-commit", "delta-after-commit"])
            }
            SinkConfig::Parquet { .. } => {
                out.extend(["parquet-before-rename", "parquet-after-rename"])
            }
            SinkConfig::PostgresUpsert { staging_table, .. } => {
                if staging_table.is_some() {
                    out.push("pg-after-staging");
                }
                out.push("pg-before-begin");
                if staging_table.is_none() {
                    out.push("pg-after-copy");
                }
                out.extend(["pg-before-commit", "pg-after-commit"]);
            }
            SinkConfig::Console { .. } => {}
        }
    }
    out.extend(["after-user-fn", "before-commit-write", "after-commit-write"]);
    // Two sinks of a kind share their points.
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(*p));
    out
}

/// (the batch the next run starts with, whether it is a replay of a planned batch), by the
/// engine's own recovery decision.
fn next_batch(checkpoint: &Path) -> Result<(u64, bool)> {
    let offsets = list_ids(&checkpoint.join("offsets"))?;
    let commits = list_ids(&checkpoint.join("commits"))?;
    Ok(
        match decide(&offsets, &commits).map_err(|e| anyhow!("{}: {e}", checkpoint.display()))? {
            Recovery::Fresh => (0, false),
            Recovery::Replay(id) => (id, true),
            Recovery::Next(id) => (id, false),
        },
    )
}

fn spawn(weir: &Path, pipeline: &Path, log: &Path, fault: Option<&str>) -> Result<Child> {
    let out = std::fs::File::create(log.with_extension("log"))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(weir);
    cmd.arg("run")
        .arg(pipeline)
        .arg("--quiet")
        .arg("--progress")
        .arg(log.with_extension("jsonl"))
        .env_remove("WEIR_FAULT")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    if let Some(f) = fault {
        cmd.env("WEIR_FAULT", f);
    }
    cmd.spawn()
        .with_context(|| format!("starting {}", weir.display()))
}

/// Waits for the child; with `kill_after`, sends SIGKILL then if it still runs.
async fn wait(child: &mut Child, kill_after: Option<Duration>, log: &Path) -> Result<ExitStatus> {
    let started = Instant::now();
    let limit = Duration::from_secs(600);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if kill_after.is_some_and(|d| started.elapsed() >= d) {
            child.kill()?;
            return Ok(child.wait()?);
        }
        if started.elapsed() > limit {
            child.kill()?;
            bail!(
                "a run did not end within {} s; see {}",
                limit.as_secs(),
                log.with_extension("log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log.with_extension("log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// The first batch id a run reported in its progress file.
fn first_progress_batch(log: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(log.with_extension("jsonl")).ok()?;
    let line = text.lines().next()?;
    serde_json::from_str::<serde_json::Value>(line)
        .ok()?
        .get("batchId")?
        .as_u64()
}

pub async fn run(mut args: ChaosArgs) -> Result<()> {
    args.kafka = args.kafka.or_else(|| std::env::var("KAFKA_BOOTSTRAP").ok());
    args.postgres = args.postgres.or_else(|| std::env::var("DATABASE_URL").ok());
    let dir = std::path::absolute(&args.dir)?;
    crate::demo::prepare_dir(&dir, "chaos")?;
    std::fs::create_dir_all(dir.join("runs"))?;
    let (template, origin) = match &args.pipeline {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (
            EXAMPLE.to_string(),
            "examples/orders_upsert.toml".to_string(),
        ),
    };
    let topic = format!(
        "weir-chaos-orders-{}",
        chrono::Utc::now().timestamp_millis()
    );
    let pipeline_path = dir.join("pipeline.toml");
    let target = Target {
        dir: &dir,
        kafka: args.kafka.as_deref(),
        postgres: args.postgres.as_deref(),
        topic: &topic,
        batch_rows: args.batch_rows,
    };
    std::fs::write(&pipeline_path, rewrite(&template, &origin, &target)?)?;
    let pipeline = Pipeline::load(&pipeline_path)?;
    if pipeline.transform.is_some()
        && let Some(s) = pipeline.sinks.iter().find(|s| {
            matches!(
                s,
                SinkConfig::DeltaAppend { .. } | SinkConfig::Parquet { .. }
            )
        })
    {
        bail!(
            "{origin}: {}: an append sink after a transform has no reference to check",
            s.label()
        );
    }
    let kafka = matches!(pipeline.source, SourceConfig::Kafka { .. });
    if let Some(url) = &args.postgres {
        drop_chaos_tables(url, &pipeline).await?;
    }
    let mut input = Input {
        files_dir: dir.join("input"),
        kafka: None,
        next_file: 0,
        seed: args.seed,
        keys: args.keys,
        rows_per_file: args.batch_rows,
    };
    if kafka {
        let brokers = args.kafka.clone().unwrap_or_default();
        weir_kafka::create_topic(&brokers, &topic, PARTITIONS).await?;
        input.kafka = Some((brokers, topic.clone()));
    }
    let weir = match &args.weir {
        Some(w) => w.clone(),
        None => std::env::current_exe()?,
    };
    let points = points(&pipeline);
    let checkpoint = pipeline.query.checkpoint.clone();
    let mut rng = SplitMix(args.seed ^ 0x5EED);
    let mut tally = Tally::default();
    // A smoothed run length, so that SIGKILLs land inside runs rather than after them.
    let mut typical_ms = 3000.0f64;
    println!(
        "weir chaos: {} kills of {origin} (seed {}), work folder {}",
        args.kills,
        args.seed,
        dir.display()
    );
    let began = Instant::now();
    while tally.kills() < args.kills {
        tally.records += input.add(2).await?;
        let (next, replay) = next_batch(&checkpoint)?;
        let recorded = replay
            .then(|| std::fs::read(checkpoint.join("offsets").join(next.to_string())))
            .transpose()?;
        let log = dir.join("runs").join(format!("{:04}", tally.runs));
        let sigkill = rng.next().is_multiple_of(3);
        let (fault, kill_after) = if sigkill {
            let frac = 0.05 + (rng.next() % 1000) as f64 / 1000.0;
            (
                None,
                Some(Duration::from_millis((typical_ms * frac) as u64)),
            )
        } else {
            let point = points[(rng.next() % points.len() as u64) as usize];
            let batch = next + rng.next() % 2;
            // One fault in five fails the batch with an error instead of killing the process.
            let error = if rng.next().is_multiple_of(5) {
                ":error"
            } else {
                ""
            };
            (Some(format!("{point}@{batch}{error}")), None)
        };
        let started = Instant::now();
        let mut child = spawn(&weir, &pipeline_path, &log, fault.as_deref())?;
        let status = wait(&mut child, kill_after, &log).await?;
        let took = started.elapsed().as_millis() as f64;
        tally.runs += 1;
        let outcome = match (status.success(), status.signal()) {
            (true, _) => Outcome::Finished,
            (false, Some(9)) if sigkill => Outcome::Killed,
            (false, Some(6)) if fault.is_some() => Outcome::Aborted,
            (false, None)
                if status.code() == Some(1)
                    && fault.as_deref().is_some_and(|f| f.ends_with(":error"))
                    && log_tail(&log).contains("fault injected") =>
            {
                Outcome::Failed
            }
            _ => bail!(
                "run {} ({}) failed with {status}:\n{}",
                tally.runs,
                fault.as_deref().unwrap_or("no fault point"),
                log_tail(&log)
            ),
        };
        match outcome {
            Outcome::Killed => tally.sigkills += 1,
            Outcome::Aborted => {
                let point = fault
                    .as_deref()
                    .and_then(|f| f.split('@').next())
                    .unwrap_or_default();
                *tally.points.entry(point.to_string()).or_default() += 1;
            }
            Outcome::Failed => tally.failures += 1,
            Outcome::Finished => {
                typical_ms = 0.7 * typical_ms + 0.3 * took;
                tally.not_reached += 1;
            }
        }
        if let Some(bytes) = recorded {
            check_replay(&checkpoint, &log, next, &bytes, &mut tally)?;
        }
        if tally.runs % 10 == 0 {
            println!(
                "  {} runs, {} kills, {:.0} s",
                tally.runs,
                tally.kills(),
                began.elapsed().as_secs_f64()
            );
        }
    }
    // The last run drains the source without faults.
    let (next, replay) = next_batch(&checkpoint)?;
    let recorded = replay
        .then(|| std::fs::read(checkpoint.join("offsets").join(next.to_string())))
        .transpose()?;
    let log = dir.join("runs").join("final");
    let mut child = spawn(&weir, &pipeline_path, &log, None)?;
    let status = wait(&mut child, None, &log).await?;
    tally.runs += 1;
    if !status.success() {
        bail!("the final run failed with {status}:\n{}", log_tail(&log));
    }
    if let Some(bytes) = recorded {
        check_replay(&checkpoint, &log, next, &bytes, &mut tally)?;
    }
    let (after, pending) = next_batch(&checkpoint)?;
    if pending {
        tally.mismatches.push(format!(
            "batch {after} is still pending after the final run"
        ));
    }
    let committed = after;
    check_sinks(&pipeline, &input, committed, &mut tally).await?;
    report(&tally, committed, &points, began.elapsed());
    if !tally.mismatches.is_empty() {
        bail!("{} mismatches", tally.mismatches.len());
    }
    Ok(())
}

/// After a run that started on a pending batch: it must have replayed that batch, with the
/// offsets recorded before the kill.
fn check_replay(
    checkpoint: &Path,
    log: &Path,
    id: u64,
    recorded: &[u8],
    tally: &mut Tally,
) -> Result<()> {
    tally.replays += 1;
    let now = std::fs::read(checkpoint.join("offsets").join(id.to_string()))
        .with_context(|| format!("reading offsets/{id} after its replay"))?;
    if now != recorded {
        tally
            .mismatches
            .push(format!("offsets/{id} changed when the batch was replayed"));
    }
    if let Some(first) = first_progress_batch(log)
        && first != id
    {
        tally.mismatches.push(format!(
            "the run after a kill in batch {id} reported batch {first} first"
        ));
    }
    Ok(())
}

async fn pg(url: &str) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL (--postgres)")?;
    tokio::spawn(conn);
    Ok(client)
}

pub async fn drop_chaos_tables(url: &str, p: &Pipeline) -> Result<()> {
    let client = pg(url).await?;
    for s in &p.sinks {
        if let SinkConfig::PostgresUpsert {
            table,
            staging_table,
            ledger,
            ..
        } = s
        {
            for t in [Some(table), staging_table.as_ref(), ledger.as_ref()]
                .into_iter()
                .flatten()
            {
                client
                    .batch_execute(&format!("DROP TABLE IF EXISTS {}", quote_ident(t)))
                    .await
                    .with_context(|| format!("dropping {t}"))?;
            }
        }
    }
    Ok(())
}

/// Every input row, as (order id, order).
type Rows = Vec<(i64, Order)>;

/// Every input row (from the generated files) and the newest row per order id.
fn reference(input: &Input) -> Result<(Rows, HashMap<i64, Order>)> {
    let mut all = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&input.files_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for f in files {
        for line in std::fs::read_to_string(&f)?.lines() {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}: not JSON: {line}", f.display()))?;
            let ts = v["updated_at"].as_str().unwrap_or_default();
            let updated_us = chrono::DateTime::parse_from_rfc3339(ts)
                .with_context(|| format!("{}: updated_at {ts}", f.display()))?
                .timestamp_micros();
            all.push((
                v["order_id"].as_i64().unwrap_or(-1),
                Order {
                    status: v["status"].as_str().unwrap_or_default().to_string(),
                    amount: v["amount"].as_f64().unwrap_or(f64::NAN),
                    updated_us,
                },
            ));
        }
    }
    let mut latest: HashMap<i64, Order> = HashMap::new();
    for (k, o) in &all {
        match latest.get(k) {
            Some(cur) if cur.updated_us >= o.updated_us => {}
            _ => {
                latest.insert(*k, o.clone());
            }
        }
    }
    Ok((all, latest))
}

/// (order_id, order) rows out of record batches with those four columns.
fn orders_of(batches: &[RecordBatch], what: &str) -> Result<Vec<(i64, Order)>> {
    let mut out = Vec::new();
    for b in batches {
        let col = |name: &str, dt: &DataType| -> Result<std::sync::Arc<dyn Array>> {
            let c = b
                .column_by_name(name)
                .ok_or_else(|| anyhow!("{what}: no column {name}"))?;
            Ok(cast(c, dt)?)
        };
        let id = col("order_id", &DataType::Int64)?;
        let status = col("status", &DataType::Utf8)?;
        let amount = col("amount", &DataType::Float64)?;
        let ts = col(
            "updated_at",
            &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        )?;
        let ts = cast(&ts, &DataType::Int64)?;
        let (id, status, amount, ts) = (
            id.as_primitive::<Int64Type>(),
            status.as_string::<i32>(),
            amount.as_primitive::<weir_core::datafusion::arrow::datatypes::Float64Type>(),
            ts.as_primitive::<Int64Type>(),
        );
        for r in 0..b.num_rows() {
            out.push((
                id.value(r),
                Order {
                    status: status.value(r).to_string(),
                    amount: amount.value(r),
                    updated_us: ts.value(r),
                },
            ));
        }
    }
    Ok(out)
}

/// Compares a MERGE/upsert sink's rows with the newest row per key.
fn compare_latest(
    what: &str,
    rows: &[(i64, Order)],
    latest: &HashMap<i64, Order>,
    tally: &mut Tally,
) {
    let mut seen: HashMap<i64, u32> = HashMap::new();
    let mut wrong = 0u64;
    for (k, o) in rows {
        *seen.entry(*k).or_default() += 1;
        match latest.get(k) {
            None => tally
                .mismatches
                .push(format!("{what}: order {k} is not in the input")),
            Some(want) if want != o => {
                wrong += 1;
                if wrong <= 5 {
                    tally.mismatches.push(format!(
                        "{what}: order {k} holds {o:?}, the newest input row is {want:?}"
                    ));
                }
            }
            Some(_) => {}
        }
    }
    if wrong > 5 {
        tally.mismatches.push(format!(
            "{what}: {} more orders with wrong values",
            wrong - 5
        ));
    }
    let doubled = seen.values().filter(|&&n| n > 1).count();
    if doubled > 0 {
        tally
            .mismatches
            .push(format!("{what}: {doubled} order ids appear more than once"));
    }
    let missing = latest.keys().filter(|k| !seen.contains_key(k)).count();
    if missing > 0 {
        tally
            .mismatches
            .push(format!("{what}: {missing} order ids are missing"));
    }
    tally.rows_checked += rows.len();
    tally.checked.push(format!("{what}: {} rows", rows.len()));
}

/// Compares an append sink's rows with every input row, as multisets.
fn compare_all(what: &str, rows: Vec<(i64, Order)>, all: &[(i64, Order)], tally: &mut Tally) {
    let key = |(k, o): &(i64, Order)| (*k, o.updated_us, o.status.clone(), o.amount.to_bits());
    let mut want: HashMap<_, i64> = HashMap::new();
    for r in all {
        *want.entry(key(r)).or_default() += 1;
    }
    for r in &rows {
        *want.entry(key(r)).or_default() -= 1;
    }
    let missing: i64 = want.values().filter(|&&n| n > 0).sum();
    let extra: i64 = -want.values().filter(|&&n| n < 0).sum::<i64>();
    if missing > 0 || extra > 0 {
        tally.mismatches.push(format!(
            "{what}: {missing} input rows missing, {extra} rows extra or doubled"
        ));
    }
    tally.rows_checked += rows.len();
    tally.checked.push(format!("{what}: {} rows", rows.len()));
}

async fn check_sinks(p: &Pipeline, input: &Input, committed: u64, tally: &mut Tally) -> Result<()> {
    let (all, latest) = reference(input)?;
    // The checkpoint exists by now: opening it only reads its metadata.
    let query_id = Checkpoint::open(&p.query.checkpoint)?.query_id();
    let default_app = format!("{}-{query_id}", p.query.name);
    let ctx = SessionContext::new();
    for s in &p.sinks {
        let what = s.label();
        match s {
            SinkConfig::DeltaMerge { path, app_id, .. }
            | SinkConfig::DeltaAppend { path, app_id, .. } => {
                let df = weir_delta::read_table(&ctx, path).await?;
                let rows = orders_of(&df.collect().await?, &what)?;
                if matches!(s, SinkConfig::DeltaMerge { .. }) {
                    compare_latest(&what, &rows, &latest, tally);
                } else {
                    compare_all(&what, rows, &all, tally);
                }
                let version = weir_delta::table_version(path).await?;
                if version != committed.checked_sub(1) {
                    tally.mismatches.push(format!(
                        "{what}: table version {version:?}, expected {} for {committed} batches (one commit each)",
                        committed.saturating_sub(1)
                    ));
                }
                let app = app_id.clone().unwrap_or_else(|| default_app.clone());
                let txn = weir_delta::recorded_version(path, &app).await?;
                if txn != committed.checked_sub(1).map(|v| v as i64) {
                    tally.mismatches.push(format!(
                        "{what}: app transaction {app} at {txn:?}, expected the last batch {}",
                        committed.saturating_sub(1)
                    ));
                }
                tally.checked.push(format!(
                    "{what}: version {}, txn {}",
                    fmt_opt(version),
                    fmt_opt(txn)
                ));
            }
            SinkConfig::Parquet { path, .. } => {
                let df = ctx
                    .read_parquet(
                        path.to_string_lossy().to_string(),
                        ParquetReadOptions::default(),
                    )
                    .await?;
                let rows = orders_of(&df.collect().await?, &what)?;
                compare_all(&what, rows, &all, tally);
            }
            SinkConfig::PostgresUpsert {
                url,
                table,
                ledger,
                app_id,
                staging_table,
                ..
            } => {
                let client = pg(url).await?;
                let sql = format!(
                    "SELECT order_id, status, amount, updated_at FROM {}",
                    quote_ident(table)
                );
                let mut rows = Vec::new();
                for r in client.query(&sql, &[]).await.context(sql.clone())? {
                    let ts: chrono::DateTime<chrono::Utc> = r.try_get(3)?;
                    rows.push((
                        r.try_get::<_, i64>(0)?,
                        Order {
                            status: r.try_get(1)?,
                            amount: r.try_get(2)?,
                            updated_us: ts.timestamp_micros(),
                        },
                    ));
                }
                compare_latest(&what, &rows, &latest, tally);
                let ledger = ledger.clone().unwrap_or_else(|| "weir_batches".into());
                let app = app_id
                    .clone()
                    .unwrap_or_else(|| format!("{default_app}/{table}"));
                let ids: Vec<i64> = client
                    .query(
                        &format!(
                            "SELECT batch_id FROM {} WHERE app_id = $1 ORDER BY batch_id",
                            quote_ident(&ledger)
                        ),
                        &[&app],
                    )
                    .await?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                let want: Vec<i64> = (0..committed as i64).collect();
                if ids != want {
                    tally.mismatches.push(format!(
                        "{what}: ledger {ledger} has {} rows for {app}, expected batches 0..{committed} once each",
                        ids.len()
                    ));
                }
                tally
                    .checked
                    .push(format!("{what}: ledger {} rows", ids.len()));
                if let Some(st) = staging_table {
                    let left: i64 = client
                        .query_one(&format!("SELECT count(*) FROM {}", quote_ident(st)), &[])
                        .await?
                        .get(0);
                    if left != 0 {
                        tally
                            .mismatches
                            .push(format!("{what}: {left} rows left in staging table {st}"));
                    }
                }
            }
            SinkConfig::Console { .. } => {}
        }
    }
    Ok(())
}

fn report(t: &Tally, committed: u64, points: &[&str], took: Duration) {
    let hit: Vec<String> = points
        .iter()
        .map(|p| format!("{p} {}", t.points.get(*p).copied().unwrap_or(0)))
        .collect();
    let row = |k: &str, v: String| println!("| {k:<18} | {v}");
    println!("---");
    row(
        "kills",
        format!(
            "{} ({} SIGKILL at random moments, {} at fault points)",
            t.kills(),
            t.sigkills,
            t.kills() - t.sigkills
        ),
    );
    row("points hit", hit.join(", "));
    row(
        "runs",
        format!(
            "{} ({} ended before their kill came, 1 final run), {:.0} s",
            t.runs,
            t.not_reached,
            took.as_secs_f64()
        ),
    );
    row(
        "batch failures",
        format!(
            "{} (an injected error failed the batch; it ran again on restart)",
            t.failures
        ),
    );
    row("batches committed", committed.to_string());
    row(
        "batches replayed",
        format!("{} (each with its recorded id and offsets)", t.replays),
    );
    row("input records", t.records.to_string());
    row(
        "rows checked",
        format!("{} ({})", t.rows_checked, t.checked.join("; ")),
    );
    row("mismatches", t.mismatches.len().to_string());
    for m in &t.mismatches {
        println!("  mismatch: {m}");
    }
}

fn fmt_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("none".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(status: &str, us: i64) -> Order {
        Order {
            status: status.into(),
            amount: 1.5,
            updated_us: us,
        }
    }

    #[test]
    fn the_checks_see_missing_doubled_stale_and_foreign_rows() {
        let latest: HashMap<i64, Order> = [(1, order("paid", 20)), (2, order("shipped", 30))]
            .into_iter()
            .collect();
        let mut t = Tally::default();
        compare_latest(
            "ok",
            &[(1, order("paid", 20)), (2, order("shipped", 30))],
            &latest,
            &mut t,
        );
        assert!(t.mismatches.is_empty(), "{:?}", t.mismatches);

        let sink = [
            (1, order("created", 10)), // older than the newest input row
            (1, order("paid", 20)),    // order 1 twice
            (3, order("paid", 5)),     // not in the input
        ]; // order 2 missing
        compare_latest("bad", &sink, &latest, &mut t);
        let all = t.mismatches.join("\n");
        assert!(all.contains("order 1 holds"), "{all}");
        assert!(all.contains("1 order ids appear more than once"), "{all}");
        assert!(all.contains("order 3 is not in the input"), "{all}");
        assert!(all.contains("1 order ids are missing"), "{all}");
        assert_eq!(t.rows_checked, 5);

        let input = vec![
            (1, order("paid", 20)),
            (1, order("paid", 20)),
            (2, order("x", 1)),
        ];
        let mut t = Tally::default();
        compare_all("ok", input.clone(), &input, &mut t);
        assert!(t.mismatches.is_empty());
        compare_all(
            "bad",
            vec![
                (1, order("paid", 20)),
                (2, order("x", 1)),
                (2, order("x", 1)),
            ],
            &input,
            &mut t,
        );
        assert_eq!(
            t.mismatches,
            vec!["bad: 1 input rows missing, 1 rows extra or doubled"]
        );
    }

    #[test]
    fn the_pending_batch_is_read_from_the_logs() {
        let dir = tempfile::tempdir().unwrap();
        let chk = dir.path();
        assert_eq!(next_batch(chk).unwrap(), (0, false));
        std::fs::create_dir_all(chk.join("offsets")).unwrap();
        std::fs::create_dir_all(chk.join("commits")).unwrap();
        for id in 0..3 {
            std::fs::write(chk.join("offsets").join(id.to_string()), "v1").unwrap();
        }
        for id in 0..2 {
            std::fs::write(chk.join("commits").join(id.to_string()), "v1").unwrap();
        }
        assert_eq!(next_batch(chk).unwrap(), (2, true));
        std::fs::write(chk.join("commits").join("2"), "v1").unwrap();
        assert_eq!(next_batch(chk).unwrap(), (3, false));
    }
}
