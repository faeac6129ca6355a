//! Running `weir run` as a child and ending it: by itself, by a fault point, or by SIGKILL
//! after a delay. No polling: the exit and the kill timer are awaited together.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// It exited by itself with this status.
    Exited(ExitStatus),
    /// It was still running after the delay and got SIGKILL.
    Killed,
}

/// Starts `weir run <pipeline> --quiet --progress <log>.jsonl` with `WEIR_FAULT=fault`,
/// output to `<log>.log`.
pub(super) fn spawn(
    weir: &Path,
    pipeline: &Path,
    log: &Path,
    fault: Option<&str>,
    env: &[(&str, &str)],
) -> Result<Child> {
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
        .stderr(err)
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(f) = fault {
        cmd.env("WEIR_FAULT", f);
    }
    cmd.spawn()
        .with_context(|| format!("starting {}", weir.display()))
}

/// Waits for the child; with `kill_after`, sends SIGKILL when that passes first. A run that
/// goes on for `limit` is killed and reported as an error.
pub(super) async fn wait(
    child: &mut Child,
    kill_after: Option<Duration>,
    limit: Duration,
    log: &Path,
) -> Result<Ended> {
    let kill = async {
        match kill_after {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        status = child.wait() => Ok(Ended::Exited(status?)),
        () = kill => {
            child.kill().await?;
            Ok(Ended::Killed)
        }
        () = tokio::time::sleep(limit) => {
            child.kill().await?;
            bail!(
                "a run did not end within {} s; see {}",
                limit.as_secs(),
                log.with_extension("log").display()
            )
        }
    }
}

/// The last lines a run printed, for error messages.
pub(super) fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log.with_extension("log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}
