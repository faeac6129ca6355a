//! The micro-batch loop. One task per query; batches strictly one after another.
//!
//! For each batch N, in this order (each step durable before the next starts):
//! 1. ask the source for its latest offset under the read limit (`latestOffset`);
//! 2. write `offsets/N` (`walCommit`);
//! 3. read the range and materialize it once (`getBatch`), apply the transforms
//!    (`queryPlanning`);
//! 4. call the user's function (`addBatch`);
//! 5. only if it returned `Ok`: write `commits/N`, tell the source (`commitOffsets`). The
//!    entry's content is written and fsynced under a temp name while the function runs;
//!    only its link into place (and the folder's fsync) waits for the function.
//!
//! A replay (recovered `offsets/N` without `commits/N`) skips 1-2 and uses the recorded
//! offsets, batch timestamp and id.
//!
//! Reading ahead: when the next batch starts right after this one (available-now, or no
//! trigger interval), steps 1 and 3 of batch N+1 (latest offset, read) run while batch N's
//! function writes; the source hears of N's commit after that read. Nothing durable moves:
//! `offsets/N+1` is still written after `commits/N`, with the range that was read. A crash
//! before it replays N and plans N+1 again (a file source then hands out the file list it
//! had already logged for N+1).

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use datafusion::prelude::SessionContext;
use futures::FutureExt;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::batch::{self, Ahead, ReadRows, Steps, read_ahead, read_rows};
use super::cluster::{Cluster, OnCluster, WorkerTasks, run_and_hold};
use super::progress::{
    BatchStarted, BehindDetector, Durations, Phase, QueryIdle, QueryListener, QueryStarted,
};
use super::query::Shared;
use super::report::{self, Range, Timing};
use super::stateful::EventTime;
use super::step::{Answer, Cursor, Position, Step, next_step, reads_ahead};
use super::trigger::{Trigger, ms, next_tick, wait_until};
use crate::checkpoint::{Checkpoint, CommitMetadata, OffsetSeq, OffsetSeqMetadata, StartPoint};
use crate::error::{Error, Result, error_chain, join_text};
use crate::fault::{self, AFTER_COMMIT_WRITE, AFTER_OFFSETS_WRITE, BEFORE_COMMIT_WRITE};
use crate::logfile::retention;
use crate::sink::{BatchContext, ForeachBatch, SinkMetrics};
use crate::source::{ReadLimit, Source, SourceOffset};

mod plan;
mod run_batch;

/// Everything the runner needs; built by `engine::start`.
pub(crate) struct QuerySpec {
    pub checkpoint: Checkpoint,
    pub start: StartPoint,
    pub source: Arc<dyn Source>,
    pub limit: ReadLimit,
    /// The steps, opened on the checkpoint's state (taken by [`Runner::open`]).
    pub steps: Option<Steps>,
    pub sink: Arc<dyn ForeachBatch>,
    pub trigger: Trigger,
    pub retain: u64,
    pub listeners: Vec<Arc<dyn QueryListener>>,
    pub behind: BehindDetector,
    pub ctx: SessionContext,
    pub conf: BTreeMap<String, String>,
    pub no_data_delay: Duration,
    /// Where batches run, when not in this process.
    pub cluster: Option<Arc<dyn Cluster>>,
}

/// The loop of one query.
pub(crate) struct Runner {
    spec: QuerySpec,
    shared: Arc<Shared>,
    /// The query's steps, their state and the watermark.
    steps: Steps,
    /// The next batch, being read while the current one's function runs.
    ahead: Mutex<Option<JoinHandle<Result<Option<Ahead>>>>>,
    /// The end of a committed batch the source has not been told of yet (it is told once
    /// the read ahead started beside that batch has finished).
    untold: Mutex<Option<(u64, SourceOffset)>>,
}

/// What one batch reads.
struct Planned {
    id: u64,
    end: SourceOffset,
    latest: Option<SourceOffset>,
    metadata: OffsetSeqMetadata,
    replay: bool,
}

/// What a batch's steps 3-5 gave.
struct Ran {
    /// Input rows.
    rows: u64,
    metrics: Arc<SinkMetrics>,
    /// The source's figures as of the batch's read.
    source_metrics: BTreeMap<String, String>,
    /// The stateful operators' progress entries.
    state_operators: Vec<serde_json::Value>,
    /// The watermark for the next batch (`nextBatchWatermarkMs`).
    next_watermark: i64,
    /// Spark's `eventTime` entry (empty without a watermark).
    event_time: BTreeMap<String, String>,
    /// On a cluster: what each worker did.
    cluster: Option<Vec<WorkerTasks>>,
}

impl Runner {
    /// The loop for `spec`.
    pub(crate) async fn open(mut spec: QuerySpec, shared: Arc<Shared>) -> Result<Runner> {
        let steps = spec.steps.take().ok_or_else(|| Error::Internal {
            what: "a query started without its steps".into(),
        })?;
        Ok(Runner {
            spec,
            shared,
            steps,
            ahead: Mutex::new(None),
            untold: Mutex::new(None),
        })
    }

    fn in_batch(&self, batch_id: u64, stage: &'static str) -> impl Fn(Error) -> Error + '_ {
        move |e| Error::Batch {
            query: self.shared.name.clone(),
            batch_id,
            stage,
            source: Box::new(e),
        }
    }

    /// Runs batches until the query ends: stopped, done (once, available-now) or failed.
    pub(crate) async fn run(mut self) -> Result<()> {
        let result = AssertUnwindSafe(self.run_batches()).catch_unwind().await;
        // A read ahead still running is waited for, whatever ended the query (a panic too):
        // it holds the source (a file source logs the file list it planned), and nothing of
        // a query may run after it ended and released its checkpoint.
        let ahead = self.ahead.get_mut().take();
        if let Some(handle) = ahead {
            let _ = handle.await;
        }
        match result {
            Ok(result) => result?,
            Err(panic) => std::panic::resume_unwind(panic),
        }
        self.tell_committed().await
    }

    /// Tells the source of a committed batch it has not heard of yet.
    async fn tell_committed(&self) -> Result<()> {
        let untold = self.untold.lock().await.take();
        if let Some((id, end)) = untold {
            self.spec
                .source
                .commit(&end)
                .await
                .map_err(self.in_batch(id, "telling the source the batch is committed"))?;
        }
        Ok(())
    }

    /// Waits for the read ahead, if one runs, then tells the source of the batch committed
    /// before it. A read ahead that failed is dropped: the batch reads again (and reports
    /// the failure if it persists). Returns what was read and how long this waited (ms).
    async fn settle(&self, id: u64) -> Result<Option<(Ahead, u64)>> {
        let t = Instant::now();
        let handle = self.ahead.lock().await.take();
        let ahead = match handle {
            None => None,
            Some(h) => match h.await {
                Ok(Ok(a)) => a,
                Ok(Err(e)) => {
                    tracing::info!(
                        query = %self.shared.name,
                        "reading batch {id} ahead failed ({}); reading it again",
                        error_chain(&e)
                    );
                    None
                }
                Err(join) => {
                    tracing::warn!(
                        query = %self.shared.name,
                        "reading batch {id} ahead failed: {}; reading it again",
                        join_text(join)
                    );
                    None
                }
            },
        };
        let waited = t.elapsed().as_millis() as u64;
        self.tell_committed().await?;
        Ok(ahead.map(|a| (a, waited)))
    }

    async fn run_batches(&mut self) -> Result<()> {
        let origin = Instant::now();
        let start = std::mem::replace(&mut self.spec.start, StartPoint::Fresh);
        let mut at = Position::at(start, &self.spec.checkpoint)?;
        // The batch before the first one is committed: let the source catch up on what it
        // does after a commit (a crash may have come between the commit and that).
        if let Some(s) = &at.start {
            self.spec.source.commit(s).await.map_err(self.in_batch(
                at.next_id.saturating_sub(1),
                "telling the source the batch is committed",
            ))?;
        }
        if self.spec.trigger == Trigger::AvailableNow {
            self.spec.source.prepare_available_now().await?;
        }
        for l in &self.spec.listeners {
            l.on_query_started(&QueryStarted {
                id: self.shared.id,
                run_id: self.shared.run_id,
                name: self.shared.name.clone(),
                first_batch_id: at.next_id,
                replay: at.pending.is_some(),
            });
        }
        let mut stop = self.shared.stop.subscribe();
        let mut previous_trigger: Option<Instant> = None;
        let mut idle_reported = false;
        let mut ran_a_batch = false;
        let interval = self.spec.trigger.interval_ms();
        loop {
            let trigger_start = Instant::now();
            let wall_start = chrono::Utc::now();
            let mut durations = Durations::default();
            let stop_requested = *stop.borrow();
            let ahead = if stop_requested {
                None
            } else {
                self.settle(at.next_id)
                    .await?
                    .filter(|(a, _)| Some(&a.start) == at.start.as_ref())
            };
            let mut cursor = Cursor {
                stop_requested,
                ran_a_batch,
                replay_pending: at.pending.is_some(),
                read_ahead: ahead.is_some(),
                source: Answer::NotAsked,
                watermark_moved: at.watermark_ms > at.last_watermark_ms,
                evicts_state: self.steps.evicts_by_watermark(),
                has_start: at.start.is_some(),
            };
            let trigger = self.spec.trigger;
            let id = at.next_id;
            let missing = |what: &str| Error::Internal {
                what: format!("batch {id}: the loop's step needs {what}"),
            };
            // The rows, when they were read ahead.
            let mut read = None;
            let planned = match next_step(&cursor, &trigger) {
                Step::Stop => return Ok(()),
                Step::Replay => {
                    let seq = at
                        .pending
                        .take()
                        .ok_or_else(|| missing("a pending batch"))?;
                    let end = seq.source(0, &self.spec.checkpoint.offsets_name(id))?;
                    tracing::info!(query = %self.shared.name, batch = id, "running batch {id} again with its recorded offsets {end}");
                    Planned {
                        id,
                        end,
                        latest: None,
                        metadata: seq.metadata,
                        replay: true,
                    }
                }
                // Read while the batch before ran: only the wait for it is this batch's.
                Step::ReadAhead => {
                    let (a, waited) = ahead.ok_or_else(|| missing("rows read ahead"))?;
                    durations.set(Phase::LatestOffset, 0);
                    durations.set(Phase::GetBatch, waited);
                    read = Some(a.rows);
                    self.record(id, a.end, a.latest, at.watermark_ms, &mut durations)
                        .instrument(self.batch_span(id))
                        .await?
                }
                Step::Plan => {
                    let planned = self
                        .plan(id, at.start.as_ref(), at.watermark_ms, &mut durations)
                        .instrument(self.batch_span(id))
                        .await?;
                    if let Some(p) = planned {
                        p
                    } else {
                        cursor.source = Answer::NoNewData;
                        let mut step = next_step(&cursor, &trigger);
                        if step == Step::Unfinished
                            && self.spec.source.reached_available_now().await?
                        {
                            cursor.source = Answer::Drained;
                            step = next_step(&cursor, &trigger);
                        }
                        match step {
                            Step::NoData => {
                                let start = at.start.as_ref().ok_or_else(|| missing("a start"))?;
                                self.plan_no_data(id, start, at.watermark_ms, &mut durations)
                                    .instrument(self.batch_span(id))
                                    .await?
                            }
                            Step::Stop => return Ok(()),
                            Step::Unfinished => return Err(self.unfinished(id, &at.start)),
                            Step::Idle => {
                                if !idle_reported {
                                    idle_reported = true;
                                    for l in &self.spec.listeners {
                                        l.on_query_idle(&QueryIdle {
                                            id: self.shared.id,
                                            run_id: self.shared.run_id,
                                            next_batch_id: id,
                                        });
                                    }
                                }
                                let wake = if interval == 0 {
                                    trigger_start + self.spec.no_data_delay
                                } else {
                                    let now = (trigger_start - origin).as_millis() as u64;
                                    origin + ms(next_tick(0, now, interval))
                                };
                                wait_until(wake, &mut stop).await;
                                continue;
                            }
                            other => return Err(missing(&format!("new data ({other:?})"))),
                        }
                    }
                }
                // Only an answer of the source leads to these.
                other @ (Step::NoData | Step::Idle | Step::Unfinished) => {
                    return Err(missing(&format!("an answer of the source ({other:?})")));
                }
            };
            idle_reported = false;
            ran_a_batch = true;
            for l in &self.spec.listeners {
                l.on_batch_started(&BatchStarted {
                    id: self.shared.id,
                    run_id: self.shared.run_id,
                    batch_id: id,
                });
            }
            let Ran {
                rows,
                metrics,
                source_metrics,
                state_operators,
                next_watermark,
                event_time,
                cluster,
            } = self
                .run_batch(
                    &planned,
                    read,
                    at.start.as_ref(),
                    at.last_watermark_ms,
                    &mut durations,
                )
                .instrument(self.batch_span(id))
                .await?;
            at.last_watermark_ms = planned.metadata.batch_watermark_ms;
            at.watermark_ms = next_watermark;
            let total = trigger_start.elapsed();
            durations.set(Phase::TriggerExecution, total.as_millis() as u64);
            let timing = Timing {
                wall_start,
                trigger_start,
                previous_trigger,
                durations,
                state_operators,
                event_time,
                cluster,
            };
            self.report(
                &planned,
                at.start.as_ref(),
                rows,
                (&metrics, source_metrics),
                timing,
            );
            previous_trigger = Some(trigger_start);
            at.start = Some(planned.end);
            at.next_id = id + 1;
            if interval > 0 {
                if total.as_millis() as u64 > interval {
                    tracing::warn!(
                        query = %self.shared.name,
                        "Current batch is falling behind. The trigger interval is {interval} milliseconds, but spent {} milliseconds",
                        total.as_millis()
                    );
                } else {
                    let now = (Instant::now() - origin).as_millis() as u64;
                    wait_until(origin + ms(next_tick(0, now, interval)), &mut stop).await;
                }
            }
        }
    }

    /// The span every log line about batch `id` is written in: it carries the query's
    /// name and the batch id as fields (`--log-format json` shows them on each line).
    fn batch_span(&self, id: u64) -> tracing::Span {
        tracing::info_span!("batch", query = %self.shared.name, batch_id = id)
    }

    /// Tells the listeners of batch `p`'s progress, and warns when the query falls behind.
    fn report(
        &mut self,
        p: &Planned,
        start: Option<&SourceOffset>,
        rows: u64,
        metrics: (&SinkMetrics, BTreeMap<String, String>),
        t: Timing,
    ) {
        let range = Range {
            source: self.spec.source.description(),
            start,
            end: &p.end,
            latest: p.latest.as_ref(),
        };
        let progress = report::progress(&self.shared, p.id, range, rows, metrics, t);
        let interval = self.spec.trigger.interval_ms();
        report::tell(
            &self.shared,
            &self.spec.listeners,
            &mut self.spec.behind,
            interval,
            progress,
        );
    }
}
