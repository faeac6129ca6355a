//! Reads that run on a cluster's workers. On a session whose plans run on a cluster
//! ([`scans_on_cluster`]), a source that [`Source::reads_on_workers`](super::Source) does not
//! read a batch's range into the driver's memory: `read_range` returns a plan whose leaf is
//! a [`WorkerScan`], plain data naming what the range holds (the files of `sources/<i>/N`,
//! the Kafka offset ranges of `offsets/N`). The distributed planner splits it into tasks
//! ([`WorkerScan::per_task`]) and a codec sends each task's share to a worker, which reads
//! it with the same checks and decoder as the single-process path. A replay reads the same
//! rows wherever it runs.
//!
//! Each kind of scan is described once by a [`ScanKind`]: its name on the wire, how to find
//! it in a plan and how a worker rebuilds it. The binary lists the kinds it knows (beside
//! its sources) and hands the list to the cluster, so weir-core stays free of the transport
//! and connectors stay free of the cluster.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::Session;
use datafusion::common::Result as DfResult;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::logical_expr::Expr;
use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::{ExecutionPlan, PlanProperties};
use datafusion::prelude::SessionContext;

/// Marks a session whose plans run on a cluster: a source that reads on workers then hands
/// out a [`WorkerScan`] instead of reading the range itself.
#[derive(Debug, Default)]
pub struct ScansOnCluster;

/// True when `ctx`'s plans run on a cluster's workers.
pub fn scans_on_cluster(ctx: &SessionContext) -> bool {
    // Asked once or twice a batch: read under the lock, without copying the session.
    ctx.state_ref()
        .read()
        .config()
        .get_extension::<ScansOnCluster>()
        .is_some()
}

/// A leaf that reads a batch's recorded input where the plan runs.
pub trait WorkerScan: ExecutionPlan {
    /// The scan's kind on the wire (its [`ScanKind::kind`]).
    fn kind(&self) -> &'static str;

    /// The scan as plain data for the wire: the schema it decodes with, and its own
    /// description as JSON. May hold settings a worker needs to read (never shown).
    fn encode(&self) -> DfResult<(SchemaRef, String)>;

    /// How many tasks the scan can use (one per file, one per Kafka partition with
    /// records); the planner caps it at the workers.
    fn tasks_wanted(&self) -> usize;

    /// One scan per task, each of its share of the input; every row of the range is in
    /// exactly one of them.
    fn per_task(&self, tasks: usize) -> DfResult<Vec<Arc<dyn ExecutionPlan>>>;

    /// The same scan reading only the columns `projection` names (indices into this
    /// scan's schema; `None`: all).
    fn with_projection(&self, projection: Option<Vec<usize>>) -> DfResult<Arc<dyn ExecutionPlan>>;
}

/// A table whose scan is a [`WorkerScan`] reading all its columns: how a source hands its
/// scan of a range to DataFusion's planner, which asks it for the columns it needs.
#[derive(Debug)]
pub struct ScanTable(Arc<dyn WorkerScan>);

impl ScanTable {
    /// The table of `scan` (built without a projection).
    pub fn new(scan: Arc<dyn WorkerScan>) -> Self {
        ScanTable(scan)
    }
}

#[async_trait]
impl TableProvider for ScanTable {
    fn schema(&self) -> SchemaRef {
        self.0.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.0.with_projection(projection.cloned())
    }
}

/// One kind of [`WorkerScan`]: its name on the wire, how to find it in a plan and how to
/// rebuild it on a worker.
#[derive(Debug, Clone, Copy)]
pub struct ScanKind {
    /// The name on the wire, versioned (`weir.RecordedFiles.v1`).
    pub kind: &'static str,
    /// The node as a scan of this kind, if it is one.
    pub find: fn(&Arc<dyn ExecutionPlan>) -> Option<&dyn WorkerScan>,
    /// Rebuilds a scan from what [`WorkerScan::encode`] gave.
    pub decode: fn(schema: SchemaRef, body: &str) -> DfResult<Arc<dyn ExecutionPlan>>,
}

/// The node as a scan of any of `kinds`.
pub fn find_scan<'a>(
    kinds: &[&ScanKind],
    node: &'a Arc<dyn ExecutionPlan>,
) -> Option<&'a dyn WorkerScan> {
    kinds.iter().find_map(|k| (k.find)(node))
}

/// `items` in `tasks` shares of about equal weight: largest first onto the lightest share
/// (ties keep the order), each share in the order of `items`. Every item is in exactly one
/// share; shares may be empty when there are more tasks than items.
pub fn balance<T: Clone>(items: &[T], weight: impl Fn(&T) -> u64, tasks: usize) -> Vec<Vec<T>> {
    let tasks = tasks.max(1);
    let mut order: Vec<(usize, &T)> = items.iter().enumerate().collect();
    order.sort_by_key(|(i, t)| (std::cmp::Reverse(weight(t)), *i));
    let mut shares: Vec<(u64, Vec<(usize, T)>)> = vec![(0, Vec::new()); tasks];
    for (i, t) in order {
        if let Some(lightest) = shares.iter_mut().min_by_key(|s| s.0) {
            lightest.0 += weight(t).max(1);
            lightest.1.push((i, t.clone()));
        }
    }
    shares
        .into_iter()
        .map(|(_, mut s)| {
            s.sort_by_key(|(i, _)| *i);
            s.into_iter().map(|(_, t)| t).collect()
        })
        .collect()
}

/// The items stream `partition` of `partitions` reads: every `partitions`-th, from its own
/// index on, so the streams of a scan read each item once.
pub fn stream_share<'a, T: Clone + 'a>(
    items: impl Iterator<Item = &'a T>,
    partitions: usize,
    partition: usize,
) -> Vec<T> {
    let partitions = partitions.max(1);
    items
        .enumerate()
        .filter(|(i, _)| i % partitions == partition)
        .map(|(_, t)| t.clone())
        .collect()
}

/// The properties of a leaf scan: `schema` on `partitions` streams, bounded.
pub fn leaf_properties(schema: SchemaRef, partitions: usize) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(schema),
        Partitioning::UnknownPartitioning(partitions.max(1)),
        EmissionType::Incremental,
        Boundedness::Bounded,
    ))
}

/// The `ExecutionPlan` methods every leaf scan has the same way (no inputs, no
/// expressions, its `props` and `metrics` fields), inside its `impl ExecutionPlan`.
#[macro_export]
macro_rules! leaf_plan_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &std::sync::Arc<$crate::datafusion::physical_plan::PlanProperties> {
            &self.props
        }

        fn children(
            &self,
        ) -> Vec<&std::sync::Arc<dyn $crate::datafusion::physical_plan::ExecutionPlan>> {
            vec![]
        }

        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(
                &std::sync::Arc<dyn $crate::datafusion::physical_expr::PhysicalExpr>,
            ) -> $crate::datafusion::common::Result<
                $crate::datafusion::common::tree_node::TreeNodeRecursion,
            >,
        ) -> $crate::datafusion::common::Result<
            $crate::datafusion::common::tree_node::TreeNodeRecursion,
        > {
            Ok($crate::datafusion::common::tree_node::TreeNodeRecursion::Continue)
        }

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn $crate::datafusion::physical_plan::ExecutionPlan>>,
        ) -> $crate::datafusion::common::Result<
            std::sync::Arc<dyn $crate::datafusion::physical_plan::ExecutionPlan>,
        > {
            if children.is_empty() {
                Ok(self)
            } else {
                Err($crate::datafusion::common::DataFusionError::Internal(
                    concat!($name, " has no inputs").into(),
                ))
            }
        }

        fn metrics(&self) -> Option<$crate::datafusion::physical_plan::metrics::MetricsSet> {
            Some(self.metrics.clone_inner())
        }
    };
}
