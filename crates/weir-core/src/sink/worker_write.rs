//! Sinks that write where the batch's plan runs. On a cluster a sink that
//! [`ForeachBatch::writes_on_workers`](super::ForeachBatch) puts a [`WorkerWrite`] node on
//! top of the batch's plan ([`on_workers`]): each task writes its rows (Parquet parts in
//! staging, Delta data files) and outputs a small description of what it wrote, which the
//! driver commits once (moves the parts into place, commits one Delta version with the
//! transaction). A task's write is never visible before that commit, so a failed attempt
//! leaves only files that no reader lists.
//!
//! Each kind of write is described once by a [`WriteKind`], as scans are by
//! [`ScanKind`](crate::source::leaf::ScanKind): the binary lists both ([`PlanNodes`]) and
//! hands the list to the cluster, so connectors stay free of the transport.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{DFSchema, DFSchemaRef, DataFusionError, Result as DfResult};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, PlanProperties};
use datafusion::physical_planner::{ExtensionPlanner, PhysicalPlanner};
use datafusion::prelude::DataFrame;

use crate::error::{Error, Result};
use crate::source::leaf::ScanKind;
use crate::storage::{Location, StorageOptions};

/// A node that writes its input's rows where it runs and outputs what it wrote.
pub trait WorkerWrite: ExecutionPlan {
    /// The write's kind on the wire (its [`WriteKind::kind`]).
    fn kind(&self) -> &'static str;

    /// The write as plain data for the wire: a schema it needs (or its output schema) and
    /// its own description as JSON. May hold settings a worker needs (never shown).
    fn encode(&self) -> DfResult<(SchemaRef, String)>;
}

/// One kind of [`WorkerWrite`]: its name on the wire, how to find it in a plan and how to
/// rebuild it on a worker over its input.
#[derive(Debug, Clone, Copy)]
pub struct WriteKind {
    /// The name on the wire, versioned (`weir.ParquetParts.v1`).
    pub kind: &'static str,
    /// The node as a write of this kind, if it is one.
    pub find: fn(&Arc<dyn ExecutionPlan>) -> Option<&dyn WorkerWrite>,
    /// Rebuilds a write over `input` from what [`WorkerWrite::encode`] gave.
    pub decode: DecodeWrite,
}

/// Rebuilds a write over `input` from its schema and body.
pub type DecodeWrite = fn(
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    body: &str,
) -> DfResult<Arc<dyn ExecutionPlan>>;

/// The node as a write of any of `kinds`.
pub fn find_write<'a>(
    kinds: &[&WriteKind],
    node: &'a Arc<dyn ExecutionPlan>,
) -> Option<&'a dyn WorkerWrite> {
    kinds.iter().find_map(|k| (k.find)(node))
}

/// The plan nodes of weir's that travel to workers, as the binary lists them.
#[derive(Debug, Clone, Copy)]
pub struct PlanNodes {
    pub scans: &'static [&'static ScanKind],
    pub writes: &'static [&'static WriteKind],
}

/// How a sink turns the batch's physical plan into its write (called when the plan is
/// made, on the driver).
pub trait WritePlan: fmt::Debug + Send + Sync {
    /// A name for plans and `EXPLAIN`, with what tells two writes apart (folder, batch).
    fn describe(&self) -> String;

    /// The write node over `input`.
    fn plan(&self, input: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>>;
}

/// `batch` with `write` on top: its output is what the tasks wrote.
pub fn on_workers(batch: DataFrame, write: Arc<dyn WritePlan>) -> DataFrame {
    let (state, input) = batch.into_parts();
    let node = WriteNode { input, write };
    DataFrame::new(
        state,
        LogicalPlan::Extension(Extension {
            node: Arc::new(node),
        }),
    )
}

/// The output of every write: one row per thing written (a part, a data file), each
/// described as JSON by the write's kind.
pub fn written_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new(
        "written",
        DataType::Utf8,
        false,
    )]))
}

/// A batch of [`written_schema`] with `rows`.
pub fn written_batch(rows: Vec<String>) -> DfResult<RecordBatch> {
    RecordBatch::try_new(written_schema(), vec![Arc::new(StringArray::from(rows))])
        .map_err(DataFusionError::from)
}

/// The properties of a write over `input`: one output partition per input partition, each
/// giving its [`written_schema`] rows once its writes are done.
pub fn write_properties(input: &Arc<dyn ExecutionPlan>) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(written_schema()),
        Partitioning::UnknownPartitioning(input.output_partitioning().partition_count()),
        EmissionType::Final,
        Boundedness::Bounded,
    ))
}

/// The location a write names by its URL (as parsed, percent-encoded) and object-store
/// settings, rebuilt where the task runs.
pub fn write_location(url: &str, storage: &BTreeMap<String, String>) -> DfResult<Location> {
    let storage = StorageOptions::new(storage.clone()).map_err(task_error)?;
    Location::parse("sink.path", url, None, &storage).map_err(task_error)
}

/// A task's error, with its causes in its text: a worker's error reaches the driver as
/// text, and only the outermost error's text survives every path there.
pub fn task_error(e: impl std::error::Error + 'static) -> DataFusionError {
    DataFusionError::Execution(crate::error::error_chain(&e))
}

/// A write's description as JSON for the wire ([`WorkerWrite::encode`]'s body).
pub fn write_body(kind: &str, write: &impl serde::Serialize) -> DfResult<String> {
    serde_json::to_string(write)
        .map_err(|e| DataFusionError::Internal(format!("encoding {kind}: {e}")))
}

/// A write's description read back from its body ([`WriteKind::decode`]).
pub fn read_body<T: serde::de::DeserializeOwned>(kind: &str, body: &str) -> DfResult<T> {
    serde_json::from_str(body)
        .map_err(|e| DataFusionError::Internal(format!("decoding {kind}: {e}")))
}

/// The rows of a write's output, in the order the tasks gave them.
pub fn written_rows(out: &[RecordBatch]) -> Result<Vec<String>> {
    let mut rows = Vec::new();
    for b in out {
        let col = b
            .column_by_name("written")
            .and_then(|c| c.as_any().downcast_ref::<StringArray>())
            .ok_or_else(|| Error::Internal {
                what: "a write's output has no `written` text column".into(),
            })?;
        rows.extend(col.iter().map(|v| v.unwrap_or_default().to_string()));
    }
    Ok(rows)
}

fn output_schema() -> DFSchemaRef {
    // A schema of one plain column is always valid.
    Arc::new(DFSchema::try_from(written_schema()).unwrap_or_else(|_| DFSchema::empty()))
}

/// The logical form of a write on the workers.
#[derive(Debug, Clone)]
struct WriteNode {
    input: LogicalPlan,
    write: Arc<dyn WritePlan>,
}

impl PartialEq for WriteNode {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.write, &other.write) && self.input == other.input
    }
}

impl Eq for WriteNode {}

impl Hash for WriteNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.write.describe().hash(state);
        self.input.hash(state);
    }
}

impl PartialOrd for WriteNode {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        (self == other).then_some(Ordering::Equal)
    }
}

impl UserDefinedLogicalNodeCore for WriteNode {
    fn name(&self) -> &str {
        "WriteOnWorkers"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        static SCHEMA: std::sync::OnceLock<DFSchemaRef> = std::sync::OnceLock::new();
        SCHEMA.get_or_init(output_schema)
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "WriteOnWorkers: {}", self.write.describe())
    }

    fn with_exprs_and_inputs(&self, _exprs: Vec<Expr>, inputs: Vec<LogicalPlan>) -> DfResult<Self> {
        let [input] = <[_; 1]>::try_from(inputs)
            .map_err(|_| DataFusionError::Internal("WriteOnWorkers takes one input".into()))?;
        Ok(WriteNode {
            input,
            write: Arc::clone(&self.write),
        })
    }
}

/// Plans [`WriteNode`]s with their [`WritePlan`] (part of weir's query planner).
#[derive(Debug)]
pub(crate) struct WritePlanner;

#[async_trait]
impl ExtensionPlanner for WritePlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        _session: &dyn Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<WriteNode>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return Err(DataFusionError::Internal(
                "WriteOnWorkers takes one input".into(),
            ));
        };
        node.write.plan(Arc::clone(input)).map(Some)
    }
}
