//! `weir`: run pipelines from TOML, the demo, benchmarks and checkpoint tools.

mod bench;
mod chaos;
mod demo;
mod generate;
mod malloc;
mod pipeline;
mod report;
mod show;
mod soak;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "weir",
    version,
    about = "Micro-batch stream processing with exactly-once sinks"
)]
struct Cli {
    /// Log lines as text or as JSON objects (one per line, with the query name and batch id
    /// as fields of every line about a batch).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Runs a pipeline described in a TOML file.
    Run {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Writes each batch's progress as a JSON line to this file (`-`: stdout).
        #[arg(long)]
        progress: Option<String>,
        /// Prints no per-batch line.
        #[arg(long)]
        quiet: bool,
        /// On SIGTERM or Ctrl-C the batch in progress is finished and committed; if it takes
        /// longer than this, weir stops without it (it runs again on the next start). A
        /// second signal stops at once.
        #[arg(long, default_value = "60s")]
        stop_grace: String,
        /// Serves /metrics (Prometheus), /healthz, /readyz, /api/progress and a live page
        /// at this address (e.g. 127.0.0.1:9464). Off by default.
        #[arg(long)]
        http: Option<String>,
        /// With --http: every path but /healthz and the page needs `Authorization: Bearer
        /// <token>`; give `env:NAME` to read it from the environment. Open the page as
        /// /#token=<token>.
        #[arg(long, requires = "http")]
        http_token: Option<String>,
        /// /readyz fails when no batch ended for this many trigger intervals (and at least
        /// a minute) while the query was not waiting for data.
        #[arg(long, default_value_t = 10)]
        stall_intervals: u32,
        /// /readyz fails while a source is more than this many records behind the last
        /// batch's end (sources that count records: Kafka). No limit by default.
        #[arg(long)]
        max_records_behind: Option<u64>,
        /// /readyz fails while a source has had a backlog for longer than this (e.g. 10m):
        /// every batch since ended before the source's newest offset. No limit by default.
        #[arg(long)]
        max_behind: Option<String>,
    },
    /// Runs a worker: executes the plan stages that drivers (`weir run` of a pipeline with
    /// `[cluster]`) send. It keeps no state; stop it with SIGTERM or Ctrl-C.
    Worker {
        /// The address to listen on, e.g. 0.0.0.0:7400 (port 0: a free port, printed).
        #[arg(long)]
        listen: String,
        /// The cluster token drivers must send, or env:NAME to read it from the
        /// environment. Without it, any driver of the same weir version is served.
        #[arg(long)]
        token: Option<String>,
        /// Serve TLS with this certificate (PEM); drivers then list this worker as
        /// https://host:port and check it against their `[cluster] tls-ca`.
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The certificate's private key (PEM).
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// The CA certificate (PEM) that the other workers' certificates are checked
        /// against (a shuffle reads from them); default: --tls-cert itself.
        #[arg(long, requires = "tls_cert")]
        tls_ca: Option<PathBuf>,
        /// The name the other workers' certificates carry, when it is not the host dialled.
        #[arg(long, requires = "tls_cert")]
        tls_domain: Option<String>,
    },
    /// Checks a pipeline file without running it: keys, values, paths, secrets.
    Check {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Also reaches every place and server the pipeline uses (checkpoint, source, sinks,
        /// workers), writing nothing, and says what it found; exits 1 if one cannot be
        /// reached.
        #[arg(long)]
        connect: bool,
    },
    /// Writes a set of order files and runs the seed's orders pipeline on them:
    /// files -> newest row per order_id -> Delta MERGE (and Parquet).
    Demo(demo::DemoArgs),
    /// Writes reproducible order files.
    Gen(generate::GenArgs),
    /// Measures per-batch fixed cost and throughput; prints one JSON line per scenario.
    Bench(bench::BenchArgs),
    /// Kills a pipeline (the worked example by default) again and again, at random moments
    /// and at fault points, then checks every sink against the input.
    Chaos(chaos::ChaosArgs),
    /// Runs a pipeline for many batches and samples memory and batch time as they pass.
    Soak(soak::SoakArgs),
    /// Looks at a checkpoint folder.
    Checkpoint {
        #[command(subcommand)]
        command: CheckpointCommand,
    },
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Batches, the pending one, offsets and files per batch: of a checkpoint folder or
    /// URL, or of the checkpoint a pipeline file (`.toml`) names, with its `[storage]`.
    Show {
        /// The checkpoint (a folder or a URL such as s3://bucket/chk), or a pipeline file.
        dir: String,
        /// An object-store setting, as in a pipeline's `[storage]` (repeatable): e.g.
        /// --storage aws_endpoint=http://127.0.0.1:5000 --storage aws_access_key_id=env:KEY.
        #[arg(long = "storage", value_name = "KEY=VALUE")]
        storage: Vec<String>,
    },
}

/// `--log-format json`: every line on stderr is a JSON object, the notices below too.
static JSON_LOGS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A line of the binary's own for a person (where it listens, a signal, the final error,
/// each of `causes` on a line of its own after it), or with `--log-format json` one JSON
/// object of the logs' shape (`timestamp`, `level`, `target`, `fields.message`, and
/// `fields.causes` and `fields.batch_id` when there are).
fn notice(level: &str, message: &str, causes: &[String], batch_id: Option<u64>) {
    if JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed) {
        let mut fields = serde_json::json!({ "message": message });
        if !causes.is_empty() {
            fields["causes"] = serde_json::json!(causes);
        }
        if let Some(b) = batch_id {
            fields["batch_id"] = serde_json::json!(b);
        }
        let line = serde_json::json!({
            "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            "level": level,
            "target": "weir",
            "fields": fields,
        });
        say_err(&line.to_string());
    } else {
        say_err(message);
        for c in causes {
            say_err(&format!("  caused by: {c}"));
        }
    }
}

/// A line on stderr; a stderr that went away drops it (a panicking `eprintln!` there killed
/// the task that handles signals, and SIGTERM was then ignored).
fn say_err(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Whether log lines carry ANSI colours: stderr is a terminal and `NO_COLOR` is unset or
/// empty.
fn colour_on(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

fn main() -> ExitCode {
    let malloc = malloc::limit_retention();
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                // delta-rs logs an ERROR when it opens a table that does not exist yet (the
                // first write creates it) and a WARN per MERGE about a metric name.
                tracing_subscriber::EnvFilter::new(
                    "warn,buoyant_kernel::snapshot=off,deltalake_core::operations::merge=error",
                )
            }),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, and never under NO_COLOR
        // (https://no-color.org): a log file or a collector gets plain text.
        .with_ansi(colour_on(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR"),
        ));
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => {
            JSON_LOGS.store(true, std::sync::atomic::Ordering::Relaxed);
            logs.json().with_current_span(true).init()
        }
    }
    tracing::debug!("{malloc}");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            notice(
                "ERROR",
                &format!("error: cannot start the async runtime: {e}"),
                &[],
                None,
            );
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Library errors often end their own text with their source's (DataFusion's
            // wrap theirs twice): a cause the line before ended with is left out.
            let mut causes = Vec::new();
            let mut said = e.to_string();
            for cause in e.chain().skip(1) {
                let text = cause.to_string();
                if !said.ends_with(&text) {
                    causes.push(text.clone());
                }
                said = text;
            }
            // The batch it is about, as a field of its own in JSON.
            let batch = e
                .chain()
                .find_map(|c| weir_core::error::as_engine_error(c)?.batch_id());
            notice("ERROR", &format!("error: {e}"), &causes, batch);
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Run {
            pipeline,
            progress,
            quiet,
            stop_grace,
            http,
            http_token,
            stall_intervals,
            max_records_behind,
            max_behind,
        } => {
            let grace = weir_core::engine::trigger::parse_duration("--stop-grace", &stop_grace)?;
            let seconds = max_behind
                .map(|t| weir_core::engine::trigger::parse_duration("--max-behind", &t))
                .transpose()?
                .map(|d| d.as_secs());
            let opts = RunOptions {
                progress,
                quiet,
                grace,
                http,
                http_token: http_token
                    .map(|t| weir_core::connector::secret("--http-token", &t))
                    .transpose()?,
                stall_intervals,
                lag: weir_http::LagLimits {
                    records: max_records_behind,
                    seconds,
                },
            };
            run_pipeline(&pipeline, &opts).await
        }
        Command::Check { pipeline, connect } => {
            let p = pipeline::Pipeline::load(&pipeline)?;
            let transform = p
                .check_transform()
                .await
                .with_context(|| pipeline.display().to_string())?;
            println!(
                "{}: ok: {} source, sinks: {}{}",
                pipeline.display(),
                p.source.kind(),
                p.labels()?.join(", "),
                transform.map(|t| format!("; {t}")).unwrap_or_default()
            );
            if connect {
                let found = p.probe().await?;
                let failed = found.iter().filter(|(_, r)| r.is_err()).count();
                for (what, outcome) in &found {
                    match outcome {
                        Ok(text) => println!("  reached  {what}: {text}"),
                        Err(e) => println!("  FAILED   {what}: {e}"),
                    }
                }
                if failed > 0 {
                    anyhow::bail!(
                        "{}: {failed} of {} places cannot be reached (see FAILED above)",
                        pipeline.display(),
                        found.len()
                    );
                }
            }
            Ok(())
        }
        Command::Worker {
            listen,
            token,
            tls_cert,
            tls_key,
            tls_ca,
            tls_domain,
        } => {
            let tls = match (&tls_cert, &tls_key) {
                (Some(cert), Some(key)) => Some(weir_cluster::tls::WorkerTls::from_files(
                    cert,
                    key,
                    tls_ca.as_deref(),
                    tls_domain.as_deref(),
                )?),
                _ => None,
            };
            run_worker(&listen, token.as_deref(), tls).await
        }
        Command::Demo(args) => demo::run(args).await,
        Command::Gen(args) => {
            let files = generate::generate(&args)?;
            println!("wrote {} files to {}", files.len(), args.dir.display());
            if let (Some(brokers), Some(topic)) = (&args.kafka, &args.topic) {
                weir_kafka::create_topic(brokers, topic, args.partitions).await?;
                let paths: Vec<_> = files.iter().map(|w| w.path.clone()).collect();
                let sent =
                    demo::produce_lines(brokers, topic, args.partitions, &paths, 0, false).await?;
                println!(
                    "produced {sent} records to {topic} ({} partitions)",
                    args.partitions
                );
            }
            Ok(())
        }
        Command::Bench(args) => bench::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Soak(args) => soak::run(args).await,
        Command::Checkpoint {
            command: CheckpointCommand::Show { dir, storage },
        } => show::show(&dir, &storage).await,
    }
}

/// How `weir run` runs a pipeline.
struct RunOptions {
    progress: Option<String>,
    quiet: bool,
    grace: std::time::Duration,
    http: Option<String>,
    http_token: Option<String>,
    stall_intervals: u32,
    lag: weir_http::LagLimits,
}

async fn run_pipeline(path: &std::path::Path, opts: &RunOptions) -> Result<()> {
    let grace = opts.grace;
    let pipeline = pipeline::Pipeline::load(path)?;
    // A misspelt column or function in the SQL stops here, before the checkpoint is
    // opened or a batch recorded, as `weir check` would.
    pipeline
        .check_transform()
        .await
        .with_context(|| path.display().to_string())?;
    let mut writer = pipeline.writer().await?;
    if let Some(p) = &opts.progress {
        writer = writer.listener(Arc::new(report::JsonLines::open(p)?));
    }
    if !opts.quiet {
        writer = writer.listener(Arc::new(report::HumanLines));
    }
    // Bound before the query starts: a busy port stops here, before any batch runs.
    let _endpoint = match &opts.http {
        Some(addr) => {
            let interval = std::time::Duration::from_millis(pipeline.trigger()?.interval_ms());
            let stall = (interval * opts.stall_intervals).max(std::time::Duration::from_secs(60));
            let monitor = Arc::new(
                weir_http::Monitor::new(&pipeline.query.name, interval, stall)
                    .with_lag_limits(opts.lag),
            );
            let endpoint =
                weir_http::serve_with_token(addr, monitor.clone(), opts.http_token.clone()).await?;
            notice(
                "INFO",
                &format!(
                    "weir: monitoring at http://{} (/metrics, /healthz, /readyz, /api/progress, /api/status)",
                    endpoint.addr()
                ),
                &[],
                None,
            );
            writer = writer.listener(monitor);
            Some(endpoint)
        }
        None => None,
    };
    // Signals are caught before the query starts, so a SIGTERM during start-up is not lost.
    let mut signals = Signals::new()?;
    // A signal while the start waits (for the checkpoint with `lease-wait`, or for a
    // server) stops it there: no batch has begun, so there is nothing to finish.
    let query = tokio::select! {
        q = writer.start() => {
            q.with_context(|| format!("starting query '{}'", pipeline.query.name))?
        }
        first = signals.next() => {
            notice(
                "WARN",
                &format!("{first} while starting: stopped before any batch began"),
                &[],
                None,
            );
            return Ok(());
        }
    };
    let stop = query.clone();
    tokio::spawn(async move {
        let first = signals.next().await;
        notice(
            "WARN",
            &format!(
                "{first}: stopping after the current batch (at most {}; a second signal stops now)",
                weir_core::connector::DurationText(grace)
            ),
            &[],
            None,
        );
        let stopping = stop.clone();
        tokio::spawn(async move {
            let _ = stopping.stop().await;
        });
        let why = tokio::select! {
            second = signals.next() => format!("{second} again"),
            () = tokio::time::sleep(grace) => format!("the batch did not finish within {}", weir_core::connector::DurationText(grace)),
        };
        notice(
            "WARN",
            &format!(
                "{why}: stopping now; the batch in progress is not committed and runs again, \
                 with the same id and input, on the next start"
            ),
            &[],
            None,
        );
        std::process::exit(if first == "SIGINT" { 130 } else { 143 });
    });
    query.await_termination().await?;
    Ok(())
}

/// `weir worker`: serves until SIGTERM or Ctrl-C.
async fn run_worker(
    listen: &str,
    token: Option<&str>,
    tls: Option<weir_cluster::tls::WorkerTls>,
) -> Result<()> {
    let token = token
        .map(|t| weir_core::connector::secret("--token", t))
        .transpose()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("--listen {listen}: cannot listen there"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    notice(
        "INFO",
        &format!(
            "weir worker: listening on {}://{addr} (weir {}, {})",
            if tls.is_some() { "https" } else { "http" },
            weir_cluster::VERSION,
            if token.is_some() {
                "token required"
            } else {
                "no token"
            }
        ),
        &[],
        None,
    );
    let mut signals = Signals::new()?;
    weir_cluster::worker::serve(listener, token, weir::config::NODES, tls, async move {
        let why = signals.next().await;
        notice("INFO", &format!("weir worker: {why}: stopping"), &[], None);
    })
    .await?;
    Ok(())
}

/// SIGTERM and SIGINT (Ctrl-C), as one stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
        })
    }

    /// The name of the next signal.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::colour_on;

    #[test]
    fn log_lines_are_coloured_only_at_a_terminal_without_no_color() {
        let cases = [
            (true, None, true),
            (false, None, false),
            (true, Some("1"), false),
            (false, Some("1"), false),
            // An empty NO_COLOR does not count (no-color.org).
            (true, Some(""), true),
        ];
        for (terminal, no_color, want) in cases {
            assert_eq!(
                colour_on(terminal, no_color.map(std::ffi::OsString::from)),
                want,
                "terminal {terminal}, NO_COLOR {no_color:?}"
            );
        }
    }
}
