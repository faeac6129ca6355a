//! The writes of a [`Location`]: write-once (also in two steps, [`StagedWrite`]),
//! replacing, and conditional on a version (object stores' leases).

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use object_store::ObjectStore;

use super::{Backend, FileVersion, Location, WriteOutcome, blocking, join_path, local, remote};
use crate::error::Result;

/// A write made ready by [`Location::prepare_new`], not yet under its name; it knows
/// where it goes, so [`StagedWrite::finish`] needs nothing else.
#[derive(Debug)]
pub struct StagedWrite(Ready);

#[derive(Debug)]
enum Ready {
    /// The fsynced temp file and the path it is linked to.
    Local { tmp: TempFile, path: PathBuf },
    Remote {
        store: Arc<dyn ObjectStore>,
        path: object_store::path::Path,
        shown: String,
        bytes: Bytes,
    },
}

/// A temp file removed when dropped, unless [`TempFile::keep`] took it.
#[derive(Debug)]
struct TempFile(PathBuf);

impl TempFile {
    fn keep(mut self) -> PathBuf {
        std::mem::take(&mut self.0)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        // Unfinished: the temp name is ours alone; a leftover is a hidden file readers skip.
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

impl StagedWrite {
    /// Puts the prepared write under its name, unless a file of that name exists; durable
    /// when it returns, like [`Location::put_new`].
    pub async fn finish(self) -> Result<WriteOutcome> {
        match self.0 {
            Ready::Local { tmp, path } => {
                let tmp = tmp.keep();
                blocking(move || local::finish_new(&tmp, &path)).await
            }
            Ready::Remote {
                store,
                path,
                shown,
                bytes,
            } => remote::put_new(store.as_ref(), &path, bytes, &shown).await,
        }
    }
}

impl Location {
    /// Writes `name` atomically and durably unless it exists (see the module docs).
    pub async fn put_new(&self, name: &str, bytes: Bytes) -> Result<WriteOutcome> {
        match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                blocking(move || local::write_new(&path, &bytes)).await
            }
            Backend::Remote { store, prefix } => {
                remote::put_new(
                    store.as_ref(),
                    &join_path(prefix, name),
                    bytes,
                    &self.describe(name),
                )
                .await
            }
        }
    }

    /// [`Location::put_new`] in two steps, so that the slow half can run beside other work:
    /// this one makes the content durable where nothing reads it (locally: the temp file,
    /// fsynced; object stores: nothing yet), [`StagedWrite::finish`] puts it under `name`.
    /// A prepared write that is dropped unfinished removes its temp file.
    pub async fn prepare_new(&self, name: &str, bytes: Bytes) -> Result<StagedWrite> {
        Ok(StagedWrite(match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                let target = path.clone();
                let tmp = blocking(move || local::prepare_new(&target, &bytes)).await?;
                Ready::Local {
                    tmp: TempFile(tmp),
                    path,
                }
            }
            Backend::Remote { store, prefix } => Ready::Remote {
                store: store.clone(),
                path: join_path(prefix, name),
                shown: self.describe(name),
                bytes,
            },
        }))
    }

    /// Moves the file `from` to `to`, both names in this folder (either may be in a
    /// sub-folder: `_staging/x`), replacing a file named `to`; durable when it returns.
    /// Locally a rename; on an object store a server-side copy and a delete, so a reader
    /// sees `to` whole or not at all (and may see both names for a moment).
    pub async fn rename(&self, from: &str, to: &str) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let (from, to) = (p.join(from), p.join(to));
                blocking(move || local::rename_durable(&from, &to)).await
            }
            Backend::Remote { store, prefix } => {
                remote::rename(
                    store.as_ref(),
                    &join_path(prefix, from),
                    &join_path(prefix, to),
                    &self.describe(to),
                )
                .await
            }
        }
    }

    /// Writes `name` atomically and durably, replacing a file of that name.
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<()> {
        match &self.backend {
            Backend::Local(p) => {
                let path = p.join(name);
                blocking(move || local::write_replace(&path, &bytes)).await
            }
            Backend::Remote { store, prefix } => {
                remote::put(
                    store.as_ref(),
                    &join_path(prefix, name),
                    bytes,
                    &self.describe(name),
                )
                .await
            }
        }
    }

    /// Reads `name` with its version, for [`Self::put_if`]. Object stores only (local
    /// folders hold checkpoints with a file lock instead).
    pub async fn get_versioned(&self, name: &str) -> Result<Option<(Bytes, FileVersion)>> {
        match &self.backend {
            Backend::Local(_) => Ok(self.get(name).await?.map(|b| {
                (
                    b,
                    FileVersion {
                        e_tag: None,
                        version: None,
                    },
                )
            })),
            Backend::Remote { store, prefix } => {
                remote::get(
                    store.as_ref(),
                    &join_path(prefix, name),
                    &self.describe(name),
                )
                .await
            }
        }
    }

    /// Writes `name` only if it still has version `expected` (`None`: only if absent).
    /// `Ok(None)` when the condition failed; otherwise the new version.
    pub async fn put_if(
        &self,
        name: &str,
        bytes: Bytes,
        expected: Option<&FileVersion>,
    ) -> Result<Option<FileVersion>> {
        match &self.backend {
            Backend::Local(_) => {
                match expected {
                    None => Ok((self.put_new(name, bytes).await? == WriteOutcome::Written)
                        .then_some(FileVersion {
                            e_tag: None,
                            version: None,
                        })),
                    Some(_) => {
                        self.put(name, bytes).await?;
                        Ok(Some(FileVersion {
                            e_tag: None,
                            version: None,
                        }))
                    }
                }
            }
            Backend::Remote { store, prefix } => {
                remote::put_if(
                    store.as_ref(),
                    &join_path(prefix, name),
                    bytes,
                    expected,
                    &self.describe(name),
                )
                .await
            }
        }
    }
}
