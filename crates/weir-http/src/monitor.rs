//! What the endpoint shows, kept up to date by the query's events.
//!
//! [`Monitor`] is a [`QueryListener`]: add it to a query with `.listener(monitor.clone())`.
//! Everything it keeps is bounded: counters, fixed-bucket histograms, the last
//! [`RECENT`] progress reports and one lag figure per Kafka partition.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use weir_core::engine::{
    BatchStarted, DURATION_PHASES, FallingBehind, QueryIdle, QueryListener, QueryRetrying,
    QueryStarted, QueryTerminated, StreamingQueryProgress,
};
use weir_core::sink::{CACHE_DURATION_KEY, SinkMetric};

use crate::histogram::Histogram;

/// How many progress reports `/api/progress` and the page keep.
pub const RECENT: usize = 300;

/// Where the query is.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Starting,
    Active,
    /// A run failed with an error that may pass; the query starts again after a pause.
    Retrying,
    Stopped,
    Failed,
}

/// The next run of a query that failed with an error that may pass (`/api/status`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NextAttempt {
    /// The batch that failed (`None`: before the first batch).
    pub batch_id: Option<u64>,
    /// Failures in a row so far, of at most `attempts` runs.
    pub failed: u32,
    pub attempts: u32,
    /// When the next run starts: Unix time in seconds (with a fraction).
    pub at: f64,
}

#[derive(Debug, Default)]
struct SinkFigures {
    rows: u64,
    skipped: u64,
    duration: Histogram,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    query_id: Option<uuid::Uuid>,
    started: Instant,
    last_activity: Instant,
    /// The last trigger found no new data (the query waits, it is not stuck).
    idle: bool,
    committed: u64,
    failed: u64,
    replayed: u64,
    input_rows: BTreeMap<String, u64>,
    sinks: BTreeMap<String, SinkFigures>,
    /// Per cluster worker (by URL): tasks run and input rows read, over all batches.
    workers: BTreeMap<String, (u64, u64)>,
    /// Workers that ran tasks of the last batch (`None`: not on a cluster).
    last_workers: Option<usize>,
    phases: BTreeMap<&'static str, Histogram>,
    last_batch: Option<(u64, f64)>,
    add_batch_ratio: Option<f64>,
    behind: bool,
    behind_fraction: f64,
    lag: BTreeMap<(String, String), i64>,
    /// Per source: records after the last batch's end, when the source can count them.
    records_behind: BTreeMap<String, Option<i64>>,
    /// Per source with a backlog at the last batch (its newest offset beyond the batch's
    /// end): since when it has had one without a break.
    behind_since: BTreeMap<String, Instant>,
    last_error: Option<String>,
    next_attempt: Option<NextAttempt>,
    /// Runs that failed with an error that may pass and were started again.
    retried: u64,
    /// The recent reports as JSON, serialized once when they arrive (scrapes only copy).
    recent_json: VecDeque<String>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Monitor {
    name: String,
    interval: Duration,
    stall_after: Duration,
    limits: LagLimits,
    state: Mutex<State>,
}

/// How far behind its sources a query may be before `/readyz` fails (`None`: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LagLimits {
    /// Records after the last batch's end, per source (sources that count them: Kafka).
    pub records: Option<u64>,
    /// How long a source has had a backlog without a break (its newest offset beyond the
    /// end of every batch since).
    pub seconds: Option<u64>,
}

/// How far one source is behind (`/api/status`'s `sourcesBehind`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Behind {
    /// Records after the last batch's end (`None`: the source does not count them).
    pub records: Option<i64>,
    /// Seconds it has had a backlog without a break (0: none at the last batch).
    pub seconds: u64,
}

/// The query's state as `/api/status` gives it (and the page shows it).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub name: String,
    pub id: Option<uuid::Uuid>,
    pub phase: Phase,
    pub ready: bool,
    pub reason: String,
    pub trigger_interval_ms: u64,
    pub batches_committed: u64,
    pub batches_failed: u64,
    pub batches_replayed: u64,
    pub falling_behind: bool,
    pub behind_fraction: f64,
    pub last_error: Option<String>,
    /// While retrying: the next run.
    pub next_attempt: Option<NextAttempt>,
    /// Per source: how far behind it the query is.
    pub sources_behind: BTreeMap<String, Behind>,
    /// Records behind the newest offset, per `topic/partition`.
    pub kafka_lag: BTreeMap<String, i64>,
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Records behind latest per (topic, partition), when both offsets have Kafka's shape
/// `{"topic": {"0": 12}}`.
fn kafka_lag(
    end: Option<&serde_json::Value>,
    latest: Option<&serde_json::Value>,
) -> Vec<((String, String), i64)> {
    let (Some(end), Some(latest)) = (
        end.and_then(|v| v.as_object()),
        latest.and_then(|v| v.as_object()),
    ) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (topic, parts) in latest {
        let Some(parts) = parts.as_object() else {
            continue;
        };
        for (p, newest) in parts {
            let (Some(newest), Some(done)) = (
                newest.as_i64(),
                end.get(topic)
                    .and_then(|t| t.get(p))
                    .and_then(|v| v.as_i64()),
            ) else {
                continue;
            };
            out.push(((topic.clone(), p.clone()), (newest - done).max(0)));
        }
    }
    out
}

/// Per source: records behind (if counted) and seconds with a backlog.
fn sources_behind(s: &State) -> BTreeMap<String, Behind> {
    s.records_behind
        .iter()
        .map(|(source, records)| {
            let seconds = s
                .behind_since
                .get(source)
                .map_or(0, |since| since.elapsed().as_secs());
            (
                source.clone(),
                Behind {
                    records: *records,
                    seconds,
                },
            )
        })
        .collect()
}

impl Monitor {
    /// A monitor for query `name` with trigger interval `interval` (zero for `0`,
    /// available-now and once). `/readyz` fails when no batch ended and no trigger found the
    /// source idle for `stall_after`.
    pub fn new(name: &str, interval: Duration, stall_after: Duration) -> Monitor {
        let now = Instant::now();
        Monitor {
            name: name.to_string(),
            interval,
            stall_after,
            limits: LagLimits::default(),
            state: Mutex::new(State {
                phase: Phase::Starting,
                query_id: None,
                started: now,
                last_activity: now,
                idle: false,
                committed: 0,
                failed: 0,
                replayed: 0,
                input_rows: BTreeMap::new(),
                sinks: BTreeMap::new(),
                workers: BTreeMap::new(),
                last_workers: None,
                phases: BTreeMap::new(),
                last_batch: None,
                add_batch_ratio: None,
                behind: false,
                behind_fraction: 0.7,
                lag: BTreeMap::new(),
                records_behind: BTreeMap::new(),
                behind_since: BTreeMap::new(),
                last_error: None,
                next_attempt: None,
                retried: 0,
                recent_json: VecDeque::new(),
            }),
        }
    }

    /// `/readyz` also fails while a source is further behind than `limits`.
    pub fn with_lag_limits(mut self, limits: LagLimits) -> Monitor {
        self.limits = limits;
        self
    }

    /// The query's name (a label of every metric).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        self.state.lock().ok().map(|mut s| f(&mut s))
    }

    /// The recent progress reports as a JSON array, oldest first.
    pub fn recent_json(&self) -> String {
        self.with(|s| {
            let mut out =
                String::with_capacity(s.recent_json.iter().map(|j| j.len() + 1).sum::<usize>() + 2);
            out.push('[');
            for (i, j) in s.recent_json.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(j);
            }
            out.push(']');
            out
        })
        .unwrap_or_else(|| "[]".into())
    }

    /// Ready: active, and a batch ended (or a trigger found nothing new) within
    /// `stall_after`.
    pub fn status(&self) -> Status {
        let stall = self.stall_after;
        self.with(|s| {
            let quiet = s.last_activity.elapsed();
            let (ready, reason) = match s.phase {
                Phase::Starting => (false, "the query is starting".to_string()),
                Phase::Failed => (false, "the query failed".to_string()),
                Phase::Retrying => (
                    false,
                    match &s.next_attempt {
                        Some(n) => {
                            let wait = n.at - now_seconds();
                            format!(
                                "retrying: {} failed ({} of {} runs): {}; {}",
                                n.batch_id
                                    .map_or("the start".to_string(), |b| format!("batch {b}")),
                                n.failed,
                                n.attempts,
                                s.last_error.as_deref().unwrap_or("(no error text)"),
                                if wait >= 10.0 {
                                    format!("next run in {wait:.0} s")
                                } else if wait > 0.0 {
                                    format!("next run in {wait:.1} s")
                                } else {
                                    "running it again now".to_string()
                                }
                            )
                        }
                        None => "retrying".to_string(),
                    },
                ),
                Phase::Stopped => (false, "the query stopped".to_string()),
                Phase::Active if quiet > stall && !s.idle => (
                    false,
                    format!(
                        "no batch ended for {} s (more than {} s)",
                        quiet.as_secs(),
                        stall.as_secs()
                    ),
                ),
                Phase::Active => match self.too_far_behind(s) {
                    Some(why) => (false, why),
                    None => (true, "running".to_string()),
                },
            };
            Status {
                name: self.name.clone(),
                id: s.query_id,
                phase: s.phase.clone(),
                ready,
                reason,
                trigger_interval_ms: self.interval.as_millis() as u64,
                batches_committed: s.committed,
                batches_failed: s.failed,
                batches_replayed: s.replayed,
                falling_behind: s.behind,
                behind_fraction: s.behind_fraction,
                last_error: s.last_error.clone(),
                next_attempt: s.next_attempt.clone(),
                sources_behind: sources_behind(s),
                kafka_lag: s
                    .lag
                    .iter()
                    .map(|((t, p), l)| (format!("{t}/{p}"), *l))
                    .collect(),
            }
        })
        .unwrap_or_else(|| Status {
            name: self.name.clone(),
            id: None,
            phase: Phase::Failed,
            ready: false,
            reason: "the monitor's state is poisoned".into(),
            trigger_interval_ms: 0,
            batches_committed: 0,
            batches_failed: 0,
            batches_replayed: 0,
            falling_behind: false,
            behind_fraction: 0.0,
            last_error: None,
            next_attempt: None,
            sources_behind: BTreeMap::new(),
            kafka_lag: BTreeMap::new(),
        })
    }

    /// Why a source is further behind than the limits allow, if one is.
    fn too_far_behind(&self, s: &State) -> Option<String> {
        for (source, b) in sources_behind(s) {
            if let (Some(limit), Some(records)) = (self.limits.records, b.records)
                && records > 0
                && records as u64 > limit
            {
                return Some(format!(
                    "{records} records behind {source} (more than {limit})"
                ));
            }
            if let Some(limit) = self.limits.seconds
                && b.seconds > limit
            {
                return Some(format!(
                    "behind {source} for {} s (more than {limit} s): every batch since ended \
                     before its newest offset",
                    b.seconds
                ));
            }
        }
        None
    }

    /// The metrics in Prometheus' text format (without the `process_` ones).
    pub fn render(&self, out: &mut crate::expo::Exposition) {
        let q = [("query", self.name.as_str())];
        // A poisoned state renders nothing of the query's.
        let _ = self.with(|s| {
            out.gauge(
                "weir_query_up",
                "1 while the query runs (starting, active or retrying), 0 once it stopped or failed",
                &q,
                f64::from(u8::from(matches!(
                    s.phase,
                    Phase::Starting | Phase::Active | Phase::Retrying
                ))),
            );
            out.counter(
                "weir_batches_committed_total",
                "Batches committed",
                &q,
                s.committed as f64,
            );
            out.counter(
                "weir_batches_failed_total",
                "Batches that failed (the query stopped with the error)",
                &q,
                s.failed as f64,
            );
            out.counter(
                "weir_query_retries_total",
                "Runs that failed with an error that may pass (a server down, a connection \
                 cut) and were started again from the checkpoint after a pause",
                &q,
                s.retried as f64,
            );
            out.counter(
                "weir_batches_replayed_total",
                "Uncommitted batches run again at start, with their recorded id and offsets",
                &q,
                s.replayed as f64,
            );
            out.help(
                "weir_input_rows_total",
                "counter",
                "Rows read from the source",
            );
            for (source, rows) in &s.input_rows {
                out.sample(
                    "weir_input_rows_total",
                    &[("query", &self.name), ("source", source)],
                    *rows as f64,
                );
            }
            if let Some(n) = s.last_workers {
                out.gauge(
                    "weir_cluster_workers",
                    "Cluster workers that ran tasks of the last batch",
                    &q,
                    n as f64,
                );
                out.help(
                    "weir_cluster_worker_tasks_total",
                    "counter",
                    "Tasks of the batches' plans a cluster worker ran",
                );
                for (url, (tasks, _)) in &s.workers {
                    out.sample(
                        "weir_cluster_worker_tasks_total",
                        &[("query", &self.name), ("worker", url)],
                        *tasks as f64,
                    );
                }
                out.help(
                    "weir_cluster_worker_input_rows_total",
                    "counter",
                    "Input rows a cluster worker's tasks read",
                );
                for (url, (_, rows)) in &s.workers {
                    out.sample(
                        "weir_cluster_worker_input_rows_total",
                        &[("query", &self.name), ("worker", url)],
                        *rows as f64,
                    );
                }
            }
            out.help("weir_sink_rows_total", "counter", "Rows a sink wrote");
            for (sink, f) in &s.sinks {
                out.sample(
                    "weir_sink_rows_total",
                    &[("query", &self.name), ("sink", sink)],
                    f.rows as f64,
                );
            }
            out.help(
                "weir_sink_skipped_batches_total",
                "counter",
                "Batches a sink found already written (a replay) and skipped",
            );
            for (sink, f) in &s.sinks {
                out.sample(
                    "weir_sink_skipped_batches_total",
                    &[("query", &self.name), ("sink", sink)],
                    f.skipped as f64,
                );
            }
            out.help(
                "weir_batch_phase_duration_seconds",
                "histogram",
                "Time per durationMs phase of a batch",
            );
            for (phase, h) in &s.phases {
                h.render(
                    out,
                    "weir_batch_phase_duration_seconds",
                    &[("query", &self.name), ("phase", phase)],
                );
            }
            out.help(
                "weir_sink_duration_seconds",
                "histogram",
                "Time a sink took per batch",
            );
            for (sink, f) in &s.sinks {
                if f.duration.count() > 0 {
                    f.duration.render(
                        out,
                        "weir_sink_duration_seconds",
                        &[("query", &self.name), ("sink", sink)],
                    );
                }
            }
            if let Some(r) = s.add_batch_ratio {
                out.gauge(
                    "weir_add_batch_interval_ratio",
                    "The last batch's addBatch time over the trigger interval",
                    &q,
                    r,
                );
            }
            out.gauge(
                "weir_falling_behind",
                "1 while addBatch stays above the alert fraction of the trigger interval",
                &q,
                f64::from(u8::from(s.behind)),
            );
            if let Some((id, at)) = s.last_batch {
                out.gauge(
                    "weir_last_committed_batch_id",
                    "The last committed batch id",
                    &q,
                    id as f64,
                );
                out.gauge(
                    "weir_last_commit_timestamp_seconds",
                    "When the last batch was committed (Unix time)",
                    &q,
                    at,
                );
            }
            let behind = sources_behind(s);
            out.help(
                "weir_source_records_behind",
                "gauge",
                "Records after the last batch's end, per source that counts them (Kafka)",
            );
            for (source, b) in &behind {
                if let Some(r) = b.records {
                    out.sample(
                        "weir_source_records_behind",
                        &[("query", &self.name), ("source", source)],
                        r as f64,
                    );
                }
            }
            out.help(
                "weir_source_seconds_behind",
                "gauge",
                "Seconds a source has had a backlog without a break (its newest offset beyond \
                 every batch's end since); 0 when the last batch caught up",
            );
            for (source, b) in &behind {
                out.sample(
                    "weir_source_seconds_behind",
                    &[("query", &self.name), ("source", source)],
                    b.seconds as f64,
                );
            }
            out.help(
                "weir_kafka_records_behind",
                "gauge",
                "Kafka records after the last committed offset, per partition",
            );
            for ((topic, p), lag) in &s.lag {
                out.sample(
                    "weir_kafka_records_behind",
                    &[("query", &self.name), ("topic", topic), ("partition", p)],
                    *lag as f64,
                );
            }
        });
    }
}

impl QueryListener for Monitor {
    fn on_query_started(&self, e: &QueryStarted) {
        self.with(|s| {
            // Started again after a failure: retrying until a batch gets through.
            s.phase = if s.next_attempt.is_some() {
                Phase::Retrying
            } else {
                Phase::Active
            };
            s.query_id = Some(e.id);
            s.started = Instant::now();
            s.last_activity = Instant::now();
            if e.replay {
                s.replayed += 1;
            }
        });
    }

    fn on_query_progress(&self, p: &StreamingQueryProgress) {
        let interval_ms = self.interval.as_millis() as f64;
        self.with(|s| {
            // A batch ended: a retry, if one ran, got through.
            s.next_attempt = None;
            s.phase = Phase::Active;
            s.last_activity = Instant::now();
            s.idle = false;
            s.committed += 1;
            s.last_batch = Some((p.batch_id, now_seconds()));
            for source in &p.sources {
                *s.input_rows.entry(source.description.clone()).or_default() +=
                    source.num_input_rows;
                let lag = kafka_lag(source.end_offset.as_ref(), source.latest_offset.as_ref());
                let records = (!lag.is_empty()).then(|| lag.iter().map(|(_, l)| l).sum::<i64>());
                s.records_behind.insert(source.description.clone(), records);
                let backlog = source
                    .latest_offset
                    .as_ref()
                    .is_some_and(|latest| Some(latest) != source.end_offset.as_ref())
                    || records.is_some_and(|r| r > 0)
                    // A file source's files listed and not yet taken.
                    || source
                        .metrics
                        .get("numFilesQueued")
                        .and_then(|n| n.parse::<u64>().ok())
                        .is_some_and(|n| n > 0);
                if backlog {
                    s.behind_since
                        .entry(source.description.clone())
                        .or_insert_with(Instant::now);
                } else {
                    s.behind_since.remove(&source.description);
                }
                for (k, lag) in kafka_lag(source.end_offset.as_ref(), source.latest_offset.as_ref())
                {
                    s.lag.insert(k, lag);
                }
            }
            if let Some(c) = &p.cluster {
                s.last_workers = Some(c.workers.len());
                for w in &c.workers {
                    let f = s.workers.entry(w.url.clone()).or_default();
                    f.0 += w.tasks;
                    f.1 += w.input_rows;
                }
            }
            for phase in DURATION_PHASES {
                if let Some(ms) = p.duration_ms.get(phase) {
                    s.phases
                        .entry(phase)
                        .or_default()
                        .observe(*ms as f64 / 1000.0);
                }
            }
            for (key, value) in &p.sink.metrics {
                if key == CACHE_DURATION_KEY {
                    continue;
                }
                let Some((sink, metric)) = SinkMetric::parse_key(key) else {
                    continue;
                };
                let f = s.sinks.entry(sink.to_string()).or_default();
                match metric {
                    SinkMetric::Rows => f.rows += value.parse::<u64>().unwrap_or(0),
                    SinkMetric::Skipped => f.skipped += 1,
                    SinkMetric::DurationMs => f
                        .duration
                        .observe(value.parse::<f64>().unwrap_or(0.0) / 1000.0),
                    _ => {}
                }
            }
            let add = p.duration(weir_core::engine::Phase::AddBatch) as f64;
            if interval_ms > 0.0 {
                let r = add / interval_ms;
                s.add_batch_ratio = Some(r);
                if r <= s.behind_fraction {
                    s.behind = false;
                }
            }
            if s.recent_json.len() == RECENT {
                s.recent_json.pop_front();
            }
            s.recent_json.push_back(p.json());
        });
    }

    fn on_batch_started(&self, _e: &BatchStarted) {
        self.with(|s| {
            // A batch after a quiet spell: the stall limit counts from its start, and the
            // query is not idle while it runs.
            s.idle = false;
            s.last_activity = Instant::now();
        });
    }

    fn on_query_idle(&self, _e: &QueryIdle) {
        self.with(|s| {
            s.last_activity = Instant::now();
            s.idle = true;
            // Nothing was left to run: a retry, if one ran, got through.
            if s.next_attempt.take().is_some() {
                s.phase = Phase::Active;
            }
        });
    }

    fn on_query_terminated(&self, e: &QueryTerminated) {
        self.with(|s| match &e.error {
            Some(err) => {
                s.phase = Phase::Failed;
                s.failed += 1;
                s.last_error = Some(err.clone());
            }
            None => s.phase = Phase::Stopped,
        });
    }

    fn on_query_retrying(&self, e: &QueryRetrying) {
        self.with(|s| {
            s.phase = Phase::Retrying;
            s.retried += 1;
            s.last_error = Some(e.error.clone());
            s.next_attempt = Some(NextAttempt {
                batch_id: e.batch_id,
                failed: e.failed,
                attempts: e.attempts,
                at: now_seconds() + e.pause_ms as f64 / 1000.0,
            });
        });
    }

    fn on_falling_behind(&self, e: &FallingBehind) {
        self.with(|s| {
            s.behind = true;
            s.behind_fraction = e.fraction;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_lag_is_latest_minus_end_per_partition() {
        let end = serde_json::json!({"t": {"0": 10, "1": 5}});
        let latest = serde_json::json!({"t": {"0": 12, "1": 5, "2": 3}});
        let lag = kafka_lag(Some(&end), Some(&latest));
        assert_eq!(
            lag,
            vec![(("t".into(), "0".into()), 2), (("t".into(), "1".into()), 0)]
        );
        assert!(
            kafka_lag(
                Some(&serde_json::json!({"logOffset": 3})),
                Some(&serde_json::json!({"logOffset": 4}))
            )
            .is_empty()
        );
    }

    #[test]
    fn cluster_workers_add_up_per_worker_across_batches() {
        let m = Monitor::new("q", Duration::ZERO, Duration::from_secs(60));
        let mut text = String::new();
        for (batch, rows) in [(0, [5, 7]), (1, [11, 13])] {
            let p: StreamingQueryProgress = serde_json::from_value(serde_json::json!({
                "id": uuid::Uuid::nil(), "runId": uuid::Uuid::nil(), "name": "q",
                "timestamp": "2026-12-06T00:00:00.000Z", "batchId": batch,
                "batchDuration": 1, "numInputRows": rows[0] + rows[1],
                "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0,
                "durationMs": {}, "stateOperators": [], "sources": [],
                "sink": {"description": "ForeachBatchSink", "numOutputRows": -1},
                "cluster": {"workers": [
                    {"url": "http://10.0.0.1:7400/", "tasks": 1, "inputRows": rows[0]},
                    {"url": "http://10.0.0.2:7400/", "tasks": 2, "inputRows": rows[1]},
                ]},
            }))
            .unwrap();
            m.on_query_progress(&p);
            let mut out = crate::expo::Exposition::new();
            m.render(&mut out);
            text = out.finish();
        }
        for line in [
            "weir_cluster_workers{query=\"q\"} 2",
            "weir_cluster_worker_tasks_total{query=\"q\",worker=\"http://10.0.0.2:7400/\"} 4",
            "weir_cluster_worker_input_rows_total{query=\"q\",worker=\"http://10.0.0.1:7400/\"} 16",
            "weir_cluster_worker_input_rows_total{query=\"q\",worker=\"http://10.0.0.2:7400/\"} 20",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }

    fn started(m: &Monitor) {
        m.on_query_started(&QueryStarted {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            name: "q".into(),
            first_batch_id: 0,
            replay: false,
        });
    }

    /// A batch that starts after a quiet spell and then hangs (its server frozen) makes the
    /// query unready once the stall limit has passed: idle does not excuse a batch in
    /// progress.
    #[test]
    fn a_batch_that_hangs_after_an_idle_spell_fails_readiness_after_the_stall_limit() {
        let m = Monitor::new("q", Duration::ZERO, Duration::from_millis(50));
        started(&m);
        m.on_query_idle(&QueryIdle {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            next_batch_id: 4,
        });
        std::thread::sleep(Duration::from_millis(80));
        assert!(m.status().ready, "idle, waiting for data: {:?}", m.status());
        m.on_batch_started(&BatchStarted {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            batch_id: 4,
        });
        assert!(m.status().ready, "a batch just started");
        std::thread::sleep(Duration::from_millis(80));
        let s = m.status();
        assert!(!s.ready && s.reason.contains("no batch ended"), "{s:?}");
    }

    /// Between runs of a failing batch the query is up but not ready, and says why and
    /// when the next run starts; a batch that commits makes it active again.
    #[test]
    fn a_retrying_query_is_up_not_ready_and_names_the_batch_error_and_next_run() {
        let m = Monitor::new("q", Duration::ZERO, Duration::from_secs(60));
        started(&m);
        m.on_query_retrying(&QueryRetrying {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            name: "q".into(),
            batch_id: Some(4),
            failed: 2,
            attempts: 10,
            error: "connection refused".into(),
            pause_ms: 30_000,
        });
        let s = m.status();
        assert_eq!(s.phase, Phase::Retrying);
        assert!(!s.ready);
        assert!(
            s.reason
                .contains("batch 4 failed (2 of 10 runs): connection refused")
                && s.reason.contains("next run in 30 s"),
            "{}",
            s.reason
        );
        assert_eq!(s.next_attempt.as_ref().map(|n| n.batch_id), Some(Some(4)));
        let mut out = crate::expo::Exposition::new();
        m.render(&mut out);
        let text = out.finish();
        assert!(
            text.contains("weir_query_retries_total{query=\"q\"} 1"),
            "{text}"
        );
        assert!(text.contains("weir_query_up{query=\"q\"} 1"), "{text}");
        // The run after the pause starts: still retrying until a batch gets through.
        started(&m);
        assert_eq!(m.status().phase, Phase::Retrying);
        m.on_query_idle(&QueryIdle {
            id: uuid::Uuid::nil(),
            run_id: uuid::Uuid::nil(),
            next_batch_id: 5,
        });
        let s = m.status();
        assert!(
            s.ready && s.phase == Phase::Active && s.next_attempt.is_none(),
            "{s:?}"
        );
    }

    /// A Kafka backlog over `records` turns the query unready, naming the source and the
    /// count; a batch that catches up makes it ready again and zeroes the backlog's age.
    #[test]
    fn records_behind_a_kafka_source_over_the_limit_fail_readiness() {
        let m =
            Monitor::new("q", Duration::ZERO, Duration::from_secs(60)).with_lag_limits(LagLimits {
                records: Some(10_000),
                seconds: None,
            });
        started(&m);
        let batch = |end: i64, latest: i64| -> StreamingQueryProgress {
            serde_json::from_value(serde_json::json!({
                "id": uuid::Uuid::nil(), "runId": uuid::Uuid::nil(), "name": "q",
                "timestamp": "2026-12-07T00:00:00.000Z", "batchId": 0,
                "batchDuration": 1, "numInputRows": 1,
                "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0,
                "durationMs": {}, "stateOperators": [],
                "sources": [{
                    "description": "KafkaV2[Subscribe[orders]]",
                    "startOffset": {"orders": {"0": 0, "1": 0}},
                    "endOffset": {"orders": {"0": end, "1": end}},
                    "latestOffset": {"orders": {"0": latest, "1": latest}},
                    "numInputRows": 1, "inputRowsPerSecond": 0.0,
                    "processedRowsPerSecond": 0.0, "metrics": {}
                }],
                "sink": {"description": "ForeachBatchSink", "numOutputRows": -1},
            }))
            .unwrap()
        };
        m.on_query_progress(&batch(100, 9_353));
        let s = m.status();
        assert!(
            !s.ready
                && s.reason == "18506 records behind KafkaV2[Subscribe[orders]] (more than 10000)",
            "{s:?}"
        );
        assert_eq!(
            s.sources_behind["KafkaV2[Subscribe[orders]]"].records,
            Some(18_506)
        );
        let mut out = crate::expo::Exposition::new();
        m.render(&mut out);
        let text = out.finish();
        assert!(
            text.contains(
                "weir_source_records_behind{query=\"q\",source=\"KafkaV2[Subscribe[orders]]\"} 18506"
            ),
            "{text}"
        );
        m.on_query_progress(&batch(9_353, 9_353));
        let s = m.status();
        assert!(s.ready, "{s:?}");
        assert_eq!(
            s.sources_behind["KafkaV2[Subscribe[orders]]"],
            Behind {
                records: Some(0),
                seconds: 0
            }
        );
    }
}
