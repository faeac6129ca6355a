//! The file source's rows read where the plan runs. On a cluster (`weir-cluster`) a batch's
//! range is not read into the driver's memory: `read_range` returns a scan of the files that
//! `sources/<i>/N` recorded, [`RecordedFilesExec`], which the distributed planner ships to
//! the workers. Each task reads its share of the files with the same checks and decoder as
//! the single-process path (a file that changed or vanished fails the batch naming it), so
//! a replay reads the same rows wherever it runs.
//!
//! The scan is described by [`FilesScan`], plain data a codec can send: the folder's URL and
//! storage settings, the format, the bad-record mode and the files of each task. It is a
//! [`WorkerScan`] of kind [`RECORDED_FILES`]; the codec that carries it lives with the
//! cluster (`weir-cluster`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result as DfResult, project_schema};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::{FileEntry, FileFormat, read};
use crate::error::Error;
use crate::source::decode::{BadRecordMode, output_schema};
use crate::source::leaf::{ScanKind, WorkerScan, balance, leaf_properties, stream_share};
use crate::storage::{Location, StorageOptions};

/// What one scan of recorded files reads: plain data, sent to the workers with the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FilesScan {
    /// The folder the files are in, as a URL.
    pub dir: String,
    /// The object-store settings of the folder (never shown).
    #[serde(default)]
    pub storage: BTreeMap<String, String>,
    pub format: FileFormat,
    pub mode: BadRecordMode,
    /// The files in shares, in the order the batch took them: one share, until the
    /// distributed planner gives each task a scan of its own share
    /// ([`RecordedFilesExec::per_task`]). A scan reads every share it holds.
    pub shares: Vec<Vec<FileEntry>>,
    /// Partitions per task: a task reads its files on this many streams at once.
    pub partitions: usize,
    /// The columns read, by index into the decoded schema (`None`: all).
    #[serde(default)]
    pub projection: Option<Vec<usize>>,
}

impl FilesScan {
    /// Every file, in one share.
    pub fn files(&self) -> impl Iterator<Item = &FileEntry> {
        self.shares.iter().flatten()
    }

    /// The same files split into `tasks` shares of about equal bytes (largest first onto
    /// the lightest share; ties keep the order of the log), each share in log order.
    pub fn split(&self, tasks: usize) -> FilesScan {
        let files: Vec<FileEntry> = self.files().cloned().collect();
        FilesScan {
            shares: balance(&files, |e| e.size.unwrap_or(0), tasks),
            ..self.clone()
        }
    }
}

/// A scan of the files one batch recorded, read by the task that runs it.
#[derive(Debug)]
pub struct RecordedFilesExec {
    scan: FilesScan,
    /// The schema files are decoded with (before the bad-record column and projection).
    decode_schema: SchemaRef,
    dir: Location,
    metrics: ExecutionPlanMetricsSet,
    props: Arc<PlanProperties>,
}

impl RecordedFilesExec {
    /// The scan `scan` of files decoded with `decode_schema`. An error if the folder's URL
    /// or settings are not valid here.
    pub fn try_new(scan: FilesScan, decode_schema: SchemaRef) -> DfResult<Self> {
        let storage = StorageOptions::new(scan.storage.clone()).map_err(external)?;
        let dir = Location::parse("source.path", &scan.dir, None, &storage).map_err(external)?;
        Self::in_dir(scan, decode_schema, dir)
    }

    /// The scan `scan` of the folder `dir` (the one `scan.dir` names, already opened).
    pub(super) fn in_dir(
        scan: FilesScan,
        decode_schema: SchemaRef,
        dir: Location,
    ) -> DfResult<Self> {
        let full = output_schema(&decode_schema, scan.mode);
        let projected = project_schema(&full, scan.projection.as_ref())?;
        let props = leaf_properties(projected, scan.partitions);
        Ok(RecordedFilesExec {
            scan,
            decode_schema,
            dir,
            metrics: ExecutionPlanMetricsSet::new(),
            props,
        })
    }

    /// What the scan reads.
    pub fn scan(&self) -> &FilesScan {
        &self.scan
    }

    /// The schema the files are decoded with.
    pub fn decode_schema(&self) -> &SchemaRef {
        &self.decode_schema
    }

    /// One scan per task, each of its share of the files (see [`FilesScan::split`]).
    pub fn per_task(&self, tasks: usize) -> DfResult<Vec<RecordedFilesExec>> {
        self.scan
            .split(tasks)
            .shares
            .into_iter()
            .map(|share| {
                let scan = FilesScan {
                    shares: vec![share],
                    ..self.scan.clone()
                };
                Self::in_dir(scan, self.decode_schema.clone(), self.dir.clone())
            })
            .collect()
    }
}

/// The file source's scan on the wire.
pub const RECORDED_FILES: ScanKind = ScanKind {
    kind: "weir.RecordedFiles.v1",
    find: |node| {
        node.downcast_ref::<RecordedFilesExec>()
            .map(|e| e as &dyn WorkerScan)
    },
    decode: |schema, body| {
        let scan: FilesScan = serde_json::from_str(body).map_err(|e| {
            DataFusionError::Internal(format!("decoding a scan of recorded files: {e}"))
        })?;
        Ok(Arc::new(RecordedFilesExec::try_new(scan, schema)?))
    },
};

impl WorkerScan for RecordedFilesExec {
    fn kind(&self) -> &'static str {
        RECORDED_FILES.kind
    }

    fn encode(&self) -> DfResult<(SchemaRef, String)> {
        let body = serde_json::to_string(&self.scan).map_err(|e| {
            DataFusionError::Internal(format!("encoding a scan of recorded files: {e}"))
        })?;
        Ok((self.decode_schema.clone(), body))
    }

    /// One task per file.
    fn tasks_wanted(&self) -> usize {
        self.scan.files().count().max(1)
    }

    fn with_projection(&self, projection: Option<Vec<usize>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        let scan = FilesScan {
            projection,
            ..self.scan.clone()
        };
        Ok(Arc::new(Self::in_dir(
            scan,
            self.decode_schema.clone(),
            self.dir.clone(),
        )?))
    }

    fn per_task(&self, tasks: usize) -> DfResult<Vec<Arc<dyn ExecutionPlan>>> {
        Ok(RecordedFilesExec::per_task(self, tasks)?
            .into_iter()
            .map(|e| Arc::new(e) as Arc<dyn ExecutionPlan>)
            .collect())
    }
}

/// A task's error; a malformed record is the file's, so the batch is not run again on
/// other workers (it would fail the same way).
fn external(e: Error) -> DataFusionError {
    match e {
        Error::MalformedInput { .. } => crate::error::task_data_error(e),
        e => DataFusionError::External(Box::new(e)),
    }
}

impl DisplayAs for RecordedFilesExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let sizes: Vec<String> = self
            .scan
            .shares
            .iter()
            .map(|s| s.len().to_string())
            .collect();
        write!(
            f,
            "RecordedFilesExec: dir={}, files per task=[{}]",
            self.dir,
            sizes.join(", ")
        )
    }
}

impl ExecutionPlan for RecordedFilesExec {
    crate::leaf_plan_methods!("RecordedFilesExec");

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        // A task's variant holds its own share (see `FilesScan::per_task`).
        let mine = stream_share(self.scan.files(), self.scan.partitions, partition);
        let rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let (dir, format, schema, mode) = (
            self.dir.clone(),
            self.scan.format.clone(),
            self.decode_schema.clone(),
            self.scan.mode,
        );
        let projection = self.scan.projection.clone();
        let out = self.schema();
        let stream = futures::stream::iter(mine)
            .map(move |e| {
                let (dir, format, schema) = (dir.clone(), format.clone(), schema.clone());
                async move { read::read_entry(&dir, e, &format, &schema, mode, None).await }
            })
            // One file is fetched while the one before it is decoded.
            .buffered(2)
            .map_err(external)
            .and_then(move |(batch, _malformed)| {
                let projected = match &projection {
                    Some(p) => batch.project(p).map_err(DataFusionError::from),
                    None => Ok(batch),
                };
                if let Ok(b) = &projected {
                    rows.add(b.num_rows());
                }
                futures::future::ready(projected)
            });
        Ok(Box::pin(RecordBatchStreamAdapter::new(out, stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, size: u64) -> FileEntry {
        FileEntry {
            path: format!("file:///in/{name}"),
            timestamp: 0,
            batch_id: 0,
            size: Some(size),
            etag: None,
        }
    }

    fn names(s: &FilesScan) -> Vec<Vec<String>> {
        s.shares
            .iter()
            .map(|sh| {
                sh.iter()
                    .map(|e| e.path.rsplit('/').next().unwrap_or_default().to_string())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn split_balances_bytes_and_keeps_log_order() {
        let scan = FilesScan {
            dir: "file:///in/".into(),
            storage: BTreeMap::new(),
            format: FileFormat::Json,
            mode: BadRecordMode::FailFast,
            shares: vec![vec![
                entry("a", 10),
                entry("b", 100),
                entry("c", 10),
                entry("d", 50),
                entry("e", 40),
            ]],
            partitions: 1,
            projection: None,
        };
        // Largest first onto the lightest share: b | d | e, then a onto e (40) and c onto
        // the first of the two at 50.
        assert_eq!(
            names(&scan.split(3)),
            vec![vec!["b"], vec!["c", "d"], vec!["a", "e"]]
        );
        // More tasks than files: empty shares, every file once.
        let many = scan.split(7);
        assert_eq!(many.shares.len(), 7);
        assert_eq!(many.files().count(), 5);
        // One task: the log's order.
        assert_eq!(names(&scan.split(1)), vec![vec!["a", "b", "c", "d", "e"]]);
        // Sizes unknown (Spark's logs): spread by count, in order.
        let mut unknown = scan.clone();
        for e in unknown.shares[0].iter_mut() {
            e.size = None;
        }
        assert_eq!(
            names(&unknown.split(2)),
            vec![vec!["a", "c", "e"], vec!["b", "d"]]
        );
    }
}
