//! Progress reports with the field names of Spark's `StreamingQueryProgress`, listener
//! events, and the falling-behind detector.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What one batch did; serializes to the JSON Spark's `query.lastProgress.json` gives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamingQueryProgress {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub name: String,
    /// When the trigger started, ISO-8601 UTC with milliseconds.
    pub timestamp: String,
    pub batch_id: u64,
    /// ms from trigger start to commit.
    pub batch_duration: u64,
    pub num_input_rows: u64,
    /// Input rows over the time since the previous trigger started.
    pub input_rows_per_second: f64,
    /// Input rows over this batch's `triggerExecution`.
    pub processed_rows_per_second: f64,
    /// `latestOffset, walCommit, getBatch, queryPlanning, addBatch, commitOffsets,
    /// triggerExecution`, in ms.
    pub duration_ms: BTreeMap<String, u64>,
    /// With a watermark: `watermark` (the batch's), and `min`, `max`, `avg` of the event
    /// times the batch brought, ISO-8601 UTC with milliseconds (Spark's `eventTime`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub event_time: BTreeMap<String, String>,
    pub state_operators: Vec<serde_json::Value>,
    pub sources: Vec<SourceProgress>,
    pub sink: SinkProgress,
    /// On a cluster: what each worker did for the batch (weir's own field; absent without
    /// a cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterProgress>,
}

/// Progress's `cluster` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterProgress {
    /// Per worker that ran a task of the batch: its URL, tasks and input rows.
    pub workers: Vec<super::cluster::WorkerTasks>,
}

impl StreamingQueryProgress {
    /// One of the `durationMs` entries (a [`Phase`], or its name), 0 if absent.
    pub fn duration(&self, phase: impl AsRef<str>) -> u64 {
        self.duration_ms.get(phase.as_ref()).copied().unwrap_or(0)
    }

    /// The report as one line of JSON (for progress files).
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The report as indented JSON, like Spark's `prettyJson`.
    pub fn pretty_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// A `durationMs` entry of a report: the phases of a batch, in the order it passes them
/// (Spark's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Asking the source for its newest offset under the read limit.
    LatestOffset,
    /// Writing `offsets/N`.
    WalCommit,
    /// Reading the batch's rows.
    GetBatch,
    /// Applying the transforms and stateful steps.
    QueryPlanning,
    /// The function (every sink), and the state commit after it.
    AddBatch,
    /// Writing `commits/N`, telling the source, purging past retention.
    CommitOffsets,
    /// The whole batch.
    TriggerExecution,
}

impl Phase {
    /// Every phase, in the order a batch passes them.
    pub const ALL: [Phase; 7] = [
        Phase::LatestOffset,
        Phase::WalCommit,
        Phase::GetBatch,
        Phase::QueryPlanning,
        Phase::AddBatch,
        Phase::CommitOffsets,
        Phase::TriggerExecution,
    ];

    /// Spark's name of the phase, the key in `durationMs`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::LatestOffset => "latestOffset",
            Phase::WalCommit => "walCommit",
            Phase::GetBatch => "getBatch",
            Phase::QueryPlanning => "queryPlanning",
            Phase::AddBatch => "addBatch",
            Phase::CommitOffsets => "commitOffsets",
            Phase::TriggerExecution => "triggerExecution",
        }
    }
}

impl AsRef<str> for Phase {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// The `durationMs` keys of a report, in the order a batch passes them (Spark's names).
pub const DURATION_PHASES: [&str; 7] = {
    let mut keys = [""; 7];
    let mut i = 0;
    while i < keys.len() {
        keys[i] = Phase::ALL[i].as_str();
        i += 1;
    }
    keys
};

/// The phase durations of one batch, in ms, as the loop measures them.
#[derive(Debug, Default, Clone)]
pub(crate) struct Durations(BTreeMap<Phase, u64>);

impl Durations {
    /// Records `phase` as having taken `ms`.
    pub(crate) fn set(&mut self, phase: Phase, ms: u64) {
        self.0.insert(phase, ms);
    }

    /// Records `phase` as having taken the time since `since`.
    pub(crate) fn since(&mut self, phase: Phase, since: tokio::time::Instant) {
        self.set(phase, since.elapsed().as_millis() as u64);
    }

    /// The entry of `phase`, 0 if not recorded.
    pub(crate) fn get(&self, phase: Phase) -> u64 {
        self.0.get(&phase).copied().unwrap_or(0)
    }

    /// The `durationMs` map of a report.
    pub(crate) fn into_report(self) -> BTreeMap<String, u64> {
        self.0
            .into_iter()
            .map(|(p, ms)| (p.as_str().to_string(), ms))
            .collect()
    }
}

/// A source's part of a progress report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceProgress {
    pub description: String,
    pub start_offset: Option<serde_json::Value>,
    pub end_offset: Option<serde_json::Value>,
    pub latest_offset: Option<serde_json::Value>,
    pub num_input_rows: u64,
    pub input_rows_per_second: f64,
    pub processed_rows_per_second: f64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, String>,
}

/// The sink's part: `numOutputRows` is -1 unless a sink reported rows, as in Spark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SinkProgress {
    pub description: String,
    pub num_output_rows: i64,
    /// Sink figures: skipped writes (`<sink>.skipped`), versions, etc.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, String>,
}

/// The query started (or restarted on its checkpoint).
#[derive(Debug, Clone)]
pub struct QueryStarted {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub name: String,
    /// The batch it starts with, and whether that batch is a replay.
    pub first_batch_id: u64,
    pub replay: bool,
}

/// A trigger found no new data.
#[derive(Debug, Clone)]
pub struct QueryIdle {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub next_batch_id: u64,
}

/// The query ended; `error` is its error chain when it failed.
#[derive(Debug, Clone)]
pub struct QueryTerminated {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub error: Option<String>,
}

/// `addBatch` exceeded `fraction` of the trigger interval for `consecutive` batches in a
/// row: the function is the bottleneck and the query is falling behind its source.
#[derive(Debug, Clone)]
pub struct FallingBehind {
    pub id: uuid::Uuid,
    pub name: String,
    pub batch_id: u64,
    pub trigger_interval_ms: u64,
    pub add_batch_ms: u64,
    pub fraction: f64,
    pub consecutive: u32,
}

/// Receives a query's events. Called on the query's task, so keep it quick.
pub trait QueryListener: Send + Sync {
    fn on_query_started(&self, _event: &QueryStarted) {}
    fn on_query_progress(&self, _progress: &StreamingQueryProgress) {}
    fn on_query_idle(&self, _event: &QueryIdle) {}
    fn on_query_terminated(&self, _event: &QueryTerminated) {}
    fn on_falling_behind(&self, _event: &FallingBehind) {}
    /// Batch `batch_id` starts (its offsets are planned or recovered).
    fn on_batch_started(&self, _event: &BatchStarted) {}
    /// A run of the query failed with an error that may pass; it starts again from its
    /// checkpoint after the pause (`engine::retry`).
    fn on_query_retrying(&self, _event: &QueryRetrying) {}
}

/// A batch starts: the query is no longer idle, and the batch should end within the
/// stall limit.
#[derive(Debug, Clone)]
pub struct BatchStarted {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub batch_id: u64,
}

/// The query failed with an error that may pass and runs again after `pause_ms`: failure
/// `failed` in a row of at most `attempts` runs.
#[derive(Debug, Clone)]
pub struct QueryRetrying {
    pub id: uuid::Uuid,
    pub run_id: uuid::Uuid,
    pub name: String,
    /// The batch that failed (`None`: before the first batch, or while opening again).
    pub batch_id: Option<u64>,
    pub failed: u32,
    pub attempts: u32,
    /// The error chain.
    pub error: String,
    pub pause_ms: u64,
}

/// Counts consecutive batches whose `addBatch` exceeds `fraction` of the interval.
#[derive(Debug, Clone)]
pub struct BehindDetector {
    pub fraction: f64,
    pub batches: u32,
    streak: u32,
}

impl BehindDetector {
    /// Alert after `batches` consecutive batches above `fraction` of the interval.
    pub fn new(fraction: f64, batches: u32) -> Self {
        BehindDetector {
            fraction,
            batches: batches.max(1),
            streak: 0,
        }
    }

    /// Feeds one batch; true when the streak reaches the threshold (and again at every
    /// multiple of it while the streak lasts).
    pub fn observe(&mut self, add_batch_ms: u64, interval_ms: u64) -> bool {
        if interval_ms == 0 || (add_batch_ms as f64) <= self.fraction * interval_ms as f64 {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        self.streak.is_multiple_of(self.batches)
    }

    /// The current streak.
    pub fn streak(&self) -> u32 {
        self.streak
    }
}

impl Default for BehindDetector {
    fn default() -> Self {
        BehindDetector::new(0.7, 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alert_fires_after_k_consecutive_slow_batches_and_resets_on_a_fast_one() {
        let mut d = BehindDetector::new(0.7, 3);
        let fired: Vec<bool> = [800, 900, 750, 100, 800, 800, 800, 800, 800, 800]
            .iter()
            .map(|&ms| d.observe(ms, 1000))
            .collect();
        assert_eq!(
            fired,
            vec![
                false, false, true, false, false, false, true, false, false, true
            ]
        );
        assert!(!d.observe(5000, 0), "no interval, no alert");
    }

    #[test]
    fn progress_serializes_with_spark_field_names() {
        let p = StreamingQueryProgress {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            name: "q".into(),
            timestamp: "2026-12-02T12:10:08.554Z".into(),
            batch_id: 5,
            batch_duration: 1303,
            num_input_rows: 20,
            input_rows_per_second: 12.2,
            processed_rows_per_second: 15.3,
            duration_ms: [("addBatch".to_string(), 1078u64)].into_iter().collect(),
            event_time: BTreeMap::new(),
            state_operators: vec![],
            cluster: None,
            sources: vec![],
            sink: SinkProgress {
                description: "ForeachBatchSink".into(),
                num_output_rows: -1,
                metrics: BTreeMap::new(),
            },
        };
        let v: serde_json::Value = serde_json::from_str(&p.json()).unwrap();
        for key in [
            "id",
            "runId",
            "name",
            "timestamp",
            "batchId",
            "batchDuration",
            "numInputRows",
            "inputRowsPerSecond",
            "processedRowsPerSecond",
            "durationMs",
            "stateOperators",
            "sources",
            "sink",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        assert_eq!(v["durationMs"]["addBatch"], 1078);
        assert_eq!(v["sink"]["numOutputRows"], -1);
    }
}
