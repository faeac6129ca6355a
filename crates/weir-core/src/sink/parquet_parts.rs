//! The Parquet sink on a cluster: each task writes its rows where it runs; the driver
//! commits the batch once. The rows never come to the driver.
//!
//! 1. The batch's plan gets a [`ParquetPartsExec`] on top (a
//!    [`WorkerWrite`](super::WorkerWrite)), inside the stage the workers run. Each partition of
//!    each task writes its rows as parts of `target_rows_per_file` rows, named
//!    `_weir_staging/batch-<N>-<random>-<k>.parquet`, and outputs one row per part: its
//!    name and rows, as JSON. Readers do not list staging: Spark, pyarrow and weir's file source
//!    skip `_`-prefixed folders.
//! 2. After an attempt whose every task succeeded, the driver moves the parts into place as
//!    `batch-<N>-part-<P>.parquet` in name order (a rename locally, a server-side copy on an
//!    object store), removes parts of N numbered higher on a replay (as the single-process
//!    write does), and deletes whatever staging holds for batches up to N.
//!
//! | failure | what is left | what happens |
//! |---|---|---|
//! | a worker lost mid-write | staged parts of the failed attempt | the plan runs again under new names; the commit deletes the old ones |
//! | the driver dies before or during the moves | some parts of N in place, the rest staged | the replay writes and moves every part of N again, then removes higher numbers |
//! | a cut-off worker writes after its attempt failed | a staged part no commit lists | deleted by the next batch's commit |

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{LexRequirement, OrderingRequirements};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::parquet_dictionary::rows_of;
use super::parquet_encode::{Chunker, ParquetCompression, put_encoded};
use super::worker_write::{
    WorkerWrite, WriteKind, WritePlan, read_body, task_error, write_body, write_location,
    write_properties, written_batch, written_rows, written_schema,
};
use crate::error::{Error, Result};
use crate::storage::{Location, temp_target};

/// The folder, inside the sink's, where tasks write before the driver's commit.
pub(crate) const STAGING: &str = "_weir_staging";

/// What the tasks of one batch's write need: plain data, sent to the workers with the plan.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PartsWrite {
    /// The sink's folder, as a URL.
    pub dir: String,
    /// The folder's object-store settings (never shown).
    #[serde(default)]
    pub storage: BTreeMap<String, String>,
    pub batch_id: u64,
    pub compression: ParquetCompression,
    pub target_rows_per_file: usize,
}

/// The settings' values may be secrets: only their keys are shown.
impl fmt::Debug for PartsWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartsWrite")
            .field("dir", &self.dir)
            .field("storage", &self.storage.keys().collect::<Vec<_>>())
            .field("batch_id", &self.batch_id)
            .field("compression", &self.compression)
            .field("target_rows_per_file", &self.target_rows_per_file)
            .finish()
    }
}

/// One part a task staged: a row of the write's output.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(super) struct StagedPart {
    pub file: String,
    pub rows: u64,
}

/// The staged name of part `k` of one partition's write of batch `batch_id`.
fn staged_name(batch_id: u64, run: &uuid::Uuid, k: usize) -> String {
    format!("batch-{batch_id:010}-{}-{k:05}.parquet", run.simple())
}

/// The batch a staged name (or its temp file) belongs to.
fn staged_batch(name: &str) -> Option<u64> {
    let name = temp_target(name).unwrap_or(name);
    name.strip_prefix("batch-")?.get(..10)?.parse().ok()
}

/// The parts the tasks reported, in name order.
pub(super) fn parts_written(out: &[RecordBatch]) -> Result<Vec<StagedPart>> {
    let mut parts = written_rows(out)?
        .iter()
        .map(|r| {
            serde_json::from_str::<StagedPart>(r).map_err(|e| Error::Internal {
                what: format!("a staged part's description `{r}`: {e}"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    parts.sort();
    Ok(parts)
}

/// Deletes what `dir`'s staging holds for batches up to `batch_id` (failed attempts, a
/// driver that died, late writes of a lost worker).
pub(super) async fn clear_staging(dir: &Location, batch_id: u64) -> Result<()> {
    let staging = dir.join(STAGING);
    let doomed: Vec<String> = staging
        .list_names()
        .await?
        .into_iter()
        .filter(|n| staged_batch(n).is_some_and(|b| b <= batch_id))
        .collect();
    staging.delete_many(doomed).await
}

/// Writes its input's rows as staged Parquet parts, partition by partition, and outputs
/// what it wrote (see the module docs).
#[derive(Debug)]
pub struct ParquetPartsExec {
    input: Arc<dyn ExecutionPlan>,
    write: PartsWrite,
    dir: Location,
    /// The input's order, kept in the parts.
    order: Option<LexRequirement>,
    props: Arc<PlanProperties>,
}

impl ParquetPartsExec {
    /// The write `write` of `input`'s rows. An error if the folder's URL or settings are
    /// not valid here.
    pub fn try_new(input: Arc<dyn ExecutionPlan>, write: PartsWrite) -> DfResult<Self> {
        let dir = write_location(&write.dir, &write.storage)?;
        let props = write_properties(&input);
        let order = input.output_ordering().cloned().map(LexRequirement::from);
        Ok(ParquetPartsExec {
            input,
            write,
            dir,
            order,
            props,
        })
    }

    /// What the node writes.
    pub fn write(&self) -> &PartsWrite {
        &self.write
    }

    /// The rows it writes.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for ParquetPartsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ParquetPartsExec: dir={}, batch={}",
            self.dir, self.write.batch_id
        )
    }
}

impl ExecutionPlan for ParquetPartsExec {
    fn name(&self) -> &str {
        "ParquetPartsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(
            &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
        ) -> DfResult<datafusion::common::tree_node::TreeNodeRecursion>,
    ) -> DfResult<datafusion::common::tree_node::TreeNodeRecursion> {
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    }

    /// More partitions would only mean more, smaller files.
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    /// A part holds its rows in the order they come (an `ORDER BY` is written sorted, as
    /// one process writes it): the input's order is kept and required, so the optimizer
    /// does not drop the sort below.
    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn required_input_ordering(&self) -> Vec<Option<OrderingRequirements>> {
        vec![self.order.clone().map(Into::into)]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [input] = <[_; 1]>::try_from(children)
            .map_err(|_| DataFusionError::Internal("ParquetPartsExec takes one input".into()))?;
        Ok(Arc::new(ParquetPartsExec::try_new(
            input,
            self.write.clone(),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let mut input = self.input.execute(partition, context)?;
        let schema = self.input.schema();
        let staging = self.dir.join(STAGING);
        let write = self.write.clone();
        let run = uuid::Uuid::new_v4();
        let out = async move {
            staging.create_dir().await.map_err(task_error)?;
            let mut chunks = Chunker::new(write.target_rows_per_file);
            let (mut names, mut counts) = (Vec::new(), Vec::new());
            let mut put = async |part: Vec<RecordBatch>| -> DfResult<()> {
                let name = staged_name(write.batch_id, &run, names.len());
                counts.push(rows_of(&part) as u64);
                put_encoded(
                    &staging,
                    &name,
                    &schema,
                    part,
                    write.compression,
                    write.batch_id,
                )
                .await
                .map_err(task_error)?;
                names.push(name);
                Ok(())
            };
            while let Some(batch) = input.next().await {
                for part in chunks.push(&batch?) {
                    put(part).await?;
                }
            }
            if let Some(part) = chunks.finish() {
                put(part).await?;
            }
            let rows = names
                .into_iter()
                .zip(counts)
                .map(|(file, rows)| serde_json::to_string(&StagedPart { file, rows }))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| DataFusionError::External(Box::new(e)))?;
            written_batch(rows)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            written_schema(),
            futures::stream::once(out),
        )))
    }
}

impl WorkerWrite for ParquetPartsExec {
    fn kind(&self) -> &'static str {
        PARQUET_PARTS.kind
    }

    fn encode(&self) -> DfResult<(SchemaRef, String)> {
        let body = write_body(self.kind(), &self.write)?;
        Ok((written_schema(), body))
    }
}

/// The write's name on the wire.
const KIND: &str = "weir.ParquetParts.v1";

/// The Parquet sink's write on the wire.
pub const PARQUET_PARTS: WriteKind = WriteKind {
    kind: KIND,
    find: |node| {
        node.downcast_ref::<ParquetPartsExec>()
            .map(|w| w as &dyn WorkerWrite)
    },
    decode: |input, _schema, body| {
        let write: PartsWrite = read_body(KIND, body)?;
        Ok(Arc::new(ParquetPartsExec::try_new(input, write)?))
    },
};

/// How the sink puts its write on a batch's plan.
#[derive(Debug)]
pub(super) struct PartsPlan(pub PartsWrite);

impl WritePlan for PartsPlan {
    fn describe(&self) -> String {
        format!(
            "Parquet parts of batch {} in {}",
            self.0.batch_id, self.0.dir
        )
    }

    fn plan(&self, input: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(ParquetPartsExec::try_new(input, self.0.clone())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_values_are_not_shown() {
        let write = PartsWrite {
            dir: "s3://b/p/".into(),
            storage: [("aws_secret_access_key".to_string(), "hunter2".to_string())].into(),
            batch_id: 1,
            compression: ParquetCompression::Snappy,
            target_rows_per_file: 10,
        };
        let shown = format!("{write:?}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn staged_names_say_their_batch() {
        let run = uuid::Uuid::new_v4();
        let name = staged_name(42, &run, 3);
        assert_eq!(staged_batch(&name), Some(42));
        assert_eq!(staged_batch("batch-0000000007-x-00000.parquet"), Some(7));
        assert_eq!(staged_batch("other.parquet"), None);
        assert_eq!(staged_batch("batch-12-short.parquet"), None);
    }
}
