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
//! On a cluster the workers write the parts and this process moves them into place under
//! the same names (see `parquet_parts`): the rows do not pass through the driver.
//!
//! The folder belongs to one query: `_weir_query` records the query id of the checkpoint
//! that first wrote to it, and a query with another id (a new checkpoint, or a second
//! query) is refused instead of overwriting that query's `batch-0...` files.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::DataFrame;
use futures::StreamExt;
use tokio::sync::OnceCell;

use super::parquet_dictionary::rows_of;
use super::parquet_encode::{Chunker, ParquetCompression, put_encoded};
use super::parquet_parts::{
    PartsPlan, PartsWrite, STAGING, StagedPart, clear_staging, parts_written,
};
use super::worker_write::on_workers;
use super::{BatchContext, ForeachBatch, PlanRunner};
use crate::error::{BoxError, Error, Result};
use crate::fault;
use crate::storage::{Location, WriteOutcome};

/// The fault points of the Parquet sink, in the order a batch passes them.
pub const PARQUET_POINTS: &[&str] = &[POINT_BEFORE_WRITE, POINT_AFTER_WRITE];
/// Before the first part is written.
pub(super) const POINT_BEFORE_WRITE: &str = "parquet-before-rename";
/// After every part is in place and stale parts are removed.
pub(super) const POINT_AFTER_WRITE: &str = "parquet-after-rename";
/// On a cluster, after the first of several staged parts was moved into place (the
/// others are still staged).
pub const PARQUET_BETWEEN_MOVES: &str = "parquet-between-moves";

/// The file that names the query owning the folder.
pub(crate) const OWNER: &str = "_weir_query";

/// See the module docs.
#[derive(Debug, Clone)]
pub struct ParquetSink {
    dir: Location,
    target_rows_per_file: usize,
    compression: ParquetCompression,
    owner_checked: Arc<OnceCell<()>>,
}

impl ParquetSink {
    /// Writes into `dir`, one file per batch up to 1,000,000 rows.
    pub fn new(dir: impl Into<Location>) -> Self {
        ParquetSink {
            dir: dir.into(),
            target_rows_per_file: 1_000_000,
            compression: ParquetCompression::default(),
            owner_checked: Arc::new(OnceCell::new()),
        }
    }

    /// Starts a new part after this many rows, so a batch becomes few files of a useful
    /// size rather than one per DataFusion partition.
    pub fn target_rows_per_file(mut self, rows: usize) -> Self {
        self.target_rows_per_file = rows.max(1);
        self
    }

    /// The codec of the part files (default: snappy, as Spark writes Parquet).
    pub fn compression(mut self, codec: ParquetCompression) -> Self {
        self.compression = codec;
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
                let mine = owner_bytes(query_id);
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
                // The owner file's temp files a crash left, removed once the folder is
                // this query's.
                let leftovers: Vec<String> = names
                    .iter()
                    .filter(|n| crate::storage::temp_target(n) == Some(OWNER))
                    .cloned()
                    .collect();
                if self.dir.put_new(OWNER, mine.clone()).await? == WriteOutcome::Written {
                    return self.dir.delete_many(leftovers).await;
                }
                let theirs = self.dir.get(OWNER).await?.unwrap_or_default();
                if theirs == mine {
                    return self.dir.delete_many(leftovers).await;
                }
                Err(self.owned_by_another(batch_id, &theirs, query_id))
            })
            .await
            .map(|_| ())
    }

    /// The folder's owner file names another query than `query_id`.
    fn owned_by_another(&self, batch_id: u64, theirs: &[u8], query_id: uuid::Uuid) -> Error {
        self.sink_err(
            batch_id,
            format!(
                "the folder belongs to another query ({} holds {}, this query's id is \
                 {query_id}): a new checkpoint would overwrite its batch files. Give this \
                 query its own folder, or remove the old files and {OWNER} if you mean to \
                 start over",
                self.dir.describe(OWNER),
                String::from_utf8_lossy(theirs).trim()
            ),
        )
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
        let mut chunks = Chunker::new(self.target_rows_per_file);
        let mut parts = 0usize;
        let mut total = 0u64;
        while let Some(batch) = stream.next().await {
            let batch: RecordBatch = batch.map_err(|e| {
                Error::datafusion(format!("batch {batch_id}: computing rows for Parquet"), e)
            })?;
            for part in chunks.push(&batch) {
                total += rows_of(&part) as u64;
                self.put_part(&schema, part, batch_id, parts).await?;
                parts += 1;
            }
        }
        if let Some(part) = chunks.finish() {
            total += rows_of(&part) as u64;
            self.put_part(&schema, part, batch_id, parts).await?;
            parts += 1;
        }
        if ctx.is_replay {
            self.remove_stale_parts(batch_id, parts).await?;
            // What a cluster's run of this query staged before it crashed.
            clear_staging(&self.dir, batch_id).await?;
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
        put_encoded(
            &self.dir,
            &name,
            schema,
            batches,
            self.compression,
            batch_id,
        )
        .await
    }

    /// The batch's plan `df` with its write on top, for a cluster's workers (see
    /// [`super::ParquetPartsExec`]): its output is what the tasks staged.
    fn plan_on_workers(&self, df: DataFrame, batch_id: u64) -> DataFrame {
        let write = PartsWrite {
            // The URL as parsed (percent-encoded): `?`, `#` or `%41` in a folder's name
            // stay part of the name on the worker.
            dir: self.dir.url().to_string(),
            storage: self.dir.options().as_map().clone(),
            batch_id,
            compression: self.compression,
            target_rows_per_file: self.target_rows_per_file,
        };
        on_workers(df, Arc::new(PartsPlan(write)))
    }

    /// Commits what the tasks of batch `ctx.batch_id` staged (`written`, the write plan's
    /// output): moves the parts into place, removes higher-numbered parts of the batch on a
    /// replay and clears staging; returns the rows.
    async fn commit_staged(&self, written: &[RecordBatch], ctx: &BatchContext) -> Result<u64> {
        let batch_id = ctx.batch_id;
        let parts = parts_written(written)?;
        fault::hit(POINT_BEFORE_WRITE, batch_id)?;
        for (i, StagedPart { file: staged, .. }) in parts.iter().enumerate() {
            if i == 1 {
                fault::hit(PARQUET_BETWEEN_MOVES, batch_id)?;
            }
            self.dir
                .rename(
                    &format!("{STAGING}/{staged}"),
                    &Self::part_name(batch_id, i),
                )
                .await?;
        }
        if ctx.is_replay {
            self.remove_stale_parts(batch_id, parts.len()).await?;
        }
        clear_staging(&self.dir, batch_id).await?;
        fault::hit(POINT_AFTER_WRITE, batch_id)?;
        Ok(parts.iter().map(|p| p.rows).sum())
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
                if let Some(target) = crate::storage::temp_target(name) {
                    target.starts_with(&prefix)
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

/// What the owner file of `query_id`'s folder holds.
fn owner_bytes(query_id: uuid::Uuid) -> Bytes {
    Bytes::from(format!("{{\"queryId\":\"{query_id}\"}}"))
}

#[async_trait]
impl ForeachBatch for ParquetSink {
    /// Refuses a folder another query owns (or unclaimed Parquet files) without claiming
    /// it: the claim is written with the first batch, so a start refused later (by another
    /// sink) leaves the folder as it was.
    async fn open(&self, query: &crate::sink::QueryIdentity) -> Result<(), BoxError> {
        let names = self.dir.list_names().await?;
        let mine = owner_bytes(query.query_id);
        if names.iter().any(|n| n == OWNER) {
            let theirs = self.dir.get(OWNER).await?.unwrap_or_default();
            if theirs != mine {
                return Err(self.owned_by_another(0, &theirs, query.query_id).into());
            }
            return Ok(());
        }
        // Unclaimed Parquet files are refused by the claim itself.
        if names.iter().any(|n| n.ends_with(".parquet")) {
            return Ok(self.check_owner(query.query_id, 0).await?);
        }
        Ok(())
    }

    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let rows = self.write(batch, &ctx).await?;
        ctx.metrics.add_output_rows(rows);
        Ok(())
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
        self.check_owner(ctx.query_id, ctx.batch_id).await?;
        let plan = self.plan_on_workers(batch, ctx.batch_id);
        let written = run.run(plan).await?;
        let rows = self.commit_staged(&written, &ctx).await?;
        ctx.metrics.add_output_rows(rows);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{
        ArrayRef, Float64Array, Int64Array, ListArray, StringArray, TimestampMicrosecondArray,
    };
    use datafusion::arrow::compute::concat_batches;
    use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema, TimeUnit};
    use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use datafusion::parquet::basic::{Compression, GzipLevel, ZstdLevel};
    use datafusion::parquet::file::properties::WriterProperties;

    use super::super::parquet_encode::encode;
    use super::*;

    fn batch(from: i64, n: i64) -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(from..from + n));
        let names: ArrayRef = Arc::new(StringArray::from_iter(
            (from..from + n).map(|i| (i % 7 != 0).then(|| format!("n{}", i % 13))),
        ));
        let amounts: ArrayRef = Arc::new(Float64Array::from_iter(
            (from..from + n).map(|i| (i % 5 != 0).then_some(i as f64 / 4.0)),
        ));
        let at: ArrayRef = Arc::new(
            TimestampMicrosecondArray::from_iter_values((from..from + n).map(|i| i * 1_000_003))
                .with_timezone("UTC"),
        );
        let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
            (from..from + n)
                .map(|i| (i % 3 != 0).then(|| (0..i % 4).map(Some).collect::<Vec<_>>())),
        ));
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("name", DataType::Utf8, true),
                Field::new("amount", DataType::Float64, true),
                Field::new(
                    "at",
                    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                    false,
                ),
                Field::new(
                    "l",
                    DataType::List(Arc::new(Field::new("item", DataType::Int64, true))),
                    true,
                ),
            ])),
            vec![ids, names, amounts, at, lists],
        )
        .unwrap()
    }

    /// The columns encoded on several threads make the same file, byte for byte, as
    /// ArrowWriter on one, over several input batches and row groups.
    #[test]
    fn parallel_encoding_writes_the_file_arrow_writer_writes() {
        let batches = vec![batch(0, 2500), batch(2500, 10), batch(2510, 1700)];
        let schema = batches[0].schema();
        let props = || {
            WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::default()))
                .set_max_row_group_row_count(Some(1000))
                .build()
        };
        let serial = encode(schema.clone(), &batches, props(), usize::MAX).unwrap();
        let parallel = encode(schema.clone(), &batches, props(), 0).unwrap();
        assert!(serial == parallel, "the two files differ");
        let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(parallel))
            .unwrap()
            .build()
            .unwrap();
        let read: Vec<RecordBatch> = reader.collect::<std::result::Result<_, _>>().unwrap();
        assert_eq!(
            concat_batches(&schema, &read).unwrap(),
            concat_batches(&schema, &batches).unwrap()
        );
    }

    /// Each codec is what the part file's column chunks say, and the rows read back the same;
    /// the default is Spark's, snappy.
    #[tokio::test]
    async fn the_part_files_use_the_codec_asked_for() {
        use datafusion::parquet::file::reader::{FileReader, SerializedFileReader};
        use datafusion::prelude::SessionContext;
        let rows = batch(0, 300);
        let schema = rows.schema();
        let cases = [
            (None, Compression::SNAPPY),
            (
                Some(ParquetCompression::Zstd),
                Compression::ZSTD(ZstdLevel::default()),
            ),
            (Some(ParquetCompression::Lz4), Compression::LZ4_RAW),
            (
                Some(ParquetCompression::Gzip),
                Compression::GZIP(GzipLevel::default()),
            ),
            (Some(ParquetCompression::None), Compression::UNCOMPRESSED),
        ];
        for (asked, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            let mut sink = ParquetSink::new(Location::local(dir.path()));
            if let Some(c) = asked {
                sink = sink.compression(c);
            }
            let df = SessionContext::new().read_batch(rows.clone()).unwrap();
            let ctx = BatchContext::new(uuid::Uuid::new_v4(), "q", 0);
            assert_eq!(sink.write(df, &ctx).await.unwrap(), 300);
            let bytes =
                Bytes::from(std::fs::read(dir.path().join(ParquetSink::part_name(0, 0))).unwrap());
            let meta = SerializedFileReader::new(bytes.clone()).unwrap();
            let meta = meta.metadata();
            for rg in meta.row_groups() {
                for c in rg.columns() {
                    assert_eq!(c.compression(), expected, "{asked:?}: {}", c.column_path());
                }
            }
            let read: Vec<RecordBatch> = ParquetRecordBatchReaderBuilder::try_new(bytes)
                .unwrap()
                .build()
                .unwrap()
                .collect::<std::result::Result<_, _>>()
                .unwrap();
            assert_eq!(concat_batches(&schema, &read).unwrap(), rows, "{asked:?}");
        }
    }
}

#[cfg(test)]
mod leftover_tests {
    use datafusion::prelude::SessionContext;

    use super::*;

    /// A crash while the owner file was written leaves its temp file; the query that owns
    /// the folder removes it, and leaves other hidden names alone.
    #[tokio::test]
    async fn the_owner_file_s_leftover_temp_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let query = uuid::Uuid::new_v4();
        let leftover = format!(".{OWNER}.{}.tmp", "0123456789abcdef0123456789abcdef");
        let kept = format!(".{OWNER}.notours.tmp");
        for (name, restart) in [(&leftover, false), (&leftover, true)] {
            std::fs::write(dir.path().join(name), b"{\"queryId\":").unwrap();
            std::fs::write(dir.path().join(&kept), b"x").unwrap();
            let sink = ParquetSink::new(Location::local(dir.path()));
            let rows = RecordBatch::try_from_iter([(
                "id",
                Arc::new(datafusion::arrow::array::Int64Array::from(vec![1])) as _,
            )])
            .unwrap();
            let df = SessionContext::new().read_batch(rows).unwrap();
            let ctx = BatchContext::new(query, "q", u64::from(restart));
            sink.write(df, &ctx).await.unwrap();
            assert!(!dir.path().join(name).exists(), "restart {restart}: {name}");
            assert!(dir.path().join(&kept).exists());
            assert!(dir.path().join(OWNER).exists());
        }
    }
}
