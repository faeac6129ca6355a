//! The builder API, shaped like Spark's for those who know it:
//!
//! ```no_run
//! # use weir_core::*;
//! # async fn demo(schema: datafusion::arrow::datatypes::SchemaRef) -> Result<()> {
//! let query = WeirSession::new()
//!     .read_stream()
//!     .files("/data/in")
//!     .format(FileFormat::Json)
//!     .schema(schema)
//!     .max_files_per_trigger(1)
//!     .load()
//!     .await?
//!     .write_stream()
//!     .query_name("orders")
//!     .checkpoint("/chk/orders")
//!     .trigger(Trigger::AvailableNow)
//!     .foreach_batch(|batch, ctx| async move {
//!         println!("batch {}: {} rows", ctx.batch_id, batch.count().await?);
//!         Ok(())
//!     })
//!     .start()
//!     .await?;
//! query.await_termination().await?;
//! # Ok(()) }
//! ```
//!
//! Paths (`files`, `checkpoint`, and the sinks') may be local folders or object-store URLs
//! (`s3://`, `az://`, `abfss://`, `gs://`); see [`crate::storage`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::{DataFrame, SessionConfig, SessionContext};

use crate::checkpoint::LeaseSettings;
use crate::engine::{
    BehindDetector, QueryListener, RetryPolicy, StartRequest, StreamingQuery, Transform, Trigger,
};
use crate::error::{BoxError, Error, Result};
use crate::sink::{BatchContext, ForeachBatch};
use crate::source::{
    BadRecordMode, CleanSource, FileFormat, FileSource, FileSourceOptions, RateSource, ReadLimit,
    Source,
};
use crate::storage::{Location, StorageOptions};

mod location;
pub use location::{IntoLocation, LocationSpec};

pub use crate::engine::PIN_TARGET_PARTITIONS;

/// Entry point: holds the DataFusion configuration and runtime shared by its queries, and
/// the object-store settings for the URLs they use.
#[derive(Clone)]
pub struct WeirSession {
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
    storage: StorageOptions,
    cluster: Option<Arc<dyn crate::engine::Cluster>>,
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
            storage: StorageOptions::default(),
            cluster: None,
        }
    }

    /// Runs this session's queries on a cluster's workers (`weir-cluster`): the source's
    /// range is read and the stateless steps run where the plan runs; this process keeps
    /// the checkpoint and calls the function.
    pub fn cluster(mut self, cluster: Arc<dyn crate::engine::Cluster>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// Object-store settings (endpoint, region, credentials, ...) for every `s3://`,
    /// `az://` or `gs://` path of this session's queries.
    pub fn storage_options(mut self, options: StorageOptions) -> Self {
        self.storage = options;
        self
    }

    /// The object-store settings.
    pub fn storage(&self) -> &StorageOptions {
        &self.storage
    }

    /// Parses a path or URL with this session's storage settings.
    pub fn location(&self, key: &str, at: impl IntoLocation) -> Result<Location> {
        at.into_spec().resolve(key, &self.storage)
    }

    /// Starts describing a streaming read.
    pub fn read_stream(&self) -> DataStreamReader {
        DataStreamReader {
            session: self.clone(),
            kind: None,
            files: FileSettings::default(),
            limit: ReadLimit::ALL,
        }
    }

    /// Checks `transforms` over a source whose batches have `schema`, without data (what
    /// `weir check` does): the stateful steps' columns, and each SQL step planned over an
    /// empty batch (nothing run; statements refused), so a misspelt column or function is
    /// named before anything runs. Returns what is known of the columns the function gets.
    pub async fn check_transforms(
        &self,
        schema: SchemaRef,
        transforms: &[crate::engine::Transform],
    ) -> Result<crate::engine::TransformOutput> {
        crate::engine::check_transforms(&self.context(None), schema, transforms).await
    }

    fn context(&self, target_partitions: Option<usize>) -> SessionContext {
        let mut config = self.config.clone();
        if let Some(n) = target_partitions {
            config = config.with_target_partitions(n);
        }
        if self.cluster.is_some() {
            config = config.with_extension(Arc::new(crate::source::leaf::ScansOnCluster));
        }
        let builder = datafusion::execution::SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(self.runtime.clone())
            .with_default_features();
        let planner = Arc::new(crate::engine::WeirQueryPlanner);
        let builder = builder
            .with_physical_optimizer_rule(Arc::new(crate::engine::top_one::TopOnePerKey))
            .with_physical_optimizer_rule(Arc::new(crate::engine::state_nodes::StateShuffle))
            .with_query_planner(planner);
        let state = match &self.cluster {
            // weir's planner goes in first: the distributed planner wraps the one it finds,
            // and distributes the plan the top-one rule made (its node travels with the
            // cluster's codec, after the shuffle by key).
            Some(cluster) => cluster.distribute(builder).build(),
            None => builder.build(),
        };
        SessionContext::new_with_state(state)
    }
}

enum ReaderKind {
    Files(LocationSpec),
    Rate(u64),
    Custom(Arc<dyn Source>),
}

/// Settings that only a file source takes; set on another source they are an error.
#[derive(Default)]
struct FileSettings {
    format: Option<FileFormat>,
    schema: Option<SchemaRef>,
    latest_first: Option<bool>,
    max_file_age: Option<Duration>,
    mode: Option<BadRecordMode>,
    clean_source: Option<CleanSource>,
    max_files: Option<usize>,
}

impl FileSettings {
    fn any_set(&self) -> Option<&'static str> {
        [
            ("format", self.format.is_some()),
            ("latest_first", self.latest_first.is_some()),
            ("max_file_age", self.max_file_age.is_some()),
            ("mode", self.mode.is_some()),
            ("clean_source", self.clean_source.is_some()),
            ("max_files_per_trigger", self.max_files.is_some()),
        ]
        .into_iter()
        .find(|(_, set)| *set)
        .map(|(k, _)| k)
    }
}

/// Spark's `DataStreamReader`.
pub struct DataStreamReader {
    session: WeirSession,
    kind: Option<ReaderKind>,
    files: FileSettings,
    limit: ReadLimit,
}

impl DataStreamReader {
    /// A folder of files: a local path or an object-store URL.
    pub fn files(mut self, path: impl IntoLocation) -> Self {
        self.kind = Some(ReaderKind::Files(path.into_spec()));
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

    /// The file format (JSON lines by default). Files only.
    pub fn format(mut self, format: FileFormat) -> Self {
        self.files.format = Some(format);
        self
    }

    /// The schema of the files (Parquet: read from the first file when not given).
    pub fn schema(mut self, schema: SchemaRef) -> Self {
        self.files.schema = Some(schema);
        self
    }

    /// `maxFilesPerTrigger`. Files only.
    pub fn max_files_per_trigger(mut self, n: usize) -> Self {
        self.files.max_files = Some(n);
        self
    }

    /// `maxOffsetsPerTrigger`: rows or records per batch for sources that count them.
    pub fn max_offsets_per_trigger(mut self, n: u64) -> Self {
        self.limit.max_rows = Some(n);
        self
    }

    /// `minOffsetsPerTrigger` and `maxTriggerDelay`: wait for `n` new records, but no
    /// longer than `max_delay` since the last batch. Ignored by `AvailableNow` and `Once`,
    /// which read everything there is.
    pub fn min_offsets_per_trigger(mut self, n: u64, max_delay: Duration) -> Self {
        self.limit.min_rows = Some((n, max_delay));
        self
    }

    /// `latestFirst`. Files only.
    pub fn latest_first(mut self, yes: bool) -> Self {
        self.files.latest_first = Some(yes);
        self
    }

    /// `maxFileAge`. Files only.
    pub fn max_file_age(mut self, age: Duration) -> Self {
        self.files.max_file_age = Some(age);
        self
    }

    /// `mode` for malformed lines: FAILFAST (default), PERMISSIVE, DROPMALFORMED. JSON and
    /// CSV files only.
    pub fn mode(mut self, mode: BadRecordMode) -> Self {
        self.files.mode = Some(mode);
        self
    }

    /// `cleanSource`: delete or archive the files of committed batches. Files only.
    pub fn clean_source(mut self, clean: CleanSource) -> Self {
        self.files.clean_source = Some(clean);
        self
    }

    /// Checks the settings and builds the source.
    pub async fn load(self) -> Result<StreamingDataFrame> {
        let not_files = |what: &str, key: &str| {
            Error::config(
                key,
                format!("applies to a file source (.files(..)), not to {what}"),
            )
        };
        let source: Arc<dyn Source> = match self.kind {
            None => {
                return Err(Error::config(
                    "source",
                    "no source given: call .files(path), .rate(n) or .source(..)",
                ));
            }
            Some(ReaderKind::Files(path)) => {
                let f = self.files;
                let mut opts = FileSourceOptions::new(
                    path.resolve("source.path", &self.session.storage)?,
                    f.format.unwrap_or(FileFormat::Json),
                );
                opts.schema = f.schema;
                opts.latest_first = f.latest_first.unwrap_or(false);
                opts.max_file_age = f.max_file_age;
                opts.mode = f.mode.unwrap_or_default();
                opts.clean_source = f.clean_source.unwrap_or_default();
                let limit = ReadLimit {
                    max_files: f.max_files,
                    ..self.limit
                };
                return Ok(StreamingDataFrame {
                    session: self.session,
                    source: Arc::new(FileSource::new(opts).await?),
                    limit,
                    transforms: Vec::new(),
                });
            }
            Some(ReaderKind::Rate(n)) => {
                if let Some(k) = self.files.any_set() {
                    return Err(not_files("the rate source", k));
                }
                Arc::new(RateSource::new(n)?)
            }
            Some(ReaderKind::Custom(s)) => {
                if let Some(k) = self.files.any_set() {
                    return Err(not_files(&s.description(), k));
                }
                s
            }
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

    /// Replaces the read limits (what a source's config asks for).
    pub fn with_read_limit(mut self, limit: ReadLimit) -> Self {
        self.limit = limit;
        self
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

    /// Streaming deduplication (Spark's `dropDuplicates` without a watermark): a row passes
    /// only if no earlier row of the stream had the same values in `keys`, in its batch or
    /// any before. The keys seen are kept in the checkpoint's state store (`state/`), one
    /// per distinct key, for as long as the checkpoint lives; the first row of a key in a
    /// batch is the one that passes. A replayed batch passes the same rows as its first
    /// attempt. Applied where it stands among [`Self::transform`] and [`Self::sql`].
    pub fn drop_duplicates<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.transforms.push(Transform::DropDuplicates(
            keys.into_iter().map(Into::into).collect(),
        ));
        self
    }

    /// Spark's `withWatermark`: rows of this stream may come up to `delay` late in the
    /// timestamp column `column`. After each batch the watermark becomes the latest event
    /// time seen minus `delay` (it never goes back; 0 before the first batch), recorded in
    /// `offsets/N` (`batchWatermarkMs`) and `commits/N` (`nextBatchWatermarkMs`); the
    /// stateful steps after this one drop rows at or below the previous batch's watermark
    /// (Spark since 3.4) and evict what the batch's own watermark passed;
    /// when it moves and no data comes, a batch without data runs so windows close.
    /// One per query.
    pub fn with_watermark(mut self, column: impl Into<String>, delay: std::time::Duration) -> Self {
        self.transforms.push(Transform::Watermark {
            column: column.into(),
            delay,
        });
        self
    }

    /// Spark 3.5's `dropDuplicatesWithinWatermark`: a row passes unless a row with the same
    /// values in `keys` passed before it and the watermark has not yet passed that row's
    /// event time plus the watermark's delay. State stays bounded. Needs
    /// [`Self::with_watermark`] before it.
    pub fn drop_duplicates_within_watermark<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.transforms
            .push(Transform::DropDuplicatesWithinWatermark(
                keys.into_iter().map(Into::into).collect(),
            ));
        self
    }

    /// A streaming aggregation (Spark's `groupBy(window(...), ...).agg(...)` with an output
    /// mode): the function and the sinks receive its output rows instead of the input.
    pub fn aggregate(mut self, aggregation: crate::engine::Aggregation) -> Self {
        self.transforms.push(Transform::Aggregate(aggregation));
        self
    }

    /// Adds a step as it is (what the methods above add).
    pub fn then(mut self, step: Transform) -> Self {
        self.transforms.push(step);
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
            state_partitions: None,
            retry: RetryPolicy::default(),
            behind: BehindDetector::default(),
            no_data_delay: Duration::from_millis(100),
            lease: LeaseSettings::default(),
        }
    }
}

/// Spark's `DataStreamWriter`, for `foreachBatch`.
pub struct DataStreamWriter {
    frame: StreamingDataFrame,
    name: Option<String>,
    checkpoint: Option<LocationSpec>,
    trigger: Trigger,
    sink: Option<Arc<dyn ForeachBatch>>,
    listeners: Vec<Arc<dyn QueryListener>>,
    retain: u64,
    state_partitions: Option<u32>,
    retry: RetryPolicy,
    behind: BehindDetector,
    no_data_delay: Duration,
    lease: LeaseSettings,
}

impl DataStreamWriter {
    /// The query name: shown in progress and errors, part of the default app id.
    pub fn query_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The checkpoint folder (required): a local path or an object-store URL.
    pub fn checkpoint(mut self, dir: impl IntoLocation) -> Self {
        self.checkpoint = Some(dir.into_spec());
        self
    }

    /// When batches run (default: as fast as possible).
    pub fn trigger(mut self, trigger: Trigger) -> Self {
        self.trigger = trigger;
        self
    }

    /// The function called with each batch: `|batch, ctx| async move { ...; Ok(()) }`.
    /// Any error type converts with `?`; returning one stops the query without committing
    /// the batch.
    pub fn foreach_batch<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(DataFrame, BatchContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), BoxError>> + Send,
    {
        self.sink = Some(Arc::new(f));
        self
    }

    /// Like `foreach_batch`, with `state` (your sinks, clients, settings) handed to every
    /// call by value: `state` is cloned per batch, so the function needs no `Arc`s or
    /// clones of its own.
    ///
    /// ```no_run
    /// # use weir_core::*;
    /// # fn w(writer: DataStreamWriter, parquet: ParquetSink) -> DataStreamWriter {
    /// writer.foreach_batch_with(parquet, |parquet, batch, ctx| async move {
    ///     parquet.call(batch, ctx).await
    /// })
    /// # }
    /// ```
    pub fn foreach_batch_with<S, F, Fut>(mut self, state: S, f: F) -> Self
    where
        S: Clone + Send + Sync + 'static,
        F: Fn(S, DataFrame, BatchContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), BoxError>> + Send,
    {
        self.sink = Some(Arc::new(move |batch: DataFrame, ctx: BatchContext| {
            f(state.clone(), batch, ctx)
        }));
        self
    }

    /// A sink (any [`ForeachBatch`]: [`crate::ParquetSink`], a Delta or PostgreSQL sink,
    /// a [`crate::FanOut`]) as the batch function.
    pub fn sink(mut self, sink: impl ForeachBatch + 'static) -> Self {
        self.sink = Some(Arc::new(sink));
        self
    }

    /// Like `sink`, for a sink already shared.
    pub fn sink_arc(mut self, sink: Arc<dyn ForeachBatch>) -> Self {
        self.sink = Some(sink);
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

    /// The number of partitions a stateful operator's state is split into by key hash
    /// (Spark's `spark.sql.shuffle.partitions` for state; default: what the checkpoint's
    /// state recorded, else 8). Each partition's keys are looked up on a core of their own
    /// and committed as files of their own. Fixed when the state is first written: a
    /// different number on the same checkpoint is refused.
    pub fn state_partitions(mut self, n: u32) -> Self {
        self.state_partitions = Some(n);
        self
    }

    /// How failures that may pass (a server down or restarting, a connection refused or
    /// cut, a timeout) are met: the query starts again from its checkpoint after a pause,
    /// and the failed batch runs again with the same id and range (see
    /// [`crate::engine::retry`]). Default: 10 runs, pauses from 1 s doubling up to 60 s;
    /// [`RetryPolicy::none`] stops at the first failure.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
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

    /// How long the lease on an object-store checkpoint lives without renewal (default
    /// 30 s): a restart after a crash waits up to this long for it to lapse.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease = LeaseSettings {
            ttl: ttl.max(Duration::from_millis(300)),
            ..self.lease
        };
        self
    }

    /// How long a start waits for another process holding the checkpoint (a local lock,
    /// or a lease it still renews) to let it go before refusing with "another query is
    /// using the checkpoint" (default 0: at once). For deployments where the new process
    /// starts before the old one has stopped.
    pub fn lease_wait(mut self, wait: Duration) -> Self {
        self.lease = LeaseSettings { wait, ..self.lease };
        self
    }

    /// Checks everything, opens and takes the checkpoint, decides where to start (a pending
    /// batch is run again first) and starts the query on the current tokio runtime. Errors
    /// found here (bad settings, a corrupt checkpoint, another query holding it) are
    /// returned before anything runs.
    pub async fn start(self) -> Result<StreamingQuery> {
        if let Trigger::Continuous(_) = self.trigger {
            return Err(Error::ContinuousTriggerUnsupported);
        }
        self.retry.check("query.retry")?;
        let sink = self.sink.ok_or_else(|| {
            Error::config(
                "foreach-batch",
                "no function given: call .foreach_batch(..) or .sink(..)",
            )
        })?;
        let dir = self
            .checkpoint
            .ok_or_else(|| {
                Error::config(
                    "checkpoint",
                    "a checkpoint folder is required: it is what makes batches replayable",
                )
            })?
            .resolve("query.checkpoint", &self.frame.session.storage)?;
        let session = self.frame.session;
        let cluster = session.cluster.clone();
        crate::engine::start(StartRequest {
            dir,
            name: self.name.unwrap_or_else(|| "query".to_string()),
            lease: self.lease,
            source: self.frame.source,
            limit: self.frame.limit,
            transforms: self.frame.transforms,
            context: Box::new(move |pinned| session.context(pinned)),
            sink,
            trigger: self.trigger,
            retain: self.retain,
            state_partitions: self.state_partitions,
            retry: self.retry,
            listeners: self.listeners,
            behind: self.behind,
            no_data_delay: self.no_data_delay,
            cluster,
        })
        .await
    }
}
