//! `weir soak`: runs a pipeline for many batches as its own `weir run` and samples, every
//! `--every` batches, the process's resident memory and the median `durationMs` of the
//! batches in that window, so that growth with the batch count shows as a table.
//!
//! The verdict follows the soak's rule: memory within 10% of its value at the end of the
//! first window, and the median `triggerExecution` of the last window within 1.5x of the
//! second (the first after warm-up).

use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;
use weir_core::engine::{DURATION_PHASES, Phase};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SoakArgs {
    /// The pipeline to run (give it `trigger = "0"` and a small per-trigger limit).
    pub pipeline: PathBuf,
    /// Stop (SIGTERM) once this many batches are committed.
    #[arg(long, default_value_t = 100_000)]
    pub batches: u64,
    /// Batches per sample.
    #[arg(long, default_value_t = 1_000)]
    pub every: u64,
    /// The `weir` binary to run (default: this one).
    #[arg(long)]
    pub weir: Option<PathBuf>,
    /// Print the samples as JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One window of `every` batches.
#[derive(Debug, Serialize)]
pub(crate) struct Sample {
    pub batches: u64,
    pub seconds: f64,
    pub rss_mb: f64,
    /// The private part of the resident memory (Linux `RssAnon`): the heap and stacks,
    /// without the binary's pages, which the kernel maps in as code paths are first run.
    pub anon_mb: f64,
    pub cpu_seconds: f64,
    pub batches_per_sec: f64,
    pub median_ms: serde_json::Map<String, Value>,
}

/// Resident memory (MB) and CPU time (s) of process `pid`.
fn usage(pid: u32) -> Option<(f64, f64)> {
    let p = weir_http::process_stats(&pid.to_string())?;
    Some((p.resident_bytes / 1024.0 / 1024.0, p.cpu_seconds))
}

/// Resident private memory (MB) of process `pid` (`RssAnon`; 0 where /proc has none).
fn anon_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("RssAnon:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) async fn run(args: SoakArgs) -> Result<()> {
    if args.every == 0 || args.batches < args.every {
        bail!("--every must be at least 1 and at most --batches");
    }
    let weir = match &args.weir {
        Some(w) => w.clone(),
        None => std::env::current_exe()?,
    };
    let progress = std::env::temp_dir().join(format!("weir-soak-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&progress);
    let mut child = Command::new(&weir)
        .arg("run")
        .arg(&args.pipeline)
        .arg("--quiet")
        .arg("--progress")
        .arg(&progress)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", weir.display()))?;
    let pid = child.id();
    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut window: Vec<Value> = Vec::new();
    let mut done = 0u64;
    let mut offset = 0u64;
    let mut last = started;
    if !args.json {
        println!(
            "| batches | seconds | RSS MB | anon MB | CPU s | batches/s | median ms: {} |",
            DURATION_PHASES.join(" / ")
        );
        println!("|---|---|---|---|---|---|---|");
    }
    let ended = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        let Ok(mut f) = std::fs::File::open(&progress) else {
            continue;
        };
        f.seek(SeekFrom::Start(offset))?;
        let mut reader = BufReader::new(f);
        let mut line = String::new();
        while reader.read_line(&mut line)? > 0 {
            if !line.ends_with('\n') {
                // Half a line: read it again next time.
                break;
            }
            offset += line.len() as u64;
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                window.push(v);
                done += 1;
            }
            line.clear();
            if window.len() as u64 == args.every {
                let (rss, cpu) = usage(pid).unwrap_or_default();
                let now = Instant::now();
                let mut median_ms = serde_json::Map::new();
                for p in DURATION_PHASES {
                    let m = crate::bench::median(
                        window
                            .iter()
                            .map(|v| v["durationMs"][p].as_u64().unwrap_or(0))
                            .collect(),
                    );
                    median_ms.insert(p.into(), m.into());
                }
                let s = Sample {
                    batches: done,
                    seconds: round1(now.duration_since(started).as_secs_f64()),
                    rss_mb: round1(rss),
                    anon_mb: round1(anon_mb(pid)),
                    cpu_seconds: round1(cpu),
                    batches_per_sec: round1(
                        args.every as f64 / now.duration_since(last).as_secs_f64(),
                    ),
                    median_ms,
                };
                last = now;
                if args.json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    let ms: Vec<String> = DURATION_PHASES
                        .iter()
                        .map(|p| s.median_ms[*p].to_string())
                        .collect();
                    println!(
                        "| {} | {} | {} | {} | {} | {} | {} |",
                        s.batches,
                        s.seconds,
                        s.rss_mb,
                        s.anon_mb,
                        s.cpu_seconds,
                        s.batches_per_sec,
                        ms.join(" / ")
                    );
                }
                samples.push(s);
                window.clear();
            }
        }
        if done >= args.batches {
            break None;
        }
    };
    if ended.is_none() {
        // Stop as an operator would: the batch in progress finishes and commits.
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let status = child.wait()?;
        if !status.success() {
            bail!("weir run ended with {status} after SIGTERM");
        }
    } else if let Some(status) = ended
        && !status.success()
    {
        bail!("weir run failed with {status} after {done} batches");
    }
    let _ = std::fs::remove_file(&progress);
    verdict(&samples, args.json)
}

/// Memory within 10% of the first sample, and the last window's median batch time within
/// 1.5x of the second window's.
fn verdict(samples: &[Sample], json: bool) -> Result<()> {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        bail!("fewer batches than one sample: nothing to compare");
    };
    let base = samples.get(1).unwrap_or(first);
    let t = |s: &Sample| {
        s.median_ms[Phase::TriggerExecution.as_str()]
            .as_u64()
            .unwrap_or(0)
            .max(1) as f64
    };
    let rss_ratio = last.rss_mb / first.rss_mb.max(0.1);
    let time_ratio = t(last) / t(base);
    let flat = rss_ratio <= 1.10 && time_ratio <= 1.5;
    let v = serde_json::json!({
        "batches": last.batches,
        "rss_first_mb": first.rss_mb,
        "rss_last_mb": last.rss_mb,
        "rss_ratio": (rss_ratio * 100.0).round() / 100.0,
        "anon_first_mb": first.anon_mb,
        "anon_last_mb": last.anon_mb,
        "trigger_ms_after_warmup": t(base),
        "trigger_ms_last": t(last),
        "time_ratio": (time_ratio * 100.0).round() / 100.0,
        "flat": flat,
    });
    if json {
        println!("{v}");
    } else {
        println!(
            "memory {} -> {} MB ({:.2}x; anon {} -> {} MB), median batch {} -> {} ms ({:.2}x): {}",
            first.rss_mb,
            last.rss_mb,
            rss_ratio,
            first.anon_mb,
            last.anon_mb,
            t(base),
            t(last),
            time_ratio,
            if flat { "flat" } else { "GROWS" }
        );
    }
    Ok(())
}
