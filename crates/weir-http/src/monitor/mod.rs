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

mod listen;
mod metrics;

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
}

#[cfg(test)]
mod tests;
