//! `weir chaos`: kill a pipeline again and again, then check every sink against the input.
//!
//! The pipeline (the seed's worked example, `examples/orders_upsert.toml`, by default) runs
//! as a child `weir run` on generated orders. Before each run more orders are added to its
//! source; the run is then either killed with SIGKILL from outside after a random delay, or
//! aborted from inside at a fault point (`WEIR_FAULT=point@batch`) that its own connectors
//! declare, in one of the next batches (one such fault in five fails the batch with an error
//! instead). After `--kills` kills a last run drains the source, and:
//!
//! - every sink is read back through its connector's reader and compared with the reference
//!   computed from the input: MERGE/upsert sinks hold exactly the newest row per key (by the
//!   documented total order), append sinks every input row exactly once;
//! - each sink's bookkeeping holds one entry per committed batch (Delta versions and app
//!   transaction, the PostgreSQL ledger, an empty staging table, Parquet parts);
//! - the source: the last committed batch ends where the input ends (Kafka end offsets,
//!   every input file taken exactly once) and every progress report counts exactly the rows
//!   of its recorded range;
//! - each replay after a kill ran the pending batch with its recorded id and offsets.
//!
//! With `--workers N` the batches run on N `weir worker` processes started here (a
//! `[cluster]` on loopback), and one run in two also SIGKILLs a random worker at a random
//! moment; it is started again on its port when the run ends.
//!
//! Exit code 1 when anything does not match; `--json` prints the summary as JSON.

mod input;
mod power;
mod retarget;
mod stateful;
mod supervise;
mod verify;
mod workers;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use serde_json::Value;
use weir_core::checkpoint::{Checkpoint, StartPoint};
use weir_core::connector::{Feed, FeedKind, QueryIdentity, Verdict};
use weir_core::fault::{RUNNER_POINTS, STATE_POINTS};
use weir_core::storage::{Location, StorageOptions};

use crate::generate::SplitMix;
use crate::pipeline::Pipeline;
use input::{Input, PARTITIONS};
pub(crate) use retarget::{Target, retarget};
use supervise::{Ended, log_tail, spawn, wait};

/// What a power cut leaves alone: the input (upstream's), the run logs, the pipeline file.
const NOT_CUT: &[&str] = &["input", "runs", "pipeline.toml"];

/// The worked example, the default pipeline.
pub(crate) const EXAMPLE: &str = include_str!("../../../../examples/orders_upsert.toml");

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ChaosArgs {
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
    /// Working folder (input, run logs; checkpoint and tables unless --store). Recreated on
    /// each run.
    #[arg(long, default_value = "weir-chaos")]
    pub dir: PathBuf,
    /// Put the checkpoint and every sink's files here instead of the working folder: an
    /// object-store URL such as s3://bucket/chaos (settings from --storage key=value).
    #[arg(long)]
    pub store: Option<String>,
    /// Object-store settings for --store (`aws_endpoint=http://...`), repeatable.
    #[arg(long = "storage", value_parser = parse_kv)]
    pub storage: Vec<(String, String)>,
    /// Rows per batch (the source's max-offsets-per-trigger, or rows per file with one
    /// file per trigger).
    #[arg(long, default_value_t = 500)]
    pub batch_rows: usize,
    /// Distinct order ids.
    #[arg(long, default_value_t = 2000)]
    pub keys: u64,
    /// min-batches-to-retain for the query (small values exercise purging and compaction).
    #[arg(long)]
    pub retain: Option<u64>,
    /// Input that looks like real input: awkward file names, empty files, NULLs in non-key
    /// columns, ties on the ordering column, skewed Kafka partitions.
    #[arg(long)]
    pub odd: bool,
    /// Files (or Kafka batches) of input added before each run.
    #[arg(long, default_value_t = 2)]
    pub files_per_run: usize,
    /// The `weir` binary to run (default: this one).
    #[arg(long)]
    pub weir: Option<PathBuf>,
    /// After each run, remove every file and folder that a power cut at that moment could
    /// have lost (written but not fsynced, or not fsynced in its folder), as the engine's
    /// journal of durable steps shows; local folders only.
    #[arg(long)]
    pub power_loss: bool,
    /// Print the summary as one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Run the batches on this many `weir worker` processes started here (the pipeline's
    /// `[cluster]` is replaced by them), and SIGKILL workers too: one run in two kills a
    /// random worker at a random moment.
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Print the fault points the pipeline's connectors declare (a JSON array, in the
    /// order a batch passes them) and exit.
    #[arg(long)]
    pub list_points: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("'{s}' is not key=value"))
}

/// What happened, as the table and `--json` show it.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Summary {
    pub kills: u32,
    pub sigkills: u32,
    pub worker_kills: u32,
    pub points: BTreeMap<String, u32>,
    pub runs: u32,
    pub not_reached: u32,
    pub failures: u32,
    pub replays: u32,
    pub power_cuts: u32,
    pub lost_on_power_cut: usize,
    pub batches_committed: u64,
    pub input_records: u64,
    pub rows_checked: usize,
    pub checked: Vec<String>,
    pub mismatches: Vec<String>,
    pub seconds: f64,
}

/// The fault points a batch of this pipeline passes, in order: the runner's around the
/// function, and each sink's own, as the sinks declare them.
pub(crate) fn points(p: &Pipeline) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = RUNNER_POINTS[..2].to_vec();
    for s in &p.sinks {
        out.extend(s.harness().fault_points());
    }
    // after-user-fn, then the state commit, then the commit log.
    out.extend(&RUNNER_POINTS[2..3]);
    if p.transform.as_ref().is_some_and(|t| t.is_stateful()) {
        out.extend(STATE_POINTS);
    }
    out.extend(&RUNNER_POINTS[3..]);
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(*p));
    out
}

/// The pending batch and the offsets it must replay with, read from the checkpoint.
struct Pending {
    id: u64,
    start: Option<Value>,
    end: Value,
}

async fn pending(checkpoint: &Location) -> Result<(u64, Option<Pending>)> {
    let Some(cp) = Checkpoint::inspect(checkpoint.clone()).await? else {
        return Ok((0, None));
    };
    Ok(match cp.recover().await? {
        StartPoint::Fresh => (0, None),
        StartPoint::Next { batch_id, .. } => (batch_id, None),
        StartPoint::Replay {
            batch_id,
            start,
            batch,
        } => {
            let end = batch.source(0, "offsets")?.json().clone();
            let start = start
                .map(|s| s.source(0, "offsets").map(|o| o.json().clone()))
                .transpose()?;
            (
                batch_id,
                Some(Pending {
                    id: batch_id,
                    start,
                    end,
                }),
            )
        }
    })
}

fn progress_lines(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log.with_extension("jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// After a run that started on a pending batch: it must have replayed that batch first,
/// with the offsets recorded before the kill.
fn check_replay(p: &Pending, log: &std::path::Path, s: &mut Summary) {
    s.replays += 1;
    let Some(first) = progress_lines(log).into_iter().next() else {
        // The run ended before it reported a batch (killed again): nothing to compare.
        return;
    };
    if first["batchId"].as_u64() != Some(p.id) {
        s.mismatches.push(format!(
            "the run after a kill in batch {} reported batch {} first",
            p.id, first["batchId"]
        ));
        return;
    }
    let src = &first["sources"][0];
    if src["endOffset"] != p.end || src["startOffset"] != p.start.clone().unwrap_or(Value::Null) {
        s.mismatches.push(format!(
            "batch {} replayed {} -> {} instead of its recorded {:?} -> {}",
            p.id, src["startOffset"], src["endOffset"], p.start, p.end
        ));
    }
}

pub(crate) async fn run(mut args: ChaosArgs) -> Result<()> {
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
    let mut pipeline: Pipeline = toml::from_str(&template).map_err(|e| anyhow!("{origin}: {e}"))?;
    let topic = format!(
        "weir-chaos-orders-{}",
        chrono::Utc::now().timestamp_millis()
    );
    let feed = match pipeline.source.harness().feed_kind() {
        Some(FeedKind::Kafka) => Feed::Kafka {
            brokers: args.kafka.clone().ok_or_else(|| {
                anyhow!("{origin} reads Kafka: give the brokers with --kafka (or KAFKA_BOOTSTRAP)")
            })?,
            topic: topic.clone(),
        },
        _ => Feed::Files {
            dir: Location::local(dir.join("input")),
        },
    };
    let storage: BTreeMap<String, String> = args.storage.iter().cloned().collect();
    let store = match &args.store {
        Some(url) => Location::parse("--store", url, None, &StorageOptions::new(storage.clone())?)?,
        None => Location::local(&dir),
    };
    pipeline.storage.extend(storage);
    retarget(
        &mut pipeline,
        &Target {
            dir: &dir,
            store: store.clone(),
            feed: feed.clone(),
            postgres: args.postgres.as_deref(),
            batch_rows: args.batch_rows as u64,
            retain: args.retain,
        },
    )
    .with_context(|| origin.clone())?;
    let stateful_plan = stateful::plan(&pipeline).with_context(|| origin.clone())?;
    if stateful_plan.is_some() {
        if args.retain.is_some() {
            bail!(
                "{origin}: --retain cannot be used with a stateful pipeline: the check replays every batch from offsets/"
            );
        }
        pipeline.query.min_batches_to_retain = Some(1_000_000);
    }
    if args.store.is_some() && pipeline.query.lease_ttl.is_none() {
        // Restarts after a kill wait for the dead run's lease: keep it short.
        pipeline.query.lease_ttl = Some(weir_core::connector::DurationText(Duration::from_secs(2)));
    }
    if args.power_loss && args.store.is_some() {
        bail!("--power-loss simulates a local disk: it cannot be combined with --store");
    }
    if args.list_points {
        println!("{}", serde_json::to_string(&points(&pipeline))?);
        return Ok(());
    }
    let weir = match &args.weir {
        Some(w) => w.clone(),
        None => std::env::current_exe()?,
    };
    let mut cluster = None;
    if args.workers == 1 {
        bail!(
            "--workers 1: use 2 or more (a one-task plan runs in the driver, and killing the \
             only worker would leave the run nowhere to go)"
        );
    }
    if args.workers > 0 {
        let w = workers::Workers::start(&weir, &dir.join("runs"), args.workers).await?;
        pipeline.cluster = Some(weir_cluster::ClusterConfig {
            workers: w.urls(),
            token: None,
            // A killed worker fails the attempt; the next one runs on the workers left.
            max_batch_attempts: Some(5),
            connect_timeout: Some("1s".into()),
            liveness_timeout: Some("5s".into()),
            tls_ca: None,
            tls_domain: None,
        });
        cluster = Some(w);
    } else if pipeline.cluster.is_some() {
        bail!("{origin} has a [cluster]: run it with --workers N (chaos starts its own workers)");
    }
    let cluster_given = cluster.is_some();
    let pipeline_path = dir.join("pipeline.toml");
    std::fs::write(&pipeline_path, pipeline.to_toml()?)?;
    let pipeline = Pipeline::load(&pipeline_path)?;
    let env = pipeline.env()?;
    for s in &pipeline.sinks {
        if let Some(r) = s.harness().verifier(&env)? {
            r.reset().await?;
        }
    }
    let mut input = Input {
        files_dir: dir.join("input"),
        kafka: None,
        next_file: 0,
        seed: args.seed,
        keys: args.keys,
        rows_per_file: args.batch_rows,
        odd: args.odd,
        sent: 0,
        written: Vec::new(),
    };
    if let Feed::Kafka { brokers, topic } = &feed {
        weir_kafka::create_topic(brokers, topic, PARTITIONS).await?;
        input.kafka = Some((brokers.clone(), topic.clone()));
    }
    let points = points(&pipeline);
    let checkpoint = env.location("query.checkpoint", &pipeline.query.checkpoint)?;
    let mut rng = SplitMix(args.seed ^ 0x5EED);
    let mut s = Summary::default();
    let mut progress: Vec<Value> = Vec::new();
    // A smoothed run length, so that SIGKILLs land inside runs rather than after them.
    let mut typical_ms = 3000.0f64;
    let limit = Duration::from_secs(600);
    if !args.json {
        println!(
            "weir chaos: {} kills of {origin} (seed {}), work folder {}",
            args.kills,
            args.seed,
            dir.display()
        );
    }
    let began = Instant::now();
    // With workers, the runs also go on (a bounded number) until one worker was killed
    // inside a run: a short input can end every run before a randomly timed worker kill.
    let owe_worker_kill =
        |s: &Summary| cluster_given && s.worker_kills == 0 && s.runs < 4 * args.kills;
    while s.kills < args.kills || owe_worker_kill(&s) {
        s.input_records += input.add(args.files_per_run).await?;
        let (next, replay) = pending(&checkpoint).await?;
        let log = dir.join("runs").join(format!("{:04}", s.runs));
        let sigkill = rng.next().is_multiple_of(3);
        // A run only for the worker kill still owed makes no kill of the driver.
        let (fault, kill_after) = if s.kills >= args.kills {
            (None, None)
        } else if sigkill {
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
        let journal = log.with_extension("journal");
        let journal_env = journal.to_string_lossy().to_string();
        let (before, env) = if args.power_loss {
            (
                Some(power::snapshot(&dir, NOT_CUT)?),
                vec![(
                    weir_core::storage::journal::JOURNAL_VAR,
                    journal_env.as_str(),
                )],
            )
        } else {
            (None, vec![])
        };
        // With workers, one run in two also loses a random worker at a random moment.
        let owed = owe_worker_kill(&s);
        let worker_kill = match &cluster {
            Some(w) if owed || rng.next().is_multiple_of(2) => {
                // Owed a kill, it comes early in the run, before the run can end.
                let spread = if owed { 250 } else { 1000 };
                let frac = 0.05 + (rng.next() % spread) as f64 / 1000.0;
                Some((
                    (rng.next() % w.len() as u64) as usize,
                    Duration::from_millis((typical_ms * frac) as u64),
                ))
            }
            _ => None,
        };
        let mut child = spawn(&weir, &pipeline_path, &log, fault.as_deref(), &env)?;
        let mut killed_now = 0;
        let ended = {
            let run = wait(&mut child, kill_after, limit, &log);
            tokio::pin!(run);
            let kill_one = async {
                match worker_kill {
                    Some((i, after)) => {
                        tokio::time::sleep(after).await;
                        i
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ended = &mut run => ended?,
                i = kill_one => {
                    if let Some(w) = cluster.as_mut()
                        && w.kill(i).await?
                    {
                        s.worker_kills += 1;
                        killed_now += 1;
                    }
                    run.await?
                }
            }
        };
        if let Some(w) = cluster.as_mut() {
            let revived = w.revive().await?;
            if revived > killed_now {
                // Only chaos kills workers: one that ended by itself crashed on a plan.
                s.mismatches.push(format!(
                    "run {}: {} worker(s) exited by themselves (see {}/worker-*.log)",
                    s.runs,
                    revived - killed_now,
                    dir.join("runs").display()
                ));
            }
        }
        if let Some(before) = &before {
            let lost = power::cut(&dir, NOT_CUT, before, &journal)?;
            s.power_cuts += 1;
            s.lost_on_power_cut += lost.len();
        }
        let took = started.elapsed().as_millis() as f64;
        s.runs += 1;
        match ended {
            Ended::Killed => {
                s.sigkills += 1;
                s.kills += 1;
            }
            Ended::Exited(status) if status.success() => {
                typical_ms = 0.7 * typical_ms + 0.3 * took;
                s.not_reached += 1;
            }
            Ended::Exited(status) if status.signal() == Some(6) && fault.is_some() => {
                let point = fault
                    .as_deref()
                    .and_then(|f| f.split('@').next())
                    .unwrap_or_default();
                *s.points.entry(point.to_string()).or_default() += 1;
                s.kills += 1;
            }
            Ended::Exited(status)
                if status.code() == Some(1)
                    && fault.as_deref().is_some_and(|f| f.ends_with(":error"))
                    && log_tail(&log).contains("fault injected") =>
            {
                s.failures += 1;
            }
            Ended::Exited(status) => bail!(
                "run {} ({}) failed with {status}:\n{}",
                s.runs,
                fault.as_deref().unwrap_or("no fault point"),
                log_tail(&log)
            ),
        }
        if let Some(p) = &replay {
            check_replay(p, &log, &mut s);
        }
        progress.extend(progress_lines(&log));
        if !args.json && s.runs % 10 == 0 {
            println!(
                "  {} runs, {} kills, {:.0} s",
                s.runs,
                s.kills,
                began.elapsed().as_secs_f64()
            );
        }
    }
    // The last run drains the source without faults.
    let (_, replay) = pending(&checkpoint).await?;
    let log = dir.join("runs").join("final");
    let mut child = spawn(&weir, &pipeline_path, &log, None, &[])?;
    let ended = wait(&mut child, None, limit, &log).await?;
    s.runs += 1;
    if !matches!(ended, Ended::Exited(st) if st.success()) {
        bail!("the final run failed ({ended:?}):\n{}", log_tail(&log));
    }
    if let Some(p) = &replay {
        check_replay(p, &log, &mut s);
    }
    progress.extend(progress_lines(&log));
    let (committed, left) = pending(&checkpoint).await?;
    if let Some(p) = left {
        s.mismatches.push(format!(
            "batch {} is still pending after the final run",
            p.id
        ));
    }
    s.batches_committed = committed;
    let cp = Checkpoint::inspect(checkpoint.clone())
        .await?
        .ok_or_else(|| anyhow!("no checkpoint at {checkpoint} after the runs"))?;
    let query = QueryIdentity::of(&cp, &pipeline.query.name);
    let mut verdict = Verdict::default();
    match &stateful_plan {
        None => {
            let schema = crate::generate::orders_schema();
            let all = input.rows()?;
            verdict.merge(verify::check_sinks(&pipeline, &schema, &all, &query, committed).await?);
        }
        Some(plan) => {
            let r = stateful::reference(plan, &input, &cp, committed, &mut verdict).await?;
            verdict.notes.push(format!(
                "stateful: every batch replayed from the checkpoint under the watermark rules: {} output rows",
                r.rows.iter().map(|b| b.num_rows()).sum::<usize>()
            ));
            verdict.merge(
                verify::check_sinks(&pipeline, &r.schema, &r.rows, &query, committed).await?,
            );
            stateful::check_state_sizes(&r, &progress, committed, &mut verdict);
        }
    }
    verdict.merge(verify::check_source(&feed, &input, &cp, committed, &progress).await?);
    s.rows_checked = verdict.rows;
    s.checked = verdict.notes;
    s.mismatches.extend(verdict.mismatches);
    s.seconds = (began.elapsed().as_secs_f64() * 10.0).round() / 10.0;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        report(&s, &points);
    }
    if !s.mismatches.is_empty() {
        bail!("{} mismatches", s.mismatches.len());
    }
    Ok(())
}

fn report(s: &Summary, points: &[&str]) {
    let hit: Vec<String> = points
        .iter()
        .map(|p| format!("{p} {}", s.points.get(*p).copied().unwrap_or(0)))
        .collect();
    let row = |k: &str, v: String| println!("| {k:<18} | {v}");
    println!("---");
    row(
        "kills",
        format!(
            "{} ({} SIGKILL at random moments, {} at fault points)",
            s.kills,
            s.sigkills,
            s.kills - s.sigkills
        ),
    );
    row("points hit", hit.join(", "));
    if s.worker_kills > 0 {
        row(
            "worker kills",
            format!(
                "{} (SIGKILL of a worker at a random moment of a run, restarted after it)",
                s.worker_kills
            ),
        );
    }
    row(
        "runs",
        format!(
            "{} ({} ended before their kill came, 1 final run), {:.0} s",
            s.runs, s.not_reached, s.seconds
        ),
    );
    row(
        "batch failures",
        format!(
            "{} (an injected error failed the batch; it ran again on restart)",
            s.failures
        ),
    );
    if s.power_cuts > 0 {
        row(
            "power cuts",
            format!(
                "{} ({} files and folders not yet durable were dropped)",
                s.power_cuts, s.lost_on_power_cut
            ),
        );
    }
    row("batches committed", s.batches_committed.to_string());
    row(
        "batches replayed",
        format!("{} (each with its recorded id and offsets)", s.replays),
    );
    row("input records", s.input_records.to_string());
    row(
        "rows checked",
        format!("{} ({})", s.rows_checked, s.checked.join("; ")),
    );
    row("mismatches", s.mismatches.len().to_string());
    for m in &s.mismatches {
        println!("  mismatch: {m}");
    }
}

#[cfg(test)]
mod tests;
