//! Idempotent append: the rows and the application transaction in one Delta commit.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deltalake::DeltaTable;
use deltalake::kernel::Transaction;
use deltalake::protocol::SaveMode;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::sink::PlanRunner;
use weir_core::storage::Location;
use weir_core::{BatchContext, BoxError, ForeachBatch, fault};

use crate::commit_files::{self, Files};
use crate::compact::{
    Compaction, DEFAULT_DELETED_FILE_RETENTION, DELETED_FILE_RETENTION_PROPERTY, batch_bytes,
    delta_interval,
};
use crate::error::DeltaSinkError;
use crate::on_workers::{self, Placement, placement};
use crate::table::{Cached, commit_properties, note_version, prepare};
use crate::{POINT_AFTER_COMMIT, POINT_BEFORE_COMMIT};

/// Appends each batch to a Delta table, exactly once per batch id.
///
/// Before writing it reads the version the table records for the app id; if that is the
/// batch id and the batch is a replay, the write is skipped (logged, and counted in the
/// progress). Otherwise the rows are appended with the transaction `(app_id, batch_id)` in
/// the same commit, so the rows and "batch N is written" land together or not at all. A
/// recorded version this query cannot have written (beyond the batch, or the batch itself on
/// a first attempt) is an error naming the app id. A commit that loses a race with another
/// writer of the same app id fails the batch; the retry then skips.
#[derive(Debug, Clone)]
pub struct DeltaAppend {
    at: Location,
    app_id: Option<String>,
    allow_app_id_reuse: bool,
    write: WriteOptions,
    compaction: Compaction,
    table: Arc<Cached>,
    /// Why batches are written on the driver although a cluster runs them, as last logged.
    said: Arc<std::sync::Mutex<Option<String>>>,
}

/// How a sink writes data files, and the layout and properties of a table it creates.
#[derive(Debug, Clone)]
pub(crate) struct WriteOptions {
    pub partition_by: Vec<String>,
    pub target_file_size: Option<NonZeroU64>,
    /// `delta.deletedFileRetentionDuration` of a table the sink creates.
    pub deleted_file_retention: Duration,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            partition_by: Vec::new(),
            target_file_size: None,
            deleted_file_retention: DEFAULT_DELETED_FILE_RETENTION,
        }
    }
}

impl DeltaAppend {
    /// Appends to the table at `at` (created on the first write, from the batch schema).
    pub fn new(at: impl Into<Location>) -> Self {
        DeltaAppend {
            at: at.into(),
            app_id: None,
            allow_app_id_reuse: false,
            write: WriteOptions::default(),
            compaction: Compaction::default(),
            table: Arc::new(Cached::new()),
            said: Arc::default(),
        }
    }

    /// An explicit application id (Spark's `txnAppId`). The default, the query name plus
    /// the checkpoint's query id, is safer: see the crate docs.
    pub fn app_id(mut self, id: impl Into<String>) -> Self {
        self.app_id = Some(id.into());
        self
    }

    /// Skip (with a warning) instead of failing when the table records a version of the
    /// app id that this query did not write.
    pub fn allow_app_id_reuse(mut self, yes: bool) -> Self {
        self.allow_app_id_reuse = yes;
        self
    }

    /// Partition columns for a table this sink creates.
    pub fn partition_by(mut self, cols: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.write.partition_by = cols.into_iter().map(Into::into).collect();
        self
    }

    /// The size at which delta-rs starts a new data file, in bytes.
    pub fn target_file_size(mut self, bytes: u64) -> Self {
        self.write.target_file_size = NonZeroU64::new(bytes);
        self
    }

    /// How long a table this sink creates keeps tombstones of replaced files in its
    /// checkpoints (`delta.deletedFileRetentionDuration`); default one day, see
    /// [`crate::compact`]. An existing table keeps its own.
    pub fn deleted_file_retention(mut self, retention: Duration) -> Self {
        self.write.deleted_file_retention = retention;
        self
    }

    /// Rewrites small files into larger ones (OPTIMIZE) after every `n` batches; `0` turns
    /// compaction off. Default: after every 100 small batches (see [`crate::compact`]).
    pub fn optimize_every(mut self, n: u64) -> Self {
        self.compaction = Compaction::every(n);
        self
    }

    /// The table's location.
    pub fn location(&self) -> &Location {
        &self.at
    }

    /// The sink's name in progress and errors.
    pub fn label(&self) -> String {
        format!("delta-append {}", self.at)
    }

    /// Writes the batch: on the cluster's workers when `run` is given and the table can take
    /// files written there ([`placement`]), else here.
    async fn append(
        &self,
        batch: DataFrame,
        ctx: &BatchContext,
        run: Option<&dyn PlanRunner>,
    ) -> Result<(), DeltaSinkError> {
        let id = ctx.batch_id;
        let sink = self.label();
        let prepared = prepare(
            &self.table,
            &self.at,
            &sink,
            self.app_id.as_deref(),
            self.allow_app_id_reuse,
            ctx,
        )
        .await?;
        let Some(table) = prepared.table else {
            return Ok(());
        };
        let target = run.map(|r| (r, self.where_to_write(&table, &batch)));
        let (table, rows, bytes) = match target {
            Some((run, Ok(schema))) => {
                let files = Files {
                    at: &self.at,
                    options: &self.write,
                    app_id: &prepared.app_id,
                };
                files.append(table, batch, schema, ctx, run).await?
            }
            // Brought here: on a cluster its plan still runs on the workers.
            Some((run, Err(()))) => {
                self.append_here(table, batch, Some(run), &prepared.app_id, ctx)
                    .await?
            }
            None => {
                self.append_here(table, batch, None, &prepared.app_id, ctx)
                    .await?
            }
        };
        ctx.metrics.add_output_rows(rows);
        note_version(ctx, &sink, &table);
        let table = self
            .compaction
            .after_commit(table, bytes, &self.at, id)
            .await?;
        self.table.put(table).await;
        Ok(())
    }

    /// The schema the workers write the batch in, or why it is written here (logged when the
    /// reason is new).
    fn where_to_write(&self, table: &DeltaTable, batch: &DataFrame) -> Result<SchemaRef, ()> {
        let columns: Vec<String> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let facts = on_workers::facts(table);
        let decided = match placement(&facts, &columns, &self.write.partition_by) {
            Placement::Workers => commit_files::target_schema(table, batch.schema().inner()),
            Placement::Driver(why) => Err(why),
        };
        let why = match decided {
            Ok(schema) => return Ok(schema),
            Err(why) => why,
        };
        if let Ok(mut said) = self.said.lock()
            && said.as_deref() != Some(why.as_str())
        {
            tracing::warn!(
                table = %self.at,
                "the batches' rows are written on the driver, not the workers: {why}"
            );
            *said = Some(why);
        }
        Err(())
    }

    /// Brings the batch here (its plan run by `run` on a cluster) and appends it (one
    /// process, or a table the workers cannot write): the rows written and their bytes in
    /// memory.
    async fn append_here(
        &self,
        table: DeltaTable,
        batch: DataFrame,
        run: Option<&dyn PlanRunner>,
        app_id: &str,
        ctx: &BatchContext,
    ) -> Result<(DeltaTable, u64, usize), DeltaSinkError> {
        let id = ctx.batch_id;
        let df_err = |action, source| DeltaSinkError::DataFusion {
            table: self.at.to_string(),
            batch_id: id,
            action,
            source,
        };
        let schema = batch.schema().inner().clone();
        let mut batches = match run {
            Some(run) => run
                .run(batch)
                .await
                .map_err(|source| DeltaSinkError::Engine {
                    table: self.at.to_string(),
                    batch_id: id,
                    source,
                })?,
            None => batch
                .collect()
                .await
                .map_err(|e| df_err("computing the batch", e))?,
        };
        batches.retain(|b| b.num_rows() > 0);
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        if batches.is_empty() {
            // An empty batch still records its transaction, so the replay is provably done.
            batches.push(RecordBatch::new_empty(schema));
        }
        let bytes = batch_bytes(&batches);
        let table = write_with_txn(table, batches, &self.write, app_id, &self.at, id).await?;
        Ok((table, rows as u64, bytes))
    }
}

/// Appends `batches` with the application transaction `(app_id, batch_id)` in the commit,
/// with fault points before and after the commit. The first write creates the table with
/// the options' table properties.
pub(crate) async fn write_with_txn(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    options: &WriteOptions,
    app_id: &str,
    at: &Location,
    batch_id: u64,
) -> Result<DeltaTable, DeltaSinkError> {
    let engine = |source| DeltaSinkError::Engine {
        table: at.to_string(),
        batch_id,
        source,
    };
    fault::hit(POINT_BEFORE_COMMIT, batch_id).map_err(engine)?;
    let txn = Transaction::new(app_id, batch_id as i64);
    let creates = table.version().is_none();
    let mut write = table
        .write(batches)
        .with_save_mode(SaveMode::Append)
        .with_commit_properties(commit_properties().with_application_transaction(txn));
    if creates {
        write = write.with_configuration([(
            DELETED_FILE_RETENTION_PROPERTY,
            Some(delta_interval(options.deleted_file_retention)),
        )]);
    }
    if !options.partition_by.is_empty() {
        write = write.with_partition_columns(options.partition_by.clone());
    }
    if options.target_file_size.is_some() {
        write = write.with_target_file_size(options.target_file_size);
    }
    let table = write.await.map_err(|source| DeltaSinkError::Delta {
        table: at.to_string(),
        batch_id,
        action: "committing the append",
        source,
    })?;
    fault::hit(POINT_AFTER_COMMIT, batch_id).map_err(engine)?;
    Ok(table)
}

#[async_trait]
impl ForeachBatch for DeltaAppend {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        Ok(self.append(batch, &ctx, None).await?)
    }

    fn writes_on_workers(&self) -> bool {
        true
    }

    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        Ok(self.append(batch, &ctx, Some(run)).await?)
    }
}
