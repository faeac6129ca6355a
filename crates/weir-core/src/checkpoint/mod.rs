//! The checkpoint folder: query metadata, offset log, commit log, source logs.
//!
//! ```text
//! <checkpoint>/metadata        {"id":"<uuid>"}                    written once
//! <checkpoint>/offsets/N       v1, batch metadata, one offset line per source
//! <checkpoint>/commits/N       v1, {"nextBatchWatermarkMs":0}
//! <checkpoint>/sources/<i>/N   a source's own log (the file source's file lists)
//! <checkpoint>/.lock           (local) held with an OS file lock while a query runs
//! <checkpoint>/_lease          (object stores) the running query's lease, renewed
//! ```
//!
//! The shapes are Spark's (see `shared/reference/spark-4.3.0`), so the tools people use to
//! look at Spark checkpoints read these too. The checkpoint may be a local folder or an
//! object-store prefix ([`crate::storage::Location`]); every log file is written once
//! (hard link locally, `PutMode::Create` on object stores): finding it already there means
//! another query wrote it. Only this module builds paths inside the checkpoint.

mod lock;
pub mod recovery;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::logfile::{self as log, retention};
use crate::source::SourceOffset;
use crate::storage::{Location, StagedWrite, WriteOutcome, is_hidden};
pub use lock::{CheckpointGuard, LeaseSettings};
pub use recovery::{Recovery, RecoveryError, decide};

const LOG_VERSION: u32 = 1;

/// `<checkpoint>/metadata`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueryMetadata {
    /// The query id: stable across restarts of this checkpoint, new for a new one.
    pub id: uuid::Uuid,
    /// The query's name when the checkpoint was created (weir's addition; Spark writes
    /// only the id). Part of the sinks' default app id, so a rename does not change it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The batch metadata line of `offsets/N`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OffsetSeqMetadata {
    /// The event-time watermark in force for the batch (0 without one).
    #[serde(default)]
    pub batch_watermark_ms: i64,
    /// When the batch was first planned; a replay reuses it.
    #[serde(default)]
    pub batch_timestamp_ms: i64,
    /// Settings pinned for the batch: a replay runs with these, not the current ones.
    #[serde(default)]
    pub conf: BTreeMap<String, String>,
}

/// The content of `offsets/N`: what batch N reads.
#[derive(Debug, Clone, PartialEq)]
pub struct OffsetSeq {
    pub metadata: OffsetSeqMetadata,
    /// One end offset per source, in the order the query lists its sources; `None` (written
    /// as `-`) for a source that has produced nothing yet.
    pub offsets: Vec<Option<SourceOffset>>,
}

impl OffsetSeq {
    /// The file's bytes: `v1`, the metadata line, one line per source, no final newline.
    pub fn to_bytes(&self) -> Result<Bytes> {
        let mut lines = vec![to_json(&self.metadata)?];
        for o in &self.offsets {
            lines.push(match o {
                Some(o) => o.to_string(),
                None => "-".into(),
            });
        }
        Ok(log::render(lines))
    }

    /// Parses the bytes of `offsets/N`; `path` names the file in every error.
    pub fn parse(bytes: &[u8], path: &str) -> Result<Self> {
        let lines = log::parse_versioned(bytes, path, LOG_VERSION, "offset log")?;
        let Some((meta, rest)) = lines.split_first() else {
            return Err(Error::CorruptLog {
                path: path.to_string(),
                reason: "The batch metadata line is missing".into(),
            });
        };
        let metadata = log::parse_line(path, 2, meta)?;
        let offsets = rest
            .iter()
            .enumerate()
            .map(|(i, l)| match l.trim() {
                "-" => Ok(None),
                l => log::parse_line::<serde_json::Value>(path, i + 3, l)
                    .map(|v| Some(SourceOffset::new(v))),
            })
            .collect::<Result<Vec<_>>>()?;
        if offsets.is_empty() {
            return Err(Error::CorruptLog {
                path: path.to_string(),
                reason: "No source offset line follows the batch metadata".into(),
            });
        }
        Ok(OffsetSeq { metadata, offsets })
    }

    /// The end offset of source `index`; an error naming the file when it is `-` or absent.
    pub fn source(&self, index: usize, path: &str) -> Result<SourceOffset> {
        self.offsets
            .get(index)
            .cloned()
            .flatten()
            .ok_or_else(|| Error::CorruptLog {
                path: path.to_string(),
                reason: format!("The offset of source {index} is missing ('-')"),
            })
    }
}

/// The content of `commits/N`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommitMetadata {
    pub next_batch_watermark_ms: i64,
}

impl CommitMetadata {
    fn to_bytes(&self) -> Result<Bytes> {
        Ok(log::render([to_json(self)?]))
    }

    /// Parses the bytes of `commits/N`, naming the file in every error.
    pub fn parse(bytes: &[u8], path: &str) -> Result<Self> {
        let lines = log::parse_versioned(bytes, path, LOG_VERSION, "offset commit log")?;
        match lines.first() {
            Some(l) => log::parse_line(path, 2, l),
            None => Err(Error::CorruptLog {
                path: path.to_string(),
                reason: "The commit metadata line is missing".into(),
            }),
        }
    }
}

/// Where a query starts, with the log entries it needs, read and validated.
#[derive(Debug, Clone, PartialEq)]
pub enum StartPoint {
    /// Nothing recorded: batch 0 from the sources' initial positions.
    Fresh,
    /// Run `batch_id` again: `start` is the end of the batch before (None for batch 0),
    /// `batch` is exactly what was recorded for it.
    Replay {
        batch_id: u64,
        start: Option<OffsetSeq>,
        batch: OffsetSeq,
    },
    /// Batch `batch_id` is new; `previous` is the committed batch before it.
    Next {
        batch_id: u64,
        previous: OffsetSeq,
        commit: CommitMetadata,
    },
}

/// An open checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    root: Location,
    metadata: QueryMetadata,
    created: bool,
    /// The topmost local folder that opening it made (`None`: it was there, or remote).
    made: Option<Location>,
    /// The lock or lease this process holds; `None` for a checkpoint opened to look at.
    guard: Option<Arc<CheckpointGuard>>,
    /// Entries below this id are known to be purged already.
    purged_below: Arc<AtomicU64>,
}

impl Checkpoint {
    /// Opens the checkpoint at `root` for running a query: creates it and its `metadata` (a
    /// new query id) if needed, and takes it for this process (a file lock on a local disk,
    /// a lease on an object store). Another query holding it is an error, before anything
    /// is read.
    pub async fn open(root: Location, name: &str, lease: LeaseSettings) -> Result<Self> {
        let made = root.topmost_missing().await?;
        root.create_dir().await?;
        let guard = CheckpointGuard::acquire(&root, lease).await?;
        let (metadata, created) = Self::read_or_create_metadata(&root, name).await?;
        // Also on a checkpoint just made: a kill while an earlier start made it can have
        // left the temp of its `metadata`.
        remove_stale_temps(&root).await?;
        Ok(Checkpoint {
            root,
            metadata,
            created,
            made,
            guard: Some(Arc::new(guard)),
            purged_below: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Opens an existing checkpoint to look at it, without taking it. `Ok(None)` when
    /// there is no checkpoint at `root` (no `metadata`).
    pub async fn inspect(root: Location) -> Result<Option<Self>> {
        let Some(bytes) = root.get("metadata").await? else {
            return Ok(None);
        };
        let metadata = Self::parse_metadata(&bytes, &root.describe("metadata"))?;
        Ok(Some(Checkpoint {
            root,
            metadata,
            created: false,
            made: None,
            guard: None,
            purged_below: Arc::new(AtomicU64::new(0)),
        }))
    }

    async fn read_or_create_metadata(root: &Location, name: &str) -> Result<(QueryMetadata, bool)> {
        let mut created = false;
        let bytes = match root.get("metadata").await? {
            Some(b) => b,
            None => {
                let fresh = QueryMetadata {
                    id: uuid::Uuid::new_v4(),
                    name: Some(name.to_string()),
                };
                let body = Bytes::from(to_json(&fresh)?);
                created = root.put_new("metadata", body.clone()).await? == WriteOutcome::Written;
                if created {
                    body
                } else {
                    root.get("metadata").await?.unwrap_or_default()
                }
            }
        };
        Ok((
            Self::parse_metadata(&bytes, &root.describe("metadata"))?,
            created,
        ))
    }

    fn parse_metadata(bytes: &[u8], path: &str) -> Result<QueryMetadata> {
        let text = std::str::from_utf8(bytes).unwrap_or_default();
        serde_json::from_str(text.trim()).map_err(|e| Error::CorruptLog {
            path: path.to_string(),
            reason: format!("The query metadata is not valid: {e}"),
        })
    }

    /// Where the checkpoint is.
    pub fn location(&self) -> &Location {
        &self.root
    }

    /// The query id recorded in `metadata`.
    pub fn query_id(&self) -> uuid::Uuid {
        self.metadata.id
    }

    /// The query name recorded when the checkpoint was created (checkpoints written by
    /// Spark or older weir have none).
    pub fn created_name(&self) -> Option<&str> {
        self.metadata.name.as_deref()
    }

    /// Refuses a Spark checkpoint weir cannot continue: a batch Spark planned but did not
    /// commit (its writes are Spark's to finish), or state of a stateful query. A Spark
    /// checkpoint whose last batch is committed is continued from the next batch.
    pub async fn refuse_unfinished_spark(&self, start: &StartPoint) -> Result<()> {
        let refuse = |reason: String| Error::SparkCheckpoint {
            dir: self.root.to_string(),
            reason,
        };
        let (seq, pending) = match start {
            StartPoint::Fresh => return Ok(()),
            StartPoint::Replay {
                batch, batch_id, ..
            } => (batch, Some(*batch_id)),
            StartPoint::Next { previous, .. } => (previous, None),
        };
        if !is_spark(&seq.metadata.conf) {
            return Ok(());
        }
        if let Some(id) = pending {
            return Err(refuse(format!(
                "Spark planned batch {id} ({}) but did not commit it; finish it with the Spark                  job (run it once more), then start weir on the checkpoint",
                self.offsets_name(id)
            )));
        }
        if !self.root.join("state").list_names().await?.is_empty()
            || !self.root.join("state/0").list_names().await?.is_empty()
            || self
                .root
                .join("state/0/_metadata")
                .get("metadata")
                .await?
                .is_some()
        {
            return Err(refuse(
                "it holds state (state/): a stateful Spark query's state is in Spark's \
                 UnsafeRow format, which weir does not read"
                    .into(),
            ));
        }
        Ok(())
    }

    /// True when this process created the checkpoint (its first start).
    pub fn is_new(&self) -> bool {
        self.created
    }

    /// `<checkpoint>/sources/<index>`: a source's own log folder.
    pub fn source_log(&self, index: usize) -> Location {
        self.root.join(&format!("sources/{index}"))
    }

    /// `<checkpoint>/state/<operator>`: a stateful operator's folder.
    pub fn state_dir(&self, operator: usize) -> Location {
        self.root.join(&format!("state/{operator}"))
    }

    /// `<checkpoint>/state`: where the stateful operators' folders are.
    pub fn state_root(&self) -> Location {
        self.root.join("state")
    }

    fn offsets_dir(&self) -> Location {
        self.root.join("offsets")
    }

    fn commits_dir(&self) -> Location {
        self.root.join("commits")
    }

    /// How `offsets/N` is named in messages.
    pub fn offsets_name(&self, batch_id: u64) -> String {
        self.offsets_dir().describe(&batch_id.to_string())
    }

    /// Fails when the lease of an object-store checkpoint was lost (another query took it
    /// over): checked before every write of the logs.
    pub fn ensure_held(&self) -> Result<()> {
        match &self.guard {
            Some(g) => g.ensure_held(&self.root),
            None => Err(Error::Internal {
                what: format!(
                    "the checkpoint {} was opened to look at, not to run a query",
                    self.root
                ),
            }),
        }
    }

    /// Gives up the lock or lease (when the query ends).
    pub async fn release(&self) {
        if let Some(g) = &self.guard {
            g.release(&self.root).await;
        }
    }

    /// Releases the checkpoint of a start that was refused before its first batch; when
    /// this start created it, what it wrote goes too, so a refused first start leaves
    /// nothing: the folders it made, or (in a folder that was there) its `metadata`, lock file
    /// and empty folders. This happens while the checkpoint is still held, so another start
    /// cannot take it in between (see `CheckpointGuard::acquire`). A failure to remove is
    /// reported as a warning naming the path: the refusal is the error that counts.
    pub async fn release_refused(&self) {
        if self.created {
            let undone = match &self.made {
                Some(top) => top.remove_made_folder().await,
                None => {
                    async {
                        self.root.delete("metadata").await?;
                        self.root.remove_empty_folders().await?;
                        if self.root.is_local() {
                            self.root.delete(lock::LOCK).await?;
                        }
                        Ok(())
                    }
                    .await
                }
            };
            if let Err(e) = undone {
                tracing::warn!(
                    checkpoint = %self.root,
                    "removing what the refused start wrote failed: {e}"
                );
            }
        }
        self.release().await;
    }

    /// The batch ids in `offsets/` and `commits/`.
    pub async fn batch_ids(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        let (offsets, commits) = (self.offsets_dir(), self.commits_dir());
        let (o, c) = futures::try_join!(list_ids(&offsets), list_ids(&commits))?;
        Ok((o, c))
    }

    /// Reads both logs and decides where to start. Never a silent restart from zero: a log
    /// that cannot be trusted is an error naming the file.
    pub async fn recover(&self) -> Result<StartPoint> {
        let (offsets, commits) = self.batch_ids().await?;
        let inconsistent = |source: RecoveryError| Error::InconsistentCheckpoint {
            dir: self.root.to_string(),
            source,
        };
        match decide(&offsets, &commits).map_err(inconsistent)? {
            Recovery::Fresh => Ok(StartPoint::Fresh),
            Recovery::Replay(id) => {
                let batch = self.read_offsets(id).await?;
                let start = match id.checked_sub(1) {
                    Some(prev) if offsets.contains(&prev) => {
                        self.require_commit(prev).await?;
                        Some(self.read_offsets(prev).await?)
                    }
                    Some(_) => {
                        return Err(inconsistent(RecoveryError::ReplayStartMissing {
                            batch: id,
                        }));
                    }
                    None => None,
                };
                Ok(StartPoint::Replay {
                    batch_id: id,
                    start,
                    batch,
                })
            }
            Recovery::Next(id) => {
                let prev = id - 1;
                Ok(StartPoint::Next {
                    batch_id: id,
                    previous: self.read_offsets(prev).await?,
                    commit: self.require_commit(prev).await?,
                })
            }
        }
    }

    async fn require_commit(&self, batch_id: u64) -> Result<CommitMetadata> {
        self.read_commit(batch_id)
            .await?
            .ok_or_else(|| Error::CorruptLog {
                path: self.commits_dir().describe(&batch_id.to_string()),
                reason: "The commit entry vanished while it was being read".into(),
            })
    }

    /// Reads `offsets/N`.
    pub async fn read_offsets(&self, batch_id: u64) -> Result<OffsetSeq> {
        let name = batch_id.to_string();
        let path = self.offsets_dir().describe(&name);
        match self.offsets_dir().get(&name).await? {
            Some(b) => OffsetSeq::parse(&b, &path),
            None => Err(Error::CorruptLog {
                path,
                reason: "The offset log entry is missing".into(),
            }),
        }
    }

    /// Reads `commits/N`; `Ok(None)` if the batch is not committed.
    pub async fn read_commit(&self, batch_id: u64) -> Result<Option<CommitMetadata>> {
        let name = batch_id.to_string();
        match self.commits_dir().get(&name).await? {
            Some(b) => CommitMetadata::parse(&b, &self.commits_dir().describe(&name)).map(Some),
            None => Ok(None),
        }
    }

    /// Writes `offsets/N` before anything of batch N runs.
    pub async fn write_offsets(&self, batch_id: u64, seq: &OffsetSeq) -> Result<()> {
        self.write_once(&self.offsets_dir(), batch_id, seq.to_bytes()?)
            .await
    }

    /// Writes `commits/N` after batch N's function returned `Ok`.
    pub async fn write_commit(&self, batch_id: u64, commit: &CommitMetadata) -> Result<()> {
        self.write_once(&self.commits_dir(), batch_id, commit.to_bytes()?)
            .await
    }

    /// `commits/N` made ready (durable under a temp name nothing reads) while batch N's
    /// function runs; [`Checkpoint::finish_commit`] puts it in place once the function has
    /// returned `Ok`. Dropped unfinished, it leaves no `commits/N`.
    pub async fn prepare_commit(
        &self,
        batch_id: u64,
        commit: &CommitMetadata,
    ) -> Result<StagedWrite> {
        self.ensure_held()?;
        self.commits_dir()
            .prepare_new(&batch_id.to_string(), commit.to_bytes()?)
            .await
    }

    /// Puts a [`Checkpoint::prepare_commit`] in place: batch N is committed when it returns.
    pub async fn finish_commit(&self, batch_id: u64, prepared: StagedWrite) -> Result<()> {
        self.ensure_held()?;
        let outcome = prepared.finish().await?;
        self.written_once(&self.commits_dir(), batch_id, outcome)
    }

    async fn write_once(&self, dir: &Location, batch_id: u64, bytes: Bytes) -> Result<()> {
        self.ensure_held()?;
        let outcome = dir.put_new(&batch_id.to_string(), bytes).await?;
        self.written_once(dir, batch_id, outcome)
    }

    fn written_once(&self, dir: &Location, batch_id: u64, outcome: WriteOutcome) -> Result<()> {
        match outcome {
            WriteOutcome::Written => Ok(()),
            WriteOutcome::AlreadyExists => Err(Error::CheckpointInUse {
                dir: self.root.to_string(),
                detail: format!(
                    "{} was written by someone else",
                    dir.describe(&batch_id.to_string())
                ),
            }),
        }
    }

    /// Deletes offset and commit entries of batches below `keep_from`. The first call lists
    /// both logs; later calls delete just the entries that fell out of retention since.
    pub async fn purge(&self, keep_from: u64) -> Result<()> {
        let below = self.purged_below.load(Ordering::Relaxed);
        let plan = retention::purge((below > 0).then_some(below), keep_from);
        for dir in [self.offsets_dir(), self.commits_dir()] {
            let doomed: Vec<String> = match &plan {
                retention::Purge::Nothing => return Ok(()),
                retention::Purge::ListBelow(k) => list_ids(&dir)
                    .await?
                    .into_iter()
                    .filter(|id| id < k)
                    .map(|id| id.to_string())
                    .collect(),
                retention::Purge::Range(r) => r.clone().map(|id| id.to_string()).collect(),
            };
            dir.delete_many(doomed).await?;
        }
        self.purged_below.store(keep_from, Ordering::Relaxed);
        Ok(())
    }
}

/// Removes the temp files a crash left in the folders the checkpoint's holder writes: the
/// folder itself (its `metadata`), the logs (`offsets/N` or `commits/N` written to
/// `.N.<uuid>.tmp` and never linked into place; a kill while the function ran leaves
/// `commits/N`'s), the sources' logs (`sources/<i>`), and the state
/// (`state/<operator>/_metadata` and every partition's folder). Only the holder writes
/// there, and the caller holds the checkpoint; only names of weir's temp files
/// (`.<name>.<32 hex>.tmp`) are touched. Temp files are a local write's (an object store's
/// writes are single PUTs), so only a local checkpoint is looked through.
async fn remove_stale_temps(root: &Location) -> Result<()> {
    let Some(path) = root.local_path().map(std::path::Path::to_path_buf) else {
        return Ok(());
    };
    // The checkpoint's folders go 3 deep: state/<operator>/<partition>.
    let found = tokio::task::spawn_blocking(move || temps_under(&path, 3))
        .await
        .map_err(|e| Error::Internal {
            what: format!("listing the checkpoint's folders: {e}"),
        })??;
    for (rel, doomed) in found {
        let dir = if rel.is_empty() {
            root.clone()
        } else {
            root.join(&rel)
        };
        tracing::info!(
            "removing {} temp file(s) a crash left in {dir}: {}",
            doomed.len(),
            doomed.join(", ")
        );
        dir.delete_many(doomed).await?;
    }
    Ok(())
}

/// weir's temp files in `dir` and in its folders down to `depth` levels, by folder (its
/// path relative to `dir`), each folder read once.
fn temps_under(dir: &std::path::Path, depth: usize) -> Result<Vec<(String, Vec<String>)>> {
    let mut out = Vec::new();
    let mut level = vec![String::new()];
    for d in 0..=depth {
        let mut next = Vec::new();
        for rel in &level {
            let at = dir.join(rel);
            let entries = match std::fs::read_dir(&at) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("listing", at, e)),
            };
            let mut temps = Vec::new();
            for e in entries {
                let e = e.map_err(|err| Error::io("listing", &at, err))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    if d < depth {
                        next.push(if rel.is_empty() {
                            name
                        } else {
                            format!("{rel}/{name}")
                        });
                    }
                } else if crate::storage::temp_target(&name).is_some() {
                    temps.push(name);
                }
            }
            if !temps.is_empty() {
                out.push((rel.clone(), temps));
            }
        }
        level = next;
    }
    Ok(out)
}

/// True when the pinned settings of a batch are Spark's (the batch was planned by Spark).
pub fn is_spark(conf: &BTreeMap<String, String>) -> bool {
    conf.keys().any(|k| k.starts_with("spark."))
}

/// The numeric file names in a log folder. Hidden names (temp files, `.crc`) and
/// `.compact` files are skipped; anything else is an error naming it.
pub async fn list_ids(dir: &Location) -> Result<Vec<u64>> {
    let mut ids = Vec::new();
    for name in dir.list_names().await? {
        if is_hidden(&name) || name.ends_with(".compact") {
            continue;
        }
        match name.parse::<u64>() {
            Ok(id) => ids.push(id),
            Err(_) => {
                return Err(Error::CorruptLog {
                    path: dir.describe(&name),
                    reason: "Unexpected file in a log folder: log entries are named by batch id"
                        .into(),
                });
            }
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value)
        .map_err(|e| Error::config("checkpoint", format!("cannot serialize: {e}")))
}

#[cfg(test)]
mod tests;
