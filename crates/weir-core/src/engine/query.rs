//! The handle of a running query.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::progress::StreamingQueryProgress;
use crate::error::{Error, Result};

const RECENT_PROGRESS: usize = 100;

#[derive(Debug, Clone)]
pub(crate) enum Status {
    Active,
    Stopped,
    Failed(Arc<Error>),
}

/// State shared between the runner and the handles.
#[derive(Debug)]
pub(crate) struct Shared {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub name: String,
    pub status: watch::Sender<Status>,
    pub stop: watch::Sender<bool>,
    progress: Mutex<VecDeque<StreamingQueryProgress>>,
    /// The batch being run (u64::MAX before the first).
    current: AtomicU64,
}

impl Shared {
    pub(crate) fn new(id: uuid::Uuid, name: String) -> Self {
        Shared {
            id,
            run_id: uuid::Uuid::new_v4(),
            name,
            status: watch::channel(Status::Active).0,
            stop: watch::channel(false).0,
            progress: Mutex::new(VecDeque::new()),
            current: AtomicU64::new(u64::MAX),
        }
    }

    /// Records the batch being run, for errors that happen outside it.
    pub(crate) fn set_current_batch(&self, id: u64) {
        self.current.store(id, Ordering::Relaxed);
    }

    /// The batch being run, if one started.
    pub(crate) fn current_batch(&self) -> Option<u64> {
        let v = self.current.load(Ordering::Relaxed);
        (v != u64::MAX).then_some(v)
    }

    pub(crate) fn push_progress(&self, p: StreamingQueryProgress) {
        if let Ok(mut q) = self.progress.lock() {
            if q.len() == RECENT_PROGRESS {
                q.pop_front();
            }
            q.push_back(p);
        }
    }
}

/// A started query: Spark's `StreamingQuery`. Cheap to clone; all clones see the same query.
#[derive(Debug, Clone)]
pub struct StreamingQuery {
    pub(crate) shared: Arc<Shared>,
}

impl StreamingQuery {
    /// The query id: stable across restarts on the same checkpoint.
    pub fn id(&self) -> uuid::Uuid {
        self.shared.id
    }

    /// New for each start.
    pub fn run_id(&self) -> uuid::Uuid {
        self.shared.run_id
    }

    /// The query name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// True until the query stops or fails.
    pub fn is_active(&self) -> bool {
        matches!(*self.shared.status.borrow(), Status::Active)
    }

    /// The error the query failed with, if it did.
    pub fn exception(&self) -> Option<Arc<Error>> {
        match &*self.shared.status.borrow() {
            Status::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// The newest progress report.
    pub fn last_progress(&self) -> Option<StreamingQueryProgress> {
        self.shared
            .progress
            .lock()
            .ok()
            .and_then(|q| q.back().cloned())
    }

    /// Up to the last 100 progress reports, oldest first.
    pub fn recent_progress(&self) -> Vec<StreamingQueryProgress> {
        self.shared
            .progress
            .lock()
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Waits until the query ends. `Err` when it failed: `Error::QueryTerminated` whose
    /// source names the batch and the cause.
    pub async fn await_termination(&self) -> Result<()> {
        let mut rx = self.shared.status.subscribe();
        let status = rx
            .wait_for(|s| !matches!(s, Status::Active))
            .await
            .map(|s| s.clone())
            .unwrap_or(Status::Stopped);
        self.outcome(status)
    }

    /// Like `await_termination`, but gives up after `timeout`: `Ok(false)` if still running.
    pub async fn await_termination_timeout(&self, timeout: Duration) -> Result<bool> {
        match tokio::time::timeout(timeout, self.await_termination()).await {
            Ok(r) => r.map(|()| true),
            Err(_) => Ok(false),
        }
    }

    /// Asks the query to stop after the batch in progress (if any) and waits for it.
    /// A batch that is running is finished and committed, not cut off.
    pub async fn stop(&self) -> Result<()> {
        self.shared.stop.send_replace(true);
        self.await_termination().await
    }

    fn outcome(&self, status: Status) -> Result<()> {
        match status {
            Status::Failed(e) => Err(Error::QueryTerminated {
                name: self.shared.name.clone(),
                id: self.shared.id.to_string(),
                run_id: self.shared.run_id.to_string(),
                source: e,
            }),
            _ => Ok(()),
        }
    }
}
