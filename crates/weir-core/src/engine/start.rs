//! Starting a query: everything that can be refused is refused here, before anything runs.
//!
//! In this order: the steps' checks against the source's columns; the checkpoint opened and
//! taken (lock file or lease); where to start decided from its logs (`checkpoint::recovery`);
//! a Spark checkpoint that weir cannot continue refused; the settings the last recorded batch
//! pinned taken over; the sink asked to check where it writes; the source opened on its log.
//! Any failure after the checkpoint was taken releases it. Then the loop (`engine::runner`)
//! is spawned on the current tokio runtime.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use datafusion::prelude::SessionContext;

use super::batch::Steps;
use super::cluster::Cluster;
use super::progress::QueryTerminated;
use super::progress::{BehindDetector, QueryListener};
use super::query::Status;
use super::query::{Shared, StreamingQuery};
use super::runner::{QuerySpec, Runner};
use super::transform::{Transform, check_at_start};
use super::trigger::Trigger;
use crate::checkpoint::{Checkpoint, LeaseSettings, StartPoint};
use crate::error::{Error, Result, error_chain, join_text};
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
    let opened = released_on_error(&checkpoint, async {
        let start = checkpoint.recover().await?;
        checkpoint.refuse_unfinished_spark(&start).await?;
        let ctx = (req.context)(pinned_partitions(&start));
        let mut conf = BTreeMap::new();
        conf.insert(
            PIN_TARGET_PARTITIONS.to_string(),
            ctx.state().config().target_partitions().to_string(),
        );
        // The stateful steps check the checkpoint's state (operators, their columns, the
        // number of partitions) before a sink or the source is touched.
        let steps = Steps::open(
            req.transforms,
            &checkpoint.state_root(),
            req.retain,
            req.state_partitions,
        )
        .await?;
        // Sinks check where they write before anything runs.
        let identity = QueryIdentity::of(&checkpoint, &req.name);
        req.sink
            .open(&identity)
            .await
            .map_err(|source| Error::SinkRefused { source })?;
        req.source
            .open(&SourceInit {
                log: checkpoint.source_log(0),
                retain_batches: req.retain,
            })
            .await?;
        Ok((start, ctx, conf, steps))
    })
    .await?;
    let (start, ctx, conf, steps) = opened;
    let shared = Arc::new(Shared::new(checkpoint.query_id(), req.name));
    let spec = QuerySpec {
        checkpoint,
        start,
        source: req.source,
        limit: req.limit,
        steps: Some(steps),
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
    tokio::spawn(run(spec, shared.clone()));
    Ok(StreamingQuery { shared })
}

/// `steps`' result; when it failed, the checkpoint is released first (the query that took
/// it will not run).
async fn released_on_error<T>(
    checkpoint: &Checkpoint,
    steps: impl Future<Output = Result<T>>,
) -> Result<T> {
    let result = steps.await;
    if result.is_err() {
        checkpoint.release().await;
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

/// Runs the query to its end and records how it ended in `shared`.
async fn run(spec: QuerySpec, shared: Arc<Shared>) {
    let listeners = spec.listeners.clone();
    let checkpoint = spec.checkpoint.clone();
    let task_shared = shared.clone();
    let outcome =
        tokio::spawn(async move { Runner::open(spec, task_shared).await?.run().await }).await;
    let result = match outcome {
        Ok(r) => r,
        Err(join) => Err(Error::Panicked {
            query: shared.name.clone(),
            last_batch: shared.current_batch(),
            message: join_text(join),
        }),
    };
    checkpoint.release().await;
    let error = result.as_ref().err().map(|e| error_chain(e));
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
