//! Where weir reads and writes: local folders and object stores, behind one type.
//!
//! Every path a user gives (checkpoint, input folder, Delta table, Parquet folder) becomes a
//! [`Location`]: a local folder, `s3://bucket/prefix`, `az://container/prefix` (also
//! `abfss://container@account.dfs.core.windows.net/prefix`) or `gs://bucket/prefix`. Any other
//! `scheme://` is refused by [`Location::parse`] before anything runs, so a URL is never
//! taken for a relative local folder named `s3:`.
//!
//! The operations promise the same on every backend:
//!
//! | operation | local folder | object store |
//! |---|---|---|
//! | [`Location::put_new`] | temp file, fsync, hard link (fails if the name exists), fsync the folder | `PutMode::Create` (`If-None-Match: *` on S3) |
//! | [`Location::put`] | temp file, fsync, rename, fsync the folder | a single PUT (atomic) |
//! | [`Location::list`] | the folder's files (not sub-folders), with size and mtime | a delimited listing, with size, last-modified and ETag |
//!
//! A name is visible whole or not at all, and a write is durable when the call returns: a
//! sink may write `commits/N` right after. Blocking file-system calls run on tokio's blocking
//! pool, never on the async worker threads.

mod durable_store;
#[cfg(target_os = "linux")]
mod followed;
#[cfg(not(target_os = "linux"))]
mod followed {
    //! Folders are only followed on Linux (inotify); elsewhere every listing reads.
    #[derive(Debug, Clone, Copy)]
    pub(super) enum After<'a> {
        All,
        Name(&'a str),
    }
    pub(super) fn names_after(_: &std::path::Path, _: After<'_>) -> Option<Vec<String>> {
        None
    }
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Cursor;
    pub(super) fn created_since(
        _: &std::path::Path,
        _: Option<Cursor>,
    ) -> Option<(Vec<String>, Cursor)> {
        None
    }
}
pub mod journal;
mod local;
mod names;
mod offset_listing;
mod options;
mod remote;
mod write;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use datafusion::prelude::SessionContext;
use object_store::ObjectStore;
use url::Url;

use crate::error::{Error, Result};

pub use durable_store::DurableLocalStore;
/// Where [`Location::list_new_names`] left off.
pub use followed::Cursor as ListingCursor;
pub(crate) use names::temp_target;
pub use names::{fnv1a, is_hidden, percent_decode, percent_encode};

pub use options::StorageOptions;
pub use remote::object_store_for;
pub use write::StagedWrite;

/// What `put_new` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The file is now durable under its name.
    Written,
    /// A file of that name was already there; nothing was changed.
    AlreadyExists,
}

/// A file in a [`Location`], as a listing or `head` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMeta {
    /// The name relative to the location (no folder part for `list`).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time in ms since the epoch.
    pub modified_ms: i64,
    /// The object's ETag (object stores only).
    pub e_tag: Option<String>,
}

/// An opaque version of a file, for conditional updates (leases).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileVersion {
    e_tag: Option<String>,
    version: Option<String>,
}

/// The URL schemes weir accepts, for messages.
pub const SUPPORTED: &str =
    "a local path, file://, s3:// (s3a://), az:// (azure://, abfs://, abfss://) or gs://";

#[derive(Clone)]
enum Backend {
    Local(PathBuf),
    Remote {
        store: Arc<dyn ObjectStore>,
        prefix: object_store::path::Path,
    },
}

/// A folder in a local file system or an object store. Cheap to clone.
#[derive(Clone)]
pub struct Location {
    /// The folder as a URL, ending in `/`.
    url: Url,
    backend: Backend,
    options: StorageOptions,
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Location({})", self.url)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.backend {
            Backend::Local(p) => write!(f, "{}", p.display()),
            Backend::Remote { .. } => write!(f, "{}", self.url.as_str().trim_end_matches('/')),
        }
    }
}

impl From<&Path> for Location {
    /// A local folder (a `Path` is never a URL).
    fn from(p: &Path) -> Self {
        Location::local(p)
    }
}

impl From<PathBuf> for Location {
    /// A local folder (a `PathBuf` is never a URL).
    fn from(p: PathBuf) -> Self {
        Location::local(p)
    }
}

impl From<&PathBuf> for Location {
    /// A local folder.
    fn from(p: &PathBuf) -> Self {
        Location::local(p)
    }
}

/// True when `text` starts with `scheme://`.
pub fn has_scheme(text: &str) -> bool {
    text.split_once("://").is_some_and(|(s, _)| {
        !s.is_empty()
            && s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

impl Location {
    /// Parses a path or URL. A relative local path is taken from `base` (the pipeline
    /// file's folder) or the current folder. An unsupported `scheme://` is an error naming
    /// `key` (the setting it came from), before anything is read or written.
    pub fn parse(
        key: &str,
        text: &str,
        base: Option<&Path>,
        options: &StorageOptions,
    ) -> Result<Location> {
        let text = text.trim();
        if text.is_empty() {
            return Err(Error::config(key, "an empty path"));
        }
        // `s3:/bucket` is a typo of `s3://bucket`, not a local folder named `s3:`.
        if let Some((scheme, rest)) = text.split_once(':')
            && !has_scheme(text)
            && rest.starts_with('/')
            && [
                "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "hdfs",
            ]
            .contains(&scheme.to_ascii_lowercase().as_str())
        {
            return Err(Error::config(
                key,
                format!("'{text}' has one slash after '{scheme}:': did you mean {scheme}://...?"),
            ));
        }
        if !has_scheme(text) {
            let p = Path::new(text);
            let abs = if p.is_absolute() {
                p.to_path_buf()
            } else {
                match base {
                    Some(b) => b.join(p),
                    None => std::env::current_dir()
                        .map_err(|e| Error::io("reading the current folder", ".", e))?
                        .join(p),
                }
            };
            return Ok(Location::local(abs));
        }
        let url = Url::parse(text)
            .map_err(|e| Error::config(key, format!("'{text}' is not a valid URL: {e}")))?;
        match url.scheme() {
            "file" => {
                let p = url.to_file_path().map_err(|()| {
                    Error::config(key, format!("'{text}' is not a local file URL"))
                })?;
                Ok(Location::local(p))
            }
            "s3" | "s3a" | "az" | "azure" | "abfs" | "abfss" | "adl" | "gs" => {
                let (store, prefix) = remote::object_store_for(&url, options)
                    .map_err(|e| Error::config(key, crate::error::error_chain(&e)))?;
                let mut url = url;
                if !url.path().ends_with('/') {
                    let p = format!("{}/", url.path());
                    url.set_path(&p);
                }
                Ok(Location {
                    url,
                    backend: Backend::Remote { store, prefix },
                    options: options.clone(),
                })
            }
            other => Err(Error::config(
                key,
                format!("unsupported storage scheme '{other}' in '{text}': use {SUPPORTED}"),
            )),
        }
    }

    /// A local folder (made absolute against the current folder if relative).
    pub fn local(path: impl Into<PathBuf>) -> Location {
        let path: PathBuf = path.into();
        let abs = if path.is_absolute() {
            path
        } else {
            std::env::current_dir()
                .map(|d| d.join(&path))
                .unwrap_or(path)
        };
        let abs = local::normalize(&abs);
        let url = Url::from_directory_path(&abs).unwrap_or_else(|()| file_root());
        Location {
            url,
            backend: Backend::Local(abs),
            options: StorageOptions::default(),
        }
    }

    /// A sub-folder.
    pub fn join(&self, rel: &str) -> Location {
        let rel = rel.trim_matches('/');
        let mut url = self.url.clone();
        {
            if let Ok(mut segs) = url.path_segments_mut() {
                segs.pop_if_empty();
                for s in rel.split('/').filter(|s| !s.is_empty()) {
                    segs.push(s);
                }
                segs.push("");
            }
        }
        let backend = match &self.backend {
            Backend::Local(p) => Backend::Local(p.join(rel)),
            Backend::Remote { store, prefix } => Backend::Remote {
                store: store.clone(),
                prefix: join_path(prefix, rel),
            },
        };
        Location {
            url,
            backend,
            options: self.options.clone(),
        }
    }

    /// The folder as a URL, ending in `/`.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The folder's URL without the final `/` (what delta-rs and messages want).
    pub fn url_string(&self) -> String {
        match &self.backend {
            Backend::Local(p) => format!("file://{}", p.display()),
            Backend::Remote { .. } => self.url.as_str().trim_end_matches('/').to_string(),
        }
    }

    /// The storage options this location was opened with (for delta-rs).
    pub fn options(&self) -> &StorageOptions {
        &self.options
    }

    /// The local folder, when this is one.
    pub fn local_path(&self) -> Option<&Path> {
        match &self.backend {
            Backend::Local(p) => Some(p),
            Backend::Remote { .. } => None,
        }
    }

    /// True for a local folder.
    pub fn is_local(&self) -> bool {
        self.local_path().is_some()
    }

    /// How to name file `name` of this folder in a message: its path or URL.
    pub fn describe(&self, name: &str) -> String {
        match &self.backend {
            Backend::Local(p) => p.join(name).display().to_string(),
            Backend::Remote { .. } => format!("{}{}", self.url, name),
        }
    }

    /// The URI of file `name` of this folder, percent-encoded (`%` too), as Spark records
    /// paths in its logs: `file:///in/a%20b.json`, `s3://bucket/in/a%20b.json`.
    pub fn file_url_encoded(&self, name: &str) -> String {
        // Encoded by hand: the url crate drops tabs and newlines from paths, and a name
        // must come back from `percent_decode` exactly as it was.
        let mut out = self.url.as_str().to_string();
        if !out.ends_with('/') {
            out.push('/');
        }
        out.push_str(&percent_encode(name));
        out
    }

    /// The URL DataFusion reads file `name` of this folder by (after [`Self::register`]).
    pub fn file_url(&self, name: &str) -> String {
        match &self.backend {
            Backend::Local(p) => p.join(name).to_string_lossy().into_owned(),
            Backend::Remote { .. } => {
                let mut u = self.url.clone();
                if let Ok(mut segs) = u.path_segments_mut() {
                    segs.pop_if_empty();
                    for s in name.split('/') {
                        segs.push(s);
                    }
                }
                u.to_string()
            }
        }
    }

    /// Makes the object store of this location known to `ctx`, so DataFusion can read
    /// [`Self::file_url`]s. Nothing to do for a local folder.
    pub fn register(&self, ctx: &SessionContext) {
        if let Backend::Remote { store, .. } = &self.backend {
            let mut root = self.url.clone();
            root.set_path("/");
            root.set_query(None);
            ctx.runtime_env()
                .register_object_store(&root, store.clone());
        }
    }

    /// Creates the folder (and fsyncs each new folder in its parent). Object stores have no
    /// folders: nothing to do.
    pub async fn create_dir(&self) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || local::create_dir_durable(&p)).await
            }
            Backend::Remote { .. } => Ok(()),
        }
    }

    /// Reads `name`; `None` when there is no such file.
    pub async fn get(&self, name: &str) -> Result<Option<Bytes>> {
        match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                blocking(move || local::read(&path)).await
            }
            Backend::Remote { store, prefix } => remote::get(
                store.as_ref(),
                &join_path(prefix, name),
                &self.describe(name),
            )
            .await
            .map(|o| o.map(|(b, _)| b)),
        }
    }

    /// Size, modification time and ETag of `name`; `None` when there is no such file.
    pub async fn head(&self, name: &str) -> Result<Option<FileMeta>> {
        match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                let name = name.to_string();
                blocking(move || local::head(&path, name)).await
            }
            Backend::Remote { store, prefix } => {
                remote::head(
                    store.as_ref(),
                    &join_path(prefix, name),
                    name,
                    &self.describe(name),
                )
                .await
            }
        }
    }

    /// The files directly in this folder (not in sub-folders), hidden ones included; an
    /// absent folder lists as empty. In no particular order.
    pub async fn list(&self) -> Result<Vec<FileMeta>> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || local::list(&p)).await
            }
            Backend::Remote { store, prefix } => {
                remote::list(store.as_ref(), prefix, &self.to_string()).await
            }
        }
    }

    /// Checks that the place can be reached, reading as little as possible: a local folder
    /// (or, if it does not exist yet, the folder it would be made in) must be a folder;
    /// an object-store prefix is listed once. Says what it found.
    pub async fn probe(&self) -> Result<String> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || {
                    // The folder, or the nearest one above it that exists.
                    let missing = local::topmost_missing(&p)?;
                    let at = match &missing {
                        Some(top) => top.parent().unwrap_or(top),
                        None => p.as_path(),
                    };
                    if !std::fs::metadata(at)
                        .map_err(|e| Error::io("looking at", at, e))?
                        .is_dir()
                    {
                        return Err(Error::io(
                            "looking at (a file, not a folder)",
                            at,
                            std::io::Error::from(std::io::ErrorKind::NotADirectory),
                        ));
                    }
                    if missing.is_some() {
                        return Ok(format!(
                            "does not exist yet; {} is where it would be made",
                            at.display()
                        ));
                    }
                    let files = std::fs::read_dir(at)
                        .map_err(|e| Error::io("listing", at, e))?
                        .next()
                        .is_some();
                    Ok(if files {
                        "a folder, not empty".to_string()
                    } else {
                        "an empty folder".to_string()
                    })
                })
                .await
            }
            Backend::Remote { store, prefix } => {
                let any = remote::probe(store.as_ref(), prefix, &self.to_string()).await?;
                Ok(if any {
                    "reachable, not empty".to_string()
                } else {
                    "reachable, empty".to_string()
                })
            }
        }
    }

    /// The names of the files directly in this folder, without sizes or times (cheaper
    /// locally: no `stat` per file).
    pub async fn list_names(&self) -> Result<Vec<String>> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || local::list_names(&p)).await
            }
            Backend::Remote { .. } => Ok(self.list().await?.into_iter().map(|m| m.name).collect()),
        }
    }

    /// The names [`Self::list_names`] gives, or, for a local folder followed with inotify
    /// after the first such listing, only the names created or moved in since `cursor`
    /// (which this updates). Callers must treat a name as possibly seen before: after any
    /// event the follower cannot account for, every name is given again.
    pub async fn list_new_names(&self, cursor: &mut Option<ListingCursor>) -> Result<Vec<String>> {
        if let Backend::Local(p) = &self.backend {
            let p = p.clone();
            let from = *cursor;
            if let Some((names, next)) =
                blocking(move || Ok(followed::created_since(&p, from))).await?
            {
                *cursor = Some(next);
                return Ok(names);
            }
        }
        *cursor = None;
        self.list_names().await
    }

    /// Deletes `name`; a missing file is not an error.
    pub async fn delete(&self, name: &str) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                blocking(move || local::remove(&path)).await
            }
            Backend::Remote { store, prefix } => {
                remote::delete(
                    store.as_ref(),
                    &join_path(prefix, name),
                    &self.describe(name),
                )
                .await
            }
        }
    }

    /// A local folder: the topmost folder of its path that does not exist yet (what
    /// [`Location::create_dir`] would make); `None` when it exists or is not local.
    pub async fn topmost_missing(&self) -> Result<Option<Location>> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                Ok(blocking(move || local::topmost_missing(&p))
                    .await?
                    .map(Location::local))
            }
            Backend::Remote { .. } => Ok(None),
        }
    }

    /// A local folder: removes it and everything in it. Only for folders this process made
    /// (see [`Location::topmost_missing`]); on object stores it does nothing.
    pub async fn remove_made_folder(&self) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || local::remove_tree(&p)).await
            }
            Backend::Remote { .. } => Ok(()),
        }
    }

    /// A local folder: removes the empty folders under it (it stays).
    pub async fn remove_empty_folders(&self) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || local::remove_empty_folders_under(&p)).await
            }
            Backend::Remote { .. } => Ok(()),
        }
    }

    /// Deletes several files, then (locally) fsyncs the folder once.
    pub async fn delete_many(&self, names: Vec<String>) -> Result<()> {
        if names.is_empty() {
            return Ok(());
        }
        match &self.backend {
            Backend::Local(p) => {
                let p = p.clone();
                blocking(move || {
                    for n in &names {
                        local::remove_no_sync(&p.join(n))?;
                    }
                    local::sync_dir(&p)
                })
                .await
            }
            Backend::Remote { .. } => {
                for n in &names {
                    self.delete(n).await?;
                }
                Ok(())
            }
        }
    }
}

/// `file:///`, for the one case `Url::from_directory_path` refuses (a path that is not
/// absolute, which `local` never passes).
#[allow(clippy::expect_used)]
fn file_root() -> Url {
    Url::parse("file:///").expect("file:/// is a valid URL")
}

fn join_path(prefix: &object_store::path::Path, rel: &str) -> object_store::path::Path {
    let mut p = prefix.clone();
    for part in rel.split('/').filter(|s| !s.is_empty()) {
        p = p.clone().join(part);
    }
    p
}

/// Runs blocking file-system work on tokio's blocking pool.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(Error::Internal {
            what: format!("a blocking file-system task ended abnormally: {e}"),
        }),
    }
}

#[cfg(test)]
mod tests;
