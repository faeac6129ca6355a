//! A local `ObjectStore` whose writes are durable when they return.
//!
//! `object_store`'s `LocalFileSystem` never fsyncs, and neither does delta-rs on a local
//! disk: after a power cut the checkpoint could say batch N is committed while the Delta
//! table lacks it. This wrapper fsyncs every file it writes (put, multipart completion,
//! copy, rename) and the folders whose entries changed, before the call returns, so a sink
//! writing through it is durable before `commits/N` is written.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use super::followed::After;
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct DurableLocalStore {
    inner: Arc<LocalFileSystem>,
}

impl Default for DurableLocalStore {
    fn default() -> Self {
        DurableLocalStore::new()
    }
}

impl DurableLocalStore {
    /// A store rooted at `/`, like `LocalFileSystem::new()`.
    pub fn new() -> Self {
        DurableLocalStore {
            inner: Arc::new(LocalFileSystem::new()),
        }
    }

    fn fs_path(&self, location: &Path) -> object_store::Result<PathBuf> {
        self.inner.path_to_filesystem(location)
    }

    /// Journals (for power-cut tests) that `location` is about to be written.
    fn note_new(&self, location: &Path) {
        if let Ok(p) = self.fs_path(location) {
            super::journal::note('N', &p);
        }
    }

    async fn sync(&self, location: &Path) -> object_store::Result<()> {
        let path = self.fs_path(location)?;
        sync_path(path).await
    }
}

fn generic(e: Box<dyn std::error::Error + Send + Sync>) -> object_store::Error {
    object_store::Error::Generic {
        store: "DurableLocalStore",
        source: e,
    }
}

/// The files under `root` (object path `root_path`) whose paths sort after `offset`, with
/// their metadata; folders are walked whatever their name, as `LocalFileSystem` does.
///
/// The top folder's names come from [`followed`](super::followed) when it can follow the
/// folder, so a listing of a Delta log from its newest commit costs the entries after it, not
/// every commit the log holds.
fn list_after(
    root: &std::path::Path,
    root_path: &Path,
    offset: &Path,
) -> object_store::Result<Vec<ObjectMeta>> {
    let mut out = Vec::new();
    let mut folders = Vec::new();
    let top = if root_path.as_ref().is_empty() {
        None
    } else {
        let prefix = format!("{root_path}/");
        let offset = offset.as_ref();
        let after = match offset.strip_prefix(prefix.as_str()) {
            Some(rest) => Some(After::Name(rest)),
            // Every path under the folder sorts after the offset.
            None if offset < prefix.as_str() => Some(After::All),
            None => None,
        };
        after.and_then(|a| super::followed::names_after(root, a))
    };
    match top {
        Some(names) => {
            for name in names {
                let path = root.join(&name);
                let kind = match std::fs::symlink_metadata(&path) {
                    Ok(m) => m.file_type(),
                    // Gone since the folder was followed: nothing to list.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(generic(format!("reading {}: {e}", path.display()).into()));
                    }
                };
                visit(
                    &path,
                    &name,
                    kind,
                    root_path,
                    offset,
                    &mut out,
                    &mut folders,
                )?;
            }
        }
        None => folders.push((root.to_path_buf(), root_path.clone())),
    }
    while let Some((dir, dir_path)) = folders.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(generic(format!("listing {}: {e}", dir.display()).into())),
        };
        for entry in entries {
            let entry =
                entry.map_err(|e| generic(format!("listing {}: {e}", dir.display()).into()))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(generic(
                    format!(
                        "listing {}: a name that is not UTF-8: {name:?}",
                        dir.display()
                    )
                    .into(),
                ));
            };
            let kind = entry
                .file_type()
                .map_err(|e| generic(format!("reading {}: {e}", entry.path().display()).into()))?;
            visit(
                &entry.path(),
                name,
                kind,
                &dir_path,
                offset,
                &mut out,
                &mut folders,
            )?;
        }
    }
    Ok(out)
}

/// One entry `name` (at `path`, of type `kind` as the folder gave it) of the folder at object
/// path `dir_path`: a file after `offset` goes to `out` with its metadata, a folder to
/// `folders` to be walked.
fn visit(
    path: &std::path::Path,
    name: &str,
    mut kind: std::fs::FileType,
    dir_path: &Path,
    offset: &Path,
    out: &mut Vec<ObjectMeta>,
    folders: &mut Vec<(PathBuf, Path)>,
) -> object_store::Result<()> {
    // As `LocalFileSystem` names it: the raw name, not percent-encoded. A `Path` orders as
    // its string, so files up to the offset are skipped before any work.
    let raw = if dir_path.as_ref().is_empty() {
        name.to_string()
    } else {
        format!("{dir_path}/{name}")
    };
    if kind.is_symlink() {
        match std::fs::metadata(path) {
            Ok(m) => kind = m.file_type(),
            // A dangling link lists as nothing, as in `LocalFileSystem`.
            Err(_) => return Ok(()),
        }
    }
    let skip_file = !kind.is_dir()
        && (!kind.is_file() || raw.as_str() <= offset.as_ref() || is_upload_part(name));
    if skip_file {
        return Ok(());
    }
    let shown = || path.display().to_string();
    let location =
        Path::parse(&raw).map_err(|e| generic(format!("listing {}: {e}", shown()).into()))?;
    if kind.is_dir() {
        folders.push((path.to_path_buf(), location));
        return Ok(());
    }
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(generic(format!("reading {}: {e}", shown()).into())),
    };
    out.push(object_meta(location, &meta));
    Ok(())
}

/// `name#N`: a multipart upload's part in progress, which `LocalFileSystem` does not list.
fn is_upload_part(name: &str) -> bool {
    matches!(name.split_once('#'), Some((_, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The metadata `LocalFileSystem` reports for a file (the same e-tag scheme).
fn object_meta(location: Path, meta: &std::fs::Metadata) -> ObjectMeta {
    use std::os::unix::fs::MetadataExt;
    let modified = meta.modified().unwrap_or(std::time::SystemTime::UNIX_EPOCH);
    let micros = modified
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    ObjectMeta {
        location,
        last_modified: modified.into(),
        size: meta.len(),
        e_tag: Some(format!("{:x}-{micros:x}-{:x}", meta.ino(), meta.len())),
        version: None,
    }
}

async fn sync_path(path: PathBuf) -> object_store::Result<()> {
    let shown = path.display().to_string();
    let r = tokio::task::spawn_blocking(move || super::local::make_durable(&path)).await;
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(generic(Box::new(e))),
        Err(e) => Err(generic(format!("syncing {shown}: {e}").into())),
    }
}

impl fmt::Display for DurableLocalStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DurableLocalStore({})", self.inner)
    }
}

#[derive(Debug)]
struct DurableUpload {
    inner: Box<dyn MultipartUpload>,
    path: PathBuf,
}

#[async_trait]
impl MultipartUpload for DurableUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.inner.put_part(data)
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let r = self.inner.complete().await?;
        sync_path(self.path.clone()).await?;
        Ok(r)
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.inner.abort().await
    }
}

#[async_trait]
impl ObjectStore for DurableLocalStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.note_new(location);
        let r = self.inner.put_opts(location, payload, opts).await?;
        self.sync(location).await?;
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.note_new(location);
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(DurableUpload {
            inner,
            path: self.fs_path(location)?,
        }))
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
        self.inner.list(prefix)
    }

    /// Lists the entries after `offset` with one `stat` per entry listed, not per entry in
    /// the folder: `LocalFileSystem` walks with symlink following, which stats every entry,
    /// and delta-rs lists `_delta_log` from the table's version on every batch, so a folder
    /// holding one commit file per batch made each batch slower than the last.
    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let (root, root_path) = match prefix {
            Some(p) => match self.fs_path(p) {
                Ok(fs) => (fs, p.clone()),
                Err(e) => return futures::stream::once(async move { Err(e) }).boxed(),
            },
            None => (PathBuf::from("/"), Path::default()),
        };
        let offset = offset.clone();
        let shown = offset.to_string();
        futures::stream::once(async move {
            tokio::task::spawn_blocking(move || list_after(&root, &root_path, &offset))
                .await
                .map_err(|e| generic(format!("listing after {shown}: {e}").into()))
        })
        .map(|r| match r {
            Ok(Ok(entries)) => futures::stream::iter(entries.into_iter().map(Ok)).boxed(),
            Ok(Err(e)) | Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
        })
        .flatten()
        .boxed()
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
        self.note_new(to);
        self.inner.copy_opts(from, to, options).await?;
        self.sync(to).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.note_new(to);
        self.inner.rename_opts(from, to, options).await?;
        self.sync(to).await
    }
}

#[cfg(test)]
mod tests {
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    use object_store::local::LocalFileSystem;
    use object_store::path::Path;

    use super::DurableLocalStore;

    pub(super) async fn listed(
        store: &dyn ObjectStore,
        prefix: &Path,
        offset: &Path,
    ) -> Vec<(String, u64, Option<String>)> {
        let mut v: Vec<_> = store
            .list_with_offset(Some(prefix), offset)
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .into_iter()
            .map(|m| (m.location.to_string(), m.size, m.e_tag))
            .collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn listing_after_an_offset_matches_the_local_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("log/_commits")).unwrap();
        std::fs::create_dir_all(root.join("log/a dir [1]")).unwrap();
        for (name, body) in [
            ("log/00000000000000000000.json", "a"),
            ("log/00000000000000000001.json", "bb"),
            ("log/00000000000000000002.json", "ccc"),
            ("log/00000000000000000002.json#1", "part"),
            ("log/00000000000000000003.checkpoint.parquet", "dddd"),
            ("log/_last_checkpoint", "{}"),
            ("log/_commits/00000000000000000004.uuid.json", "e"),
            ("log/a dir [1]/ünï cødé %.json", "f"),
            ("log/x#y", "g"),
        ] {
            std::fs::write(root.join(name), body).unwrap();
        }
        std::os::unix::fs::symlink(
            root.join("log/00000000000000000001.json"),
            root.join("log/link"),
        )
        .unwrap();
        std::os::unix::fs::symlink(root.join("nowhere"), root.join("log/dangling")).unwrap();
        let prefix = Path::from_absolute_path(root.join("log")).unwrap();
        let ours = DurableLocalStore::new();
        let theirs = LocalFileSystem::new();
        for last in [
            "",
            "00000000000000000000.json",
            "00000000000000000001.json",
            "_commits",
            "zzz",
        ] {
            let offset = prefix.clone().join(last);
            let want = listed(&theirs, &prefix, &offset).await;
            let got = listed(&ours, &prefix, &offset).await;
            assert_eq!(got, want, "after {offset}");
        }
        let all = listed(&ours, &prefix, &prefix.clone().join("")).await;
        assert!(all.iter().any(|(l, _, _)| l.ends_with("link")), "{all:?}");
        assert!(!all.iter().any(|(l, _, _)| l.ends_with("#1")), "{all:?}");
        let missing = Path::from_absolute_path(root.join("no such folder")).unwrap();
        assert!(
            listed(&ours, &missing, &missing.clone().join("a"))
                .await
                .is_empty()
        );
    }
}

#[cfg(all(test, target_os = "linux"))]
mod followed_tests {
    use object_store::local::LocalFileSystem;
    use object_store::path::Path;

    use super::DurableLocalStore;
    use super::tests::listed;

    fn commit(v: u64) -> String {
        format!("{v:020}.json")
    }

    /// A followed folder lists as `LocalFileSystem` reads it through creations, deletions,
    /// renames in and out, links, a sub-folder, a replaced folder and trims of kept names.
    #[tokio::test]
    async fn a_followed_folder_lists_as_a_fresh_read_through_every_change() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("t [1]/_delta_log");
        std::fs::create_dir_all(&log).unwrap();
        let prefix = Path::from_absolute_path(&log).unwrap();
        let ours = DurableLocalStore::new();
        let theirs = LocalFileSystem::new();
        let check = |step: String| {
            let prefix = prefix.clone();
            let ours = &ours;
            let theirs = &theirs;
            async move {
                for last in [
                    String::new(),
                    commit(0),
                    commit(3),
                    commit(17),
                    commit(1_100),
                    "_commits".to_string(),
                    "_commits/a".to_string(),
                    "zzz".to_string(),
                ] {
                    let offset = prefix.clone().join(last.as_str());
                    let want = listed(theirs, &prefix, &offset).await;
                    let got = listed(ours, &prefix, &offset).await;
                    assert_eq!(got, want, "{step}: after {offset}");
                }
                // An offset outside the folder, below and above it.
                for offset in [Path::from("a"), Path::from("zzz/zzz")] {
                    let want = listed(theirs, &prefix, &offset).await;
                    let got = listed(ours, &prefix, &offset).await;
                    assert_eq!(got, want, "{step}: after {offset}");
                }
            }
        };
        check("empty".into()).await;
        for v in 0..20 {
            std::fs::write(log.join(commit(v)), format!("{v}")).unwrap();
        }
        check("20 commits".into()).await;
        std::fs::create_dir(log.join("_commits")).unwrap();
        std::fs::write(log.join("_commits/b.json"), "b").unwrap();
        std::fs::write(log.join("_last_checkpoint"), "{}").unwrap();
        std::fs::remove_file(log.join(commit(3))).unwrap();
        std::fs::rename(log.join(commit(4)), dir.path().join("away")).unwrap();
        std::fs::rename(dir.path().join("away"), log.join(commit(40))).unwrap();
        std::fs::write(log.join("00000000000000000020.json#1"), "part").unwrap();
        std::os::unix::fs::symlink(log.join(commit(5)), log.join("link")).unwrap();
        std::os::unix::fs::symlink(log.join("_commits"), log.join("dirlink")).unwrap();
        std::fs::write(log.join(commit(6)), "rewritten, longer").unwrap();
        check("changed".into()).await;
        // Over two trims, listings from a moving start; then from below what is kept.
        for v in 20..2_300u64 {
            std::fs::write(log.join(commit(v)), "x").unwrap();
            let offset = prefix.clone().join(commit(v - 5).as_str());
            let got = listed(&ours, &prefix, &offset).await;
            if v % 7 == 0 {
                let want = listed(&theirs, &prefix, &offset).await;
                assert_eq!(got, want, "at {v}");
            }
            if v % 100 == 0 {
                std::fs::remove_file(log.join(commit(v - 50))).unwrap();
            }
        }
        let (_, names) = super::super::followed::kept();
        assert!(names < 1_500, "{names} names kept after trims");
        check("after trims".into()).await;
        // Another folder at the same path.
        std::fs::rename(&log, dir.path().join("old log")).unwrap();
        std::fs::create_dir(&log).unwrap();
        std::fs::write(log.join(commit(7)), "new").unwrap();
        check("replaced".into()).await;
        std::fs::remove_dir_all(dir.path().join("t [1]")).unwrap();
        check("removed".into()).await;
        std::fs::create_dir_all(&log).unwrap();
        std::fs::write(log.join(commit(9)), "again").unwrap();
        check("made again".into()).await;
    }
}
