//! One query per checkpoint: a file lock on a local disk, a lease on an object store.
//!
//! Locally, `<checkpoint>/.lock` is held with an exclusive OS lock (`flock`) for as long as
//! the query runs; the OS releases it when the process ends, however it ends, so a restart
//! after a crash never waits.
//!
//! On an object store, `<checkpoint>/_lease` holds the run id and an expiry and is written
//! with a conditional put: created if absent, renewed (every third of its time to live)
//! only if it still has the version this process wrote. A second query finding a lease
//! that is still being renewed is refused; a lease that stops changing for its whole time to
//! live belonged to a query that died, and is taken over. A query that finds its own lease
//! taken over stops before it writes another log entry.

use std::fs::{File, OpenOptions};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::storage::{FileVersion, Location, blocking};

const LEASE: &str = "_lease";
pub(super) const LOCK: &str = ".lock";

/// How long an object-store lease lives without renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// How long an object-store lease lives without renewal.
    pub ttl: Duration,
    /// How long a start waits for another process holding the checkpoint (its lock or a
    /// lease it renews) to let it go before it refuses; zero refuses at once.
    pub wait: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            ttl: Duration::from_secs(30),
            wait: Duration::ZERO,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Lease {
    run: String,
    host: String,
    pid: u32,
    ttl_ms: u64,
    expires_at_ms: i64,
}

/// What this process holds while its query runs.
#[derive(Debug)]
pub struct CheckpointGuard {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// The locked `.lock` file; the lock lives as long as the handle.
    Local(Mutex<Option<File>>),
    Lease(Arc<LeaseState>),
}

#[derive(Debug)]
struct LeaseState {
    version: Mutex<Option<FileVersion>>,
    lost: std::sync::atomic::AtomicBool,
    renewer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

impl CheckpointGuard {
    /// Takes the checkpoint at `root`, waiting up to `settings.wait` while another process
    /// holds it, or fails with `CheckpointInUse`.
    pub async fn acquire(root: &Location, settings: LeaseSettings) -> Result<Self> {
        let deadline = tokio::time::Instant::now() + settings.wait;
        let mut told = false;
        loop {
            match Self::try_acquire(root, settings).await {
                Err(Error::CheckpointInUse { detail, .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    if !told {
                        tracing::warn!(
                            checkpoint = %root,
                            "waiting up to {} ms (lease-wait) for the checkpoint: {detail}",
                            settings.wait.as_millis()
                        );
                        told = true;
                    }
                    let left = deadline - tokio::time::Instant::now();
                    tokio::time::sleep(left.min(Duration::from_millis(250))).await;
                }
                other => return other,
            }
        }
    }

    async fn try_acquire(root: &Location, settings: LeaseSettings) -> Result<Self> {
        match root.local_path() {
            Some(dir) => {
                let path = dir.join(LOCK);
                let shown = root.to_string();
                let file = blocking(move || {
                    let f = OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&path)
                        .map_err(|e| Error::io("opening the lock file", &path, e))?;
                    match f.try_lock() {
                        // A refused first start removes the checkpoint while it holds the
                        // lock: a lock taken on a file that is gone is not the checkpoint's.
                        Ok(()) => {
                            use std::os::unix::fs::MetadataExt;
                            let held = f
                                .metadata()
                                .map_err(|e| Error::io("looking at", &path, e))?;
                            match std::fs::metadata(&path) {
                                Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => {
                                    Ok(f)
                                }
                                _ => Err(Error::CheckpointInUse {
                                    dir: shown,
                                    detail: format!(
                                        "{} was removed while this start opened it (a refused \
                                         start undid the checkpoint it had made); start again",
                                        path.display()
                                    ),
                                }),
                            }
                        }
                        Err(std::fs::TryLockError::WouldBlock) => Err(Error::CheckpointInUse {
                            dir: shown,
                            detail: format!("{} is locked by a running process", path.display()),
                        }),
                        Err(std::fs::TryLockError::Error(e)) => Err(Error::io("locking", &path, e)),
                    }
                })
                .await?;
                Ok(CheckpointGuard {
                    kind: Kind::Local(Mutex::new(Some(file))),
                })
            }
            None => Self::acquire_lease(root, settings).await,
        }
    }

    fn lease_bytes(run: &str, settings: LeaseSettings) -> Result<Bytes> {
        let ttl_ms = settings.ttl.as_millis() as u64;
        let lease = Lease {
            run: run.to_string(),
            host: host(),
            pid: std::process::id(),
            ttl_ms,
            expires_at_ms: now_ms() + ttl_ms as i64,
        };
        serde_json::to_vec(&lease)
            .map(Bytes::from)
            .map_err(|e| Error::Internal {
                what: format!("serializing the lease: {e}"),
            })
    }

    async fn acquire_lease(root: &Location, settings: LeaseSettings) -> Result<Self> {
        let run = uuid::Uuid::new_v4().to_string();
        let in_use = |detail: String| Error::CheckpointInUse {
            dir: root.to_string(),
            detail,
        };
        let mut version = root
            .put_if(LEASE, Self::lease_bytes(&run, settings)?, None)
            .await?;
        if version.is_none() {
            let Some((bytes, seen)) = root.get_versioned(LEASE).await? else {
                return Err(in_use(
                    "its lease vanished while it was being read; retry".into(),
                ));
            };
            let held: Option<Lease> = serde_json::from_slice(&bytes).ok();
            let wait = match &held {
                // Clearly expired: the holder stopped renewing it.
                Some(l) if l.expires_at_ms < now_ms() => Duration::ZERO,
                Some(l) => Duration::from_millis(l.ttl_ms.max(1)),
                None => settings.ttl,
            };
            if !wait.is_zero() {
                // Still within its time: see whether its holder renews it.
                tokio::time::sleep(wait).await;
                match root.get_versioned(LEASE).await? {
                    Some((_, now)) if now != seen => {
                        let who = held
                            .map(|l| format!("run {} of pid {} on {}", l.run, l.pid, l.host))
                            .unwrap_or_else(|| "another process".into());
                        return Err(in_use(format!(
                            "its lease {} is held and renewed by {who}",
                            root.describe(LEASE)
                        )));
                    }
                    _ => {}
                }
            }
            version = root
                .put_if(LEASE, Self::lease_bytes(&run, settings)?, Some(&seen))
                .await?;
            if version.is_none() {
                return Err(in_use(format!(
                    "another process took over the lease {} at the same moment",
                    root.describe(LEASE)
                )));
            }
            tracing::warn!(
                checkpoint = %root,
                "took over the lease of a query that stopped renewing it (it died)"
            );
        }
        let state = Arc::new(LeaseState {
            version: Mutex::new(version),
            lost: std::sync::atomic::AtomicBool::new(false),
            renewer: Mutex::new(None),
        });
        let task = {
            let state = state.clone();
            let root = root.clone();
            tokio::spawn(async move {
                let every = settings.ttl / 3;
                loop {
                    tokio::time::sleep(every).await;
                    let current = state.version.lock().ok().and_then(|v| v.clone());
                    let Some(current) = current else { return };
                    let Ok(bytes) = Self::lease_bytes(&run, settings) else {
                        return;
                    };
                    match root.put_if(LEASE, bytes, Some(&current)).await {
                        Ok(Some(v)) => {
                            if let Ok(mut g) = state.version.lock() {
                                *g = Some(v);
                            }
                        }
                        Ok(None) => {
                            tracing::error!(checkpoint = %root, "the checkpoint lease was taken over by another query; this query stops before its next log write");
                            state.lost.store(true, std::sync::atomic::Ordering::SeqCst);
                            return;
                        }
                        // A network error: try again at the next turn; the lease outlives
                        // two missed renewals.
                        Err(e) => {
                            tracing::warn!(checkpoint = %root, "renewing the lease failed: {e}")
                        }
                    }
                }
            })
        };
        if let Ok(mut r) = state.renewer.lock() {
            *r = Some(task);
        }
        Ok(CheckpointGuard {
            kind: Kind::Lease(state),
        })
    }

    /// Fails when the lease was lost.
    pub fn ensure_held(&self, root: &Location) -> Result<()> {
        match &self.kind {
            Kind::Local(_) => Ok(()),
            Kind::Lease(s) if s.lost.load(std::sync::atomic::Ordering::SeqCst) => {
                Err(Error::CheckpointInUse {
                    dir: root.to_string(),
                    detail: format!("this query's lease {} was taken over", root.describe(LEASE)),
                })
            }
            Kind::Lease(_) => Ok(()),
        }
    }

    /// Releases the lock, or stops renewing and deletes the lease.
    pub async fn release(&self, root: &Location) {
        match &self.kind {
            Kind::Local(f) => {
                if let Ok(mut f) = f.lock() {
                    // Dropping the handle releases the OS lock.
                    f.take();
                }
            }
            Kind::Lease(s) => {
                if let Some(t) = s.renewer.lock().ok().and_then(|mut r| r.take()) {
                    t.abort();
                }
                let held = s.version.lock().ok().and_then(|mut v| v.take());
                if held.is_some() && !s.lost.load(std::sync::atomic::Ordering::SeqCst) {
                    // Best effort: an undeleted lease expires by itself.
                    if let Err(e) = root.delete(LEASE).await {
                        tracing::warn!(checkpoint = %root, "deleting the lease failed: {e}");
                    }
                }
            }
        }
    }
}

impl Drop for CheckpointGuard {
    fn drop(&mut self) {
        // The renewal task holds the state: stop it, or the lease would be renewed forever.
        if let Kind::Lease(s) = &self.kind
            && let Some(t) = s.renewer.lock().ok().and_then(|mut r| r.take())
        {
            t.abort();
        }
    }
}
