//! Starting a query: everything that can be refused is refused here, before anything runs.
//!
//! In this order: the steps' checks against the source's columns; the checkpoint opened and
//! taken (lock file or lease); where to start decided from its logs (`checkpoint::recovery`);
//! a Spark checkpoint that weir cannot continue refused; the settings the last recorded batch
//! pinned taken over; the source opened on its log; the sink asked to check where it writes.
//! Any failure after the checkpoint was taken releases it. Then the loop (`engine::runner`)
//! is spawned on the current tokio runtime. A run of the loop that fails with an error that
//! may pass goes through the same opening again (not the checks, nor taking the
//! checkpoint, which it still holds) after a pause (`engine::retry`).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use datafusion::prelude::SessionContext;

use super::batch::Steps;
use super::cluster::Cluster;
use super::progress::{BehindDetector, QueryListener};
use super::progress::{QueryRetrying, QueryTerminated};
use super::query::Status;
use super::query::{Shared, StreamingQuery};
use super::retry::{self, Decision, RetryPolicy};
use super::runner::{QuerySpec, Runner};
use super::transform::{Transform, check_at_start};
use super::trigger::Trigger;
use crate::checkpoint::{Checkpoint, LeaseSettings, StartPoint};
use crate::error::{Error, Result, error_chain, is_transient, join_text};
use crate::sink::{ForeachBatch, QueryIdentity};
use crate::source::{ReadLimit, Source, SourceInit};
use crate::storage::Location;

/// The pinned setting that a replay must reuse: the partitioning of the batch, so that
/// sinks that name output by partition write the same names again.
pub const PIN_TARGET_PARTITIONS: &str = "datafusion.execution.target_partitions";

/// A DataFusion context for the query, with the partitioning a recorded batch pinned, if any.
pub(crate) type ContextFor = Box<dyn FnOnce(Option<usize>) -> SessionContext + Send>;

/// What a query is started with (`DataStreamWriter::start` fills it in).
pub(crate) struct StartRequest {
    /// The checkpoint folder.
    pub dir: Location,
    pub name: String,
    pub lease: LeaseSettings,
    pub source: Arc<dyn Source>,
    pub limit: ReadLimit,
    pub transforms: Vec<Transform>,
    pub context: ContextFor,
    pub sink: Arc<dyn ForeachBatch>,
    pub trigger: Trigger,
    /// Batches kept in the logs (`minBatchesToRetain`).
    pub retain: u64,
    /// `state-partitions` (`None`: what the state recorded, or the default).
    pub state_partitions: Option<u32>,
    /// How failures that may pass are met.
    pub retry: RetryPolicy,
    pub listeners: Vec<Arc<dyn QueryListener>>,
    pub behind: BehindDetector,
    pub no_data_delay: Duration,
    /// Where batches run, when not in this process.
    pub cluster: Option<Arc<dyn Cluster>>,
}

/// Checks everything, takes the checkpoint, decides where to start and spawns the query.
pub(crate) async fn start(req: StartRequest) -> Result<StreamingQuery> {
    check_at_start(&req.source.schema(), &req.transforms)?;
    if let Some(n) = req.state_partitions {
        crate::state::partitioned::check_partitions("query.state-partitions", n)?;
    }
    if let Some(cluster) = &req.cluster {
        if !req.source.reads_on_workers() {
            return Err(Error::config(
                "cluster",
                format!(
                    "the source {} does not run on a cluster yet: only the files and Kafka \
                     sources' reads are sent to workers; run this query without a cluster",
                    req.source.description()
                ),
            ));
        }
        // No usable worker is an error before batch 0, naming each worker and why.
        let usable = cluster.prepare().await?;
        tracing::info!(
            query = %req.name,
            "running on the cluster {}: {} usable worker(s): {}",
            cluster.describe(),
            usable.len(),
            usable.join(", ")
        );
    }
    let checkpoint = Checkpoint::open(req.dir, &req.name, req.lease).await?;
    let reopen = Reopen {
        transforms: req.transforms,
        state_partitions: req.state_partitions,
        retain: req.retain,
        name: req.name.clone(),
        policy: req.retry,
        source: req.source.clone(),
        sink: req.sink.clone(),
    };
    let opened = released_on_error(&checkpoint, async {
        let (start, steps) = reopen.open(&checkpoint).await?;
        let ctx = (req.context)(pinned_partitions(&start));
        Ok((start, ctx, steps))
    })
    .await?;
    let (start, ctx, steps) = opened;
    let mut conf = BTreeMap::new();
    conf.insert(
        PIN_TARGET_PARTITIONS.to_string(),
        ctx.state().config().target_partitions().to_string(),
    );
    let shared = Arc::new(Shared::new(checkpoint.query_id(), req.name));
    let parts = Parts {
        checkpoint,
        source: req.source,
        limit: req.limit,
        sink: req.sink,
        trigger: req.trigger,
        retain: req.retain,
        listeners: req.listeners,
        behind: req.behind,
        ctx,
        conf,
        no_data_delay: req.no_data_delay,
        cluster: req.cluster,
    };
    let spec = parts.spec(start, steps);
    tokio::spawn(run(spec, parts, reopen, shared.clone()));
    Ok(StreamingQuery { shared })
}

/// What opening the query on its checkpoint needs, at start and again after a failure
/// that may pass (`engine::retry`).
struct Reopen {
    transforms: Vec<Transform>,
    state_partitions: Option<u32>,
    retain: u64,
    name: String,
    policy: RetryPolicy,
    source: Arc<dyn Source>,
    sink: Arc<dyn ForeachBatch>,
}

impl Reopen {
    /// Decides where to start from the checkpoint's logs, opens the steps on its state,
    /// opens the source on its log and lets the sink check where it writes: what a process
    /// does at start, so that running again after a failure is a restart in all but the
    /// process.
    async fn open(&self, checkpoint: &Checkpoint) -> Result<(StartPoint, Steps)> {
        let start = checkpoint.recover().await?;
        checkpoint.refuse_unfinished_spark(&start).await?;
        // The stateful steps check the checkpoint's state (operators, their columns, the
        // number of partitions) before a sink or the source is touched.
        let steps = Steps::open(
            self.transforms.clone(),
            &checkpoint.state_root(),
            self.retain,
            self.state_partitions,
        )
        .await?;
        // The source opens on its log first: it writes nothing, while a sink's check may
        // claim its place (a Parquet folder's `_weir_query`), which a source refused after
        // it would leave claimed by a query that never ran.
        self.source
            .open(&SourceInit {
                log: checkpoint.source_log(0),
                retain_batches: self.retain,
                query_id: checkpoint.query_id(),
            })
            .await?;
        // Sinks check where they write before anything runs.
        let identity = QueryIdentity::of(checkpoint, &self.name);
        self.sink
            .open(&identity)
            .await
            .map_err(|source| Error::SinkRefused { source })?;
        Ok((start, steps))
    }
}

/// The parts of a query's [`QuerySpec`] that every run of it shares.
struct Parts {
    checkpoint: Checkpoint,
    source: Arc<dyn Source>,
    limit: ReadLimit,
    sink: Arc<dyn ForeachBatch>,
    trigger: Trigger,
    retain: u64,
    listeners: Vec<Arc<dyn QueryListener>>,
    behind: BehindDetector,
    ctx: SessionContext,
    conf: BTreeMap<String, String>,
    no_data_delay: Duration,
    cluster: Option<Arc<dyn Cluster>>,
}

impl Parts {
    fn spec(&self, start: StartPoint, steps: Steps) -> QuerySpec {
        QuerySpec {
            checkpoint: self.checkpoint.clone(),
            start,
            source: self.source.clone(),
            limit: self.limit,
            steps: Some(steps),
            sink: self.sink.clone(),
            trigger: self.trigger,
            retain: self.retain,
            listeners: self.listeners.clone(),
            behind: self.behind.clone(),
            ctx: self.ctx.clone(),
            conf: self.conf.clone(),
            no_data_delay: self.no_data_delay,
            cluster: self.cluster.clone(),
        }
    }
}

/// `steps`' result; when it failed, the checkpoint is released first (the query that took
/// it will not run), and a checkpoint this start created is removed.
async fn released_on_error<T>(
    checkpoint: &Checkpoint,
    steps: impl Future<Output = Result<T>>,
) -> Result<T> {
    let result = steps.await;
    if result.is_err() {
        checkpoint.release_refused().await;
    }
    result
}

/// The partitioning the last recorded batch ran with: settings pinned by it win over the
/// current ones.
fn pinned_partitions(start: &StartPoint) -> Option<usize> {
    let recorded = match start {
        StartPoint::Fresh => None,
        StartPoint::Replay { batch, .. } => Some(&batch.metadata.conf),
        StartPoint::Next { previous, .. } => Some(&previous.metadata.conf),
    };
    recorded
        .and_then(|c| c.get(PIN_TARGET_PARTITIONS))
        .and_then(|v| v.parse::<usize>().ok())
}

/// Runs the query to its end and records how it ended in `shared`. A run that fails with
/// an error that may pass starts again from the checkpoint after a pause, as long as the
/// retry policy allows (`engine::retry`).
async fn run(spec: QuerySpec, parts: Parts, reopen: Reopen, shared: Arc<Shared>) {
    let listeners = parts.listeners.clone();
    let checkpoint = parts.checkpoint.clone();
    let mut next = Ok(spec);
    // Failures in a row of the same batch (a commit in between starts the count again).
    let mut failed = 0;
    let mut failing: Option<Option<u64>> = None;
    let result = loop {
        let result = match next {
            Ok(spec) => run_once(spec, &shared).await,
            Err(e) => Err(e),
        };
        let Err(e) = result else { break Ok(()) };
        // The batch the error names (planning batch N+1 fails while N is the last one
        // started), else the last one started.
        let batch = e.batch_id().or_else(|| shared.current_batch());
        if failing != Some(batch) {
            failed = 0;
            failing = Some(batch);
        }
        let stopping = *shared.stop.borrow();
        let (pause, now_failed) =
            match retry::decide(&reopen.policy, is_transient(&e), failed, stopping) {
                Decision::Stop => break Err(e),
                Decision::Stopped => {
                    tracing::warn!(
                        query = %shared.name,
                        batch_id = batch,
                        "stopping as asked; the batch that failed with an error that may pass \
                         runs again at the next start: {}",
                        error_chain(&e)
                    );
                    break Ok(());
                }
                Decision::Retry { pause, failed } => (pause, failed),
            };
        failed = now_failed;
        let error = error_chain(&e);
        let at = batch.map_or("before its first batch".to_string(), |b| {
            format!("batch {b}")
        });
        tracing::warn!(
            query = %shared.name,
            batch_id = batch,
            "{at} failed (run {failed} of {}) with an error that may pass; starting again \
             from the checkpoint in {} ms: {error}",
            reopen.policy.attempts,
            pause.as_millis()
        );
        for l in &listeners {
            l.on_query_retrying(&QueryRetrying {
                id: shared.id,
                run_id: shared.run_id,
                name: shared.name.clone(),
                batch_id: batch,
                failed,
                attempts: reopen.policy.attempts,
                error: error.clone(),
                pause_ms: pause.as_millis() as u64,
            });
        }
        // The pause, cut short by a stop: the batch then runs again at the next start.
        let mut stop = shared.stop.subscribe();
        let stopped = tokio::select! {
            _ = tokio::time::sleep(pause) => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        if stopped {
            tracing::warn!(
                query = %shared.name,
                "stopped while waiting to run {at} again; it runs again at the next start"
            );
            break Ok(());
        }
        next = reopen
            .open(&checkpoint)
            .await
            .map(|(start, steps)| parts.spec(start, steps));
    };
    checkpoint.release().await;
    let error = result.as_ref().err().map(|e| error_chain(e));
    if let Some(e) = &error {
        let batch_id = result.as_ref().err().and_then(Error::batch_id);
        tracing::error!(query = %shared.name, batch_id, "query terminated with an error: {e}");
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

/// One run of the query's loop, on a task of its own (a panic is an error naming it).
async fn run_once(spec: QuerySpec, shared: &Arc<Shared>) -> Result<()> {
    let task_shared = shared.clone();
    let outcome =
        tokio::spawn(async move { Runner::open(spec, task_shared).await?.run().await }).await;
    match outcome {
        Ok(r) => r,
        Err(join) => Err(Error::Panicked {
            query: shared.name.clone(),
            last_batch: shared.current_batch(),
            message: join_text(join),
        }),
    }
}
