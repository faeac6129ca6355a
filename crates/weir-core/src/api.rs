//! The builder API, shaped like Spark's for those who know it:
//!
//! ```no_run
//! # use weir_core::*;
//! # async fn demo(schema: datafusion::arrow::datatypes::SchemaRef) -> Result<()> {
//! let session = WeirSession::new();
//! let query = session
//!     .read_stream()
//!     .files("/data/in")
//!     .format(FileFormat::Json)
//!     .schema(schema)
//!     .max_files_per_trigger(1)
//!     .load()?
//!     .write_stream()
//!     .query_name("orders")
//!     .checkpoint("/chk/orders")
//!     .trigger(Trigger::AvailableNow)
//!     .foreach_batch(|batch: datafusion::prelude::DataFrame, ctx: BatchContext| async move {
//!         println!("batch {}: {} rows", ctx.batch_id, batch.count().await?);
//!         Ok(())
//!     })
//!     .start()
//!     .await?;
//! query.await_termination().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::{DataFrame, SessionConfig, SessionContext};

use crate::checkpoint::{Checkpoint, StartPoint};
use crate::engine::{
    BehindDetector, QueryListener, QuerySpec, Shared, StreamingQuery, Transform, Trigger, run,
};
use crate::error::{Error, Result};
use crate::sink::ForeachBatch;
use crate::source::file::FileSourceOptions;
use crate::source::{FileFormat, FileSource, RateSource, ReadLimit, Source, SourceInit};

/// The pinned setting that a replay must reuse: the partitioning of the batch, so that
/// sinks that name output by partition write the same names again.
pub const PIN_TARGET_PARTITIONS: &str = "datafusion.execution.target_partitions";

/// Entry point: holds the DataFusion configuration and runtime shared by its queries.
#[derive(Clone)]
pub struct WeirSession {
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
}

impl Default for WeirSession {
    fn default() -> Self {
        WeirSession::new()
    }
}

impl WeirSession {
    /// DataFusion's defaults.
    pub fn new() -> Self {
        WeirSession::with_config(SessionConfig::new())
    }

    /// With a DataFusion configuration of your own.
    pub fn with_config(config: SessionConfig) -> Self {
        WeirSession {
            config,
            runtime: Arc::new(RuntimeEnv::default()),
        }
    }

    /// Starts describing a streaming read.
    pub fn read_stream(&self) -> DataStreamReader {
        DataStreamReader {
            session: self.clone(),
            kind: None,
            format: FileFormat::Json,
            schema: None,
            limit: ReadLimit::ALL,
            latest_first: false,
            max_file_age: None,
        }
    }

    fn context(&self, target_partitions: Option<usize>) -> SessionContext {
        let mut config = self.config.clone();
        if let Some(n) = target_partitions {
            config = config.with_target_partitions(n);
        }
        SessionContext::new_with_config_rt(config, self.runtime.clone())
    }
}

enum ReaderKind {
    Files(PathBuf),
    Rate(u64),
    Custom(Arc<dyn Source>),
}

/// Spark's `DataStreamReader`.
pub struct DataStreamReader {
    session: WeirSession,
    kind: Option<ReaderKind>,
    format: FileFormat,
    schema: Option<SchemaRef>,
    limit: ReadLimit,
    latest_first: bool,
    max_file_age: Option<Duration>,
}

impl DataStreamReader {
    /// A folder of files.
    pub fn files(mut self, path: impl Into<PathBuf>) -> Self {
        self.kind = Some(ReaderKind::Files(path.into()));
        self
    }

    /// Generated rows (`timestamp`, `value`).
    pub fn rate(mut self, rows_per_second: u64) -> Self {
        self.kind = Some(ReaderKind::Rate(rows_per_second));
        self
    }

    /// Any source, e.g. `weir_kafka::KafkaSource` or a [`crate::MemorySource`].
    pub fn source(mut self, source: Arc<dyn Source>) -> Self {
        self.kind = Some(ReaderKind::Custom(source));
        self
    }

    /// The file format (JSON lines by default).
    pub fn format(mut self, format: FileFormat) -> Self {
        self.format = format;
        self
    }

    /// The schema of the files.
    pub fn schema(mut self, schema: SchemaRef) -> Self {
        self.schema = Some(schema);
        self
    }

    /// `maxFilesPerTrigger`.
    pub fn max_files_per_trigger(mut self, n: usize) -> Self {
        self.limit.max_files = Some(n);
        self
    }

    /// `maxOffsetsPerTrigger`: rows or records per batch for sources that count them.
    pub fn max_offsets_per_trigger(mut self, n: u64) -> Self {
        self.limit.max_rows = Some(n);
        self
    }

    /// `latestFirst`.
    pub fn latest_first(mut self, yes: bool) -> Self {
        self.latest_first = yes;
        self
    }

    /// `maxFileAge`.
    pub fn max_file_age(mut self, age: Duration) -> Self {
        self.max_file_age = Some(age);
        self
    }

    /// Checks the settings and builds the source.
    pub fn load(self) -> Result<StreamingDataFrame> {
        let source: Arc<dyn Source> = match self.kind {
            None => {
                return Err(Error::config(
                    "source",
                    "no source given: call .files(path), .rate(n) or .source(..)",
                ));
            }
            Some(ReaderKind::Files(path)) => Arc::new(FileSource::new(FileSourceOptions {
                path,
                format: self.format,
                schema: self.schema,
                latest_first: self.latest_first,
                max_file_age: self.max_file_age,
            })?),
            Some(ReaderKind::Rate(n)) => Arc::new(RateSource::new(n)?),
            Some(ReaderKind::Custom(s)) => s,
        };
        Ok(StreamingDataFrame {
            session: self.session,
            source,
            limit: self.limit,
            transforms: Vec::new(),
        })
    }
}

/// A stream of batches with stateless transformations: what `readStream...load()` gives.
pub struct StreamingDataFrame {
    session: WeirSession,
    source: Arc<dyn Source>,
    limit: ReadLimit,
    transforms: Vec<Transform>,
}

impl StreamingDataFrame {
    /// The schema of the source.
    pub fn source_schema(&self) -> SchemaRef {
        self.source.schema()
    }

    /// Applies a DataFrame function to every batch.
    pub fn transform<F>(mut self, f: F) -> Self
    where
        F: Fn(DataFrame) -> datafusion::error::Result<DataFrame> + Send + Sync + 'static,
    {
        self.transforms.push(Transform::Fn(Arc::new(f)));
        self
    }

    /// Applies SQL to every batch, which the query sees as the view `batch`.
    pub fn sql(mut self, sql: impl Into<String>) -> Self {
        self.transforms.push(Transform::Sql(sql.into()));
        self
    }

    /// Starts describing where the batches go.
    pub fn write_stream(self) -> DataStreamWriter {
        DataStreamWriter {
            frame: self,
            name: None,
            checkpoint: None,
            trigger: Trigger::default(),
            sink: None,
            listeners: Vec::new(),
            retain: 100,
            behind: BehindDetector::default(),
            no_data_delay: Duration::from_millis(100),
        }
    }
}

/// Spark's `DataStreamWriter`, for `foreachBatch`.
pub struct DataStreamWriter {
    frame: StreamingDataFrame,
    name: Option<String>,
    checkpoint: Option<PathBuf>,
    trigger: Trigger,
    sink: Option<Arc<dyn ForeachBatch>>,
    listeners: Vec<Arc<dyn QueryListener>>,
    retain: u64,
    behind: BehindDetector,
    no_data_delay: Duration,
}

impl DataStreamWriter {
    /// The query name: stable across restarts; part of the sinks' default application id.
    pub fn query_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The checkpoint folder (required).
    pub fn checkpoint(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint = Some(dir.into());
        self
    }

    /// When batches run (default: as fast as possible).
    pub fn trigger(mut self, trigger: Trigger) -> Self {
        self.trigger = trigger;
        self
    }

    /// The function called with each batch: a closure `|DataFrame, BatchContext| async`
    /// returning `Result<(), BoxError>`, or any [`ForeachBatch`] (sinks are).
    pub fn foreach_batch(mut self, f: impl ForeachBatch + 'static) -> Self {
        self.sink = Some(Arc::new(f));
        self
    }

    /// Like `foreach_batch`, for a sink already shared.
    pub fn foreach_batch_arc(mut self, f: Arc<dyn ForeachBatch>) -> Self {
        self.sink = Some(f);
        self
    }

    /// Receives started / progress / idle / terminated / falling-behind events.
    pub fn listener(mut self, l: Arc<dyn QueryListener>) -> Self {
        self.listeners.push(l);
        self
    }

    /// How many batches of logs to keep in the checkpoint (default 100, at least 2).
    pub fn min_batches_to_retain(mut self, n: u64) -> Self {
        self.retain = n.max(2);
        self
    }

    /// Alert when `addBatch` exceeds `fraction` of the trigger interval for `batches`
    /// batches in a row (default 0.7 and 3).
    pub fn falling_behind_alert(mut self, fraction: f64, batches: u32) -> Self {
        self.behind = BehindDetector::new(fraction, batches);
        self
    }

    /// How long to wait before asking the source again when a trigger of interval 0 found
    /// no data (default 100 ms).
    pub fn no_data_delay(mut self, d: Duration) -> Self {
        self.no_data_delay = d;
        self
    }

    /// Checks everything, opens the checkpoint, decides where to start (a pending batch is
    /// run again first) and starts the query on the current tokio runtime. Errors found
    /// here (bad settings, a corrupt checkpoint) are returned before anything runs.
    pub async fn start(self) -> Result<StreamingQuery> {
        if let Trigger::Continuous(_) = self.trigger {
            return Err(Error::ContinuousTriggerUnsupported);
        }
        let sink = self.sink.ok_or_else(|| {
            Error::config(
                "foreach-batch",
                "no function given: call .foreach_batch(..)",
            )
        })?;
        let dir = self.checkpoint.ok_or_else(|| {
            Error::config(
                "checkpoint",
                "a checkpoint folder is required: it is what makes batches replayable",
            )
        })?;
        let checkpoint = Checkpoint::open(&dir)?;
        let start = checkpoint.recover()?;
        // Settings pinned by the last recorded batch win over the current ones.
        let recorded = match &start {
            StartPoint::Fresh => None,
            StartPoint::Replay { batch, .. } => Some(&batch.metadata.conf),
            StartPoint::Next { previous, .. } => Some(&previous.metadata.conf),
        };
        let pinned = recorded
            .and_then(|c| c.get(PIN_TARGET_PARTITIONS))
            .and_then(|v| v.parse::<usize>().ok());
        let ctx = self.frame.session.context(pinned);
        let mut conf = BTreeMap::new();
        conf.insert(
            PIN_TARGET_PARTITIONS.to_string(),
            ctx.state().config().target_partitions().to_string(),
        );
        let name = self.name.unwrap_or_else(|| "query".to_string());
        let shared = Arc::new(Shared::new(checkpoint.query_id(), name));
        self.frame
            .source
            .open(&SourceInit {
                log_dir: checkpoint.source_dir(0),
                retain_batches: self.retain,
            })
            .await?;
        let spec = QuerySpec {
            checkpoint,
            start,
            source: self.frame.source,
            limit: self.frame.limit,
            transforms: self.frame.transforms,
            sink,
            trigger: self.trigger,
            retain: self.retain,
            listeners: self.listeners,
            behind: self.behind,
            ctx,
            conf,
            no_data_delay: self.no_data_delay,
        };
        tokio::spawn(run(spec, shared.clone()));
        Ok(StreamingQuery { shared })
    }
}
