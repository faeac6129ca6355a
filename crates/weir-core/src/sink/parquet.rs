//! The idempotent Parquet folder sink, local or on an object store.
//!
//! Batch N's rows go to `batch-<N>-part-<P>.parquet` (N zero-padded to 10 digits, P to 5),
//! parts of `target_rows_per_file` rows, each written whole and durably under its final
//! name (locally: temp file, fsync, rename, fsync the folder; object stores: one PUT). A
//! replay writes the same names again and removes parts of N beyond the new count (it
//! lists only on a replay, and only the batch's own names on an object store), so after any
//! crash and a successful retry the folder holds each row of each committed batch once.
//! Readers that list the folder while a batch is being written or replaced may see part of
//! it; the batch is complete when its `commits/N` exists.
//!
//! The folder belongs to one query: `_weir_query` records the query id of the checkpoint
//! that first wrote to it, and a query with another id (a new checkpoint, or a second
//! query) is refused instead of overwriting that query's `batch-0...` files.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::DataFrame;
use futures::StreamExt;
use tokio::sync::OnceCell;

use super::{BatchContext, ForeachBatch};
use crate::error::{BoxError, Error, Result};
use crate::fault;
use crate::storage::{Location, WriteOutcome, blocking};

/// The fault points of the Parquet sink, in the order a batch passes them.
pub const PARQUET_POINTS: &[&str] = &[POINT_BEFORE_WRITE, POINT_AFTER_WRITE];
/// Before the first part is written.
pub const POINT_BEFORE_WRITE: &str = "parquet-before-rename";
/// After every part is in place and stale parts are removed.
pub const POINT_AFTER_WRITE: &str = "parquet-after-rename";

/// The file that names the query owning the folder.
pub(crate) const OWNER: &str = "_weir_query";

/// See the module docs.
#[derive(Debug, Clone)]
pub struct ParquetSink {
    dir: Location,
    target_rows_per_file: usize,
    owner_checked: Arc<OnceCell<()>>,
}

impl ParquetSink {
    /// Writes into `dir`, one file per batch up to 1,000,000 rows.
    pub fn new(dir: impl Into<Location>) -> Self {
        ParquetSink {
            dir: dir.into(),
            target_rows_per_file: 1_000_000,
            owner_checked: Arc::new(OnceCell::new()),
        }
    }

    /// Starts a new part after this many rows, so a batch becomes few files of a useful
    /// size rather than one per DataFusion partition.
    pub fn target_rows_per_file(mut self, rows: usize) -> Self {
        self.target_rows_per_file = rows.max(1);
        self
    }

    /// The folder.
    pub fn dir(&self) -> &Location {
        &self.dir
    }

    /// The sink's name in progress and errors.
    pub fn label(&self) -> String {
        format!("parquet {}", self.dir)
    }

    fn part_name(batch_id: u64, part: usize) -> String {
        format!("batch-{batch_id:010}-part-{part:05}.parquet")
    }

    fn sink_err(&self, batch_id: u64, reason: String) -> Error {
        Error::Sink {
            sink: self.label(),
            batch_id,
            source: reason.into(),
        }
    }

    /// Claims the folder for `query_id`, or refuses a folder another query wrote (or that
    /// holds part files nobody claimed).
    async fn check_owner(&self, query_id: uuid::Uuid, batch_id: u64) -> Result<()> {
        self.owner_checked
            .get_or_try_init(|| async {
                self.dir.create_dir().await?;
                let mine = Bytes::from(format!("{{\"queryId\":\"{query_id}\"}}"));
                let names = self.dir.list_names().await?;
                if !names.iter().any(|n| n == OWNER)
                    && let Some(part) = names.iter().find(|n| n.ends_with(".parquet"))
                {
                    return Err(self.sink_err(
                        batch_id,
                        format!(
                            "the folder holds Parquet files no query claims (e.g. {part}): \
                             a new query would overwrite them. Give this query its own folder"
                        ),
                    ));
                }
                if self.dir.put_new(OWNER, mine.clone()).await? == WriteOutcome::Written {
                    return Ok(());
                }
                let theirs = self.dir.get(OWNER).await?.unwrap_or_default();
                if theirs == mine {
                    return Ok(());
                }
                Err(self.sink_err(
                    batch_id,
                    format!(
                        "the folder belongs to another query ({} holds {}, this query's id is \
                         {query_id}): a new checkpoint would overwrite its batch files. Give \
                         this query its own folder, or remove the old files and {OWNER} if \
                         you mean to start over",
                        self.dir.describe(OWNER),
                        String::from_utf8_lossy(&theirs).trim()
                    ),
                ))
            })
            .await
            .map(|_| ())
    }

    /// Writes batch `ctx.batch_id` from `df`; returns the rows written.
    pub async fn write(&self, df: DataFrame, ctx: &BatchContext) -> Result<u64> {
        let batch_id = ctx.batch_id;
        self.check_owner(ctx.query_id, batch_id).await?;
        let schema = df.schema().inner().clone();
        let mut stream = df.execute_stream().await.map_err(|e| {
            Error::datafusion(format!("batch {batch_id}: planning the Parquet write"), e)
        })?;
        fault::hit(POINT_BEFORE_WRITE, batch_id)?;
        let mut pending: Vec<RecordBatch> = Vec::new();
        let mut pending_rows = 0usize;
        let mut parts = 0usize;
        let mut total = 0u64;
        while let Some(batch) = stream.next().await {
            let batch: RecordBatch = batch.map_err(|e| {
                Error::datafusion(format!("batch {batch_id}: computing rows for Parquet"), e)
            })?;
            let mut offset = 0;
            while offset < batch.num_rows() {
                let take =
                    (self.target_rows_per_file - pending_rows).min(batch.num_rows() - offset);
                pending.push(batch.slice(offset, take));
                pending_rows += take;
                offset += take;
                if pending_rows == self.target_rows_per_file {
                    self.put_part(&schema, std::mem::take(&mut pending), batch_id, parts)
                        .await?;
                    parts += 1;
                    total += pending_rows as u64;
                    pending_rows = 0;
                }
            }
        }
        if pending_rows > 0 {
            self.put_part(&schema, pending, batch_id, parts).await?;
            parts += 1;
            total += pending_rows as u64;
        }
        if ctx.is_replay {
            self.remove_stale_parts(batch_id, parts).await?;
        }
        fault::hit(POINT_AFTER_WRITE, batch_id)?;
        Ok(total)
    }

    async fn put_part(
        &self,
        schema: &SchemaRef,
        batches: Vec<RecordBatch>,
        batch_id: u64,
        part: usize,
    ) -> Result<()> {
        let name = Self::part_name(batch_id, part);
        let shown = self.dir.describe(&name);
        let schema = schema.clone();
        let sink = self.label();
        let bytes = blocking(move || {
            let props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::default()))
                .build();
            let err = |e: datafusion::parquet::errors::ParquetError| Error::Sink {
                sink: sink.clone(),
                batch_id,
                source: format!("encoding {shown}: {e}").into(),
            };
            let mut w = ArrowWriter::try_new(Vec::new(), schema, Some(props)).map_err(err)?;
            for b in &batches {
                w.write(b).map_err(err)?;
            }
            w.into_inner().map(Bytes::from).map_err(err)
        })
        .await?;
        self.dir.put(&name, bytes).await
    }

    /// Removes parts of `batch_id` numbered `from` and up, left by an earlier attempt that
    /// split the batch differently, and temp files of the batch left by a crash.
    async fn remove_stale_parts(&self, batch_id: u64, from: usize) -> Result<()> {
        let prefix = format!("batch-{batch_id:010}-part-");
        let doomed: Vec<String> = self
            .dir
            .list_names()
            .await?
            .into_iter()
            .filter(|name| {
                if let Some(rest) = name.strip_prefix('.') {
                    rest.starts_with(&prefix) && name.ends_with(".tmp")
                } else {
                    name.strip_prefix(&prefix)
                        .and_then(|r| r.strip_suffix(".parquet"))
                        .and_then(|p| p.parse::<usize>().ok())
                        .is_some_and(|p| p >= from)
                }
            })
            .collect();
        self.dir.delete_many(doomed).await
    }
}

#[async_trait]
impl ForeachBatch for ParquetSink {
    async fn open(&self, query: &crate::connector::QueryIdentity) -> Result<(), BoxError> {
        Ok(self.check_owner(query.query_id, 0).await?)
    }

    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let rows = self.write(batch, &ctx).await?;
        ctx.metrics.add_output_rows(rows);
        Ok(())
    }
}
