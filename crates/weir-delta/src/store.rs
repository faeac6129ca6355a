//! Where delta-rs reads and writes: the same object stores as the rest of weir.
//!
//! delta-rs 1.1 knows only `file://` and `memory://` unless its per-cloud crates are linked
//! (which bring the AWS SDK). Instead, weir registers factories for `s3://`, `az://`
//! (`abfss://`, ...) and `gs://` that build stores with `weir_core::storage` (the same
//! builder, settings and credential chain as checkpoints and Parquet folders), and commits
//! through delta-rs's default log store, which writes `_delta_log/N.json` with a
//! conditional put (`PutMode::Create`). For `file://` it registers a store that fsyncs every
//! file and folder it writes, so a local table's commit is durable before `commits/N`.

use std::collections::BTreeMap;
use std::sync::{Arc, Once};

use deltalake::logstore::{
    LogStore, LogStoreFactory, ObjectStoreFactory, ObjectStoreRef, StorageConfig, default_logstore,
    logstore_factories, object_store_factories,
};
use deltalake::{DeltaResult, DeltaTableError, Path};
use url::Url;
use weir_core::storage::{DurableLocalStore, StorageOptions, object_store_for};

/// Schemes whose tables weir opens through object stores.
pub const CLOUD_SCHEMES: &[&str] = &["s3", "s3a", "az", "azure", "abfs", "abfss", "adl", "gs"];

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
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

/// Registers the factories with delta-rs, once per process.
pub fn register() {
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
            object_store_factories().insert(u, Arc::new(LocalStores));
        }
    });
}
