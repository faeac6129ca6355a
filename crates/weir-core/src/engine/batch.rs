//! One batch's work after its range is recorded: read the rows once, apply the steps, call
//! the function, commit the state. The loop (`engine::runner`) puts these together with the
//! checkpoint's logs and the read-ahead; nothing here writes `offsets/N` or `commits/N`.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::datasource::{MemTable, TableProvider, source_as_provider};
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::{DataFrame, SessionContext};
use futures::FutureExt;
use tokio::sync::Mutex;

use super::cluster::{Cluster, OnCluster, WorkerTasks, hold, run_and_hold, run_on_cluster};
use super::kept_plan::{SqlPlan, deal};
use super::stateful::{
    EventTime, EventTimeStats, Operator, StateSettings, check_no_operator_removed,
};
use super::transform::{Transform, sql_over_batch};
use crate::error::{Error, Result, panic_text};
use crate::fault::{self, AFTER_STATE_COMMIT, AFTER_USER_FN, BEFORE_STATE_COMMIT, BEFORE_USER_FN};
use crate::sink::{BatchContext, ForeachBatch};
use crate::source::{ReadLimit, Source, SourceOffset};
use crate::state::StateConf;
use crate::storage::Location;

/// A batch's rows read into memory, or on a cluster the plan that reads them where it
/// runs, with the source's figures as of that read.
pub(super) struct ReadRows {
    pub input: BatchInput,
    /// Rows read (0 for a plan: its scans count them when it runs).
    pub count: u64,
    pub metrics: BTreeMap<String, String>,
}

/// A batch's input.
pub(super) enum BatchInput {
    /// Read once into this process's memory.
    Held(Arc<MemTable>),
    /// The source's plan, read where it runs (on a cluster's workers).
    Planned(DataFrame),
}

/// The batch after `start`, planned and read while the batch ending at `start` ran.
pub(super) struct Ahead {
    pub start: SourceOffset,
    pub end: SourceOffset,
    pub latest: SourceOffset,
    pub rows: ReadRows,
}

/// Plans and reads the batch after `start` (latest offset under `limit`, then the range):
/// `None` when the source has nothing new. Nothing is recorded in the checkpoint.
pub(super) async fn read_ahead(
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

/// Reads `(start, end]` into memory once (see [`materialize`]), with the source's figures
/// as of the read.
pub(super) async fn read_rows(
    source: &dyn Source,
    ctx: &SessionContext,
    start: Option<&SourceOffset>,
    end: &SourceOffset,
) -> Result<ReadRows> {
    let df = source.read_range(ctx, start, end).await?;
    if crate::source::leaf::scans_on_cluster(ctx) {
        return Ok(ReadRows {
            input: BatchInput::Planned(df),
            count: 0,
            metrics: source.metrics(),
        });
    }
    let (table, count) = materialize(df).await?;
    Ok(ReadRows {
        input: BatchInput::Held(table),
        count,
        metrics: source.metrics(),
    })
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
async fn partitions_of(table: &MemTable) -> Vec<Vec<RecordBatch>> {
    let mut parts = Vec::with_capacity(table.batches.len());
    for p in &table.batches {
        parts.push(p.read().await.clone());
    }
    parts
}

/// Whether `t` keeps state that runs on the workers (a deduplication, an aggregation).
fn keeps_state_on_workers(t: &Transform) -> bool {
    matches!(
        t,
        Transform::DropDuplicates(_)
            | Transform::DropDuplicatesWithinWatermark(_)
            | Transform::Aggregate(_)
    )
}

/// The workers' rows come back in an order that depends on how the tasks ran (which
/// worker, how many, how their streams interleaved); the stateful steps get them sorted by
/// every column that has an order (ascending, NULLs first), so every run and every retry of
/// a batch passes the same row of a key and keeps the same event time in the state.
fn in_fixed_order(df: DataFrame) -> Result<DataFrame> {
    let by: Vec<datafusion::logical_expr::SortExpr> = df
        .schema()
        .fields()
        .iter()
        .filter(|f| super::stateful::on_workers::orderable(f.data_type()))
        .map(|f| datafusion::prelude::ident(f.name()).sort(true, true))
        .collect();
    if by.is_empty() {
        return Ok(df);
    }
    df.sort(by)
        .map_err(|e| Error::datafusion("ordering the cluster's rows", e))
}

/// What [`Steps::apply`] gives: the function's input, the batch's event times, and on a
/// cluster, when the plan ran there already (the query has a stateful step), the input rows
/// read and what each worker did.
pub(super) struct Applied {
    pub df: DataFrame,
    pub event_times: EventTimeStats,
    pub ran: Option<(u64, Vec<WorkerTasks>)>,
}

/// The query's steps between the source and the function, with the state they keep from
/// batch to batch.
pub(super) struct Steps {
    transforms: Vec<Transform>,
    /// The stateful operators, in the order of their transforms.
    stateful: Mutex<Vec<Operator>>,
    /// The plan of a query whose only transform is SQL, kept from batch to batch when it
    /// may be (see `engine::kept_plan`).
    sql_plan: Mutex<SqlPlan>,
    /// The watermark's column and delay in ms, if the query has one.
    watermark: Option<(String, i64)>,
    /// The query has a watermark and an operator that drops state when it passes.
    evicts_by_watermark: bool,
}

impl Steps {
    /// The steps of a query whose state lives under `state_root`, each stateful operator
    /// checked against what its state folder recorded.
    pub(super) async fn open(
        transforms: Vec<Transform>,
        state_root: &Location,
        retain: u64,
        partitions: Option<u32>,
    ) -> Result<Steps> {
        let settings = StateSettings {
            conf: StateConf::new(10, retain)?,
            partitions,
        };
        let mut stateful = Vec::new();
        let mut watermark = None;
        for t in &transforms {
            if let Some(op) = t.operator(stateful.len() as u32, state_root, settings)? {
                stateful.push(op);
            }
            if let Transform::Watermark { column, delay } = t {
                watermark = Some((
                    column.clone(),
                    i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
                ));
            }
        }
        check_no_operator_removed(state_root, stateful.len()).await?;
        for (i, op) in stateful.iter_mut().enumerate() {
            op.check_place(i as u32, state_root).await?;
        }
        let evicts_by_watermark = watermark.is_some() && stateful.iter().any(Operator::evicts);
        Ok(Steps {
            transforms,
            stateful: Mutex::new(stateful),
            sql_plan: Mutex::new(SqlPlan::default()),
            watermark,
            evicts_by_watermark,
        })
    }

    /// The watermark's column and delay in ms, if the query has one.
    pub(super) fn watermark(&self) -> Option<&(String, i64)> {
        self.watermark.as_ref()
    }

    /// Whether the query has a watermark and a stateful operator that drops state when the
    /// watermark passes it (so a batch without new rows can still have work to do).
    pub(super) fn evicts_by_watermark(&self) -> bool {
        self.evicts_by_watermark
    }

    /// The function's input for batch `batch_id`'s rows `table`, and the event times seen.
    ///
    /// On a cluster (`input` is a plan; with the query's id) the steps before the first stateful one (the
    /// watermark, a deduplication, an aggregation) are planned on it; that plan runs on the
    /// workers there and its rows are held here, where the rest runs. A deduplication
    /// first (or right after the watermark) runs on the workers with that plan, its state
    /// partitions as their tasks; any other stateful step runs here (the state's partitions
    /// on this machine's cores). What the workers did is returned then; `None` means the
    /// plan has not run yet.
    pub(super) async fn apply(
        &self,
        ctx: &SessionContext,
        input: BatchInput,
        batch_id: u64,
        event: Option<&EventTime>,
        cluster: Option<(&Arc<dyn Cluster>, uuid::Uuid)>,
    ) -> Result<Applied> {
        let mut event_times = EventTimeStats::default();
        let mut on_cluster = None;
        let mut df = match input {
            BatchInput::Planned(df) => df,
            BatchInput::Held(table) => {
                if let [Transform::Sql(sql)] = self.transforms.as_slice() {
                    let parts = partitions_of(&table).await;
                    let n = ctx.state_ref().read().config().target_partitions();
                    let df = self
                        .sql_plan
                        .lock()
                        .await
                        .frame(ctx, sql, table.schema(), deal(parts, n))
                        .await
                        .map_err(|e| Error::datafusion(format!("the SQL transform `{sql}`"), e))?;
                    return Ok(Applied {
                        df,
                        event_times,
                        ran: None,
                    });
                }
                ctx.read_table(table)
                    .map_err(|e| Error::datafusion("reading the materialized batch", e))?
            }
        };
        let mut stateful = 0;
        let mut skip = 0;
        for (i, t) in self.transforms.iter().enumerate() {
            if i < skip {
                continue;
            }
            let keeps_state = !matches!(t, Transform::Fn(_) | Transform::Sql(_));
            if let (true, Some((c, query)), true) = (keeps_state, cluster, on_cluster.is_none()) {
                // A deduplication (after the watermark, or first) runs its state partitions
                // on the workers; anything else stateful runs here on the workers' rows.
                let next = self.transforms.get(i + 1);
                let on_workers = match (t, next) {
                    (Transform::Watermark { column, .. }, Some(n)) if keeps_state_on_workers(n) => {
                        Some((Some(column.as_str()), i + 1))
                    }
                    (t, _) if keeps_state_on_workers(t) => Some((None, i)),
                    _ => None,
                };
                let mut ops = self.stateful.lock().await;
                match (on_workers, ops.get_mut(stateful)) {
                    (Some((observe, at)), Some(op)) => {
                        let (plan, schema) = op
                            .plan_on_workers(ctx, df, (query, batch_id), event, observe)
                            .await?;
                        let run = run_on_cluster(c, plan, batch_id).await?;
                        let (rows, seen) = op.ran_on_workers(run.batches, &schema)?;
                        if observe.is_some() {
                            event_times = seen;
                        }
                        df = in_fixed_order(hold(ctx, schema, rows)?)?;
                        on_cluster = Some((run.input_rows, run.workers));
                        stateful += 1;
                        skip = at + 1;
                        continue;
                    }
                    _ => {
                        drop(ops);
                        let (held, read, workers) = run_and_hold(c, ctx, df, batch_id).await?;
                        df = in_fixed_order(held)?;
                        on_cluster = Some((read, workers));
                    }
                }
            }
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
        Ok(Applied {
            df,
            event_times,
            ran: on_cluster,
        })
    }

    /// Commits every operator's state version N+1 (after the function, before
    /// `commits/N`); their progress entries.
    /// `failed` gives an operator's error its context.
    pub(super) async fn commit(
        &self,
        batch_id: u64,
        failed: impl Fn(Error) -> Error,
    ) -> Result<Vec<serde_json::Value>> {
        let mut entries = Vec::new();
        for op in self.stateful.lock().await.iter_mut() {
            fault::hit(BEFORE_STATE_COMMIT, batch_id)?;
            entries.push(op.commit().await.map_err(&failed)?);
            fault::hit(AFTER_STATE_COMMIT, batch_id)?;
        }
        Ok(entries)
    }

    /// Deletes state files past retention; `failed` gives an operator's error its context.
    pub(super) async fn purge(&self, failed: impl Fn(Error) -> Error) -> Result<()> {
        for op in self.stateful.lock().await.iter_mut() {
            op.purge().await.map_err(&failed)?;
        }
        Ok(())
    }
}

/// Calls the function for batch `ctx.batch_id` while `prepare` (the commit entry written
/// under a temp name) runs beside it; `prepare`'s result once the function returned `Ok`.
/// An error or a panic of the function fails the batch, naming it.
/// On a cluster (`on_workers`), a sink that writes on the workers is given the plan and
/// the cluster to run it on ([`ForeachBatch::write_on_workers`]) instead.
pub(super) async fn call<P>(
    sink: &dyn ForeachBatch,
    df: DataFrame,
    ctx: BatchContext,
    on_workers: Option<&OnCluster>,
    prepare: impl Future<Output = P>,
) -> Result<P> {
    let (query, batch_id) = (ctx.query_name.clone(), ctx.batch_id);
    fault::hit(BEFORE_USER_FN, batch_id)?;
    let work = async {
        match on_workers {
            Some(run) => sink.write_on_workers(df, ctx, run).await,
            None => sink.call(df, ctx).await,
        }
    };
    let (outcome, prepared) = futures::join!(AssertUnwindSafe(work).catch_unwind(), prepare);
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            return Err(Error::BatchFailed {
                query,
                batch_id,
                source,
            });
        }
        Err(panic) => {
            return Err(Error::BatchPanicked {
                query,
                batch_id,
                message: panic_text(panic.as_ref()),
            });
        }
    }
    fault::hit(AFTER_USER_FN, batch_id)?;
    Ok(prepared)
}
