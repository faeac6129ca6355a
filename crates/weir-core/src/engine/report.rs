//! A batch's progress report, built from what the loop measured: Spark's
//! `StreamingQueryProgress` with one source and the foreachBatch sink.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::time::Instant;

use super::cluster::WorkerTasks;
use super::progress::{
    BehindDetector, ClusterProgress, Durations, FallingBehind, Phase, QueryListener, SinkProgress,
    SourceProgress, StreamingQueryProgress,
};
use super::query::Shared;
use crate::sink::SinkMetrics;
use crate::source::SourceOffset;

/// When a batch ran, for its progress report.
pub(super) struct Timing {
    pub wall_start: chrono::DateTime<chrono::Utc>,
    pub trigger_start: Instant,
    pub previous_trigger: Option<Instant>,
    pub durations: Durations,
    /// The stateful operators' progress entries.
    pub state_operators: Vec<serde_json::Value>,
    /// Spark's `eventTime` entry (empty without a watermark).
    pub event_time: BTreeMap<String, String>,
    /// On a cluster: what each worker did.
    pub cluster: Option<Vec<WorkerTasks>>,
}

/// The range a batch read, as its report names it.
pub(super) struct Range<'a> {
    /// The source's description.
    pub source: String,
    pub start: Option<&'a SourceOffset>,
    pub end: &'a SourceOffset,
    /// The newest offset the source had seen (`None` on a replay).
    pub latest: Option<&'a SourceOffset>,
}

/// The report of batch `batch_id`, which read `rows` rows of `range`.
pub(super) fn progress(
    shared: &Shared,
    batch_id: u64,
    range: Range<'_>,
    rows: u64,
    (sink, source_metrics): (&SinkMetrics, BTreeMap<String, String>),
    timing: Timing,
) -> StreamingQueryProgress {
    let Timing {
        wall_start,
        trigger_start,
        previous_trigger,
        durations,
        state_operators,
        event_time,
        cluster,
    } = timing;
    let total_ms = durations.get(Phase::TriggerExecution);
    let processed = per_second(rows, total_ms as f64 / 1000.0);
    let input = previous_trigger.map_or(0.0, |prev| {
        per_second(rows, (trigger_start - prev).as_secs_f64())
    });
    StreamingQueryProgress {
        id: shared.id,
        run_id: shared.run_id,
        name: shared.name.clone(),
        timestamp: wall_start.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        batch_id,
        batch_duration: total_ms,
        num_input_rows: rows,
        input_rows_per_second: input,
        processed_rows_per_second: processed,
        duration_ms: durations.into_report(),
        event_time,
        state_operators,
        sources: vec![SourceProgress {
            description: range.source,
            start_offset: range.start.map(|s| s.json().clone()),
            end_offset: Some(range.end.json().clone()),
            latest_offset: range.latest.map(|s| s.json().clone()),
            num_input_rows: rows,
            input_rows_per_second: input,
            processed_rows_per_second: processed,
            metrics: source_metrics,
        }],
        sink: SinkProgress {
            description: "ForeachBatchSink".into(),
            num_output_rows: sink.output_rows(),
            metrics: sink.entries().into_iter().collect(),
        },
        cluster: cluster.map(|workers| ClusterProgress { workers }),
    }
}

/// Hands `progress` to the listeners and the query's recent reports, and warns (log line and
/// listener event) when `behind` sees the query falling behind its trigger interval.
pub(super) fn tell(
    shared: &Shared,
    listeners: &[Arc<dyn QueryListener>],
    behind: &mut BehindDetector,
    interval: u64,
    progress: StreamingQueryProgress,
) {
    tracing::debug!(query = %shared.name, "progress: {}", progress.json());
    for l in listeners {
        l.on_query_progress(&progress);
    }
    let add_batch = progress.duration(Phase::AddBatch);
    if behind.observe(add_batch, interval) {
        let event = FallingBehind {
            id: shared.id,
            name: shared.name.clone(),
            batch_id: progress.batch_id,
            trigger_interval_ms: interval,
            add_batch_ms: add_batch,
            fraction: behind.fraction,
            consecutive: behind.streak(),
        };
        tracing::warn!(
            query = %shared.name,
            "falling behind: addBatch took more than {:.0}% of the {interval} ms trigger interval for {} batches in a row (batch {} took {add_batch} ms); raise the interval or lower maxFilesPerTrigger/maxOffsetsPerTrigger",
            event.fraction * 100.0,
            event.consecutive,
            progress.batch_id
        );
        for l in listeners {
            l.on_falling_behind(&event);
        }
    }
    shared.push_progress(progress);
}

fn per_second(rows: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        0.0
    } else {
        (rows as f64 / secs * 10.0).round() / 10.0
    }
}
