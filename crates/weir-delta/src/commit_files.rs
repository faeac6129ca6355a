//! The driver's side of the Delta append on a cluster (see [`crate::on_workers`]): the
//! schema the tasks write in, the plan's run, and the one commit of every task's files with
//! the application transaction.

use std::sync::Arc;

use delta_kernel::engine::arrow_conversion::TryIntoKernel as _;
use delta_kernel::table_properties::DataSkippingNumIndexedCols;
use deltalake::DeltaTable;
use deltalake::kernel::schema::cast::normalize_for_delta;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties, TableReference};
use deltalake::kernel::{Action, Add, StructType, Transaction};
use deltalake::operations::write::WriterStatsConfig;
use deltalake::protocol::{DeltaOperation, SaveMode};
use deltalake::table::config::{DEFAULT_TARGET_FILE_SIZE, TablePropertiesExt as _};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::sink::{PlanRunner, on_workers, written_rows};
use weir_core::storage::Location;
use weir_core::{BatchContext, fault};

use crate::append::WriteOptions;
use crate::compact::{DELETED_FILE_RETENTION_PROPERTY, delta_interval};
use crate::error::DeltaSinkError;
use crate::on_workers::{FilesPlan, FilesWrite, TaskFiles};
use crate::table::commit_properties;
use crate::{POINT_AFTER_COMMIT, POINT_BEFORE_COMMIT};

/// The schema the workers write a batch of `batch` in: the table's, or for a table not
/// created yet the batch's as delta-rs stores it (an error when Delta has no type for a
/// column: the driver's write then reports it).
pub(crate) fn target_schema(table: &DeltaTable, batch: &SchemaRef) -> Result<SchemaRef, String> {
    if table.version().is_some() {
        return table
            .snapshot()
            .map(|s| s.snapshot().arrow_schema())
            .map_err(|e| e.to_string());
    }
    let normalized = normalize_for_delta(batch);
    let _: StructType = normalized
        .as_ref()
        .try_into_kernel()
        .map_err(|e| format!("the batch's schema has no Delta form: {e}"))?;
    Ok(normalized)
}

/// The driver's side of a batch written on the workers.
pub(crate) struct Files<'a> {
    pub at: &'a Location,
    pub options: &'a WriteOptions,
    pub app_id: &'a str,
}

impl Files<'_> {
    /// Runs the batch's write on the workers with `run` and commits what the tasks wrote in
    /// one version with the application transaction: the table, the rows and their bytes
    /// as written.
    pub(crate) async fn append(
        &self,
        table: DeltaTable,
        batch: DataFrame,
        schema: SchemaRef,
        ctx: &BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(DeltaTable, u64, usize), DeltaSinkError> {
        let batch_id = ctx.batch_id;
        let engine = |source| DeltaSinkError::Engine {
            table: self.at.to_string(),
            batch_id,
            source,
        };
        let write = self.files_write(&table, batch_id)?;
        let plan = on_workers(
            batch,
            Arc::new(FilesPlan {
                write,
                schema: Arc::clone(&schema),
            }),
        );
        let out = run.run(plan).await.map_err(engine)?;
        let (mut rows, mut adds) = (0u64, Vec::new());
        for text in written_rows(&out).map_err(engine)? {
            let task: TaskFiles = serde_json::from_str(&text).map_err(|e| {
                self.delta(
                    batch_id,
                    "reading what a task wrote",
                    deltalake::DeltaTableError::Generic(format!("`{text}`: {e}")),
                )
            })?;
            rows += task.rows;
            adds.extend(task.adds);
        }
        let bytes = adds.iter().map(|a| a.size.max(0) as usize).sum();
        self.check_shared(&table, &adds, batch_id).await?;
        fault::hit(POINT_BEFORE_COMMIT, batch_id).map_err(engine)?;
        let txn = Transaction::new(self.app_id, batch_id as i64);
        let properties = commit_properties().with_application_transaction(txn);
        let actions = adds.into_iter().map(Action::Add);
        let table = if table.version().is_some() {
            self.commit(table, actions.collect(), properties, batch_id)
                .await?
        } else {
            self.create(&table, schema, actions, properties, batch_id)
                .await?
        };
        fault::hit(POINT_AFTER_COMMIT, batch_id).map_err(engine)?;
        Ok((table, rows, bytes))
    }

    /// A local table must be on a folder the workers share: the files the tasks wrote must
    /// be here before they are committed, or the table would list files no reader finds.
    /// (An object store is shared by its nature; its files are not checked.)
    async fn check_shared(
        &self,
        table: &DeltaTable,
        adds: &[Add],
        batch_id: u64,
    ) -> Result<(), DeltaSinkError> {
        if self.at.local_path().is_none() {
            return Ok(());
        }
        let store = table.log_store().object_store(None);
        for add in adds {
            // As delta-rs's writer made it and its readers take it: the text as it is (a
            // partition folder's name is percent-escaped on disk, not decoded).
            let path = Path::parse(&add.path).unwrap_or_else(|_| Path::from(add.path.as_str()));
            let found = match store.head(&path).await {
                Ok(_) => true,
                Err(deltalake::ObjectStoreError::NotFound { .. }) => false,
                Err(e) => {
                    return Err(self.delta(batch_id, "finding a worker's data file", e.into()));
                }
            };
            if !found {
                return Err(DeltaSinkError::NotShared {
                    table: self.at.to_string(),
                    batch_id,
                    file: add.path.clone(),
                });
            }
        }
        Ok(())
    }

    fn delta(
        &self,
        batch_id: u64,
        action: &'static str,
        source: deltalake::DeltaTableError,
    ) -> DeltaSinkError {
        DeltaSinkError::Delta {
            table: self.at.to_string(),
            batch_id,
            action,
            source,
        }
    }

    /// What the tasks need: the table's layout and file settings (a new table's from the
    /// sink's options).
    fn files_write(&self, table: &DeltaTable, batch_id: u64) -> Result<FilesWrite, DeltaSinkError> {
        let (partition_columns, target, stats) = if table.version().is_some() {
            let state = table
                .snapshot()
                .map_err(|e| self.delta(batch_id, "reading the table's settings", e))?
                .snapshot();
            (
                state.metadata().partition_columns().to_vec(),
                state.table_properties().target_file_size(),
                WriterStatsConfig::from_config(state.table_configuration()),
            )
        } else {
            (
                self.options.partition_by.clone(),
                DEFAULT_TARGET_FILE_SIZE,
                WriterStatsConfig::new(DataSkippingNumIndexedCols::default(), None),
            )
        };
        Ok(FilesWrite {
            // The URL as parsed (percent-encoded): `?`, `#` or `%41` in a folder's name stay
            // part of the name on the worker.
            table: self.at.url().to_string(),
            storage: self.at.options().as_map().clone(),
            batch_id,
            partition_columns,
            target_file_size: Some(self.options.target_file_size.unwrap_or(target).get()),
            stats_num_columns: match stats.num_indexed_cols {
                DataSkippingNumIndexedCols::AllColumns => None,
                DataSkippingNumIndexedCols::NumColumns(n) => Some(n),
            },
            stats_columns: stats.stats_columns,
        })
    }

    /// Commits `actions` to the existing `table` as one append.
    async fn commit(
        &self,
        mut table: DeltaTable,
        actions: Vec<Action>,
        properties: CommitProperties,
        batch_id: u64,
    ) -> Result<DeltaTable, DeltaSinkError> {
        let state = table
            .snapshot()
            .map_err(|e| self.delta(batch_id, "committing the append", e))?;
        let partition_by = state.metadata().partition_columns().to_vec();
        let operation = DeltaOperation::Write {
            mode: SaveMode::Append,
            partition_by: (!partition_by.is_empty()).then_some(partition_by),
            predicate: None,
        };
        let done = CommitBuilder::from(properties)
            .with_actions(actions)
            .build(
                Some(state as &dyn TableReference),
                table.log_store(),
                operation,
            )
            .await
            .map_err(|e| self.delta(batch_id, "committing the append", e))?;
        table
            .update_incremental(Some(done.version()))
            .await
            .map_err(|e| self.delta(batch_id, "reading the append's commit", e))?;
        Ok(table)
    }

    /// Creates the table with the batch's files in its first version (the sink's
    /// partitioning and table properties, as the write in one process creates it).
    async fn create(
        &self,
        table: &DeltaTable,
        schema: SchemaRef,
        adds: impl IntoIterator<Item = Action>,
        properties: CommitProperties,
        batch_id: u64,
    ) -> Result<DeltaTable, DeltaSinkError> {
        let err = |e| self.delta(batch_id, "creating the table with the batch's files", e);
        let columns: StructType = schema
            .as_ref()
            .try_into_kernel()
            .map_err(|e| err(e.into()))?;
        let mut create = table
            .create()
            .with_columns(columns.fields().cloned())
            .with_configuration([(
                DELETED_FILE_RETENTION_PROPERTY,
                Some(delta_interval(self.options.deleted_file_retention)),
            )])
            .with_actions(adds)
            .with_commit_properties(properties);
        if !self.options.partition_by.is_empty() {
            create = create.with_partition_columns(self.options.partition_by.clone());
        }
        create.await.map_err(err)
    }
}
