use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use datafusion::prelude::SessionContext;

/// What the function knows about the batch it is called for.
///
/// Built by the engine; tests and tools build one with [`BatchContext::new`].
#[derive(Clone)]
#[non_exhaustive]
pub struct BatchContext {
    /// The query id from `<checkpoint>/metadata`: the same across restarts.
    pub query_id: uuid::Uuid,
    /// New each time the query starts.
    pub run_id: uuid::Uuid,
    /// The query name (`query_name(..)`) of this run.
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
    /// The name the query had when its checkpoint was created: part of the default app id,
    /// so renaming a query never changes it (a pending batch would be written twice).
    app_name: String,
}

impl BatchContext {
    /// Batch `batch_id` of query `name` with id `query_id`: a first attempt, on a fresh
    /// session, with empty metrics. For tests and tools; the engine fills in the rest.
    pub fn new(query_id: uuid::Uuid, name: impl Into<String>, batch_id: u64) -> Self {
        Self::on_session(query_id, name, batch_id, SessionContext::new())
    }

    /// [`BatchContext::new`] on `session` (the engine's: a new session per batch cost more
    /// than the rest of a 10-row batch's planning).
    pub(crate) fn on_session(
        query_id: uuid::Uuid,
        name: impl Into<String>,
        batch_id: u64,
        session: SessionContext,
    ) -> Self {
        let name = name.into();
        BatchContext {
            query_id,
            run_id: uuid::Uuid::new_v4(),
            app_name: name.clone(),
            query_name: name,
            batch_id,
            batch_timestamp_ms: chrono::Utc::now().timestamp_millis(),
            session,
            is_replay: false,
            checkpoint_is_new: batch_id == 0,
            metrics: Arc::new(SinkMetrics::default()),
        }
    }

    /// Marks the batch as a replay (planned by an earlier run).
    pub fn replay(mut self, yes: bool) -> Self {
        self.is_replay = yes;
        self
    }

    /// Sets whether this run created the checkpoint.
    pub fn new_checkpoint(mut self, yes: bool) -> Self {
        self.checkpoint_is_new = yes;
        self
    }

    /// Uses this DataFusion session.
    pub fn with_session(mut self, session: SessionContext) -> Self {
        self.session = session;
        self
    }

    /// The run id and the planned time (the engine sets these).
    pub(crate) fn with_run(mut self, run_id: uuid::Uuid, batch_timestamp_ms: i64) -> Self {
        self.run_id = run_id;
        self.batch_timestamp_ms = batch_timestamp_ms;
        self
    }

    /// The name recorded with the checkpoint, for the default app id.
    pub fn with_app_name(mut self, name: impl Into<String>) -> Self {
        self.app_name = name.into();
        self
    }

    /// The default application id for idempotent sinks: the query's name when its
    /// checkpoint was created, and the query id, so a new checkpoint (batch ids from 0
    /// again) never collides with an old one's versions, and renaming the query does not
    /// change it.
    pub fn app_id(&self) -> String {
        self.query().default_app_id()
    }

    /// The query this batch belongs to, for app ids.
    pub fn query(&self) -> QueryIdentity {
        QueryIdentity {
            query_id: self.query_id,
            app_name: self.app_name.clone(),
        }
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

/// A figure a sink reports for one batch. Serialized in the progress report's
/// `sink.metrics` as `<sink label>.<key>`; read back with [`SinkMetric::parse_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SinkMetric {
    /// The sink found the batch already written and skipped it (`true`).
    Skipped,
    /// ms the sink took (a fan-out records it per sink).
    DurationMs,
    /// ms the sink's staging took, beside the sinks before it (a fan-out records it).
    StageMs,
    /// The table version the batch's commit made (Delta).
    Version,
    /// Rows inserted (MERGE / upsert).
    Inserted,
    /// Rows updated (MERGE / upsert).
    Updated,
    /// Rows the sink wrote.
    Rows,
    /// Rows dropped by the sink (e.g. NULL keys with `null-keys = "drop"`).
    Dropped,
    /// Stored rows deleted (MERGE / upsert of a batch with `_deleted`).
    Deleted,
}

impl SinkMetric {
    /// Every metric, for parsing.
    pub const ALL: [SinkMetric; 9] = [
        SinkMetric::Skipped,
        SinkMetric::DurationMs,
        SinkMetric::StageMs,
        SinkMetric::Version,
        SinkMetric::Inserted,
        SinkMetric::Updated,
        SinkMetric::Rows,
        SinkMetric::Dropped,
        SinkMetric::Deleted,
    ];

    /// The key suffix in `sink.metrics`.
    pub fn key(self) -> &'static str {
        match self {
            SinkMetric::Skipped => "skipped",
            SinkMetric::DurationMs => "durationMs",
            SinkMetric::StageMs => "stageMs",
            SinkMetric::Version => "version",
            SinkMetric::Inserted => "inserted",
            SinkMetric::Updated => "updated",
            SinkMetric::Rows => "rows",
            SinkMetric::Dropped => "dropped",
            SinkMetric::Deleted => "deleted",
        }
    }

    /// `<sink>.<key>` into (sink label, metric); `None` for keys that are not a sink's.
    pub fn parse_key(key: &str) -> Option<(&str, SinkMetric)> {
        let (sink, suffix) = key.rsplit_once('.')?;
        SinkMetric::ALL
            .into_iter()
            .find(|m| m.key() == suffix)
            .map(|m| (sink, m))
    }
}

/// The key under which the fan-out records the time spent caching (running the transform).
pub const CACHE_DURATION_KEY: &str = "cache.durationMs";

/// Per-batch sink counters. Skips must never be silent: a sink that finds the batch
/// already written says so here, and the progress report carries it.
#[derive(Debug)]
pub struct SinkMetrics {
    output_rows: AtomicI64,
    skipped: AtomicU64,
    typed: Mutex<BTreeMap<(String, SinkMetric), String>>,
    notes: Mutex<Vec<(String, String)>>,
}

impl Default for SinkMetrics {
    fn default() -> Self {
        SinkMetrics {
            output_rows: AtomicI64::new(-1),
            skipped: AtomicU64::new(0),
            typed: Mutex::new(BTreeMap::new()),
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

    /// Sink `sink` found the batch already written and skipped it.
    pub fn add_skipped(&self, sink: &str) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
        self.record(sink, SinkMetric::Skipped, "true");
    }

    /// A typed figure of sink `sink` for the progress report.
    pub fn record(&self, sink: &str, metric: SinkMetric, value: impl ToString) {
        if let Ok(mut t) = self.typed.lock() {
            t.insert((sink.to_string(), metric), value.to_string());
        }
    }

    /// A typed figure of sink `sink`, if recorded.
    pub fn get(&self, sink: &str, metric: SinkMetric) -> Option<String> {
        self.typed
            .lock()
            .ok()
            .and_then(|t| t.get(&(sink.to_string(), metric)).cloned())
    }

    /// A free-form figure for the progress report (`sink.metrics`).
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

    /// Every figure as `sink.metrics` entries: typed ones as `<sink>.<key>`, then notes.
    pub fn entries(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .typed
            .lock()
            .map(|t| {
                t.iter()
                    .map(|((s, m), v)| (format!("{s}.{}", m.key()), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        out.extend(self.notes.lock().map(|n| n.clone()).unwrap_or_default());
        out
    }
}

/// Which query a sink works for: what its default app id is derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryIdentity {
    /// The checkpoint's query id.
    pub query_id: uuid::Uuid,
    /// The query's name when its checkpoint was created.
    pub app_name: String,
}

impl QueryIdentity {
    /// The identity of the query whose checkpoint this is.
    pub fn of(checkpoint: &crate::checkpoint::Checkpoint, current_name: &str) -> Self {
        QueryIdentity {
            query_id: checkpoint.query_id(),
            app_name: checkpoint
                .created_name()
                .unwrap_or(current_name)
                .to_string(),
        }
    }

    /// The default application id of idempotent sinks (see `BatchContext::app_id`).
    pub fn default_app_id(&self) -> String {
        format!("{}-{}", self.app_name, self.query_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_metrics_round_trip_through_their_keys() {
        let m = SinkMetrics::default();
        m.record("delta-merge /t.x", SinkMetric::Version, 7);
        m.add_skipped("parquet /out");
        let entries = m.entries();
        assert!(entries.contains(&("delta-merge /t.x.version".into(), "7".into())));
        for (k, _) in &entries {
            assert!(SinkMetric::parse_key(k).is_some(), "{k}");
        }
        assert_eq!(
            SinkMetric::parse_key("delta-merge /t.x.version"),
            Some(("delta-merge /t.x", SinkMetric::Version))
        );
        assert_eq!(
            SinkMetric::parse_key("cache.durationMs").map(|p| p.1),
            Some(SinkMetric::DurationMs)
        );
    }
}
