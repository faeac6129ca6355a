//! Object stores: building them from URLs, and the operations `Location` needs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use url::Url;

use super::options::Cloud;
use super::{FileMeta, FileVersion, StorageOptions, WriteOutcome};
use crate::error::{Error, Result};

/// Scheme, bucket, settings, and the tokio runtime: a client's pooled connections belong to
/// the runtime they were made on and die with it ("runtime dropped the dispatch task"), so
/// a process with several runtimes (tests) must not share a client between them.
type StoreKey = (String, String, StorageOptions, String);

fn cache() -> &'static Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>> {
    static CACHE: OnceLock<Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn cloud_of(url: &Url) -> Option<Cloud> {
    match url.scheme() {
        "s3" | "s3a" => Some(Cloud::S3),
        "az" | "azure" | "abfs" | "abfss" | "adl" => Some(Cloud::Azure),
        "gs" => Some(Cloud::Gcs),
        _ => None,
    }
}

/// The store for an `s3://`, `az://`/`abfss://` or `gs://` URL (one client per bucket and
/// settings, shared), and the path of the URL inside it. Credentials not in `options`
/// come from the environment and the cloud's default chain.
pub fn object_store_for(
    url: &Url,
    options: &StorageOptions,
) -> std::result::Result<(Arc<dyn ObjectStore>, ObjPath), object_store::Error> {
    let (_, path) = object_store::ObjectStoreScheme::parse(url)?;
    let cloud = cloud_of(url).ok_or_else(|| object_store::Error::NotImplemented {
        operation: format!("storage scheme {}", url.scheme()),
        implementer: "weir".into(),
    })?;
    let key = (
        url.scheme().to_string(),
        url.host_str().unwrap_or_default().to_string() + url.username(),
        options.clone(),
        tokio::runtime::Handle::try_current()
            .map(|h| h.id().to_string())
            .unwrap_or_default(),
    );
    if let Some(s) = cache().lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok((s, path));
    }
    let root = {
        let mut r = url.clone();
        r.set_path("");
        r.set_query(None);
        r.to_string()
    };
    let store: Arc<dyn ObjectStore> = match cloud {
        Cloud::S3 => {
            let mut b = AmazonS3Builder::from_env().with_url(root);
            for (k, v) in options.for_cloud(cloud) {
                b = b.with_config(k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>()?, v);
            }
            Arc::new(b.build()?)
        }
        Cloud::Azure => {
            let mut b = MicrosoftAzureBuilder::from_env().with_url(root);
            for (k, v) in options.for_cloud(cloud) {
                b = b.with_config(k.to_ascii_lowercase().parse::<AzureConfigKey>()?, v);
            }
            Arc::new(super::offset_listing::OffsetListing {
                inner: Arc::new(b.build()?),
            })
        }
        Cloud::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env().with_url(root);
            for (k, v) in options.for_cloud(cloud) {
                b = b.with_config(k.to_ascii_lowercase().parse::<GoogleConfigKey>()?, v);
            }
            Arc::new(b.build()?)
        }
    };
    if let Ok(mut c) = cache().lock() {
        c.insert(key, store.clone());
    }
    Ok((store, path))
}

fn err(action: &'static str, what: &str, source: object_store::Error) -> Error {
    Error::Store {
        action,
        location: what.to_string(),
        source: Box::new(source),
    }
}

pub(super) async fn put_new(
    store: &dyn ObjectStore,
    path: &ObjPath,
    bytes: Bytes,
    what: &str,
) -> Result<WriteOutcome> {
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    match store.put_opts(path, PutPayload::from(bytes), opts).await {
        Ok(_) => Ok(WriteOutcome::Written),
        Err(object_store::Error::AlreadyExists { .. }) => Ok(WriteOutcome::AlreadyExists),
        // Some servers answer a lost If-None-Match race with 412.
        Err(object_store::Error::Precondition { .. }) => Ok(WriteOutcome::AlreadyExists),
        Err(e) => Err(err("writing (if absent)", what, e)),
    }
}

pub(super) async fn put(
    store: &dyn ObjectStore,
    path: &ObjPath,
    bytes: Bytes,
    what: &str,
) -> Result<()> {
    store
        .put(path, PutPayload::from(bytes))
        .await
        .map(|_| ())
        .map_err(|e| err("writing", what, e))
}

pub(super) async fn put_if(
    store: &dyn ObjectStore,
    path: &ObjPath,
    bytes: Bytes,
    expected: Option<&FileVersion>,
    what: &str,
) -> Result<Option<FileVersion>> {
    let mode = match expected {
        None => PutMode::Create,
        Some(v) => PutMode::Update(UpdateVersion {
            e_tag: v.e_tag.clone(),
            version: v.version.clone(),
        }),
    };
    let opts = PutOptions {
        mode,
        ..Default::default()
    };
    match store.put_opts(path, PutPayload::from(bytes), opts).await {
        Ok(r) => Ok(Some(FileVersion {
            e_tag: r.e_tag,
            version: r.version,
        })),
        Err(object_store::Error::AlreadyExists { .. })
        | Err(object_store::Error::Precondition { .. }) => Ok(None),
        Err(e) => Err(err("writing (conditionally)", what, e)),
    }
}

pub(super) async fn get(
    store: &dyn ObjectStore,
    path: &ObjPath,
    what: &str,
) -> Result<Option<(Bytes, FileVersion)>> {
    match store.get(path).await {
        Ok(r) => {
            let version = FileVersion {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            let bytes = r.bytes().await.map_err(|e| err("reading", what, e))?;
            Ok(Some((bytes, version)))
        }
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(err("reading", what, e)),
    }
}

pub(super) async fn head(
    store: &dyn ObjectStore,
    path: &ObjPath,
    name: &str,
    what: &str,
) -> Result<Option<FileMeta>> {
    match store.head(path).await {
        Ok(m) => Ok(Some(FileMeta {
            name: name.to_string(),
            size: m.size,
            modified_ms: m.last_modified.timestamp_millis(),
            e_tag: m.e_tag,
        })),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(err("reading metadata of", what, e)),
    }
}

/// Whether anything is stored under `prefix`: one listing request, which fails when the
/// bucket or container is missing, the credentials are refused or the server is down.
pub(super) async fn probe(store: &dyn ObjectStore, prefix: &ObjPath, what: &str) -> Result<bool> {
    use futures::StreamExt;
    match store.list(Some(prefix)).next().await {
        None => Ok(false),
        Some(Ok(_)) => Ok(true),
        Some(Err(e)) => Err(err("listing", what, e)),
    }
}

pub(super) async fn list(
    store: &dyn ObjectStore,
    prefix: &ObjPath,
    what: &str,
) -> Result<Vec<FileMeta>> {
    let listing = store
        .list_with_delimiter(Some(prefix))
        .await
        .map_err(|e| err("listing", what, e))?;
    Ok(listing
        .objects
        .into_iter()
        .filter_map(|m| {
            // object_store percent-encodes some characters of a path part: give the name
            // as it was written.
            let name = super::percent_decode(m.location.filename()?);
            Some(FileMeta {
                name,
                size: m.size,
                modified_ms: m.last_modified.timestamp_millis(),
                e_tag: m.e_tag,
            })
        })
        .collect())
}

/// Copies `from` to `to` (replacing it) and deletes `from`: a server-side copy, the bytes do
/// not pass through this process.
pub(super) async fn rename(
    store: &dyn ObjectStore,
    from: &ObjPath,
    to: &ObjPath,
    what: &str,
) -> Result<()> {
    store
        .copy(from, to)
        .await
        .map_err(|e| err("copying into place", what, e))?;
    delete(store, from, what).await
}

pub(super) async fn delete(store: &dyn ObjectStore, path: &ObjPath, what: &str) -> Result<()> {
    match store.delete(path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(err("deleting", what, e)),
    }
}
