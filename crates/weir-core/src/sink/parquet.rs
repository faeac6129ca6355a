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
use datafusion::parquet::arrow::arrow_writer::{
    ArrowColumnChunk, ArrowColumnWriter, ArrowLeafColumn, compute_leaves,
};
use datafusion::parquet::basic::{Compression, GzipLevel, ZstdLevel};
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::DataFrame;
use futures::StreamExt;
use tokio::sync::OnceCell;

use super::parquet_dictionary::{rows_of, without_wasted_dictionaries};
use super::{BatchContext, ForeachBatch};
use crate::error::{BoxError, Error, Result};
use crate::fault;
use crate::storage::{Location, WriteOutcome, blocking};

/// The fault points of the Parquet sink, in the order a batch passes them.
pub const PARQUET_POINTS: &[&str] = &[POINT_BEFORE_WRITE, POINT_AFTER_WRITE];
/// Before the first part is written.
pub(super) const POINT_BEFORE_WRITE: &str = "parquet-before-rename";
/// After every part is in place and stale parts are removed.
pub(super) const POINT_AFTER_WRITE: &str = "parquet-after-rename";

/// The file that names the query owning the folder.
pub(crate) const OWNER: &str = "_weir_query";

/// The codec of the part files' pages: Spark's `compression` option of its Parquet writer,
/// with Spark's default (`snappy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParquetCompression {
    /// Spark's default: fast, larger files.
    #[default]
    Snappy,
    /// Smaller files for more CPU (level 3); measured on 200,000-row parts, the codec took
    /// about a quarter of the write.
    Zstd,
    /// LZ4 (the raw format of Parquet's `LZ4_RAW`).
    Lz4,
    /// gzip, level 6.
    Gzip,
    /// No compression.
    None,
}

impl ParquetCompression {
    fn codec(self) -> Compression {
        match self {
            ParquetCompression::Snappy => Compression::SNAPPY,
            ParquetCompression::Zstd => Compression::ZSTD(ZstdLevel::default()),
            ParquetCompression::Lz4 => Compression::LZ4_RAW,
            ParquetCompression::Gzip => Compression::GZIP(GzipLevel::default()),
            ParquetCompression::None => Compression::UNCOMPRESSED,
        }
    }
}

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
        let codec = self.compression.codec();
        let bytes = blocking(move || {
            let props = WriterProperties::builder().set_compression(codec);
            let props = without_wasted_dictionaries(props, &schema, &batches).build();
            encode(schema, &batches, props, PARALLEL_FROM_ROWS)
                .map(Bytes::from)
                .map_err(|e| Error::Sink {
                    sink,
                    batch_id,
                    source: format!("encoding {shown}: {e}").into(),
                })
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

/// Parts with fewer rows are encoded on the calling thread: starting threads would cost more
/// than it saves.
const PARALLEL_FROM_ROWS: usize = 50_000;

/// One Parquet file of `batches`. From `parallel_from_rows` rows on, the columns are encoded
/// on as many threads as there are cores (the slowest step of a large batch's write, done on
/// one core before); the file is the one [`ArrowWriter`] writes.
fn encode(
    schema: SchemaRef,
    batches: &[RecordBatch],
    props: WriterProperties,
    parallel_from_rows: usize,
) -> std::result::Result<Vec<u8>, ParquetError> {
    let rows = rows_of(batches);
    let threads = crate::cores().min(schema.fields().len());
    let group_rows = props.max_row_group_row_count().unwrap_or(usize::MAX);
    let mut w = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props))?;
    if rows < parallel_from_rows || threads < 2 {
        for b in batches {
            w.write(b)?;
        }
        return w.into_inner();
    }
    let (mut file, factory) = w.into_serialized_writer()?;
    let mut index = 0;
    let mut flush = |group: Vec<RecordBatch>| {
        let mut jobs: Vec<(ArrowColumnWriter, Vec<ArrowLeafColumn>)> = factory
            .create_column_writers(index)?
            .into_iter()
            .map(|w| (w, Vec::new()))
            .collect();
        for b in group {
            let mut leaf = 0;
            for (field, column) in schema.fields().iter().zip(b.columns()) {
                for l in compute_leaves(field, column)? {
                    let job = jobs.get_mut(leaf).ok_or_else(|| {
                        ParquetError::General("more leaf columns than writers".into())
                    })?;
                    job.1.push(l);
                    leaf += 1;
                }
            }
        }
        let chunks = encode_columns(jobs, threads)?;
        let mut rg = file.next_row_group()?;
        for c in chunks {
            c.append_to_row_group(&mut rg)?;
        }
        rg.close()?;
        index += 1;
        Ok::<(), ParquetError>(())
    };
    let mut groups = Chunker::new(group_rows);
    for b in batches {
        for group in groups.push(b) {
            flush(group)?;
        }
    }
    if let Some(group) = groups.finish() {
        flush(group)?;
    }
    file.into_inner()
}

/// Cuts a stream of batches into runs of `rows` rows (zero-copy slices), as parts of a
/// batch and row groups of a part are cut; the last run may be shorter.
struct Chunker {
    rows: usize,
    pending: Vec<RecordBatch>,
    pending_rows: usize,
}

impl Chunker {
    fn new(rows: usize) -> Self {
        Chunker {
            rows: rows.max(1),
            pending: Vec::new(),
            pending_rows: 0,
        }
    }

    /// Takes `batch`; the runs it completed, in order.
    fn push(&mut self, batch: &RecordBatch) -> Vec<Vec<RecordBatch>> {
        let mut full = Vec::new();
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take = (self.rows - self.pending_rows).min(batch.num_rows() - offset);
            self.pending.push(batch.slice(offset, take));
            self.pending_rows += take;
            offset += take;
            if self.pending_rows == self.rows {
                full.push(std::mem::take(&mut self.pending));
                self.pending_rows = 0;
            }
        }
        full
    }

    /// The last, shorter run, if rows are left.
    fn finish(self) -> Option<Vec<RecordBatch>> {
        (self.pending_rows > 0).then_some(self.pending)
    }
}

/// Encodes each leaf column with its writer, `threads` columns at a time; the chunks in
/// column order.
fn encode_columns(
    jobs: Vec<(ArrowColumnWriter, Vec<ArrowLeafColumn>)>,
    threads: usize,
) -> std::result::Result<Vec<ArrowColumnChunk>, ParquetError> {
    let count = jobs.len();
    let queue = std::sync::Mutex::new(jobs.into_iter().enumerate());
    let work = || {
        let mut done = Vec::new();
        loop {
            let next = queue
                .lock()
                .map_err(|_| ParquetError::General("a column encoder panicked".into()))?
                .next();
            let Some((i, (mut w, leaves))) = next else {
                return Ok::<_, ParquetError>(done);
            };
            for l in &leaves {
                w.write(l)?;
            }
            done.push((i, w.close()?));
        }
    };
    let mut chunks: Vec<(usize, ArrowColumnChunk)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mut all = work()?;
        for h in helpers {
            let done = h
                .join()
                .map_err(|_| ParquetError::General("a column encoder panicked".into()))??;
            all.extend(done);
        }
        Ok::<_, ParquetError>(all)
    })?;
    if chunks.len() != count {
        return Err(ParquetError::General(format!(
            "{} of {count} columns encoded",
            chunks.len()
        )));
    }
    chunks.sort_unstable_by_key(|c| c.0);
    Ok(chunks.into_iter().map(|c| c.1).collect())
}

#[async_trait]
impl ForeachBatch for ParquetSink {
    async fn open(&self, query: &crate::sink::QueryIdentity) -> Result<(), BoxError> {
        Ok(self.check_owner(query.query_id, 0).await?)
    }

    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let rows = self.write(batch, &ctx).await?;
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
