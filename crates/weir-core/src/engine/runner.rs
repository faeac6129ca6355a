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

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::plan_err;
use datafusion::datasource::{MemTable, TableProvider, source_as_provider};
use datafusion::execution::context::SQLOptions;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::{DataFrame, SessionContext};
use futures::FutureExt;
use tokio::time::Instant;

use super::prepared::{SqlPlan, deal};
use super::progress::{
    BehindDetector, FallingBehind, QueryIdle, QueryListener, QueryStarted, QueryTerminated,
    SinkProgress, SourceProgress, StreamingQueryProgress,
};
use super::query::{Shared, Status};
use super::stateful::{Aggregation, EventTime, EventTimeStats, Operator};
use super::trigger::{Trigger, next_tick};
use crate::checkpoint::{Checkpoint, CommitMetadata, OffsetSeq, OffsetSeqMetadata, StartPoint};
use crate::error::{Error, Result};
use crate::fault;
use crate::sink::{BatchContext, ForeachBatch, SinkMetrics};
use crate::source::{ReadLimit, Source, SourceOffset};

/// The name under which a SQL transform sees the batch.
pub const BATCH_VIEW: &str = "batch";

/// Plans `sql` over `df`, which it sees as the table [`BATCH_VIEW`] of `ctx` (registered for
/// the planning only).
pub async fn sql_over_batch(
    ctx: &SessionContext,
    df: DataFrame,
    sql: &str,
) -> datafusion::error::Result<DataFrame> {
    sql_over_table(ctx, df.into_view(), sql).await
}

/// [`sql_over_batch`] over a table.
pub(crate) async fn sql_over_table(
    ctx: &SessionContext,
    table: Arc<dyn TableProvider>,
    sql: &str,
) -> datafusion::error::Result<DataFrame> {
    ctx.register_table(BATCH_VIEW, table)?;
    let planned = plan_query(ctx, sql).await;
    ctx.deregister_table(BATCH_VIEW)?;
    planned
}

/// Plans `sql` without running any of it. It must be a query: DDL (`CREATE VIEW`), DML
/// (`INSERT`, `COPY .. TO`) and statements (`SET`) would run when planned or at every
/// batch, outside any sink and its exactly-once, and give nothing to write.
async fn plan_query(ctx: &SessionContext, sql: &str) -> datafusion::error::Result<DataFrame> {
    let plan = ctx.state().create_logical_plan(sql).await?;
    let queries_only = SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false);
    if let Err(e) = queries_only.verify_plan(&plan) {
        return plan_err!(
            "it must be a query (SELECT ...) over `batch`, not a statement ({})",
            e.strip_backtrace()
        );
    }
    ctx.execute_logical_plan(plan).await
}

/// What [`check_transforms`] learned of the columns the function gets.
#[derive(Debug, Clone)]
pub enum TransformOutput {
    /// Names and types: every SQL step was planned.
    Schema(SchemaRef),
    /// The names only: an aggregation's value types come from the data.
    Names(Vec<String>),
    /// Known at run time only: a step (SQL over an aggregation's output, a DataFrame
    /// function) was not planned.
    Unknown,
}

/// Checks `transforms` against the source's columns without data, as far as the columns
/// are known before a batch runs: the start checks of the stateful steps, then every SQL
/// step planned (logical and physical, nothing run) over an empty batch of its input's
/// columns, as `weir check` does.
pub(crate) async fn check_transforms(
    ctx: &SessionContext,
    source: SchemaRef,
    transforms: &[Transform],
) -> Result<TransformOutput> {
    super::check_at_start(&source, transforms)?;
    let mut schema = source;
    for (i, t) in transforms.iter().enumerate() {
        match t {
            t if t.keeps_columns() => {}
            Transform::Aggregate(a) => {
                let names = a.output_names(&schema)?;
                return Ok(
                    if transforms[i + 1..].iter().all(Transform::keeps_columns) {
                        TransformOutput::Names(names)
                    } else {
                        TransformOutput::Unknown
                    },
                );
            }
            Transform::Sql(sql) => {
                let failed = |e| Error::datafusion(format!("the SQL transform `{sql}`"), e);
                let empty = MemTable::try_new(schema.clone(), vec![vec![]]).map_err(failed)?;
                let df = sql_over_table(ctx, Arc::new(empty), sql)
                    .await
                    .map_err(failed)?;
                schema = df.schema().inner().clone();
                df.create_physical_plan().await.map_err(failed)?;
            }
            // A DataFrame function: its columns are known when it runs.
            _ => return Ok(TransformOutput::Unknown),
        }
    }
    Ok(TransformOutput::Schema(schema))
}

/// A stateless step between the source and the function.
#[derive(Clone)]
pub enum Transform {
    /// SQL over the batch, which it sees as the view `batch`.
    Sql(String),
    /// A DataFrame function.
    Fn(Arc<dyn Fn(DataFrame) -> datafusion::error::Result<DataFrame> + Send + Sync>),
    /// Streaming deduplication on these columns: a row passes only if no earlier row, in
    /// this batch or any before it, had the same values (see `engine::stateful`).
    DropDuplicates(Vec<String>),
    /// Spark's `withWatermark`: the event-time column and how late its rows may come.
    Watermark { column: String, delay: Duration },
    /// Spark's `dropDuplicatesWithinWatermark`: a row passes unless a row with the same
    /// values came before it less than the watermark's delay earlier (in event time).
    DropDuplicatesWithinWatermark(Vec<String>),
    /// A streaming aggregation (see [`Aggregation`]).
    Aggregate(Aggregation),
}

impl Transform {
    /// Whether the step passes rows on with the columns they came with (watermark,
    /// deduplication).
    pub(crate) fn keeps_columns(&self) -> bool {
        matches!(
            self,
            Transform::Watermark { .. }
                | Transform::DropDuplicates(_)
                | Transform::DropDuplicatesWithinWatermark(_)
        )
    }
}

/// Everything the runner needs; built by `DataStreamWriter::start`.
pub(crate) struct QuerySpec {
    pub checkpoint: Checkpoint,
    pub start: StartPoint,
    pub source: Arc<dyn Source>,
    pub limit: ReadLimit,
    pub transforms: Vec<Transform>,
    pub sink: Arc<dyn ForeachBatch>,
    pub trigger: Trigger,
    pub retain: u64,
    pub listeners: Vec<Arc<dyn QueryListener>>,
    pub behind: BehindDetector,
    pub ctx: SessionContext,
    pub conf: BTreeMap<String, String>,
    pub no_data_delay: Duration,
}

/// Runs the query to its end and records how it ended in `shared`.
pub(crate) async fn run(spec: QuerySpec, shared: Arc<Shared>) {
    let listeners = spec.listeners.clone();
    let checkpoint = spec.checkpoint.clone();
    let task_shared = shared.clone();
    let outcome = tokio::spawn(async move {
        let conf = crate::state::StateConf::new(10, spec.retain)?;
        let mut stateful = Vec::new();
        let root = spec.checkpoint.state_root();
        let mut watermark = None;
        for t in &spec.transforms {
            if let Some(op) = Operator::for_transform(stateful.len() as u32, t, &root, conf)? {
                stateful.push(op);
            }
            if let Transform::Watermark { column, delay } = t {
                watermark = Some((
                    column.clone(),
                    i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
                ));
            }
        }
        super::stateful::check_no_operator_removed(&root, stateful.len()).await?;
        for (i, op) in stateful.iter().enumerate() {
            op.check_place(i as u32, &root).await?;
        }
        Runner {
            spec,
            shared: task_shared,
            stateful: tokio::sync::Mutex::new(stateful),
            watermark,
            ahead: tokio::sync::Mutex::new(None),
            untold: tokio::sync::Mutex::new(None),
            sql_plan: tokio::sync::Mutex::new(SqlPlan::default()),
        }
        .run()
        .await
    })
    .await;
    let result = match outcome {
        Ok(r) => r,
        Err(join) => Err(Error::Panicked {
            query: shared.name.clone(),
            last_batch: shared.current_batch(),
            message: panic_message(join),
        }),
    };
    checkpoint.release().await;
    let error = result.as_ref().err().map(|e| crate::sink::error_chain(e));
    if let Some(e) = &error {
        tracing::error!(query = %shared.name, "query terminated with an error: {e}");
    }
    for l in &listeners {
        l.on_query_terminated(&QueryTerminated {
            id: shared.id,
            run_id: shared.run_id,
            error: error.clone(),
        });
    }
    shared.status.send_replace(match result {
        Ok(()) => Status::Stopped,
        Err(e) => Status::Failed(Arc::new(e)),
    });
}

fn panic_message(join: tokio::task::JoinError) -> String {
    if join.is_cancelled() {
        return "the query task was cancelled".into();
    }
    let panic = join.into_panic();
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

struct Runner {
    spec: QuerySpec,
    shared: Arc<Shared>,
    /// The stateful operators, in the order of their transforms.
    stateful: tokio::sync::Mutex<Vec<Operator>>,
    /// The watermark's column and delay in ms, if the query has one.
    watermark: Option<(String, i64)>,
    /// The next batch, being read while the current one's function runs.
    ahead: tokio::sync::Mutex<Option<tokio::task::JoinHandle<Result<Option<Ahead>>>>>,
    /// The end of a committed batch the source has not been told of yet (it is told once
    /// the read ahead started beside that batch has finished).
    untold: tokio::sync::Mutex<Option<(u64, SourceOffset)>>,
    /// The plan of a query whose only transform is SQL, kept from batch to batch when it
    /// may be (see `engine::prepared`).
    sql_plan: tokio::sync::Mutex<SqlPlan>,
}

/// What one batch reads.
struct Planned {
    id: u64,
    end: SourceOffset,
    latest: Option<SourceOffset>,
    metadata: OffsetSeqMetadata,
    replay: bool,
}

/// A batch's rows read into memory, with the source's figures as of that read.
struct ReadRows {
    table: Arc<MemTable>,
    count: u64,
    metrics: BTreeMap<String, String>,
}

/// The batch after `start`, planned and read while the batch ending at `start` ran.
struct Ahead {
    start: SourceOffset,
    end: SourceOffset,
    latest: SourceOffset,
    rows: ReadRows,
}

/// Plans and reads the batch after `start` (latest offset under `limit`, then the range):
/// `None` when the source has nothing new. Nothing is recorded in the checkpoint.
async fn read_ahead(
    source: Arc<dyn Source>,
    ctx: SessionContext,
    start: SourceOffset,
    limit: ReadLimit,
) -> Result<Option<Ahead>> {
    let Some(end) = source
        .latest_offset(Some(&start), limit)
        .await?
        .filter(|e| e != &start)
    else {
        return Ok(None);
    };
    let latest = source.latest_seen().unwrap_or_else(|| end.clone());
    let rows = read_rows(source.as_ref(), &ctx, Some(&start), &end).await?;
    Ok(Some(Ahead {
        start,
        end,
        latest,
        rows,
    }))
}

/// Step 3: reads `(start, end]` into memory once (see [`materialize`]), with the source's
/// figures as of the read.
async fn read_rows(
    source: &dyn Source,
    ctx: &SessionContext,
    start: Option<&SourceOffset>,
    end: &SourceOffset,
) -> Result<ReadRows> {
    let df = source.read_range(ctx, start, end).await?;
    let (table, count) = materialize(df).await?;
    Ok(ReadRows {
        table,
        count,
        metrics: source.metrics(),
    })
}

impl Runner {
    fn in_batch(&self, batch_id: u64, stage: &'static str) -> impl Fn(Error) -> Error + '_ {
        move |e| Error::Batch {
            query: self.shared.name.clone(),
            batch_id,
            stage,
            source: Box::new(e),
        }
    }

    async fn run(mut self) -> Result<()> {
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

    /// Whether the next batch starts right after this one, so reading it ahead pays.
    fn reads_ahead(&self) -> bool {
        match self.spec.trigger {
            Trigger::AvailableNow => true,
            Trigger::ProcessingTime(d) => d.is_zero(),
            Trigger::Once | Trigger::Continuous(_) => false,
        }
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
                        crate::sink::error_chain(&e)
                    );
                    None
                }
                Err(join) => {
                    tracing::warn!(
                        query = %self.shared.name,
                        "reading batch {id} ahead failed: {}; reading it again",
                        panic_message(join)
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
        let path_of = |id: u64, cp: &Checkpoint| cp.offsets_name(id);
        // The watermark the next new batch runs with, and the one the last batch ran with
        // (which the next batch filters late rows with, as Spark does since 3.4).
        let (mut watermark_ms, mut last_watermark_ms) = match &self.spec.start {
            StartPoint::Fresh => (0, 0),
            StartPoint::Replay { batch, start, .. } => (
                batch.metadata.batch_watermark_ms,
                start.as_ref().map_or(0, |s| s.metadata.batch_watermark_ms),
            ),
            StartPoint::Next {
                previous, commit, ..
            } => (
                commit.next_batch_watermark_ms,
                previous.metadata.batch_watermark_ms,
            ),
        };
        let (mut next_id, mut start, mut pending) =
            match std::mem::replace(&mut self.spec.start, StartPoint::Fresh) {
                StartPoint::Fresh => (0, None, None),
                StartPoint::Replay {
                    batch_id,
                    start,
                    batch,
                } => {
                    let start = match start {
                        Some(s) => {
                            Some(s.source(0, &path_of(batch_id - 1, &self.spec.checkpoint))?)
                        }
                        None => None,
                    };
                    (batch_id, start, Some(batch))
                }
                StartPoint::Next {
                    batch_id, previous, ..
                } => (
                    batch_id,
                    Some(previous.source(0, &path_of(batch_id - 1, &self.spec.checkpoint))?),
                    None,
                ),
            };
        // The batch before the first one is committed: let the source catch up on what it
        // does after a commit (a crash may have come between the commit and that).
        if let Some(s) = &start {
            self.spec.source.commit(s).await.map_err(self.in_batch(
                next_id.saturating_sub(1),
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
                first_batch_id: next_id,
                replay: pending.is_some(),
            });
        }
        let mut stop = self.shared.stop.subscribe();
        let mut previous_trigger: Option<Instant> = None;
        let mut idle_reported = false;
        let interval = self.spec.trigger.interval_ms();
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            let trigger_start = Instant::now();
            let wall_start = chrono::Utc::now();
            let mut durations = BTreeMap::new();
            let ahead = self
                .settle(next_id)
                .await?
                .filter(|(a, _)| Some(&a.start) == start.as_ref());
            // The rows, when they were read ahead.
            let mut read = None;
            let planned = match (pending.take(), ahead) {
                (Some(seq), _) => {
                    let end = seq.source(0, &self.spec.checkpoint.offsets_name(next_id))?;
                    tracing::info!(query = %self.shared.name, batch = next_id, "running batch {next_id} again with its recorded offsets {end}");
                    Planned {
                        id: next_id,
                        end,
                        latest: None,
                        metadata: seq.metadata,
                        replay: true,
                    }
                }
                // Read while the batch before ran: only the wait for it is this batch's.
                (None, Some((a, waited))) => {
                    durations.insert("latestOffset".into(), 0);
                    durations.insert("getBatch".into(), waited);
                    read = Some(a.rows);
                    self.record(next_id, a.end, a.latest, watermark_ms, &mut durations)
                        .instrument(self.batch_span(next_id))
                        .await?
                }
                (None, None) => match self
                    .plan(next_id, start.as_ref(), watermark_ms, &mut durations)
                    .instrument(self.batch_span(next_id))
                    .await?
                {
                    Some(p) => p,
                    // Spark's no-data batch: the watermark moved, so windows close and
                    // state is evicted although nothing new came.
                    None if self.spec.trigger != Trigger::Once
                        && watermark_ms > last_watermark_ms
                        && self.watermark.is_some()
                        && self.stateful.lock().await.iter().any(Operator::evicts)
                        && let Some(s) = &start =>
                    {
                        self.plan_no_data(next_id, s, watermark_ms, &mut durations)
                            .instrument(self.batch_span(next_id))
                            .await?
                    }
                    None => {
                        match self.spec.trigger {
                            Trigger::Once => return Ok(()),
                            Trigger::AvailableNow => {
                                if self.spec.source.reached_available_now().await? {
                                    return Ok(());
                                }
                                return Err(Error::Batch {
                                    query: self.shared.name.clone(),
                                    batch_id: next_id,
                                    stage: "draining the source (available-now)",
                                    source: Box::new(Error::from_source(
                                        self.spec.source.description(),
                                        format!(
                                            "the source holds data that was there when the query \
                                             started, but offered no new offset after {}: the query \
                                             stops with an error rather than end with data unread",
                                            start
                                                .as_ref()
                                                .map_or("the start".to_string(), |s| s.to_string())
                                        ),
                                    )),
                                });
                            }
                            _ => {}
                        }
                        if !idle_reported {
                            idle_reported = true;
                            for l in &self.spec.listeners {
                                l.on_query_idle(&QueryIdle {
                                    id: self.shared.id,
                                    run_id: self.shared.run_id,
                                    next_batch_id: next_id,
                                });
                            }
                        }
                        let wake = if interval == 0 {
                            trigger_start + self.spec.no_data_delay
                        } else {
                            origin
                                + ms(next_tick(
                                    0,
                                    (trigger_start - origin).as_millis() as u64,
                                    interval,
                                ))
                        };
                        wait_until(wake, &mut stop).await;
                        continue;
                    }
                },
            };
            idle_reported = false;
            let id = planned.id;
            let Ran {
                rows,
                metrics,
                source_metrics,
                state_operators,
                next_watermark,
                event_time,
            } = self
                .run_batch(
                    &planned,
                    read,
                    start.as_ref(),
                    last_watermark_ms,
                    &mut durations,
                )
                .instrument(self.batch_span(id))
                .await?;
            last_watermark_ms = planned.metadata.batch_watermark_ms;
            watermark_ms = next_watermark;
            let total = trigger_start.elapsed();
            durations.insert("triggerExecution".into(), total.as_millis() as u64);
            let timing = Timing {
                wall_start,
                trigger_start,
                previous_trigger,
                durations,
                state_operators,
                event_time,
            };
            self.report(
                &planned,
                start.as_ref(),
                rows,
                (&metrics, source_metrics),
                timing,
            );
            previous_trigger = Some(trigger_start);
            start = Some(planned.end);
            next_id = id + 1;
            if self.spec.trigger == Trigger::Once {
                return Ok(());
            }
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

    /// Records batch `id` as a no-data batch: the range of the batch before (nothing to
    /// read) with the watermark that moved since.
    async fn plan_no_data(
        &self,
        id: u64,
        start: &SourceOffset,
        watermark_ms: i64,
        durations: &mut BTreeMap<String, u64>,
    ) -> Result<Planned> {
        tracing::info!(query = %self.shared.name, batch = id, "no-data batch {id}: the watermark moved to {}", super::stateful::iso(watermark_ms));
        self.record(id, start.clone(), start.clone(), watermark_ms, durations)
            .await
    }

    /// Step 2: writes `offsets/N` for batch `id` ending at `end`.
    async fn record(
        &self,
        id: u64,
        end: SourceOffset,
        latest: SourceOffset,
        watermark_ms: i64,
        durations: &mut BTreeMap<String, u64>,
    ) -> Result<Planned> {
        let metadata = OffsetSeqMetadata {
            batch_watermark_ms: watermark_ms,
            batch_timestamp_ms: chrono::Utc::now().timestamp_millis(),
            conf: self.spec.conf.clone(),
        };
        let t = Instant::now();
        let seq = OffsetSeq {
            metadata: metadata.clone(),
            offsets: vec![Some(end.clone())],
        };
        self.shared.set_current_batch(id);
        self.spec.checkpoint.write_offsets(id, &seq).await?;
        durations.insert("walCommit".into(), t.elapsed().as_millis() as u64);
        fault::hit("after-offsets-write", id)?;
        Ok(Planned {
            id,
            latest: Some(latest),
            end,
            metadata,
            replay: false,
        })
    }

    /// The read limit of every batch under the query's trigger.
    fn read_limit(&self) -> ReadLimit {
        match self.spec.trigger {
            Trigger::Once => ReadLimit::ALL,
            // Drain what is there, in batches of the max limits; never wait for more.
            Trigger::AvailableNow => ReadLimit {
                min_rows: None,
                ..self.spec.limit
            },
            _ => self.spec.limit,
        }
    }

    /// Steps 1-2: decides batch `id`'s range and records it. `None`: no new data.
    async fn plan(
        &self,
        id: u64,
        start: Option<&SourceOffset>,
        watermark_ms: i64,
        durations: &mut BTreeMap<String, u64>,
    ) -> Result<Option<Planned>> {
        let limit = self.read_limit();
        let t = Instant::now();
        let latest = self
            .spec
            .source
            .latest_offset(start, limit)
            .await
            .map_err(self.in_batch(id, "asking the source for new data"))?;
        durations.insert("latestOffset".into(), t.elapsed().as_millis() as u64);
        let Some(end) = latest.filter(|l| Some(l) != start) else {
            return Ok(None);
        };
        let latest = self
            .spec
            .source
            .latest_seen()
            .unwrap_or_else(|| end.clone());
        self.record(id, end, latest, watermark_ms, durations)
            .await
            .map(Some)
    }

    /// Steps 3-5 for a planned batch.
    async fn run_batch(
        &self,
        p: &Planned,
        read: Option<ReadRows>,
        start: Option<&SourceOffset>,
        late_watermark_ms: i64,
        durations: &mut BTreeMap<String, u64>,
    ) -> Result<Ran> {
        let id = p.id;
        self.shared.set_current_batch(id);
        let ctx = &self.spec.ctx;
        let read = match read {
            Some(r) => r,
            None => {
                let t = Instant::now();
                let r = read_rows(self.spec.source.as_ref(), ctx, start, &p.end)
                    .await
                    .map_err(self.in_batch(id, "reading the source"))?;
                durations.insert("getBatch".into(), t.elapsed().as_millis() as u64);
                r
            }
        };
        let ReadRows {
            table,
            count: rows,
            metrics: source_metrics,
        } = read;

        let t = Instant::now();
        let event = self.watermark.as_ref().map(|(column, delay_ms)| EventTime {
            column: column.clone(),
            delay_ms: *delay_ms,
            watermark_ms: p.metadata.batch_watermark_ms,
            late_ms: late_watermark_ms,
        });
        let (df, event_times) = self
            .transform(table, id, event.as_ref())
            .await
            .map_err(self.in_batch(id, "applying the transforms"))?;
        durations.insert("queryPlanning".into(), t.elapsed().as_millis() as u64);

        // The next batch is read while this one's function writes (see the module docs).
        let ahead = self.reads_ahead();
        if ahead {
            let handle = tokio::spawn(
                read_ahead(
                    self.spec.source.clone(),
                    ctx.clone(),
                    p.end.clone(),
                    self.read_limit(),
                )
                .instrument(self.batch_span(id + 1)),
            );
            *self.ahead.lock().await = Some(handle);
        }

        let t = Instant::now();
        fault::hit("before-user-fn", id)?;
        let metrics = Arc::new(SinkMetrics::default());
        let app_name = self
            .spec
            .checkpoint
            .created_name()
            .unwrap_or(&self.shared.name)
            .to_string();
        let mut bctx =
            BatchContext::on_session(self.shared.id, self.shared.name.clone(), id, ctx.clone())
                .with_run(self.shared.run_id, p.metadata.batch_timestamp_ms)
                .replay(p.replay)
                .new_checkpoint(self.spec.checkpoint.is_new())
                .with_app_name(app_name);
        bctx.metrics = metrics.clone();
        let next_watermark = match &event {
            Some(e) => event_times.next_watermark(e.watermark_ms, e.delay_ms),
            None => 0,
        };
        // `commits/N`'s content is known before the function runs: it is made durable under
        // a temp name meanwhile and linked into place only after the function (and the
        // state) succeeded. A failure drops it unlinked.
        let commit = CommitMetadata {
            next_batch_watermark_ms: next_watermark,
        };
        let (outcome, prepared) = futures::join!(
            AssertUnwindSafe(self.spec.sink.call(df, bctx)).catch_unwind(),
            self.spec.checkpoint.prepare_commit(id, &commit),
        );
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                return Err(Error::BatchFailed {
                    query: self.shared.name.clone(),
                    batch_id: id,
                    source,
                });
            }
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                return Err(Error::BatchPanicked {
                    query: self.shared.name.clone(),
                    batch_id: id,
                    message,
                });
            }
        }
        fault::hit("after-user-fn", id)?;

        // State version N+1, before `commits/N` (a replay of N loads version N again).
        let mut state_operators = Vec::new();
        let mut stateful = self.stateful.lock().await;
        for op in stateful.iter_mut() {
            fault::hit("before-state-commit", id)?;
            state_operators.push(
                op.commit()
                    .await
                    .map_err(self.in_batch(id, "committing the state"))?,
            );
            fault::hit("after-state-commit", id)?;
        }
        durations.insert("addBatch".into(), t.elapsed().as_millis() as u64);

        let t = Instant::now();
        fault::hit("before-commit-write", id)?;
        self.spec.checkpoint.finish_commit(id, prepared?).await?;
        fault::hit("after-commit-write", id)?;
        // With a read ahead running, the source hears of the commit once that read is done
        // (a source is never asked two things at once).
        *self.untold.lock().await = Some((id, p.end.clone()));
        if !ahead {
            self.tell_committed().await?;
        }
        if let Some(keep_from) = crate::checkpoint::retention::keep_from(id, self.spec.retain) {
            self.spec.checkpoint.purge(keep_from).await?;
        }
        for op in stateful.iter_mut() {
            op.purge()
                .await
                .map_err(self.in_batch(id, "deleting state files past retention"))?;
        }
        durations.insert("commitOffsets".into(), t.elapsed().as_millis() as u64);
        let event_time = match &event {
            Some(e) => event_times.progress(e.watermark_ms),
            None => BTreeMap::new(),
        };
        Ok(Ran {
            rows,
            metrics,
            source_metrics,
            state_operators,
            next_watermark,
            event_time,
        })
    }

    async fn transform(
        &self,
        table: Arc<MemTable>,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<(DataFrame, EventTimeStats)> {
        let ctx = &self.spec.ctx;
        let mut event_times = EventTimeStats::default();
        if let [Transform::Sql(sql)] = self.spec.transforms.as_slice() {
            let parts = partitions_of(&table).await;
            let n = ctx.state_ref().read().config().target_partitions();
            let df = self
                .sql_plan
                .lock()
                .await
                .frame(ctx, sql, table.schema(), deal(parts, n))
                .await
                .map_err(|e| Error::datafusion(format!("the SQL transform `{sql}`"), e))?;
            return Ok((df, event_times));
        }
        let mut df = ctx
            .read_table(table.clone())
            .map_err(|e| Error::datafusion("reading the materialized batch", e))?;
        let mut stateful = 0;
        for t in &self.spec.transforms {
            df = match t {
                Transform::DropDuplicates(_)
                | Transform::DropDuplicatesWithinWatermark(_)
                | Transform::Aggregate(_) => {
                    let mut ops = self.stateful.lock().await;
                    let op = ops.get_mut(stateful).ok_or_else(|| Error::Internal {
                        what: format!("stateful operator {stateful} was not set up"),
                    })?;
                    stateful += 1;
                    op.apply(ctx, df, batch_id, event).await?
                }
                Transform::Watermark { column, .. } => {
                    let (df, stats) = super::stateful::observe_event_times(ctx, df, column).await?;
                    event_times = stats;
                    df
                }
                Transform::Fn(f) => {
                    f(df).map_err(|e| Error::datafusion("the DataFrame transform", e))?
                }
                Transform::Sql(sql) => sql_over_batch(ctx, df, sql)
                    .await
                    .map_err(|e| Error::datafusion(format!("the SQL transform `{sql}`"), e))?,
            };
        }
        Ok((df, event_times))
    }

    fn report(
        &mut self,
        p: &Planned,
        start: Option<&SourceOffset>,
        rows: u64,
        (metrics, source_metrics): (&SinkMetrics, BTreeMap<String, String>),
        t: Timing,
    ) {
        let Timing {
            wall_start,
            trigger_start,
            previous_trigger,
            durations,
            state_operators,
            event_time,
        } = t;
        let total_ms = durations.get("triggerExecution").copied().unwrap_or(0);
        let processed = per_second(rows, total_ms as f64 / 1000.0);
        let input = previous_trigger.map_or(0.0, |prev| {
            per_second(rows, (trigger_start - prev).as_secs_f64())
        });
        let progress = StreamingQueryProgress {
            id: self.shared.id,
            run_id: self.shared.run_id,
            name: self.shared.name.clone(),
            timestamp: wall_start.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
            batch_id: p.id,
            batch_duration: total_ms,
            num_input_rows: rows,
            input_rows_per_second: input,
            processed_rows_per_second: processed,
            duration_ms: durations,
            event_time,
            state_operators,
            sources: vec![SourceProgress {
                description: self.spec.source.description(),
                start_offset: start.map(|s| s.json().clone()),
                end_offset: Some(p.end.json().clone()),
                latest_offset: p.latest.as_ref().map(|s| s.json().clone()),
                num_input_rows: rows,
                input_rows_per_second: input,
                processed_rows_per_second: processed,
                metrics: source_metrics,
            }],
            sink: SinkProgress {
                description: "ForeachBatchSink".into(),
                num_output_rows: metrics.output_rows(),
                metrics: metrics.entries().into_iter().collect(),
            },
        };
        tracing::debug!(query = %self.shared.name, "progress: {}", progress.json());
        for l in &self.spec.listeners {
            l.on_query_progress(&progress);
        }
        let add_batch = progress.duration("addBatch");
        let interval = self.spec.trigger.interval_ms();
        if self.spec.behind.observe(add_batch, interval) {
            let event = FallingBehind {
                id: self.shared.id,
                name: self.shared.name.clone(),
                batch_id: p.id,
                trigger_interval_ms: interval,
                add_batch_ms: add_batch,
                fraction: self.spec.behind.fraction,
                consecutive: self.spec.behind.streak(),
            };
            tracing::warn!(
                query = %self.shared.name,
                "falling behind: addBatch took more than {:.0}% of the {interval} ms trigger interval for {} batches in a row (batch {} took {add_batch} ms); raise the interval or lower maxFilesPerTrigger/maxOffsetsPerTrigger",
                event.fraction * 100.0,
                event.consecutive,
                p.id
            );
            for l in &self.spec.listeners {
                l.on_falling_behind(&event);
            }
        }
        self.shared.push_progress(progress);
    }
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
}

/// When a batch ran, for its progress report.
struct Timing {
    wall_start: chrono::DateTime<chrono::Utc>,
    trigger_start: Instant,
    previous_trigger: Option<Instant>,
    durations: BTreeMap<String, u64>,
    /// The stateful operators' progress entries.
    state_operators: Vec<serde_json::Value>,
    /// Spark's `eventTime` entry (empty without a watermark).
    event_time: BTreeMap<String, String>,
}

/// Reads the batch once into memory: the row count for progress, and every action of the
/// function (and every sink of a fan-out) reads this copy instead of the source again.
async fn materialize(df: DataFrame) -> Result<(Arc<MemTable>, u64)> {
    let schema = df.schema().inner().clone();
    // A source that read the range into memory (the file source) hands over a scan of an
    // in-memory table: its batches are taken as they are, without planning a query.
    if let LogicalPlan::TableScan(scan) = df.logical_plan()
        && scan.projection.is_none()
        && scan.filters.is_empty()
        && scan.fetch.is_none()
        && let Ok(provider) = source_as_provider(&scan.source)
        && provider.schema() == schema
        && let Ok(held) = (provider as Arc<dyn std::any::Any + Send + Sync>).downcast::<MemTable>()
    {
        let rows = partitions_of(&held)
            .await
            .iter()
            .flatten()
            .map(|b| b.num_rows() as u64)
            .sum();
        return Ok((held, rows));
    }
    let parts = df
        .collect_partitioned()
        .await
        .map_err(|e| Error::datafusion("reading the batch", e))?;
    let rows = parts.iter().flatten().map(|b| b.num_rows() as u64).sum();
    let table =
        MemTable::try_new(schema, parts).map_err(|e| Error::datafusion("holding the batch", e))?;
    Ok((Arc::new(table), rows))
}

/// The record batches of each partition of an in-memory table.
async fn partitions_of(table: &MemTable) -> Vec<Vec<datafusion::arrow::array::RecordBatch>> {
    let mut parts = Vec::with_capacity(table.batches.len());
    for p in &table.batches {
        parts.push(p.read().await.clone());
    }
    parts
}

fn per_second(rows: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        0.0
    } else {
        (rows as f64 / secs * 10.0).round() / 10.0
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

async fn wait_until(deadline: Instant, stop: &mut tokio::sync::watch::Receiver<bool>) {
    tokio::select! {
        _ = tokio::time::sleep_until(deadline) => {}
        _ = stop.wait_for(|s| *s) => {}
    }
}
