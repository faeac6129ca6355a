use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use datafusion::prelude::SessionContext;

/// What the function knows about the batch it is called for.
#[derive(Clone)]
pub struct BatchContext {
    /// The query id from `<checkpoint>/metadata`: the same across restarts.
    pub query_id: uuid::Uuid,
    /// New each time the query starts.
    pub run_id: uuid::Uuid,
    /// The query name (`query_name(..)`), stable across restarts.
    pub query_name: String,
    /// The batch id: a replay after a crash carries the same id.
    pub batch_id: u64,
    /// When the batch was first planned (ms since the epoch); a replay has the same value,
    /// so use it rather than the clock for anything written with the rows.
    pub batch_timestamp_ms: i64,
    /// The DataFusion session the batch was planned on; run further SQL on it.
    pub session: SessionContext,
    /// True when this batch was planned by an earlier run and is being run again.
    pub is_replay: bool,
    /// True when this run created the checkpoint (batch ids start at 0 for the first time).
    pub checkpoint_is_new: bool,
    /// Counters the sinks fill in; they show up in the batch's progress.
    pub metrics: Arc<SinkMetrics>,
}

impl BatchContext {
    /// The default application id for idempotent sinks: the query name and the query id,
    /// so a new checkpoint (batch ids from 0 again) never collides with an old one's
    /// versions.
    pub fn app_id(&self) -> String {
        format!("{}-{}", self.query_name, self.query_id)
    }
}

impl std::fmt::Debug for BatchContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchContext")
            .field("query_id", &self.query_id)
            .field("query_name", &self.query_name)
            .field("batch_id", &self.batch_id)
            .field("is_replay", &self.is_replay)
            .finish_non_exhaustive()
    }
}

/// Per-batch sink counters. Skips must never be silent: a sink that finds the batch
/// already written says so here, and the progress report carries it.
#[derive(Debug)]
pub struct SinkMetrics {
    output_rows: AtomicI64,
    skipped: AtomicU64,
    notes: Mutex<Vec<(String, String)>>,
}

impl Default for SinkMetrics {
    fn default() -> Self {
        SinkMetrics {
            output_rows: AtomicI64::new(-1),
            skipped: AtomicU64::new(0),
            notes: Mutex::new(Vec::new()),
        }
    }
}

impl SinkMetrics {
    /// Adds `rows` written by a sink to the batch's `numOutputRows`.
    pub fn add_output_rows(&self, rows: u64) {
        let rows = i64::try_from(rows).unwrap_or(i64::MAX);
        let _ = self
            .output_rows
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.max(0).saturating_add(rows))
            });
    }

    /// A sink found the batch already written and skipped it.
    pub fn add_skipped(&self, sink: &str) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
        self.note(format!("{sink}.skipped"), "true".into());
    }

    /// A sink-specific figure for the progress report (`sink.metrics`).
    pub fn note(&self, key: String, value: String) {
        if let Ok(mut n) = self.notes.lock() {
            n.retain(|(k, _)| *k != key);
            n.push((key, value));
        }
    }

    /// Rows the sinks reported writing, or -1 when none reported (as Spark's foreachBatch).
    pub fn output_rows(&self) -> i64 {
        self.output_rows.load(Ordering::Relaxed)
    }

    /// How many sink writes were skipped as already done.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// The notes, in the order they were made.
    pub fn notes(&self) -> Vec<(String, String)> {
        self.notes.lock().map(|n| n.clone()).unwrap_or_default()
    }
}
