//! Batches on many machines: the hook a cluster (`weir-cluster`, on datafusion-distributed)
//! fills in. weir-core stays free of the transport: it asks a [`Cluster`] to make its
//! session plan on the workers, to check them before each batch, and to run a batch's plan
//! and bring back its rows with what each worker did.
//!
//! The driver (this process) keeps every durable step: it plans batch N's range, writes
//! `offsets/N`, runs the plan on the workers (each task reads its share of the recorded
//! input), hands the rows to the function and writes `commits/N` after it. Reading and
//! transforming have no effect outside the plan, so a plan that failed on a worker is run
//! again with the same range (up to [`Cluster::max_attempts`]) on the workers left before
//! the batch fails; the function is called once per successful attempt, as without a
//! cluster.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{DataFrame, SessionContext};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sink::PlanRunner;

/// What one worker did for one batch: progress's `cluster.workers[]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTasks {
    /// The worker's URL.
    pub url: String,
    /// Tasks of the batch's plan it ran.
    pub tasks: u64,
    /// Input rows its tasks read.
    pub input_rows: u64,
}

/// One batch's plan, run on the cluster.
#[derive(Debug, Default)]
pub struct ClusterRun {
    /// The plan's output, on the driver.
    pub batches: Vec<RecordBatch>,
    /// Input rows read by the plan's scans.
    pub input_rows: u64,
    /// Per worker, in URL order.
    pub workers: Vec<WorkerTasks>,
}

/// Where a query's batches run when a cluster is set (`WeirSession::cluster`).
#[async_trait]
pub trait Cluster: Send + Sync {
    /// A short description for logs: the workers' setting.
    fn describe(&self) -> String;

    /// Makes `builder` plan on the workers. weir's own planner is already set on it.
    fn distribute(&self, builder: SessionStateBuilder) -> SessionStateBuilder;

    /// Resolves the workers again and checks each (reachable, same weir version, accepts
    /// the token); later plans go to the usable ones. An error when none is usable, naming
    /// each worker and why. Called before batch 0 and before every attempt of a batch.
    async fn prepare(&self) -> Result<Vec<String>>;

    /// Runs `df`, planned on a session made by [`Cluster::distribute`], on the workers.
    async fn collect(&self, df: DataFrame) -> Result<ClusterRun>;

    /// Attempts of a batch's plan before the batch fails (at least 1).
    fn max_attempts(&self) -> u32;
}

/// Runs a sink's plans for batch `batch_id` on the cluster ([`PlanRunner`]), keeping what
/// the workers did for the progress report.
pub(crate) struct OnCluster {
    cluster: Arc<dyn Cluster>,
    batch_id: u64,
    /// The batch's input rows (the most any plan read) and tasks per worker, over the
    /// plans run.
    ran: std::sync::Mutex<(u64, Vec<WorkerTasks>)>,
}

impl OnCluster {
    pub(crate) fn new(cluster: Arc<dyn Cluster>, batch_id: u64) -> Self {
        OnCluster {
            cluster,
            batch_id,
            ran: std::sync::Mutex::new((0, Vec::new())),
        }
    }

    /// Input rows read and what each worker did, over the plans run so far.
    pub(crate) fn ran(&self) -> (u64, Vec<WorkerTasks>) {
        self.ran.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

#[async_trait]
impl PlanRunner for OnCluster {
    async fn run(&self, plan: DataFrame) -> Result<Vec<RecordBatch>> {
        let run = run_on_cluster(&self.cluster, plan, self.batch_id).await?;
        if let Ok(mut ran) = self.ran.lock() {
            // Every plan of the batch reads the batch's input (a sink may run a second
            // one, such as the MERGE's count of NULL keys): the batch's input is read once
            // as far as its rows go; the workers' figures count all they did.
            ran.0 = ran.0.max(run.input_rows);
            for w in run.workers {
                match ran.1.iter_mut().find(|r| r.url == w.url) {
                    Some(r) => {
                        r.tasks += w.tasks;
                        r.input_rows += w.input_rows;
                    }
                    None => ran.1.push(w),
                }
            }
        }
        Ok(run.batches)
    }
}

/// Runs batch `batch_id`'s plan `df` on `cluster` and holds its output in this process as
/// the function's input: the held frame, the input rows read and what each worker did.
pub(crate) async fn run_and_hold(
    cluster: &Arc<dyn Cluster>,
    ctx: &SessionContext,
    df: DataFrame,
    batch_id: u64,
) -> Result<(DataFrame, u64, Vec<WorkerTasks>)> {
    let run = run_on_cluster(cluster, df.clone(), batch_id).await?;
    let df = hold(ctx, df.schema().inner().clone(), run.batches)?;
    Ok((df, run.input_rows, run.workers))
}

/// The cluster's rows `batches` (of `schema`) held in this process, as a frame.
pub(crate) fn hold(
    ctx: &SessionContext,
    schema: datafusion::arrow::datatypes::SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<DataFrame> {
    let held = MemTable::try_new(schema, vec![batches])
        .map_err(|e| Error::datafusion("holding the cluster's rows", e))?;
    ctx.read_table(Arc::new(held))
        .map_err(|e| Error::datafusion("reading the held batch", e))
}

/// Runs a batch's plan on `cluster`: each attempt checks the workers first; a failed
/// attempt is logged and run again on the workers left, up to the cluster's limit.
pub(crate) async fn run_on_cluster(
    cluster: &Arc<dyn Cluster>,
    df: DataFrame,
    batch_id: u64,
) -> Result<ClusterRun> {
    let attempts = cluster.max_attempts().max(1);
    let mut attempt = 1;
    loop {
        let tried = match cluster.prepare().await {
            Ok(_) => cluster.collect(df.clone()).await,
            Err(e) => Err(e),
        };
        match tried {
            Ok(run) => return Ok(run),
            Err(e) if attempt < attempts && !crate::error::is_data_error(&e) => {
                tracing::warn!(
                    batch_id,
                    attempt,
                    attempts,
                    "batch {batch_id}: attempt {attempt} of {attempts} on the cluster failed, \
                     running it again with the same range: {}",
                    crate::error::error_chain(&e)
                );
                // A pause that grows with each attempt, so a worker being restarted (a
                // rolling update) has a moment to come back.
                tokio::time::sleep(std::time::Duration::from_millis(500 * u64::from(attempt)))
                    .await;
                attempt += 1;
            }
            Err(Error::Cluster { reason }) => {
                return Err(Error::Cluster {
                    reason: format!("batch {batch_id}, attempt {attempt} of {attempts}: {reason}"),
                });
            }
            Err(e) => return Err(e),
        }
    }
}
