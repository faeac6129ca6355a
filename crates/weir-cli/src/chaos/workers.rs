//! `weir chaos --workers N`: the pipeline's batches run on N `weir worker` processes started
//! here (a `[cluster]` on loopback), and the kills hit them too. A worker is SIGKILLed at a
//! random moment of a run and started again on its port when the run ends, so the next
//! batch (or the next attempt of the same batch) finds it back.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// One `weir worker` child.
struct Worker {
    child: Child,
    /// `host:port` it listens on (kept across restarts).
    addr: String,
}

/// The workers of a chaos run.
pub(super) struct Workers {
    weir: PathBuf,
    logs: PathBuf,
    all: Vec<Worker>,
    /// Starts so far, for log names.
    starts: usize,
}

impl Workers {
    /// Starts `n` workers on free loopback ports; their output goes to `logs/worker-*.log`.
    pub(super) async fn start(weir: &Path, logs: &Path, n: usize) -> Result<Workers> {
        let mut w = Workers {
            weir: weir.to_path_buf(),
            logs: logs.to_path_buf(),
            all: Vec::new(),
            starts: 0,
        };
        for _ in 0..n {
            let worker = w.spawn("127.0.0.1:0").await?;
            w.all.push(worker);
        }
        Ok(w)
    }

    /// The workers' URLs, for `[cluster] workers`.
    pub(super) fn urls(&self) -> Vec<String> {
        self.all
            .iter()
            .map(|w| format!("http://{}", w.addr))
            .collect()
    }

    pub(super) fn len(&self) -> usize {
        self.all.len()
    }

    /// SIGKILLs worker `i`; false if it had already exited.
    pub(super) async fn kill(&mut self, i: usize) -> Result<bool> {
        let w = &mut self.all[i];
        if w.child.try_wait()?.is_some() {
            return Ok(false);
        }
        w.child.kill().await?;
        Ok(true)
    }

    /// Starts again every worker that is not running, each on its old address.
    pub(super) async fn revive(&mut self) -> Result<usize> {
        let mut revived = 0;
        for i in 0..self.all.len() {
            if self.all[i].child.try_wait()?.is_some() {
                let addr = self.all[i].addr.clone();
                self.all[i] = self.spawn_retrying(&addr).await?;
                revived += 1;
            }
        }
        Ok(revived)
    }

    /// A worker on `addr`, retried for a few seconds while the old one's port is released.
    async fn spawn_retrying(&mut self, addr: &str) -> Result<Worker> {
        let mut last = None;
        for _ in 0..50 {
            match self.spawn(addr).await {
                Ok(w) => return Ok(w),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last.unwrap_or_else(|| anyhow!("starting a worker on {addr}")))
    }

    /// `weir worker --listen addr`, once it says where it listens.
    async fn spawn(&mut self, addr: &str) -> Result<Worker> {
        self.starts += 1;
        let log = self.logs.join(format!("worker-{:03}.log", self.starts));
        let mut child = Command::new(&self.weir)
            .args(["worker", "--listen", addr])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} worker", self.weir.display()))?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| anyhow!("the worker's stderr is not piped"))?;
        let mut lines = BufReader::new(stderr).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| anyhow!("a worker on {addr} said nothing within 30 s"))??
            .ok_or_else(|| anyhow!("a worker on {addr} exited before listening"))?;
        let Some(bound) = first
            .split("listening on http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        else {
            let _ = child.kill().await;
            return Err(anyhow!("a worker on {addr} did not start: {first}"));
        };
        let bound = bound.to_string();
        // Its later lines go to its log, so that it never blocks on a full pipe.
        let mut file = tokio::fs::File::create(&log).await?;
        file.write_all(format!("{first}\n").as_bytes()).await?;
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if file
                    .write_all(format!("{line}\n").as_bytes())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        Ok(Worker { child, addr: bound })
    }
}
