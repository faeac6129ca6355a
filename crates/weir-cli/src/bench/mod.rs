//! `weir bench`: figures for the closing notes, one JSON line per scenario.
//!
//! - `fixed-cost`: 50 files of 10 rows, one file per trigger: the per-batch overhead.
//! - `throughput`: 2,000,000 rows in 200 files, 500,000 keys, 20 files per trigger:
//!   newest row per key (window) then Parquet.
//! - `delta-merge`: the same files, 1,000,000 keys, MERGE into a Delta table that grows to
//!   about 865,000 rows (200k-row batches).
//! - `delta-append`: the same files appended to a Delta table with the transaction.
//! - `postgres-copy` / `postgres-insert` (with `--postgres URL`): the same files as
//!   `delta-merge`, upserted into PostgreSQL with binary COPY or with multi-row INSERT.
//! - `kafka` (with `--kafka BROKERS`): 600,000 JSON records read and parsed, next to what a
//!   consume-only librdkafka loop reaches against the same broker (best of three).
//! - `example` (with both): the worked example, `examples/orders_upsert.toml` as shipped,
//!   on 1,000,000 orders (500,000 ids) in 200,000-record batches: Kafka -> newest per key
//!   -> Delta MERGE -> PostgreSQL upsert through staging + ledger; the time split by
//!   `durationMs` and per sink, next to PostgreSQL's own floor for the same rows measured
//!   with `psql` (`\copy` + `INSERT .. ON CONFLICT` + ledger row per batch).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use weir::config::SinkConfig;
use weir_core::connector::BuildEnv;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::engine::{Phase, QueryListener, StreamingQueryProgress};
use weir_core::sink::CACHE_DURATION_KEY;
use weir_core::{
    BatchContext, DataStreamWriter, ForeachBatch, Location, SinkMetric, Trigger, WeirSession,
    dedupe_latest,
};

use crate::generate::{GenArgs, generate, orders_schema};

mod ceilings;
use ceilings::{librdkafka_ceiling, postgres_floor};

/// The scenarios of `weir bench` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scenario {
    All,
    FixedCost,
    Throughput,
    DeltaMerge,
    DeltaAppend,
    PostgresCopy,
    PostgresInsert,
    Kafka,
    Example,
}

impl Scenario {
    /// The name `--scenario` takes.
    fn name(self) -> String {
        use clap::ValueEnum;
        self.to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_string())
    }
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Which scenario to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    pub scenario: Scenario,
    /// Work folder (default: a new temp folder).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Kafka brokers for the kafka scenario (skipped without it).
    #[arg(long)]
    pub kafka: Option<String>,
    /// PostgreSQL server for the postgres-* scenarios (they are skipped without it).
    #[arg(long)]
    pub postgres: Option<String>,
    /// Scale the row counts down (e.g. 10 for a quick look).
    #[arg(long, default_value_t = 1)]
    pub scale_down: usize,
}

#[derive(Default)]
struct Collect(Mutex<Vec<StreamingQueryProgress>>);

impl QueryListener for Collect {
    fn on_query_progress(&self, p: &StreamingQueryProgress) {
        if let Ok(mut v) = self.0.lock() {
            v.push(p.clone());
        }
    }
}

/// Runs the query to its end with a listener that keeps every progress report; returns
/// (seconds since `started`, the reports, input rows).
async fn run_to_end(
    writer: DataStreamWriter,
    started: Instant,
) -> Result<(f64, Vec<StreamingQueryProgress>, u64)> {
    let collect = Arc::new(Collect::default());
    let query = writer.listener(collect.clone()).start().await?;
    query.await_termination().await?;
    let seconds = started.elapsed().as_secs_f64();
    let progress = collect.0.lock().map(|v| v.clone()).unwrap_or_default();
    let rows = progress.iter().map(|p| p.num_input_rows).sum();
    Ok((seconds, progress, rows))
}

pub(crate) fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Peak resident memory of this process in MB (VmHWM).
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kb| (kb / 1024.0 * 10.0).round() / 10.0)
}

/// A scenario's sink: a `[[sink]]` table as a pipeline file gives it, read through the
/// connector registry (`path = "out"` is in the scenario's folder; a PostgreSQL sink's
/// tables, its ledger included, are the scenario's own and dropped first), and whether the
/// batch is first reduced to the newest row per key (the seed's files query).
struct Sink {
    table: String,
    dedupe_first: bool,
}

impl Sink {
    fn parquet() -> Self {
        Sink {
            table: r#"type = "parquet"
path = "out""#
                .into(),
            dedupe_first: true,
        }
    }

    fn delta(kind: &str) -> Self {
        Sink {
            table: format!(
                r#"type = "{kind}"
path = "out"
keys = ["order_id"]
ordering = "updated_at""#
            ),
            dedupe_first: false,
        }
    }

    fn postgres(url: &str, table: &str, load: &str) -> Self {
        Sink {
            table: format!(
                r#"type = "postgres-upsert"
url = "{url}"
table = "{table}"
keys = ["order_id"]
ordering = "updated_at"
create-table = true
ledger = "{table}_batches"
load = "{load}""#
            ),
            dedupe_first: false,
        }
    }
}

async fn scenario(
    name: &str,
    work: &Path,
    files: usize,
    rows_per_file: usize,
    keys: u64,
    per_trigger: usize,
    sink: Sink,
) -> Result<()> {
    let dir = work.join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let input = dir.join("input");
    generate(&GenArgs::new(input.clone(), files, rows_per_file, keys, 7))?;
    let config: SinkConfig =
        toml::from_str(&sink.table).map_err(|e| anyhow!("{name}: the sink's table: {e}"))?;
    let env = BuildEnv {
        base: Some(dir.clone()),
        ..BuildEnv::default()
    };
    if let Some(reader) = config.harness().verifier(&env)? {
        reader.reset().await?;
    }
    let built = config.spec().build(&env)?;
    let f: Arc<dyn ForeachBatch> = if sink.dedupe_first {
        Arc::new(move |batch: DataFrame, ctx: BatchContext| {
            let built = built.clone();
            async move {
                let latest = dedupe_latest(batch, &["order_id".to_string()], "updated_at")?;
                built.call(latest, ctx).await
            }
        })
    } else {
        built
    };
    let started = Instant::now();
    let writer = WeirSession::new()
        .read_stream()
        .files(&input)
        .schema(orders_schema())
        .max_files_per_trigger(per_trigger)
        .load()
        .await?
        .write_stream()
        .query_name(name)
        .checkpoint(dir.join("checkpoint"))
        .trigger(Trigger::AvailableNow)
        .sink_arc(f);
    let (seconds, progress, rows) = run_to_end(writer, started).await?;
    if rows != (files * rows_per_file) as u64 {
        bail!(
            "{name}: read {rows} rows, expected {}",
            files * rows_per_file
        );
    }
    let line = serde_json::json!({
        "scenario": name,
        "rows": rows,
        "files": files,
        "files_per_trigger": per_trigger,
        "batches": progress.len(),
        "seconds": (seconds * 1000.0).round() / 1000.0,
        "rows_per_sec": (rows as f64 / seconds).round(),
        "median_trigger_execution_ms": median(progress.iter().map(|p| p.duration(Phase::TriggerExecution)).collect()),
        "median_add_batch_ms": median(progress.iter().map(|p| p.duration(Phase::AddBatch)).collect()),
        "median_get_batch_ms": median(progress.iter().map(|p| p.duration(Phase::GetBatch)).collect()),
        "peak_rss_mb": peak_rss_mb(),
    });
    println!("{line}");
    Ok(())
}

pub(crate) async fn run(args: BenchArgs) -> Result<()> {
    let tmp;
    let work = match &args.dir {
        Some(d) => d.clone(),
        None => {
            tmp = std::env::temp_dir().join(format!("weir-bench-{}", std::process::id()));
            tmp.clone()
        }
    };
    std::fs::create_dir_all(&work)?;
    let s = args.scale_down.max(1);
    let all = args.scenario == Scenario::All;
    let runs = |s: Scenario| all || args.scenario == s;
    if runs(Scenario::FixedCost) {
        scenario("fixed-cost", &work, 50, 10, 100, 1, Sink::parquet()).await?;
    }
    if runs(Scenario::Throughput) {
        scenario(
            "throughput",
            &work,
            200,
            10_000 / s,
            500_000 / s as u64,
            20,
            Sink::parquet(),
        )
        .await?;
    }
    if runs(Scenario::DeltaMerge) {
        scenario(
            "delta-merge",
            &work,
            200,
            10_000 / s,
            1_000_000 / s as u64,
            20,
            Sink::delta("delta-merge"),
        )
        .await?;
    }
    if runs(Scenario::DeltaAppend) {
        scenario(
            "delta-append",
            &work,
            200,
            10_000 / s,
            500_000 / s as u64,
            20,
            Sink::delta("delta-append"),
        )
        .await?;
    }
    for (which, mode) in [
        (Scenario::PostgresCopy, "copy"),
        (Scenario::PostgresInsert, "insert"),
    ] {
        if runs(which) {
            let name = which.name();
            match &args.postgres {
                Some(url) => {
                    let table = format!("bench_{}", name.replace('-', "_"));
                    let sink = Sink::postgres(url, &table, mode);
                    scenario(
                        &name,
                        &work,
                        200,
                        10_000 / s,
                        1_000_000 / s as u64,
                        20,
                        sink,
                    )
                    .await?;
                }
                None if all => eprintln!("{name}: skipped (give --postgres URL)"),
                None => bail!("{name} needs --postgres URL"),
            }
        }
    }
    if runs(Scenario::Example) {
        match (&args.kafka, &args.postgres) {
            (Some(b), Some(url)) => example_scenario(&work, b, url, 1_000_000 / s).await?,
            _ if all => eprintln!("example: skipped (give --kafka BROKERS and --postgres URL)"),
            _ => bail!("example needs --kafka BROKERS and --postgres URL"),
        }
    }
    if runs(Scenario::Kafka) {
        match &args.kafka {
            Some(b) => kafka_scenario(b, 600_000 / s).await?,
            None if all => eprintln!("kafka: skipped (give --kafka BROKERS)"),
            None => bail!("kafka needs --kafka BROKERS"),
        }
    }
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&work);
    }
    Ok(())
}

/// Records/s from Kafka through JSON parsing into the batch DataFrame: produces `n` order
/// records into a new 3-partition topic, then reads them in batches of 200,000, three times,
/// each read followed by a consume-only librdkafka loop over the same topic.
async fn kafka_scenario(bootstrap: &str, n: usize) -> Result<()> {
    use weir_kafka::{BadRecordMode, KafkaOptions, KafkaSource, ValueFormat};

    let work = std::env::temp_dir().join(format!("weir-bench-kafka-{}", std::process::id()));
    let files: Vec<PathBuf> = generate(&GenArgs::new(work.join("input"), 60, n / 60, 100_000, 7))?
        .into_iter()
        .map(|w| w.path)
        .collect();
    let topic = format!("weir-bench-{}", std::process::id());
    weir_kafka::create_topic(bootstrap, &topic, 3).await?;
    let n = crate::demo::produce_lines(bootstrap, &topic, 3, &files, 0, false).await? as usize;
    let settled = settle().await;
    let mut opts = KafkaOptions::new(bootstrap, vec![topic.clone()]);
    opts.value_format = ValueFormat::Json {
        schema: orders_schema(),
        mode: BadRecordMode::FailFast,
    };
    // The broker's pace varies from run to run (a fetch now and then stalls for a second):
    // weir's read and the consume-only loop take turns, three times, and each gives its best.
    let mut runs = Vec::new();
    let mut ceilings = Vec::new();
    for round in 0..3 {
        let started = Instant::now();
        let writer = WeirSession::new()
            .read_stream()
            .source(Arc::new(KafkaSource::new(opts.clone())?))
            .max_offsets_per_trigger(200_000)
            .load()
            .await?
            .write_stream()
            .query_name("kafka-bench")
            .checkpoint(work.join(format!("checkpoint-{round}")))
            .trigger(Trigger::AvailableNow)
            .foreach_batch(|batch, _ctx| async move {
                batch.count().await?;
                Ok(())
            });
        let (seconds, progress, rows) = run_to_end(writer, started).await?;
        if rows != n as u64 {
            weir_kafka::delete_topic(bootstrap, &topic).await?;
            bail!("kafka: read {rows} records, produced {n}");
        }
        let get_ms: u64 = progress.iter().map(|p| p.duration(Phase::GetBatch)).sum();
        runs.push(KafkaRun {
            seconds,
            batches: progress.len(),
            read_and_parse: rows as f64 / (get_ms.max(1) as f64 / 1000.0),
            median_get_batch_ms: median(
                progress
                    .iter()
                    .map(|p| p.duration(Phase::GetBatch))
                    .collect(),
            ),
        });
        ceilings.push(librdkafka_ceiling(bootstrap, &topic, 3, n)?);
    }
    let best = runs
        .iter()
        .max_by(|a, b| a.read_and_parse.total_cmp(&b.read_and_parse))
        .ok_or_else(|| anyhow::anyhow!("kafka: no run"))?;
    let ceiling = ceilings.iter().copied().fold(0.0, f64::max);
    let rounded = |v: &[f64]| v.iter().map(|x| x.round()).collect::<Vec<_>>();
    println!(
        "{}",
        serde_json::json!({
            "scenario": "kafka",
            "records": n,
            "batches": best.batches,
            "seconds": (best.seconds * 1000.0).round() / 1000.0,
            "records_per_sec": (n as f64 / best.seconds).round(),
            "records_per_sec_read_and_parse": best.read_and_parse.round(),
            "records_per_sec_read_and_parse_each_run": rounded(&runs.iter().map(|r| r.read_and_parse).collect::<Vec<_>>()),
            "median_get_batch_ms": best.median_get_batch_ms,
            "librdkafka_consume_only_records_per_sec": ceiling.round(),
            "librdkafka_consume_only_each_run": rounded(&ceilings),
            "read_and_parse_over_ceiling": (best.read_and_parse / ceiling * 100.0).round() / 100.0,
            "settled_after_produce_s": settled,
            "peak_rss_mb": peak_rss_mb(),
        })
    );
    let _ = std::fs::remove_dir_all(&work);
    // A broker that keeps every bench's records slows down the next run (it saves them).
    weir_kafka::delete_topic(bootstrap, &topic).await?;
    Ok(())
}

/// Waits (at most 20 s) until the machine's CPUs have been at most 15% busy for 3 s in a
/// row, and returns the seconds waited: a local broker goes on working after a produce
/// (noida-db saves what it received, in bursts of a full core for a second or more, with
/// quiet gaps of a second between them), which would be measured as weir's. Without
/// `/proc/stat` it returns at once.
async fn settle() -> f64 {
    fn busy_idle() -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal
        let idle = cpu.get(3)? + cpu.get(4)?;
        Some((cpu.iter().take(8).sum::<u64>() - idle, idle))
    }
    let started = Instant::now();
    let mut quiet = 0;
    while quiet < 6 && started.elapsed() < Duration::from_secs(20) {
        let Some((b0, i0)) = busy_idle() else { break };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some((b1, i1)) = busy_idle() else { break };
        let (busy, idle) = (b1.saturating_sub(b0), i1.saturating_sub(i0));
        if busy * 100 <= 15 * (busy + idle).max(1) {
            quiet += 1;
        } else {
            quiet = 0;
        }
    }
    (started.elapsed().as_secs_f64() * 10.0).round() / 10.0
}

/// One read of the kafka scenario's topic by weir.
struct KafkaRun {
    seconds: f64,
    batches: usize,
    read_and_parse: f64,
    median_get_batch_ms: u64,
}

/// The worked example as shipped (`examples/orders_upsert.toml`), on `n` orders produced to
/// a new topic, 200,000 records per batch.
async fn example_scenario(work: &Path, bootstrap: &str, url: &str, n: usize) -> Result<()> {
    use crate::chaos::{EXAMPLE, Target, retarget};
    let dir = work.join("example");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let files: Vec<PathBuf> = generate(&GenArgs::new(
        dir.join("input"),
        100,
        n / 100,
        (n / 2) as u64,
        7,
    ))?
    .into_iter()
    .map(|w| w.path)
    .collect();
    let topic = format!("weir-bench-example-{}", std::process::id());
    weir_kafka::create_topic(bootstrap, &topic, 3).await?;
    crate::demo::produce_lines(bootstrap, &topic, 3, &files, 0, false).await?;
    let settled = settle().await;
    let path = dir.join("pipeline.toml");
    let mut pipeline: crate::pipeline::Pipeline = toml::from_str(EXAMPLE)?;
    retarget(
        &mut pipeline,
        &Target {
            dir: &dir,
            store: Location::local(&dir),
            feed: weir_core::connector::Feed::Kafka {
                brokers: bootstrap.to_string(),
                topic: topic.clone(),
            },
            postgres: Some(url),
            batch_rows: 200_000,
            retain: None,
        },
    )?;
    std::fs::write(&path, pipeline.to_toml()?)?;
    let pipeline = crate::pipeline::Pipeline::load(&path)?;
    let env = pipeline.env()?;
    for s in &pipeline.sinks {
        if let Some(r) = s.harness().verifier(&env)? {
            r.reset().await?;
        }
    }
    let started = Instant::now();
    // The rewritten file runs available-now, as `weir run` would run it.
    let writer = pipeline.writer().await?;
    let (seconds, progress, rows) = run_to_end(writer, started).await?;
    weir_kafka::delete_topic(bootstrap, &topic).await?;
    if rows != n as u64 {
        bail!("example: read {rows} records, produced {n}");
    }
    let busy: u64 = progress
        .iter()
        .map(|p| p.duration(Phase::TriggerExecution))
        .sum();
    let mut duration_ms = serde_json::Map::new();
    for key in weir_core::engine::DURATION_PHASES {
        let v = median(progress.iter().map(|p| p.duration(key)).collect());
        duration_ms.insert(key.into(), v.into());
    }
    let mut per_sink = serde_json::Map::new();
    let keys = std::iter::once(("cache".to_string(), CACHE_DURATION_KEY.to_string())).chain(
        pipeline.labels()?.into_iter().map(|l| {
            let key = format!("{l}.{}", SinkMetric::DurationMs.key());
            (l, key)
        }),
    );
    for (label, key) in keys {
        let v = median(
            progress
                .iter()
                .filter_map(|p| p.sink.metrics.get(&key)?.parse().ok())
                .collect(),
        );
        per_sink.insert(label, v.into());
    }
    // The floor is measured on a quiet machine too (the topic was just deleted).
    settle().await;
    let floor = postgres_floor(&dir, &files, 200_000, url)?;
    let floor_ms = median(floor.iter().map(|m| m.round() as u64).collect()) as f64;
    let trigger_ms = median(
        progress
            .iter()
            .map(|p| p.duration(Phase::TriggerExecution))
            .collect(),
    );
    println!(
        "{}",
        serde_json::json!({
            "scenario": "example",
            "records": rows,
            "batches": progress.len(),
            "seconds": (seconds * 1000.0).round() / 1000.0,
            "records_per_sec": (rows as f64 / (busy as f64 / 1000.0)).round(),
            "median_duration_ms": duration_ms,
            "median_sink_ms": per_sink,
            "per_batch": progress.iter().map(|p| {
                let mut m: serde_json::Map<String, serde_json::Value> = p
                    .duration_ms
                    .iter()
                    .filter(|(_, v)| **v > 0)
                    .map(|(k, v)| (k.clone(), (*v).into()))
                    .collect();
                for (k, v) in &p.sink.metrics {
                    if k.ends_with("durationMs") || k.ends_with("stageMs") {
                        m.insert(k.rsplit('/').next().unwrap_or(k).to_string(), v.clone().into());
                    }
                }
                serde_json::Value::Object(m)
            }).collect::<Vec<_>>(),
            "postgres_floor_ms_per_batch": floor.iter().map(|m| m.round()).collect::<Vec<_>>(),
            "median_postgres_floor_ms": floor_ms.round(),
            "trigger_over_postgres_floor": ((trigger_ms as f64 / floor_ms) * 100.0).round() / 100.0,
            "settled_after_produce_s": settled,
            "peak_rss_mb": peak_rss_mb(),
        })
    );
    Ok(())
}
