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

use async_trait::async_trait;
use bytes::Bytes;
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

async fn sync_path(path: PathBuf) -> object_store::Result<()> {
    let shown = path.display().to_string();
    let r = tokio::task::spawn_blocking(move || super::local::make_durable(&path)).await;
    let generic = |e: Box<dyn std::error::Error + Send + Sync>| object_store::Error::Generic {
        store: "DurableLocalStore",
        source: e,
    };
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
