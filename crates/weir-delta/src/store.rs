//! Where delta-rs reads and writes: the same object stores as the rest of weir.
//!
//! delta-rs 1.1 knows only `file://` and `memory://` unless its per-cloud crates are linked
//! (which bring the AWS SDK). Instead, weir registers factories for `s3://`, `az://`
//! (`abfss://`, ...) and `gs://` that build stores with `weir_core::storage` (the same
//! builder, settings and credential chain as checkpoints and Parquet folders), and commits
//! through delta-rs's default log store, which writes `_delta_log/N.json` with a
//! conditional put (`PutMode::Create`). For `file://` it registers a store that fsyncs every
//! file and folder it writes, so a local table's commit is durable before `commits/N`.
//!
//! Every table's log store is wrapped ([`BoundedReads`]) so that the kernel engine delta-rs
//! reads the log with opens at most [`LOG_FILES_AT_ONCE`] log files at a time: its default,
//! 1,000, opened every commit file since the checkpoint at once on each batch's lookup of the
//! application transaction, each with a JSON decoder sized for 1,000 rows (about 3 MB),
//! a transient peak of over 100 MB that left the process's memory higher batch after batch.

use std::collections::BTreeMap;
use std::sync::{Arc, Once};

use std::num::NonZero;

use bytes::Bytes;
use delta_kernel::Engine;
use delta_kernel_default_engine::DefaultEngineBuilder;
use delta_kernel_default_engine::executor::tokio::{
    TokioBackgroundExecutor, TokioMultiThreadExecutor,
};
use deltalake::kernel::Version;
use deltalake::kernel::transaction::TransactionError;
use deltalake::logstore::{
    CommitOrBytes, LogStore, LogStoreConfig, LogStoreFactory, ObjectStoreFactory, ObjectStoreRef,
    StorageConfig, default_logstore, logstore_factories, object_store_factories,
};
use deltalake::{DeltaResult, DeltaTable, DeltaTableError, ObjectStore, Path};
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};
use std::ops::Range;
use tokio::runtime::{Handle, RuntimeFlavor};
use url::Url;
use uuid::Uuid;
use weir_core::datafusion::execution::object_store::ObjectStoreUrl;
use weir_core::storage::{DurableLocalStore, StorageOptions, object_store_for};

/// Schemes whose tables weir opens through object stores.
pub(crate) const CLOUD_SCHEMES: &[&str] =
    &["s3", "s3a", "az", "azure", "abfs", "abfss", "adl", "gs"];

#[derive(Debug)]
struct CloudStores;

impl ObjectStoreFactory for CloudStores {
    fn parse_url_opts(
        &self,
        url: &Url,
        config: &StorageConfig,
    ) -> DeltaResult<(ObjectStoreRef, Path)> {
        let options: BTreeMap<String, String> = config
            .raw
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let options =
            StorageOptions::new(options).map_err(|e| DeltaTableError::Generic(e.to_string()))?;
        let (store, path) = object_store_for(url, &options)?;
        Ok((store, path))
    }
}

#[derive(Debug)]
struct LocalStores;

impl ObjectStoreFactory for LocalStores {
    fn parse_url_opts(
        &self,
        url: &Url,
        _config: &StorageConfig,
    ) -> DeltaResult<(ObjectStoreRef, Path)> {
        let path = Path::from_url_path(url.path())?;
        Ok((Arc::new(DurableLocalStore::new()), path))
    }
}

#[derive(Debug)]
struct Logs;

impl LogStoreFactory for Logs {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> DeltaResult<Arc<dyn LogStore>> {
        Ok(Arc::new(BoundedReads {
            inner: default_logstore(prefixed_store, root_store, location, options),
            unlisted_log: false,
        }))
    }
}

/// How many log files the kernel engine reads at once.
pub(crate) const LOG_FILES_AT_ONCE: NonZero<usize> = NonZero::<usize>::MIN.saturating_add(15);

/// Rows per batch the engine decodes from a log file: a batch's commit has a handful of
/// actions, and the decoder reserves room for this many up front.
const LOG_ROWS_PER_BATCH: NonZero<usize> = NonZero::<usize>::MIN.saturating_add(255);

/// delta-rs's default log store with a kernel engine that reads at most
/// [`LOG_FILES_AT_ONCE`] log files at a time; everything else is passed through, but for
/// [`unlisted_log`](Self::unlisted_log).
struct BoundedReads {
    inner: Arc<dyn LogStore>,
    /// Whether the store it hands out lists nothing under `_delta_log` (see
    /// [`for_compaction`]).
    unlisted_log: bool,
}

impl std::fmt::Debug for BoundedReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BoundedReads({})", self.inner.name())
    }
}

/// `table` with a log store whose object store lists nothing for a whole-log listing
/// (`list` of `_delta_log` without an offset), for delta-rs's OPTIMIZE.
///
/// OPTIMIZE commits with delta-rs's default commit properties, dropping the
/// `cleanup_expired_logs = false` weir passes (deltalake-core 1.1.3,
/// `operations/optimize.rs`), so its post-commit hook runs `cleanup_expired_logs_for`,
/// which lists and holds every entry of `_delta_log`: a table keeps 30 days of commits by
/// default, one per batch, so each compaction's cost and memory grew with every batch (a
/// rate -> Delta append soak's RSS grew 12% over 53,000 batches). The whole-log listing is
/// that hook's only use of `list` on the log in an OPTIMIZE (the snapshot reads the log
/// through the kernel engine, on the root store and with an offset), and with nothing
/// listed the hook finds no checkpoint and removes nothing. Expired log files are removed
/// by weir's own cleanup ([`crate::log_cleanup`]) instead, as after every other commit weir
/// makes. Returns the table's own log store too: use the table only for the OPTIMIZE and
/// carry on with [`with_log_store`].
pub(crate) fn for_compaction(table: DeltaTable) -> (DeltaTable, Arc<dyn LogStore>) {
    let own = table.log_store();
    let mut t = DeltaTable::new(Arc::new(BoundedReads {
        inner: own.clone(),
        unlisted_log: true,
    }));
    t.state = table.state;
    (t, own)
}

/// `table`'s state with the log store `own` (undoes [`for_compaction`]).
pub(crate) fn with_log_store(table: DeltaTable, own: Arc<dyn LogStore>) -> DeltaTable {
    let mut t = DeltaTable::new(own);
    t.state = table.state;
    t
}

#[async_trait::async_trait]
impl LogStore for BoundedReads {
    /// The inner store's name, unchanged: delta-rs hands the commit bytes straight to a
    /// store named `DefaultLogStore` and would otherwise write a temporary commit file that
    /// the default store's `write_commit_entry` does not accept.
    fn name(&self) -> String {
        self.inner.name()
    }

    async fn refresh(&self) -> DeltaResult<()> {
        self.inner.refresh().await
    }

    async fn read_commit_entry(&self, version: Version) -> DeltaResult<Option<Bytes>> {
        self.inner.read_commit_entry(version).await
    }

    async fn write_commit_entry(
        &self,
        version: Version,
        commit_or_bytes: CommitOrBytes,
        operation_id: Uuid,
    ) -> Result<(), TransactionError> {
        self.inner
            .write_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn abort_commit_entry(
        &self,
        version: Version,
        commit_or_bytes: CommitOrBytes,
        operation_id: Uuid,
    ) -> Result<(), TransactionError> {
        self.inner
            .abort_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn get_latest_version(&self, start_version: Version) -> DeltaResult<Version> {
        self.inner.get_latest_version(start_version).await
    }

    fn object_store(&self, operation_id: Option<Uuid>) -> Arc<dyn ObjectStore> {
        let store = self.inner.object_store(operation_id);
        if self.unlisted_log {
            Arc::new(UnlistedLog {
                inner: store,
                log: self.inner.log_path().clone(),
            })
        } else {
            store
        }
    }

    fn root_object_store(&self, operation_id: Option<Uuid>) -> Arc<dyn ObjectStore> {
        self.inner.root_object_store(operation_id)
    }

    fn engine(&self, operation_id: Option<Uuid>) -> Arc<dyn Engine> {
        let builder = DefaultEngineBuilder::new(self.root_object_store(operation_id))
            .with_buffer_size(LOG_FILES_AT_ONCE)
            .with_batch_size(LOG_ROWS_PER_BATCH);
        // As delta-rs does it: the multi-threaded runtime's own workers when there is one.
        match Handle::try_current() {
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => Arc::new(
                builder
                    .with_task_executor(Arc::new(TokioMultiThreadExecutor::new(h)))
                    .build(),
            ),
            _ => Arc::new(
                builder
                    .with_task_executor(Arc::new(TokioBackgroundExecutor::new()))
                    .build(),
            ),
        }
    }

    fn to_uri(&self, location: &Path) -> String {
        self.inner.to_uri(location)
    }

    fn root_url(&self) -> &Url {
        self.inner.root_url()
    }

    fn log_path(&self) -> &Path {
        self.inner.log_path()
    }

    fn transaction_url(&self, operation_id: Option<Uuid>) -> DeltaResult<Url> {
        self.inner.transaction_url(operation_id)
    }

    async fn is_delta_table_location(&self) -> DeltaResult<bool> {
        self.inner.is_delta_table_location().await
    }

    fn config(&self) -> &LogStoreConfig {
        self.inner.config()
    }

    /// The key the table's store is registered under in DataFusion. delta-rs puts the
    /// table's path into the URL's host as it is and panics when that is not a valid host
    /// (a `[` in a folder name); here every byte but `a-z0-9` is written as `-xx` (hex),
    /// which any host accepts and which keeps two different paths two different keys.
    fn object_store_url(&self) -> ObjectStoreUrl {
        let root = self.root_url();
        let encoded: String = root
            .as_str()
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'0'..=b'9' => char::from(b).to_string(),
                _ => format!("-{b:02x}"),
            })
            .collect();
        match ObjectStoreUrl::parse(format!("delta-rs://{encoded}")) {
            Ok(u) => u,
            Err(_) => self.inner.object_store_url(),
        }
    }
}

/// An object store that lists nothing for `list(Some(log))`; everything else, including
/// `list_with_offset` and listings of any other prefix, is passed through.
#[derive(Debug)]
struct UnlistedLog {
    inner: Arc<dyn ObjectStore>,
    log: Path,
}

impl std::fmt::Display for UnlistedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnlistedLog({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for UnlistedLog {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        if prefix == Some(&self.log) {
            return futures::stream::empty().boxed();
        }
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

/// Registers the factories with delta-rs, once per process.
pub(crate) fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let cloud = Arc::new(CloudStores);
        let logs = Arc::new(Logs);
        for scheme in CLOUD_SCHEMES {
            if let Ok(u) = Url::parse(&format!("{scheme}://")) {
                object_store_factories().insert(u.clone(), cloud.clone());
                logstore_factories().insert(u, logs.clone());
            }
        }
        if let Ok(u) = Url::parse("file://") {
            object_store_factories().insert(u.clone(), Arc::new(LocalStores));
            logstore_factories().insert(u, logs);
        }
    });
}
