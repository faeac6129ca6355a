//! Encoding Parquet parts: shared by the sink's write in this process and its tasks' writes
//! on a cluster's workers.

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

use super::parquet_dictionary::{rows_of, without_wasted_dictionaries};
use crate::error::{Error, Result};
use crate::storage::{Location, blocking};

/// The codec of the part files' pages: Spark's `compression` option of its Parquet writer,
/// with Spark's default (`snappy`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
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
    pub(super) fn codec(self) -> Compression {
        match self {
            ParquetCompression::Snappy => Compression::SNAPPY,
            ParquetCompression::Zstd => Compression::ZSTD(ZstdLevel::default()),
            ParquetCompression::Lz4 => Compression::LZ4_RAW,
            ParquetCompression::Gzip => Compression::GZIP(GzipLevel::default()),
            ParquetCompression::None => Compression::UNCOMPRESSED,
        }
    }
}

/// Encodes `batches` as one Parquet file and writes it whole as `dir`'s `name`.
pub(super) async fn put_encoded(
    dir: &Location,
    name: &str,
    schema: &SchemaRef,
    batches: Vec<RecordBatch>,
    compression: ParquetCompression,
    batch_id: u64,
) -> Result<()> {
    let shown = dir.describe(name);
    let schema = schema.clone();
    let sink = format!("parquet {dir}");
    let codec = compression.codec();
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
    dir.put(name, bytes).await
}

/// Parts with fewer rows are encoded on the calling thread: starting threads would cost more
/// than it saves.
pub(super) const PARALLEL_FROM_ROWS: usize = 50_000;

/// One Parquet file of `batches`. From `parallel_from_rows` rows on, the columns are encoded
/// on as many threads as there are cores (the slowest step of a large batch's write, done on
/// one core before); the file is the one [`ArrowWriter`] writes.
pub(super) fn encode(
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
pub(super) struct Chunker {
    rows: usize,
    pending: Vec<RecordBatch>,
    pending_rows: usize,
}

impl Chunker {
    pub(super) fn new(rows: usize) -> Self {
        Chunker {
            rows: rows.max(1),
            pending: Vec::new(),
            pending_rows: 0,
        }
    }

    /// Takes `batch`; the runs it completed, in order.
    pub(super) fn push(&mut self, batch: &RecordBatch) -> Vec<Vec<RecordBatch>> {
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
    pub(super) fn finish(self) -> Option<Vec<RecordBatch>> {
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
