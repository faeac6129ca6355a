//! A SQL transform planned once per query instead of once per batch.
//!
//! Parsing, the logical optimizer and the physical optimizer cost a few milliseconds per
//! batch whatever the batch's size: most of the time of a 10-row batch. Every batch of a
//! query runs the same SQL over rows of the same schema, so the physical plan of the first
//! batch is kept as a template and each later batch gets a copy of it with its own rows
//! in the leaves and fresh execution state ([`reset_plan_states`]).
//!
//! Only plans that cannot tell one batch from another are kept:
//! - the batch is read through [`BatchScanExec`], which reports no statistics (so no
//!   optimizer rule folds a row count or a min/max of the first batch into the plan) and
//!   always the same number of partitions;
//! - every leaf of the plan is such a scan (a plan that also reads a table, whose files
//!   may change between batches, is planned again per batch);
//! - no function that is not immutable (`now()` is folded into a constant by the
//!   optimizer, `random()` ...), no subquery, no session variable;
//! - the template is planned without dynamic filters (which a reused plan cannot reset).
//!
//! The batch reaches the function as a `DataFrame` over a [`KeptPlanNode`] node; the session's
//! [`WeirQueryPlanner`] turns that node into the copy of the template, each time the frame
//! is planned (so a frame executed twice runs twice on fresh state).

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use async_trait::async_trait;
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DFSchemaRef, Result as DfResult, project_schema};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::TaskContext;
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore, Volatility,
};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType, reset_plan_states};
use datafusion::physical_plan::memory::MemoryStream;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
    SendableRecordBatchStream,
};
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};
use datafusion::prelude::{DataFrame, SessionContext};

/// The rows of one batch, spread over a fixed number of partitions.
type Parts = Arc<Vec<Vec<RecordBatch>>>;

/// Deals the batch's record batches round-robin into `n` partitions (in their order, so
/// the same batch is always dealt the same way).
pub(crate) fn deal(parts: Vec<Vec<RecordBatch>>, n: usize) -> Parts {
    let n = n.max(1);
    let mut out = vec![Vec::new(); n];
    for (i, b) in parts.into_iter().flatten().enumerate() {
        out[i % n].push(b);
    }
    Arc::new(out)
}

/// The batch as a table: what `batch` names in the SQL of a kept plan.
#[derive(Debug)]
pub(crate) struct BatchTable {
    schema: SchemaRef,
    parts: Parts,
}

impl BatchTable {
    pub(crate) fn new(schema: SchemaRef, parts: Parts) -> Self {
        BatchTable { schema, parts }
    }
}

#[async_trait]
impl TableProvider for BatchTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        // A hint: the limit stays in the plan above the scan.
        _limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(BatchScanExec::try_new(
            Arc::clone(&self.schema),
            projection.cloned(),
            Arc::clone(&self.parts),
        )?))
    }
}

/// Reads the batch's rows; the leaf whose rows change from one batch to the next.
#[derive(Debug)]
pub(crate) struct BatchScanExec {
    schema: SchemaRef,
    projection: Option<Vec<usize>>,
    parts: Parts,
    cache: Arc<PlanProperties>,
}

impl BatchScanExec {
    fn try_new(schema: SchemaRef, projection: Option<Vec<usize>>, parts: Parts) -> DfResult<Self> {
        let projected = project_schema(&schema, projection.as_ref())?;
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(projected),
            Partitioning::UnknownPartitioning(parts.len()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(BatchScanExec {
            schema,
            projection,
            parts,
            cache,
        })
    }

    /// The same scan over other rows (same schema, same number of partitions).
    fn with_parts(&self, parts: Parts) -> Self {
        BatchScanExec {
            schema: Arc::clone(&self.schema),
            projection: self.projection.clone(),
            parts,
            cache: Arc::clone(&self.cache),
        }
    }
}

impl DisplayAs for BatchScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "BatchScanExec: partitions={}", self.parts.len())
    }
}

impl ExecutionPlan for BatchScanExec {
    fn name(&self) -> &str {
        "BatchScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        if children.is_empty() {
            Ok(self)
        } else {
            Err(datafusion::error::DataFusionError::Internal(
                "BatchScanExec has no inputs".into(),
            ))
        }
    }

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let rows = self.parts.get(partition).cloned().ok_or_else(|| {
            datafusion::error::DataFusionError::Internal(format!(
                "BatchScanExec has {} partitions, not {}",
                self.parts.len(),
                partition + 1
            ))
        })?;
        // The stream's schema is that of the batches it gives: the projected one (sorts
        // concatenate their input by the stream's schema).
        Ok(Box::pin(MemoryStream::try_new(
            rows,
            self.schema(),
            self.projection.clone(),
        )?))
    }
}

/// A plan whose leaves are [`BatchScanExec`]s, with the rows of one batch.
#[derive(Debug, Clone)]
pub(crate) struct KeptPlanNode {
    /// Tells one prepared batch from another for the logical plan's `Eq`/`Hash`.
    id: u64,
    template: Arc<dyn ExecutionPlan>,
    parts: Parts,
    schema: DFSchemaRef,
}

static PREPARED_IDS: AtomicU64 = AtomicU64::new(0);

impl KeptPlanNode {
    /// The template with these rows in its scans and fresh state in every node.
    fn instantiate(&self) -> DfResult<Arc<dyn ExecutionPlan>> {
        reset_plan_states(with_rows(Arc::clone(&self.template), &self.parts)?)
    }
}

impl PartialEq for KeptPlanNode {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for KeptPlanNode {}

impl Hash for KeptPlanNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl PartialOrd for KeptPlanNode {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.id.cmp(&other.id))
    }
}

impl UserDefinedLogicalNodeCore for KeptPlanNode {
    fn name(&self) -> &str {
        "KeptPlan"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "KeptPlan: the query's plan over this batch")
    }

    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        _inputs: Vec<LogicalPlan>,
    ) -> DfResult<Self> {
        Ok(self.clone())
    }
}

/// Plans [`KeptPlanNode`] nodes anywhere in a plan (a function may build on the batch).
#[derive(Debug)]
struct KeptPlanPlanner;

#[async_trait]
impl ExtensionPlanner for KeptPlanPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        _physical_inputs: &[Arc<dyn ExecutionPlan>],
        _session: &dyn Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        node.as_any()
            .downcast_ref::<KeptPlanNode>()
            .map(KeptPlanNode::instantiate)
            .transpose()
    }
}

/// The query planner of every weir session: DataFusion's, which also knows [`KeptPlanNode`]
/// nodes and the sinks' writes on workers; a plan that is only such a node is not optimized again (its template was).
#[derive(Debug)]
pub(crate) struct WeirQueryPlanner;

#[async_trait]
impl QueryPlanner for WeirQueryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        if let LogicalPlan::Extension(Extension { node }) = logical_plan
            && let Some(p) = node.as_any().downcast_ref::<KeptPlanNode>()
        {
            return p.instantiate();
        }
        DefaultPhysicalPlanner::with_extension_planners(vec![
            Arc::new(KeptPlanPlanner),
            Arc::new(crate::sink::WritePlanner),
            Arc::new(super::stateful::on_workers::StatePlanner),
        ])
        .create_physical_plan(logical_plan, session)
        .await
    }
}

/// What a query knows of its SQL transform's plan.
#[derive(Default)]
pub(crate) enum SqlPlan {
    /// Not planned yet.
    #[default]
    Unknown,
    /// Planned again for every batch (see the module docs for why a plan is not kept).
    PerBatch,
    /// Planned once, for input of this schema in this many partitions.
    Kept {
        input: SchemaRef,
        partitions: usize,
        template: Arc<dyn ExecutionPlan>,
        schema: DFSchemaRef,
    },
}

impl SqlPlan {
    /// `sql` over a batch of `input` with the rows `parts`, as a `DataFrame`: from the kept
    /// plan when there is one for this schema, else planned (and kept when it may be).
    pub(crate) async fn frame(
        &mut self,
        ctx: &SessionContext,
        sql: &str,
        input: SchemaRef,
        parts: Parts,
    ) -> DfResult<DataFrame> {
        if let SqlPlan::Kept {
            input: kept,
            partitions,
            template,
            schema,
        } = self
            && *kept == input
            && *partitions == parts.len()
        {
            return Ok(kept_frame(ctx, template, schema, parts));
        }
        let table = Arc::new(BatchTable::new(Arc::clone(&input), Arc::clone(&parts)));
        let df = super::transform::sql_over_table(ctx, table, sql).await?;
        if matches!(self, SqlPlan::PerBatch) || !may_keep(df.logical_plan())? {
            *self = SqlPlan::PerBatch;
            return Ok(df);
        }
        let mut state = ctx.state();
        {
            let optimizer = &mut state.config_mut().options_mut().optimizer;
            optimizer.enable_dynamic_filter_pushdown = false;
            optimizer.enable_topk_dynamic_filter_pushdown = false;
            optimizer.enable_join_dynamic_filter_pushdown = false;
            optimizer.enable_aggregate_dynamic_filter_pushdown = false;
        }
        let planned = state.create_physical_plan(df.logical_plan()).await?;
        if !only_batch_leaves(&planned)? {
            *self = SqlPlan::PerBatch;
            return Ok(df);
        }
        let schema = Arc::new(df.schema().clone());
        // The template holds no rows (they would stay in memory as long as the query).
        let empty: Parts = Arc::new(vec![Vec::new(); parts.len()]);
        let template = with_rows(planned, &empty)?;
        let frame = kept_frame(ctx, &template, &schema, parts);
        *self = SqlPlan::Kept {
            input,
            partitions: empty.len(),
            template,
            schema,
        };
        Ok(frame)
    }
}

/// A `DataFrame` over `template` with the rows `parts`.
fn kept_frame(
    ctx: &SessionContext,
    template: &Arc<dyn ExecutionPlan>,
    schema: &DFSchemaRef,
    parts: Parts,
) -> DataFrame {
    let node = KeptPlanNode {
        id: PREPARED_IDS.fetch_add(1, AtomicOrdering::Relaxed),
        template: Arc::clone(template),
        parts,
        schema: Arc::clone(schema),
    };
    let plan = LogicalPlan::Extension(Extension {
        node: Arc::new(node),
    });
    DataFrame::new(ctx.state(), plan)
}

/// `plan` with `parts` in each of its batch scans.
fn with_rows(plan: Arc<dyn ExecutionPlan>, parts: &Parts) -> DfResult<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(scan) = node.downcast_ref::<BatchScanExec>() else {
            return Ok(Transformed::no(node));
        };
        if scan.parts.len() != parts.len() {
            return Err(datafusion::error::DataFusionError::Internal(format!(
                "the kept plan reads the batch in {} partitions, this batch has {}",
                scan.parts.len(),
                parts.len()
            )));
        }
        Ok(Transformed::yes(
            Arc::new(scan.with_parts(Arc::clone(parts))) as Arc<dyn ExecutionPlan>,
        ))
    })
    .map(|t| t.data)
}

/// A query (not a statement) with nothing in it that may differ from one batch to the next.
fn may_keep(plan: &LogicalPlan) -> DfResult<bool> {
    if matches!(
        plan,
        LogicalPlan::Ddl(_)
            | LogicalPlan::Dml(_)
            | LogicalPlan::Copy(_)
            | LogicalPlan::Statement(_)
            | LogicalPlan::Explain(_)
            | LogicalPlan::Analyze(_)
            | LogicalPlan::DescribeTable(_)
    ) {
        return Ok(false);
    }
    let mut keep = true;
    plan.apply(|node| {
        for e in node.expressions() {
            e.apply(|e| {
                let varies = match e {
                    Expr::ScalarFunction(f) => {
                        f.func.signature().volatility != Volatility::Immutable
                    }
                    Expr::ScalarSubquery(_)
                    | Expr::Exists(_)
                    | Expr::InSubquery(_)
                    | Expr::SetComparison(_)
                    | Expr::ScalarVariable(..)
                    | Expr::Placeholder(_)
                    | Expr::OuterReferenceColumn(..)
                    | Expr::HigherOrderFunction(_) => true,
                    _ => false,
                };
                keep &= !varies;
                Ok(if varies {
                    TreeNodeRecursion::Stop
                } else {
                    TreeNodeRecursion::Continue
                })
            })?;
        }
        Ok(match node {
            LogicalPlan::Subquery(_)
            | LogicalPlan::RecursiveQuery(_)
            | LogicalPlan::Extension(_) => {
                keep = false;
                TreeNodeRecursion::Stop
            }
            _ if keep => TreeNodeRecursion::Continue,
            _ => TreeNodeRecursion::Stop,
        })
    })?;
    Ok(keep)
}

/// Every leaf of `plan` reads the batch.
fn only_batch_leaves(plan: &Arc<dyn ExecutionPlan>) -> DfResult<bool> {
    let mut only = true;
    plan.apply(|node| {
        if node.children().is_empty() && !node.is::<BatchScanExec>() {
            only = false;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    Ok(only)
}

#[cfg(test)]
mod tests;
