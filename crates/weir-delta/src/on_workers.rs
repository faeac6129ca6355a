//! The Delta append on a cluster: each task writes its rows as data files of the table
//! where it runs; the driver commits the batch's files in one Delta transaction with the
//! application transaction `(app_id, batch id)`. The rows never come to the driver.
//!
//! 1. The driver decides whether the table can take files written elsewhere
//!    ([`placement`]): a table with rules that delta-rs enforces while it writes (CHECK
//!    constraints, invariants, generated or identity columns, column mapping, writer features
//!    weir does not know) or a batch whose columns are not the table's is written on the
//!    driver, as in one process, so delta-rs checks it and reports what is wrong.
//! 2. Otherwise the batch's plan gets a [`DeltaFilesExec`] on top. Each partition of each
//!    task casts its rows to the table's schema, writes them with delta-rs's `DeltaWriter`
//!    (partition folders, `target-file-size`, the table's statistics settings) and outputs
//!    the `add` actions of its files and its row count, as JSON.
//! 3. After an attempt whose every task succeeded, the driver commits every `add` and the
//!    `txn` in one version (creating the table in that same version on the first batch).
//!
//! | failure | what is left | what happens |
//! |---|---|---|
//! | a worker lost mid-write | data files of the failed attempt, in no commit | the plan runs again; readers never see the files (`VACUUM` removes them) |
//! | the driver dies before the commit | data files in no commit | the replay writes the batch again and commits once |
//! | the driver dies after the commit | the batch's version | the replay finds the app id's version and skips |

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;

use delta_kernel::table_properties::DataSkippingNumIndexedCols;
use deltalake::DeltaTable;
use deltalake::datafile::writer::{DeltaWriter, WriterConfig};
use deltalake::kernel::Add;
use deltalake::kernel::schema::cast::cast_record_batch;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use weir_core::datafusion::arrow::array::{Array, RecordBatch};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, SchemaRef};
use weir_core::datafusion::common::{DataFusionError, Result as DfResult};
use weir_core::datafusion::execution::{SendableRecordBatchStream, TaskContext};
use weir_core::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use weir_core::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties,
};
use weir_core::sink::{
    WorkerWrite, WriteKind, WritePlan, read_body, task_data_error, task_error, write_body,
    write_location, write_properties, written_batch, written_schema,
};
use weir_core::storage::Location;

use crate::error::DeltaSinkError;
use crate::table::unloaded;

/// Where a batch's rows are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Placement {
    /// By the tasks, on the workers.
    Workers,
    /// On the driver, as in one process; the reason is logged once.
    Driver(String),
}

/// What the placement looks at in a table (all empty for a table not created yet).
#[derive(Debug, Clone, Default)]
pub(crate) struct TableFacts {
    pub exists: bool,
    pub columns: Vec<String>,
    pub partition_columns: Vec<String>,
    /// The protocol's writer features (`None`: a protocol of fixed versions).
    pub writer_features: Option<Vec<String>>,
    pub column_mapping: bool,
    pub check_constraints: bool,
    /// Column rules found in the schema's metadata: "invariants", "generated columns",
    /// "identity columns".
    pub column_rules: Vec<&'static str>,
}

/// Writer features a task's data files satisfy, or whose use [`TableFacts`] checks itself
/// (a table may list `checkConstraints` and have none).
const KNOWN_WRITER_FEATURES: &[&str] = &[
    "appendOnly",
    "invariants",
    "checkConstraints",
    "changeDataFeed",
    "generatedColumns",
    "columnMapping",
    "identityColumns",
    "timestampNtz",
    "deletionVectors",
    "v2Checkpoint",
    "vacuumProtocolCheck",
    "checkpointProtection",
];

/// Where batch rows with `batch_columns` go, for a table with `table` and a sink asking for
/// `partition_by`: a pure decision.
pub(crate) fn placement(
    table: &TableFacts,
    batch_columns: &[String],
    partition_by: &[String],
) -> Placement {
    if !table.exists {
        return Placement::Workers;
    }
    let driver = |why: String| Placement::Driver(why);
    if let Some(f) = table
        .writer_features
        .iter()
        .flatten()
        .find(|f| !KNOWN_WRITER_FEATURES.contains(&f.as_str()))
    {
        return driver(format!("the table uses the writer feature `{f}`"));
    }
    if table.column_mapping {
        return driver("the table maps column names (delta.columnMapping.mode)".into());
    }
    if table.check_constraints {
        return driver("the table has CHECK constraints".into());
    }
    if let Some(rule) = table.column_rules.first() {
        return driver(format!("the table's columns have {rule}"));
    }
    if !partition_by.is_empty() && partition_by != table.partition_columns {
        return driver(format!(
            "partition-by {partition_by:?} is not the table's partition columns {:?}",
            table.partition_columns
        ));
    }
    let missing: Vec<&str> = table
        .columns
        .iter()
        .filter(|c| !batch_columns.contains(c))
        .map(String::as_str)
        .collect();
    let extra: Vec<&str> = batch_columns
        .iter()
        .filter(|c| !table.columns.contains(c))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() || !extra.is_empty() {
        return driver(format!(
            "the batch's columns are not the table's (the batch lacks [{}]; the table lacks [{}])",
            missing.join(", "),
            extra.join(", ")
        ));
    }
    Placement::Workers
}

/// The facts of `table` (loaded or not yet created).
pub(crate) fn facts(table: &DeltaTable) -> TableFacts {
    let Ok(state) = table.snapshot() else {
        return TableFacts::default();
    };
    if table.version().is_none() {
        return TableFacts::default();
    }
    let metadata = state.metadata();
    let config = metadata.configuration();
    let schema = state.schema();
    let arrow = state.snapshot().arrow_schema();
    let mut column_rules = Vec::new();
    for (key, rule) in [
        ("delta.invariants", "invariants"),
        ("delta.generationExpression", "generated columns"),
        ("delta.identity.start", "identity columns"),
    ] {
        if arrow.fields().iter().any(|f| has_metadata(f, key)) {
            column_rules.push(rule);
        }
    }
    let protocol = serde_json::to_value(state.protocol()).unwrap_or_default();
    let writer_features = protocol["writerFeatures"].as_array().map(|fs| {
        fs.iter()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect()
    });
    TableFacts {
        exists: true,
        columns: schema.fields().map(|f| f.name().to_string()).collect(),
        partition_columns: metadata.partition_columns().to_vec(),
        writer_features,
        column_mapping: config
            .get("delta.columnMapping.mode")
            .is_some_and(|m| m != "none"),
        check_constraints: config.keys().any(|k| k.starts_with("delta.constraints.")),
        column_rules,
    }
}

/// Whether `field` or a field nested in it has the metadata `key`.
fn has_metadata(field: &Field, key: &str) -> bool {
    field.metadata().contains_key(key)
        || match field.data_type() {
            DataType::Struct(fields) => fields.iter().any(|f| has_metadata(f, key)),
            DataType::List(f) | DataType::LargeList(f) | DataType::Map(f, _) => {
                has_metadata(f, key)
            }
            _ => false,
        }
}

/// What the tasks of one batch's write need: plain data, sent with the plan.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FilesWrite {
    /// The table's location, as a URL.
    pub table: String,
    /// Its object-store settings (never shown).
    #[serde(default)]
    pub storage: BTreeMap<String, String>,
    pub batch_id: u64,
    pub partition_columns: Vec<String>,
    pub target_file_size: Option<u64>,
    /// How many leading columns get statistics (`None`: all of them).
    pub stats_num_columns: Option<u64>,
    /// The columns that get statistics, when the table names them.
    pub stats_columns: Option<Vec<String>>,
}

/// The settings' values may be secrets: only their keys are shown.
impl fmt::Debug for FilesWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FilesWrite")
            .field("table", &self.table)
            .field("storage", &self.storage.keys().collect::<Vec<_>>())
            .field("batch_id", &self.batch_id)
            .field("partition_columns", &self.partition_columns)
            .field("target_file_size", &self.target_file_size)
            .finish()
    }
}

/// What one partition of a task wrote: a row of the write's output.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct TaskFiles {
    pub rows: u64,
    pub adds: Vec<Add>,
}

/// Writes its input's rows as data files of a Delta table, partition by partition, and
/// outputs their `add` actions (see the module docs).
#[derive(Debug)]
pub struct DeltaFilesExec {
    input: Arc<dyn ExecutionPlan>,
    write: FilesWrite,
    /// The table's schema, which the files are written in.
    schema: SchemaRef,
    at: Location,
    props: Arc<PlanProperties>,
}

impl DeltaFilesExec {
    /// The write `write` of `input`'s rows in `schema`. An error if the table's URL or
    /// settings are not valid here.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        write: FilesWrite,
        schema: SchemaRef,
    ) -> DfResult<Self> {
        let at = write_location(&write.table, &write.storage)?;
        let props = write_properties(&input);
        Ok(DeltaFilesExec {
            input,
            write,
            schema,
            at,
            props,
        })
    }

    /// What the node writes.
    pub fn write(&self) -> &FilesWrite {
        &self.write
    }
}

impl DisplayAs for DeltaFilesExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "DeltaFilesExec: table={}, batch={}",
            self.at, self.write.batch_id
        )
    }
}

impl ExecutionPlan for DeltaFilesExec {
    fn name(&self) -> &str {
        "DeltaFilesExec"
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
            &Arc<dyn weir_core::datafusion::physical_expr::PhysicalExpr>,
        )
            -> DfResult<weir_core::datafusion::common::tree_node::TreeNodeRecursion>,
    ) -> DfResult<weir_core::datafusion::common::tree_node::TreeNodeRecursion> {
        Ok(weir_core::datafusion::common::tree_node::TreeNodeRecursion::Continue)
    }

    /// More partitions would only mean more, smaller files.
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [input] = <[_; 1]>::try_from(children)
            .map_err(|_| DataFusionError::Internal("DeltaFilesExec takes one input".into()))?;
        Ok(Arc::new(DeltaFilesExec::try_new(
            input,
            self.write.clone(),
            Arc::clone(&self.schema),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let mut input = self.input.execute(partition, context)?;
        let write = self.write.clone();
        let schema = Arc::clone(&self.schema);
        let at = self.at.clone();
        let out = async move {
            let batch_id = write.batch_id;
            let delta = |action, source| {
                task_error(DeltaSinkError::Delta {
                    table: at.to_string(),
                    batch_id,
                    action,
                    source,
                })
            };
            let store = unloaded(&at, batch_id)
                .map_err(task_error)?
                .log_store()
                .object_store(None);
            let config = WriterConfig::new(
                Arc::clone(&schema),
                write.partition_columns.clone(),
                None,
                write.target_file_size.and_then(NonZeroU64::new),
                None,
                write
                    .stats_num_columns
                    .map_or(DataSkippingNumIndexedCols::AllColumns, |n| {
                        DataSkippingNumIndexedCols::NumColumns(n)
                    }),
                write.stats_columns.clone(),
            );
            let mut writer = DeltaWriter::new(store, config);
            let mut rows = 0u64;
            while let Some(batch) = input.next().await {
                let batch = batch?;
                if batch.num_rows() == 0 {
                    continue;
                }
                let written = match conform(&batch, &schema, &at, batch_id) {
                    Ok(b) => writer.write(&b).await.map_err(|e| DeltaSinkError::Delta {
                        table: at.to_string(),
                        batch_id,
                        action: "writing a data file",
                        source: e,
                    }),
                    Err(e) => Err(e),
                };
                if let Err(e) = written {
                    // Unfinished uploads go; finished files are in no commit.
                    let _ = writer.abort().await;
                    // A value the table cannot take fails on any worker; a failed upload may not.
                    let data = matches!(
                        e,
                        DeltaSinkError::NullInNotNull { .. }
                            | DeltaSinkError::Delta {
                                action: "casting the batch's rows to the table's schema",
                                ..
                            }
                    );
                    return Err(if data {
                        task_data_error(e)
                    } else {
                        task_error(e)
                    });
                }
                rows += batch.num_rows() as u64;
            }
            let adds = writer
                .close()
                .await
                .map_err(|e| delta("finishing the data files", e))?;
            let text = serde_json::to_string(&TaskFiles { rows, adds }).map_err(task_error)?;
            written_batch(vec![text])
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            written_schema(),
            futures::stream::once(out),
        )))
    }
}

/// `batch` in the table's schema `schema`: a NULL in a NOT NULL column is an error naming
/// it, other columns are cast as delta-rs casts them (an error if a value does not fit).
fn conform(
    batch: &RecordBatch,
    schema: &SchemaRef,
    at: &Location,
    batch_id: u64,
) -> Result<RecordBatch, DeltaSinkError> {
    for field in schema.fields().iter().filter(|f| !f.is_nullable()) {
        if let Some(col) = batch.column_by_name(field.name())
            && col.null_count() > 0
        {
            return Err(DeltaSinkError::NullInNotNull {
                table: at.to_string(),
                batch_id,
                column: field.name().clone(),
            });
        }
    }
    cast_record_batch(batch, Arc::clone(schema), false, false).map_err(|source| {
        DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id,
            action: "casting the batch's rows to the table's schema",
            source,
        }
    })
}

impl WorkerWrite for DeltaFilesExec {
    fn kind(&self) -> &'static str {
        DELTA_FILES.kind
    }

    fn encode(&self) -> DfResult<(SchemaRef, String)> {
        let body = write_body(self.kind(), &self.write)?;
        Ok((Arc::clone(&self.schema), body))
    }
}

/// The write's name on the wire.
const KIND: &str = "weir.DeltaFiles.v1";

/// The Delta append's write on the wire.
pub const DELTA_FILES: WriteKind = WriteKind {
    kind: KIND,
    find: |node| {
        node.downcast_ref::<DeltaFilesExec>()
            .map(|w| w as &dyn WorkerWrite)
    },
    decode: |input, schema, body| {
        let write: FilesWrite = read_body(KIND, body)?;
        Ok(Arc::new(DeltaFilesExec::try_new(input, write, schema)?))
    },
};

/// How the sink puts its write on a batch's plan.
#[derive(Debug)]
pub(crate) struct FilesPlan {
    pub write: FilesWrite,
    pub schema: SchemaRef,
}

impl WritePlan for FilesPlan {
    fn describe(&self) -> String {
        format!(
            "Delta data files of batch {} in {}",
            self.write.batch_id, self.write.table
        )
    }

    fn plan(&self, input: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(DeltaFilesExec::try_new(
            input,
            self.write.clone(),
            Arc::clone(&self.schema),
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(cols: &[&str]) -> Vec<String> {
        cols.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn only_tables_without_write_time_rules_take_files_written_elsewhere() {
        let plain = TableFacts {
            exists: true,
            columns: names(&["id", "day", "v"]),
            partition_columns: names(&["day"]),
            writer_features: None,
            ..TableFacts::default()
        };
        let with = |f: &dyn Fn(&mut TableFacts)| {
            let mut t = plain.clone();
            f(&mut t);
            t
        };
        let batch = names(&["v", "id", "day"]);
        let driver = |why: &str| Placement::Driver(why.to_string());
        // (table, batch columns, partition-by) -> placement
        let cases: Vec<(TableFacts, Vec<String>, Vec<String>, Placement)> = vec![
            // Not created yet: the commit creates it from the batch's schema.
            (
                TableFacts::default(),
                batch.clone(),
                vec![],
                Placement::Workers,
            ),
            (plain.clone(), batch.clone(), vec![], Placement::Workers),
            (
                plain.clone(),
                batch.clone(),
                names(&["day"]),
                Placement::Workers,
            ),
            (
                with(&|t| t.writer_features = Some(names(&["appendOnly", "timestampNtz"]))),
                batch.clone(),
                vec![],
                Placement::Workers,
            ),
            (
                with(&|t| t.writer_features = Some(names(&["rowTracking"]))),
                batch.clone(),
                vec![],
                driver("the table uses the writer feature `rowTracking`"),
            ),
            (
                with(&|t| t.column_mapping = true),
                batch.clone(),
                vec![],
                driver("the table maps column names (delta.columnMapping.mode)"),
            ),
            (
                with(&|t| t.check_constraints = true),
                batch.clone(),
                vec![],
                driver("the table has CHECK constraints"),
            ),
            (
                with(&|t| t.column_rules = vec!["generated columns"]),
                batch.clone(),
                vec![],
                driver("the table's columns have generated columns"),
            ),
            (
                plain.clone(),
                batch.clone(),
                names(&["id"]),
                driver("partition-by [\"id\"] is not the table's partition columns [\"day\"]"),
            ),
            (
                plain.clone(),
                names(&["id", "day"]),
                vec![],
                driver(
                    "the batch's columns are not the table's (the batch lacks [v]; the table lacks [])",
                ),
            ),
            (
                plain.clone(),
                names(&["id", "day", "v", "extra"]),
                vec![],
                driver(
                    "the batch's columns are not the table's (the batch lacks []; the table lacks [extra])",
                ),
            ),
        ];
        for (table, cols, by, want) in cases {
            assert_eq!(
                placement(&table, &cols, &by),
                want,
                "{table:?} {cols:?} {by:?}"
            );
        }
    }

    #[test]
    fn settings_values_are_not_shown() {
        let write = FilesWrite {
            table: "s3://b/t/".into(),
            storage: [("aws_secret_access_key".to_string(), "hunter2".to_string())].into(),
            batch_id: 1,
            partition_columns: vec![],
            target_file_size: None,
            stats_num_columns: Some(32),
            stats_columns: None,
        };
        let shown = format!("{write:?}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
