//! Stateful steps whose state partitions run on the cluster's workers (issue 38, step 6):
//! a deduplication, and an aggregation ([`aggregate`]).
//!
//! The plan, below the driver:
//!
//! ```text
//! DedupeStateExec            one task per live worker, each owning the partitions whose
//!   RepartitionExec(Hash p)  tags reach it: load version N of each, pass the new keys,
//!     PartitionTagExec       evict by the watermark, commit N+1; a side row says what it did
//!       (the batch's plan)   every row tagged with its key's state partition p
//! ```
//!
//! - **Which task owns a partition.** Rows are tagged with weir's own [`partition_of`] of
//!   their key (the checkpoint's partitioning, fixed for its life) and shuffled by that tag.
//!   Where a tag lands is DataFusion's hash over a fixed count, so the same task while the
//!   workers stay the same; nothing durable depends on it. Every task of the tagging stage
//!   also sends one *marker* row per state partition, so the task that owns partition `p`
//!   hears of it even when the batch has no row of `p`: every partition loads, evicts and
//!   commits version N+1 every batch, as on one machine. The driver checks that each
//!   partition was committed by exactly one task.
//! - **Which copy of a key passes.** A shuffle interleaves rows from several tasks in an
//!   order that changes from run to run. A task judges the least copy of each key by every
//!   column that has an order (ascending, NULLs first: the order the driver puts the
//!   workers' rows in before a stateful step it runs itself), so every attempt of a batch
//!   passes the same copy. An aggregation sorts its rows so, and aggregates them on one
//!   thread, so a floating-point sum adds in the same order on every attempt.
//! - **When the state is committed.** A task commits its partitions' version N+1 when its
//!   rows are done, before the function runs, as Spark's tasks do: a failed function or a
//!   driver killed before `commits/N` replays batch N, which loads version N again and
//!   writes N+1 over what the first attempt wrote (see [`StateStore::commit`]). A task's
//!   worker keeps the partitions it committed in memory for the next batch (by the query's
//!   id, so a checkpoint made again on the same path is not taken for the old one); a
//!   partition that moved loads from the checkpoint. Files of versions retention let go
//!   are deleted when version N is loaded, which `commits/N-1` made final.
//! - **What the driver learns.** Each task outputs one side row (a JSON column, the data
//!   columns NULL) with its partitions, counts, times, state size and the event times of
//!   its rows when the watermark step comes right before the stateful step. The driver
//!   takes those rows out ([`split`]) and reports them as the operator's progress.

use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{Array, RecordBatch, StringArray};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DFSchema, DFSchemaRef, DataFusionError, Result as DfResult};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::physical_expr::Partitioning;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::expressions::Column;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_planner::{ExtensionPlanner, PhysicalPlanner};
use datafusion::prelude::DataFrame;
use serde::{Deserialize, Serialize};

use super::dedupe::{Dedupe, DedupeMode, Rules};
use super::watermark::{EventTime, EventTimeStats};
use super::{OperatorMetrics, Ran, watermark};
use crate::error::{Error, Result};
use crate::state::StateConf;
use crate::storage::Location;

mod aggregate;
mod exec;

pub(crate) use aggregate::AggSpec;
pub use aggregate::{AggStateExec, AggTagExec};

use exec::TagBody;
pub(crate) use exec::orderable;
pub use exec::{DedupeStateExec, PartitionTagExec};

/// The tagging node on the wire.
pub const TAG_KIND: &str = "weir.StatePartitionTag.v1";
/// The deduplication node on the wire.
pub const DEDUPE_KIND: &str = "weir.DedupeState.v1";
/// The aggregation's tagging node on the wire.
pub const AGG_TAG_KIND: &str = "weir.AggregateTag.v1";
/// The aggregation node on the wire.
pub const AGG_KIND: &str = "weir.AggregateState.v1";

/// Whether `node` works state partitions (its stage is the state's).
pub fn is_state_exec(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<DedupeStateExec>().is_some()
        || node.downcast_ref::<AggStateExec>().is_some()
}

fn is_tag_exec(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<PartitionTagExec>().is_some() || node.downcast_ref::<AggTagExec>().is_some()
}

/// What a stateful operator on the workers needs.
#[derive(Debug, Clone)]
pub(crate) enum StateSpec {
    Dedupe(DedupeSpec),
    Aggregate(AggSpec),
}

impl StateSpec {
    fn describe(&self) -> (u32, u64) {
        match self {
            StateSpec::Dedupe(d) => (d.operator, d.batch_id),
            StateSpec::Aggregate(a) => (a.operator, a.batch_id),
        }
    }
}

/// The tag: the state partition of the row's key.
const PART_COL: &str = "__weir_state_partition";
/// Whether the row is a marker (no data, only its partition).
const MARK_COL: &str = "__weir_state_marker";
/// A task's side row: what it did, as JSON (NULL on data rows).
const META_COL: &str = "__weir_state";

/// What a deduplication on the workers needs: all of it travels with the plan.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct DedupeSpec {
    /// The query's id (its checkpoint's): a worker keeps partitions by it, so a checkpoint
    /// deleted and made again on the same path is not taken for the old one.
    query: uuid::Uuid,
    operator: u32,
    /// `state/<operator>` as a URL (as parsed, percent-encoded) and the object store's
    /// settings there (never shown).
    dir: String,
    storage: BTreeMap<String, String>,
    partitions: u32,
    snapshot_every: u64,
    retain: u64,
    batch_id: u64,
    keys: Vec<usize>,
    within: bool,
    keep_time: bool,
    event: Option<(EventTime, usize)>,
    /// The watermark's column, when its step comes right before: the event times of the
    /// rows are noted here for the next watermark.
    observe: Option<usize>,
}

impl fmt::Debug for DedupeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupeSpec")
            .field("operator", &self.operator)
            .field("dir", &self.dir)
            .field("partitions", &self.partitions)
            .field("batch_id", &self.batch_id)
            .field("keys", &self.keys)
            .field("within", &self.within)
            .finish_non_exhaustive()
    }
}

impl DedupeSpec {
    /// The spec of operator `operator`, whose state is in `dir` in `partitions`
    /// partitions, for batch `batch_id`'s rows by `rules`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        query: uuid::Uuid,
        operator: u32,
        dir: &Location,
        partitions: u32,
        conf: StateConf,
        batch_id: u64,
        rules: &Rules,
        observe: Option<usize>,
    ) -> DedupeSpec {
        DedupeSpec {
            query,
            operator,
            dir: dir.url().to_string(),
            storage: dir.options().as_map().clone(),
            partitions,
            snapshot_every: conf.snapshot_every(),
            retain: conf.retain(),
            batch_id,
            keys: rules.columns.clone(),
            within: rules.mode == DedupeMode::WithinWatermark,
            keep_time: rules.keep_time,
            event: rules.event.clone(),
            observe,
        }
    }

    fn rules(&self) -> Rules {
        Rules {
            columns: self.keys.clone(),
            event: self.event.clone(),
            keep_time: self.keep_time,
            mode: match self.within {
                true => DedupeMode::WithinWatermark,
                false => DedupeMode::Plain,
            },
        }
    }
}

/// What one task did: its side row.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Meta {
    partitions: Vec<u32>,
    updated: u64,
    removed: u64,
    dropped_late: u64,
    rows_total: u64,
    memory_bytes: u64,
    update_ms: u64,
    remove_ms: u64,
    commit_ms: u64,
    event: EventTimeStats,
}

/// Batch `batch_id`'s rows `df` of query `query` with deduplication `d` on top, to run on
/// the workers, and the schema of its rows; `observe` names the watermark's column when its
/// step comes right before, so the workers note the event times.
pub(super) async fn plan_dedupe(
    d: &mut Dedupe,
    df: DataFrame,
    (query, batch_id): (uuid::Uuid, u64),
    event: Option<&EventTime>,
    observe: Option<&str>,
) -> Result<(DataFrame, SchemaRef)> {
    let schema = df.schema().as_arrow().clone();
    let rules = d.rules(&schema, batch_id, event, true).await?;
    let observe = match observe {
        Some(column) => Some(watermark::column_index(&schema, column)?),
        None => None,
    };
    d.metrics = OperatorMetrics::new(d.mode.name());
    d.on_workers = None;
    let dir = d.op.state_root.join(&d.op.operator.to_string());
    let spec = DedupeSpec::new(
        query,
        d.op.operator,
        &dir,
        d.op.store.partitions(),
        d.op.settings.conf,
        batch_id,
        &rules,
        observe,
    );
    let plan = plan(df, StateSpec::Dedupe(spec), &schema)?;
    Ok((plan, Arc::new(schema)))
}

/// `df` with the stateful operator `spec` on top, to run on the workers: its output is
/// rows of `data` (the deduplication's input schema, the aggregation's output) and the
/// tasks' side rows.
pub(super) fn plan(df: DataFrame, spec: StateSpec, data: &Schema) -> Result<DataFrame> {
    let (state, input) = df.into_parts();
    let out = out_schema(data);
    let schema = Arc::new(
        DFSchema::try_from(out.as_ref().clone())
            .map_err(|e| Error::datafusion("planning a stateful step on the workers", e))?,
    );
    let node = StateNode {
        input,
        spec: Arc::new(spec),
        schema,
    };
    Ok(DataFrame::new(
        state,
        LogicalPlan::Extension(Extension {
            node: Arc::new(node),
        }),
    ))
}

/// The workers' output `out` for a stateful operator of `partitions` state partitions:
/// its rows (as `data`), the tasks' totals, and the event times they saw.
/// An error unless every partition was committed by exactly one task.
pub(super) fn split(
    out: Vec<RecordBatch>,
    data: &SchemaRef,
    partitions: u32,
    metrics: &mut super::OperatorMetrics,
) -> Result<(Vec<RecordBatch>, Ran, EventTimeStats)> {
    let internal = |what: String| Error::Internal { what };
    let mut rows = Vec::with_capacity(out.len());
    let mut ran = Ran::default();
    let mut event = EventTimeStats::default();
    let mut seen = vec![0u32; partitions as usize];
    for b in out {
        let meta = b
            .column_by_name(META_COL)
            .and_then(|c| c.as_any().downcast_ref::<StringArray>())
            .ok_or_else(|| internal(format!("the workers' rows have no {META_COL}")))?;
        for text in meta.iter().flatten() {
            let m: Meta = serde_json::from_str(text)
                .map_err(|e| internal(format!("a task's report `{text}`: {e}")))?;
            for p in &m.partitions {
                match seen.get_mut(*p as usize) {
                    Some(n) => *n += 1,
                    None => return Err(internal(format!("a task reported partition {p}"))),
                }
            }
            metrics.updated += m.updated;
            metrics.removed += m.removed;
            metrics.dropped_late += m.dropped_late;
            metrics.update_ms += m.update_ms;
            metrics.remove_ms += m.remove_ms;
            ran.rows_total += m.rows_total;
            ran.memory_bytes += m.memory_bytes;
            ran.commit_ms += m.commit_ms;
            event.merge(&m.event);
        }
        let is_data = datafusion::arrow::compute::is_null(meta)
            .map_err(|e| Error::datafusion("the workers' rows", e.into()))?;
        let kept = filter_record_batch(&b, &is_data)
            .map_err(|e| Error::datafusion("the workers' rows", e.into()))?;
        if kept.num_rows() > 0 {
            let cols = kept.columns()[..data.fields().len()].to_vec();
            rows.push(
                RecordBatch::try_new(Arc::clone(data), cols)
                    .map_err(|e| Error::datafusion("the workers' rows", e.into()))?,
            );
        }
    }
    let wrong: Vec<String> = seen
        .iter()
        .enumerate()
        .filter(|(_, n)| **n != 1)
        .map(|(p, n)| format!("partition {p} by {n} tasks"))
        .collect();
    if !wrong.is_empty() {
        return Err(Error::Cluster {
            reason: format!(
                "the workers committed the state partitions other than once each: {}",
                wrong.join(", ")
            ),
        });
    }
    Ok((rows, ran, event))
}

/// The data columns as nullable (a marker or side row has NULLs in every one).
fn nullable(data: &Schema) -> Vec<Field> {
    data.fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(true))
        .collect()
}

fn tag_schema(data: &Schema) -> SchemaRef {
    let mut fields = nullable(data);
    fields.push(Field::new(PART_COL, DataType::UInt32, false));
    fields.push(Field::new(MARK_COL, DataType::Boolean, false));
    Arc::new(Schema::new(fields))
}

fn out_schema(data: &Schema) -> SchemaRef {
    let mut fields = nullable(data);
    fields.push(Field::new(META_COL, DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

/// The logical form of a stateful operator on the workers.
#[derive(Debug, Clone)]
struct StateNode {
    input: LogicalPlan,
    spec: Arc<StateSpec>,
    schema: DFSchemaRef,
}

impl PartialEq for StateNode {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.spec, &other.spec) && self.input == other.input
    }
}

impl Eq for StateNode {}

impl Hash for StateNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.spec.describe().hash(state);
        self.input.hash(state);
    }
}

impl PartialOrd for StateNode {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        (self == other).then_some(std::cmp::Ordering::Equal)
    }
}

impl UserDefinedLogicalNodeCore for StateNode {
    fn name(&self) -> &str {
        "StateOnWorkers"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let (operator, batch) = self.spec.describe();
        write!(f, "StateOnWorkers: operator {operator}, batch {batch}")
    }

    fn with_exprs_and_inputs(&self, _exprs: Vec<Expr>, inputs: Vec<LogicalPlan>) -> DfResult<Self> {
        let [input] = <[_; 1]>::try_from(inputs)
            .map_err(|_| DataFusionError::Internal("StateOnWorkers takes one input".into()))?;
        Ok(StateNode {
            input,
            spec: Arc::clone(&self.spec),
            schema: Arc::clone(&self.schema),
        })
    }
}

/// Plans [`StateNode`]s (part of weir's query planner); [`StateShuffle`] then puts the
/// shuffle by partition between the two nodes.
#[derive(Debug)]
pub(crate) struct StatePlanner;

#[async_trait]
impl ExtensionPlanner for StatePlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        _session: &dyn Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<StateNode>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return Err(DataFusionError::Internal(
                "StateOnWorkers takes one input".into(),
            ));
        };
        let input = Arc::clone(input);
        Ok(Some(match node.spec.as_ref() {
            StateSpec::Dedupe(d) => {
                let tag = PartitionTagExec::new(input, d.keys.clone(), d.partitions);
                Arc::new(DedupeStateExec::new(Arc::new(tag), Arc::new(d.clone())))
            }
            StateSpec::Aggregate(a) => {
                let a = Arc::new(a.clone());
                let tag = AggTagExec::new(input, Arc::clone(&a));
                let out = Arc::new(node.schema.as_arrow().clone());
                Arc::new(AggStateExec::new(Arc::new(tag), a, out))
            }
        }))
    }
}

/// The physical optimizer rule (registered after DataFusion's own, so nothing takes it
/// out) that puts a hash shuffle on the partition tag right under every
/// [`DedupeStateExec`]: the distributed planner makes it the network shuffle between the
/// tasks that tag and the tasks that own the partitions.
#[derive(Debug, Default)]
pub struct StateShuffle;

impl PhysicalOptimizerRule for StateShuffle {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let target = config.execution.target_partitions.max(1);
        plan.transform_up(|node| {
            if !is_state_exec(&node) {
                return Ok(Transformed::no(node));
            }
            let Some(mut child) = node.children().first().map(|c| Arc::clone(*c)) else {
                return Ok(Transformed::no(node));
            };
            loop {
                if is_tag_exec(&child) {
                    break;
                }
                let below = if child.downcast_ref::<RepartitionExec>().is_some()
                    || child.downcast_ref::<CoalescePartitionsExec>().is_some()
                {
                    child.children().first().map(|c| Arc::clone(*c))
                } else {
                    None
                };
                child = below.ok_or_else(|| {
                    DataFusionError::Internal(format!(
                        "{} over {} instead of its partition tag",
                        node.name(),
                        child.name()
                    ))
                })?;
            }
            // A fixed count (the distributed planner multiplies it by the tasks): a
            // partition's tag lands on the same task every batch while the workers stay.
            let p = child.schema().index_of(PART_COL)?;
            let n = target;
            let shuffle = RepartitionExec::try_new(
                child,
                Partitioning::Hash(vec![Arc::new(Column::new(PART_COL, p))], n),
            )?;
            Ok(Transformed::yes(Arc::clone(&node).replace_children(
                vec![Arc::new(shuffle)],
                ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
            )?))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "weir_state_shuffle"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The node as plain data for the wire, if it is one of this module's: its kind and body
/// (the codec sends its output schema with it).
pub fn encode_node(node: &Arc<dyn ExecutionPlan>) -> DfResult<Option<(&'static str, String)>> {
    if let Some(t) = node.downcast_ref::<PartitionTagExec>() {
        let b = TagBody {
            keys: t.keys.clone(),
            partitions: t.partitions,
        };
        return Ok(Some((TAG_KIND, json(&b)?)));
    }
    if let Some(d) = node.downcast_ref::<DedupeStateExec>() {
        return Ok(Some((DEDUPE_KIND, json(d.spec.as_ref())?)));
    }
    if let Some(t) = node.downcast_ref::<AggTagExec>() {
        return Ok(Some((AGG_TAG_KIND, json(t.spec.as_ref())?)));
    }
    if let Some(a) = node.downcast_ref::<AggStateExec>() {
        return Ok(Some((AGG_KIND, json(a.spec.as_ref())?)));
    }
    Ok(None)
}

/// Rebuilds a node of kind `kind` over `input` from its body (and the output schema the
/// node came with, which an aggregation needs); `None` for another kind.
pub fn decode_node(
    kind: &str,
    input: &Arc<dyn ExecutionPlan>,
    body: &str,
    schema: Option<SchemaRef>,
) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let parse = |e: serde_json::Error| DataFusionError::Internal(format!("decoding {kind}: {e}"));
    Ok(match kind {
        TAG_KIND => {
            let b: TagBody = serde_json::from_str(body).map_err(parse)?;
            Some(Arc::new(PartitionTagExec::new(
                Arc::clone(input),
                b.keys,
                b.partitions,
            )))
        }
        DEDUPE_KIND => {
            let spec: DedupeSpec = serde_json::from_str(body).map_err(parse)?;
            Some(Arc::new(DedupeStateExec::new(
                Arc::clone(input),
                Arc::new(spec),
            )))
        }
        AGG_TAG_KIND => {
            let spec: AggSpec = serde_json::from_str(body).map_err(parse)?;
            Some(Arc::new(AggTagExec::new(Arc::clone(input), Arc::new(spec))))
        }
        AGG_KIND => {
            let spec: AggSpec = serde_json::from_str(body).map_err(parse)?;
            let out = schema.ok_or_else(|| {
                DataFusionError::Internal(format!("{AGG_KIND} without its output schema"))
            })?;
            Some(Arc::new(AggStateExec::new(
                Arc::clone(input),
                Arc::new(spec),
                out,
            )))
        }
        _ => None,
    })
}

fn json<T: Serialize>(v: &T) -> DfResult<String> {
    serde_json::to_string(v)
        .map_err(|e| DataFusionError::Internal(format!("encoding a state node: {e}")))
}

#[cfg(test)]
mod tests;
