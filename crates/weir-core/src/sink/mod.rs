//! What a batch is handed to: the `foreachBatch` contract, and the sinks weir ships in core.
//!
//! | sink | idempotency pattern | on replay |
//! |---|---|---|
//! | [`ParquetSink`] | file names derived from (batch id, part), temp name + rename | the same files are written again |
//! | [`ParquetSink`] on a cluster | tasks write staged parts; the driver moves them to the same names ([`ParquetPartsExec`]) | the same names are written again |
//!
//! The Delta, PostgreSQL and console sinks live in their own crates and implement the same
//! trait.

mod context;
mod parquet;
mod parquet_dictionary;
mod parquet_encode;
mod parquet_parts;
pub mod recorded;
mod timeout;
pub mod upsert;
mod worker_write;

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::prelude::DataFrame;
use futures::FutureExt;
use tracing::Instrument;

use crate::error::{BoxError, Error};

/// Where it was first: the chain printer lives with the error type now.
pub use crate::error::error_chain;
pub use context::{BatchContext, CACHE_DURATION_KEY, QueryIdentity, SinkMetric, SinkMetrics};
pub(crate) use parquet::OWNER;
pub use parquet::{PARQUET_BETWEEN_MOVES, PARQUET_POINTS, ParquetSink};
pub use parquet_encode::ParquetCompression;
pub use parquet_parts::{PARQUET_PARTS, ParquetPartsExec, PartsWrite};
pub use timeout::WithTimeout;
pub use upsert::{NullKeys, NullOrdering, dedupe_latest};
pub(crate) use worker_write::WritePlanner;
// Where the sinks (and the connectors) have always found them; they live in `error` so a
// source can mark its own data errors without depending on `sink`.
pub use crate::error::{is_data_error, task_data_error};
pub use worker_write::{
    DecodeWrite, PlanNodes, WorkerWrite, WriteKind, WritePlan, find_write, on_workers, read_body,
    task_error, write_body, write_location, write_properties, written_batch, written_rows,
    written_schema,
};

/// The user's function: called once per attempt of a batch, on one task, batches in order.
///
/// Promises the engine makes: `ctx.batch_id` increases by one per new batch; after a crash
/// the same batch id comes again with the same rows (for a deterministic transform), so the
/// function must make a second write of that batch harmless (see the sinks). The engine
/// commits the batch only when this returns `Ok`. Returning `Err` (or panicking) stops the
/// query with an error naming the batch; nothing is committed. Never catch a write error
/// and return `Ok`: that batch's data would be lost.
#[async_trait]
pub trait ForeachBatch: Send + Sync {
    /// Called when the query starts, before its first batch (and before `start()`
    /// returns): a sink checks that it may write where it was told, and refuses to start
    /// otherwise (a folder another query owns, ...). Called again when the query starts
    /// over in the same process after a failure that may pass (`engine::retry`). The
    /// default does nothing.
    ///
    /// An error of a sink's (here or from a write) that may pass, such as its server being
    /// down, is wrapped in [`crate::error::Transient`]: the batch then runs again after a
    /// pause instead of stopping the query.
    async fn open(&self, _query: &crate::sink::QueryIdentity) -> Result<(), BoxError> {
        Ok(())
    }

    /// Writes one batch (see the trait docs).
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError>;

    /// Work of `call` that no reader sees and that every attempt redoes from scratch (the
    /// PostgreSQL sink's staging rows, cleared and loaded again per attempt). A [`FanOut`]
    /// runs it beside the sinks before this one, so it overlaps their writes, and calls
    /// `call` after it, in the same order as without it; `call` then skips what was staged
    /// for this run and batch. Called alone, `call` does everything. The default stages
    /// nothing.
    async fn stage(&self, _batch: DataFrame, _ctx: BatchContext) -> Result<(), BoxError> {
        Ok(())
    }

    /// The `call` after a successful `stage` will not come (a sink before this one failed):
    /// drop what the stage holds. The default has nothing to drop.
    async fn discard(&self, _ctx: BatchContext) {}

    /// Whether this sink writes a batch where the batch's plan runs (a cluster's workers,
    /// each task writing its share) with [`ForeachBatch::write_on_workers`], so that the
    /// rows never come to this process. The default: no, the rows are brought here and
    /// `call` writes them.
    fn writes_on_workers(&self) -> bool {
        false
    }

    /// Writes the batch the way [`ForeachBatch::writes_on_workers`] says: builds a plan
    /// over `batch` whose tasks write their rows and output what they wrote, runs it with
    /// `run` (which retries it on the workers left when a worker is lost), then commits
    /// what the tasks wrote, once, here. The same promises as `call`: a replay of the batch
    /// must leave each row once. The default calls `call`.
    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        _run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        self.call(batch, ctx).await
    }
}

/// Runs a plan where the batch's plan runs (on a cluster: on the workers, attempt after
/// attempt until one succeeds or the cluster's limit is reached) and brings its output
/// here: what a sink's tasks wrote, never the batch's rows.
#[async_trait]
pub trait PlanRunner: Send + Sync {
    /// `plan`'s output, from the first attempt that succeeded.
    async fn run(
        &self,
        plan: DataFrame,
    ) -> crate::error::Result<Vec<datafusion::arrow::array::RecordBatch>>;
}

#[async_trait]
impl<F, Fut> ForeachBatch for F
where
    F: Fn(DataFrame, BatchContext) -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), BoxError>> + Send,
{
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        (self)(batch, ctx).await
    }
}

/// Several sinks fed from one read of the batch, in order: the batch is materialized once
/// (so no sink reads the source again), each sink is called in turn, and the first error
/// stops the rest. Put the write that is hardest to undo last. The memory is released when
/// the call returns, whether it succeeded or not. Each sink's time goes into the progress
/// report's `sink.metrics` as `<name>.durationMs`.
///
/// With [`FanOut::overlap_stages`], what the sinks stage ([`ForeachBatch::stage`]) runs from
/// the start, one sink after another, beside the calls of the sinks before; a sink's `call`
/// waits for its stage. The call returns only when staging has ended, also when a sink
/// failed or panicked; sinks whose call did not come are told to discard what they staged.
/// A stage's time is `<name>.stageMs`.
pub struct FanOut {
    /// Shared with the stager task of each batch (no copy per batch).
    sinks: Arc<[(String, Arc<dyn ForeachBatch>)]>,
    overlap: bool,
}

impl FanOut {
    /// `sinks` are (name for errors and progress, sink), called in this order.
    pub fn new(
        sinks: impl IntoIterator<Item = (impl Into<String>, Arc<dyn ForeachBatch>)>,
    ) -> Self {
        FanOut {
            sinks: sinks
                .into_iter()
                .map(|(n, s)| (n.into(), s))
                .collect::<Vec<_>>()
                .into(),
            overlap: false,
        }
    }

    /// Stage each sink beside the sinks before it (off by default). A `PostgresUpsert` then
    /// holds an open transaction, with its row locks, while the earlier sinks write: turn
    /// this on only when no earlier sink writes the same PostgreSQL rows (it would wait for
    /// a COMMIT that waits for it). `weir run` turns it on: its sinks are known.
    pub fn overlap_stages(mut self, on: bool) -> Self {
        self.overlap = on;
        self
    }
}

#[async_trait]
impl ForeachBatch for FanOut {
    /// One sink that writes on the workers: the fan-out is only a name for it (several
    /// sinks share one read of the batch, held here).
    fn writes_on_workers(&self) -> bool {
        matches!(&self.sinks[..], [(_, sink)] if sink.writes_on_workers())
    }

    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        let [(name, sink)] = &self.sinks[..] else {
            return self.call(batch, ctx).await;
        };
        timed_sink(name, &ctx, sink.write_on_workers(batch, ctx.clone(), run)).await
    }

    async fn open(&self, query: &crate::sink::QueryIdentity) -> Result<(), BoxError> {
        for (name, sink) in self.sinks.iter() {
            sink.open(query).await.map_err(|source| {
                Box::new(Error::Sink {
                    sink: name.clone(),
                    batch_id: 0,
                    source,
                }) as BoxError
            })?;
        }
        Ok(())
    }

    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let batch = if self.sinks.len() > 1 {
            let started = std::time::Instant::now();
            let cached = batch.cache().await.map_err(|e| {
                Error::datafusion(format!("batch {}: caching for fan-out", ctx.batch_id), e)
            })?;
            // Runs the transform: its time, apart from the sinks'.
            ctx.metrics.note(
                CACHE_DURATION_KEY.into(),
                started.elapsed().as_millis().to_string(),
            );
            cached
        } else {
            batch
        };
        if !self.overlap {
            let mut none: Vec<_> = self.sinks.iter().map(|_| None).collect();
            return self.call_in_order(&batch, &ctx, &mut none).await.0;
        }
        // Stages run one after another in one task (a stage may wait for what an earlier
        // one holds until that sink's call; in parallel, two could wait for each other).
        let mut done = Vec::new();
        let mut senders = Vec::new();
        for _ in self.sinks.iter() {
            let (tx, rx) = tokio::sync::oneshot::channel::<Result<(), BoxError>>();
            senders.push(tx);
            done.push(Some(rx));
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sinks = Arc::clone(&self.sinks);
        let (b, c, halt) = (batch.clone(), ctx.clone(), stop.clone());
        let stager = tokio::spawn(
            async move {
                for ((name, sink), tx) in sinks.iter().zip(senders) {
                    if halt.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    let started = std::time::Instant::now();
                    let out = sink.stage(b.clone(), c.clone()).await;
                    let ms = started.elapsed().as_millis();
                    if ms > 0 {
                        c.metrics.record(name, SinkMetric::StageMs, ms);
                    }
                    let failed = out.is_err();
                    if tx.send(out).is_err() || failed {
                        return;
                    }
                }
            }
            .in_current_span(),
        );
        let out = std::panic::AssertUnwindSafe(self.call_in_order(&batch, &ctx, &mut done))
            .catch_unwind()
            .await;
        // A failed or panicking sink ends the batch: no further stage starts, what the
        // stages hold for calls that will not come is dropped (first, as a running stage may
        // wait for it), and no stage outlives the call.
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let called = match &out {
            Ok((_, called)) => *called,
            Err(_) => 0,
        };
        for (_, sink) in self.sinks.iter().skip(called) {
            sink.discard(ctx.clone()).await;
        }
        let _ = stager.await;
        for (_, sink) in self.sinks.iter().skip(called) {
            sink.discard(ctx.clone()).await;
        }
        match out {
            Ok((result, _)) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl FanOut {
    /// Calls the sinks in order, each after its stage; returns how many calls were made.
    async fn call_in_order(
        &self,
        batch: &DataFrame,
        ctx: &BatchContext,
        staged: &mut [Option<tokio::sync::oneshot::Receiver<Result<(), BoxError>>>],
    ) -> (Result<(), BoxError>, usize) {
        let failed = |name: &String, source: BoxError| {
            Box::new(Error::Sink {
                sink: name.clone(),
                batch_id: ctx.batch_id,
                source,
            }) as BoxError
        };
        for (i, ((name, sink), stage)) in self.sinks.iter().zip(staged.iter_mut()).enumerate() {
            if let Some(stage) = stage.take() {
                let out = match stage.await {
                    Ok(r) => r,
                    Err(_) => Err("staging the batch ended without an answer (a panic)".into()),
                };
                if let Err(source) = out {
                    return (Err(failed(name, source)), i);
                }
            }
            if let Err(e) = timed_sink(name, ctx, sink.call(batch.clone(), ctx.clone())).await {
                return (Err(e), i + 1);
            }
        }
        (Ok(()), self.sinks.len())
    }
}

/// Runs sink `name`'s write `work` of the batch of `ctx`: its error names the sink, and its
/// time and the rows it wrote go into the progress report's `sink.metrics` (sinks add to
/// one batch-wide row count, one after another).
async fn timed_sink(
    name: &str,
    ctx: &BatchContext,
    work: impl Future<Output = Result<(), BoxError>>,
) -> Result<(), BoxError> {
    let started = std::time::Instant::now();
    let rows_before = ctx.metrics.output_rows();
    work.await.map_err(|source| {
        Box::new(Error::Sink {
            sink: name.to_string(),
            batch_id: ctx.batch_id,
            source,
        }) as BoxError
    })?;
    // Where addBatch went, per sink, in the progress report.
    ctx.metrics
        .record(name, SinkMetric::DurationMs, started.elapsed().as_millis());
    let rows_after = ctx.metrics.output_rows();
    if rows_after != rows_before {
        ctx.metrics
            .record(name, SinkMetric::Rows, rows_after - rows_before.max(0));
    }
    Ok(())
}
