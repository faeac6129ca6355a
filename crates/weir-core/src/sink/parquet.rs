//! The idempotent Parquet directory sink.
//!
//! Batch N's rows go to `batch-<N>-part-<P>.parquet` (N zero-padded to 10 digits, P to 5).
//! Every part is first written whole to a hidden temp name and fsynced; then all parts are
//! renamed into place, parts of N beyond the new count are removed, and the folder is
//! fsynced. A replay writes the same names again, so after any crash and a successful
//! retry the folder holds each row of each committed batch once. Readers that list the
//! folder while a batch is being replaced may see a mix of the two attempts.

use std::fs;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::prelude::DataFrame;
use futures::StreamExt;

use super::{BatchContext, ForeachBatch};
use crate::checkpoint::file::{is_hidden, sync_dir, temp_name};
use crate::error::{BoxError, Error, Result};
use crate::fault;

/// See the module docs.
#[derive(Debug, Clone)]
pub struct ParquetSink {
    dir: PathBuf,
    target_rows_per_file: usize,
}

impl ParquetSink {
    /// Writes into `dir`, one file per batch up to 1,000,000 rows.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ParquetSink {
            dir: dir.into(),
            target_rows_per_file: 1_000_000,
        }
    }

    /// Starts a new part after this many rows, so a batch becomes few files of a useful
    /// size rather than one per DataFusion partition.
    pub fn target_rows_per_file(mut self, rows: usize) -> Self {
        self.target_rows_per_file = rows.max(1);
        self
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn part_name(batch_id: u64, part: usize) -> String {
        format!("batch-{batch_id:010}-part-{part:05}.parquet")
    }

    /// Writes batch `batch_id` from `df`; returns the rows written.
    pub async fn write(&self, df: DataFrame, batch_id: u64) -> Result<u64> {
        let sink_err = |reason: String| Error::Sink {
            sink: format!("parquet {}", self.dir.display()),
            batch_id,
            reason,
        };
        fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io("creating output folder", &self.dir, e))?;
        let schema = df.schema().inner().clone();
        let mut stream = df.execute_stream().await.map_err(|e| {
            Error::datafusion(format!("batch {batch_id}: planning the Parquet write"), e)
        })?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .build();
        let mut parts: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut writer: Option<(ArrowWriter<fs::File>, PathBuf, usize)> = None;
        let mut total = 0u64;
        let finish = |w: ArrowWriter<fs::File>, tmp: &Path| -> Result<()> {
            let f = w
                .into_inner()
                .map_err(|e| sink_err(format!("closing {}: {e}", tmp.display())))?;
            f.sync_all().map_err(|e| Error::io("syncing", tmp, e))
        };
        while let Some(batch) = stream.next().await {
            let batch: RecordBatch = batch.map_err(|e| {
                Error::datafusion(format!("batch {batch_id}: computing rows for Parquet"), e)
            })?;
            if batch.num_rows() == 0 {
                continue;
            }
            let mut offset = 0;
            while offset < batch.num_rows() {
                if writer
                    .as_ref()
                    .is_some_and(|w| w.2 >= self.target_rows_per_file)
                    && let Some((w, tmp, _)) = writer.take()
                {
                    finish(w, &tmp)?;
                }
                if writer.is_none() {
                    let final_path = self.dir.join(Self::part_name(batch_id, parts.len()));
                    let tmp = temp_name(&final_path)?;
                    let file =
                        fs::File::create(&tmp).map_err(|e| Error::io("creating", &tmp, e))?;
                    let w = ArrowWriter::try_new(file, schema.clone(), Some(props.clone()))
                        .map_err(|e| sink_err(format!("opening {}: {e}", tmp.display())))?;
                    parts.push((tmp.clone(), final_path));
                    writer = Some((w, tmp, 0));
                }
                if let Some((w, tmp, rows)) = writer.as_mut() {
                    let take = (self.target_rows_per_file - *rows).min(batch.num_rows() - offset);
                    w.write(&batch.slice(offset, take))
                        .map_err(|e| sink_err(format!("writing {}: {e}", tmp.display())))?;
                    *rows += take;
                    offset += take;
                }
            }
            total += batch.num_rows() as u64;
        }
        if let Some((w, tmp, _)) = writer.take() {
            finish(w, &tmp)?;
        }
        fault::hit("parquet-before-rename", batch_id)?;
        for (tmp, final_path) in &parts {
            fs::rename(tmp, final_path)
                .map_err(|e| Error::io("renaming into place", final_path, e))?;
        }
        self.remove_stale_parts(batch_id, parts.len())?;
        sync_dir(&self.dir)?;
        fault::hit("parquet-after-rename", batch_id)?;
        Ok(total)
    }

    /// Removes parts of `batch_id` numbered `from` and up, left by an earlier attempt that
    /// split the batch differently, and temp files of the batch left by a crash.
    fn remove_stale_parts(&self, batch_id: u64, from: usize) -> Result<()> {
        let prefix = format!("batch-{batch_id:010}-part-");
        let entries = fs::read_dir(&self.dir).map_err(|e| Error::io("listing", &self.dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("listing", &self.dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale = if is_hidden(&name) {
                name.starts_with(&format!(".{prefix}")) && name.ends_with(".tmp")
            } else {
                name.strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(".parquet"))
                    .and_then(|p| p.parse::<usize>().ok())
                    .is_some_and(|p| p >= from)
            };
            if stale {
                fs::remove_file(entry.path())
                    .map_err(|e| Error::io("removing stale part", entry.path(), e))?;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl ForeachBatch for ParquetSink {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let rows = self.write(batch, ctx.batch_id).await?;
        ctx.metrics.add_output_rows(rows);
        Ok(())
    }
}
