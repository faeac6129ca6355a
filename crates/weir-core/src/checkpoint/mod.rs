//! The checkpoint folder: query metadata, offset log, commit log, source logs.
//!
//! ```text
//! <checkpoint>/metadata        {"id":"<uuid>"}                    written once
//! <checkpoint>/offsets/N       v1, batch metadata, one offset line per source
//! <checkpoint>/commits/N       v1, {"nextBatchWatermarkMs":0}
//! <checkpoint>/sources/<i>/N   a source's own log (the file source's file lists)
//! ```
//!
//! The shapes are Spark's (see `shared/reference/spark-4.3.0`), so the tools people use
//! to look at Spark checkpoints read these too. Every file goes through
//! [`file::write_new`]: atomic, durable, never overwritten.

pub mod file;
pub mod recovery;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::source::SourceOffset;
use file::WriteOutcome;
pub use recovery::{Recovery, RecoveryError, decide};

const LOG_VERSION: u32 = 1;

/// `<checkpoint>/metadata`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueryMetadata {
    /// The query id: stable across restarts of this checkpoint, new for a new one.
    pub id: uuid::Uuid,
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
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = format!("v{LOG_VERSION}\n");
        out.push_str(&to_json(&self.metadata)?);
        for o in &self.offsets {
            out.push('\n');
            match o {
                Some(o) => out.push_str(&o.to_string()),
                None => out.push('-'),
            }
        }
        Ok(out.into_bytes())
    }

    /// Reads `offsets/N`, naming the file in every error.
    pub fn read(path: &Path) -> Result<Self> {
        let lines = file::read_versioned(path, LOG_VERSION, "offset log")?;
        let Some((meta, rest)) = lines.split_first() else {
            return Err(Error::CorruptLog {
                path: path.to_path_buf(),
                reason: "The batch metadata line is missing".into(),
            });
        };
        let metadata = file::parse_line(path, 2, meta)?;
        let offsets = rest
            .iter()
            .enumerate()
            .map(|(i, l)| match l.trim() {
                "-" => Ok(None),
                l => file::parse_line::<serde_json::Value>(path, i + 3, l)
                    .map(|v| Some(SourceOffset::new(v))),
            })
            .collect::<Result<Vec<_>>>()?;
        if offsets.is_empty() {
            return Err(Error::CorruptLog {
                path: path.to_path_buf(),
                reason: "No source offset line follows the batch metadata".into(),
            });
        }
        Ok(OffsetSeq { metadata, offsets })
    }
}

/// The content of `commits/N`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommitMetadata {
    pub next_batch_watermark_ms: i64,
}

impl CommitMetadata {
    fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(format!("v{LOG_VERSION}\n{}", to_json(self)?).into_bytes())
    }

    /// Reads `commits/N`, naming the file in every error.
    pub fn read(path: &Path) -> Result<Self> {
        let lines = file::read_versioned(path, LOG_VERSION, "offset commit log")?;
        match lines.first() {
            Some(l) => file::parse_line(path, 2, l),
            None => Err(Error::CorruptLog {
                path: path.to_path_buf(),
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

/// An open checkpoint folder.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    metadata: QueryMetadata,
    created: bool,
}

impl Checkpoint {
    /// Opens `dir`, creating it and its `metadata` (a new query id) if needed.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating checkpoint folder", &dir, e))?;
        let path = dir.join("metadata");
        let mut created = false;
        if !path.exists() {
            let fresh = QueryMetadata {
                id: uuid::Uuid::new_v4(),
            };
            created = file::write_new(&path, to_json(&fresh)?.as_bytes())? == WriteOutcome::Written;
        }
        let text = fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
        let metadata: QueryMetadata =
            serde_json::from_str(text.trim()).map_err(|e| Error::CorruptLog {
                path: path.clone(),
                reason: format!("The query metadata is not valid: {e}"),
            })?;
        Ok(Checkpoint {
            dir,
            metadata,
            created,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The query id recorded in `metadata`.
    pub fn query_id(&self) -> uuid::Uuid {
        self.metadata.id
    }

    /// True when this process created the checkpoint (its first start).
    pub fn is_new(&self) -> bool {
        self.created
    }

    /// `<checkpoint>/sources/<index>`: a source's own log folder.
    pub fn source_dir(&self, index: usize) -> PathBuf {
        self.dir.join("sources").join(index.to_string())
    }

    fn offsets_path(&self, batch_id: u64) -> PathBuf {
        self.dir.join("offsets").join(batch_id.to_string())
    }

    fn commits_path(&self, batch_id: u64) -> PathBuf {
        self.dir.join("commits").join(batch_id.to_string())
    }

    /// The batch ids in `offsets/` and `commits/`.
    pub fn batch_ids(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        Ok((
            list_ids(&self.dir.join("offsets"))?,
            list_ids(&self.dir.join("commits"))?,
        ))
    }

    /// Reads both logs and decides where to start. Never a silent restart from zero: a log
    /// that cannot be trusted is an error naming the file.
    pub fn recover(&self) -> Result<StartPoint> {
        let (offsets, commits) = self.batch_ids()?;
        let inconsistent = |reason: String| Error::InconsistentCheckpoint {
            dir: self.dir.clone(),
            reason,
        };
        match decide(&offsets, &commits).map_err(|e| inconsistent(e.to_string()))? {
            Recovery::Fresh => Ok(StartPoint::Fresh),
            Recovery::Replay(id) => {
                let batch = OffsetSeq::read(&self.offsets_path(id))?;
                let start = match id.checked_sub(1) {
                    Some(prev) if offsets.contains(&prev) => {
                        CommitMetadata::read(&self.commits_path(prev))?;
                        Some(OffsetSeq::read(&self.offsets_path(prev))?)
                    }
                    Some(prev) => {
                        return Err(inconsistent(format!(
                            "offsets/{id} must be run again but offsets/{prev}, where it starts, is missing"
                        )));
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
                    previous: OffsetSeq::read(&self.offsets_path(prev))?,
                    commit: CommitMetadata::read(&self.commits_path(prev))?,
                })
            }
        }
    }

    /// Reads `offsets/N`.
    pub fn read_offsets(&self, batch_id: u64) -> Result<OffsetSeq> {
        OffsetSeq::read(&self.offsets_path(batch_id))
    }

    /// Reads `commits/N`; `Ok(None)` if the batch is not committed.
    pub fn read_commit(&self, batch_id: u64) -> Result<Option<CommitMetadata>> {
        let p = self.commits_path(batch_id);
        if p.exists() {
            CommitMetadata::read(&p).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Writes `offsets/N` before anything of batch N runs.
    pub fn write_offsets(&self, batch_id: u64, seq: &OffsetSeq) -> Result<()> {
        self.write_once(&self.offsets_path(batch_id), &seq.to_bytes()?)
    }

    /// Writes `commits/N` after batch N's function returned `Ok`.
    pub fn write_commit(&self, batch_id: u64, commit: &CommitMetadata) -> Result<()> {
        self.write_once(&self.commits_path(batch_id), &commit.to_bytes()?)
    }

    fn write_once(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        match file::write_new(path, bytes)? {
            WriteOutcome::Written => Ok(()),
            WriteOutcome::AlreadyExists => Err(Error::CheckpointInUse {
                dir: self.dir.clone(),
                path: path.to_path_buf(),
            }),
        }
    }

    /// Deletes offset and commit entries of batches below `keep_from`.
    pub fn purge(&self, keep_from: u64) -> Result<()> {
        for sub in ["offsets", "commits"] {
            let dir = self.dir.join(sub);
            for id in list_ids(&dir)?.into_iter().filter(|&id| id < keep_from) {
                let p = dir.join(id.to_string());
                fs::remove_file(&p).map_err(|e| Error::io("removing old log entry", &p, e))?;
            }
        }
        Ok(())
    }
}

/// The numeric file names in a log folder. Hidden names (temp files, `.crc`) are skipped;
/// anything else is an error naming it.
pub fn list_ids(dir: &Path) -> Result<Vec<u64>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if file::is_hidden(&name) || name.ends_with(".compact") {
            continue;
        }
        match name.parse::<u64>() {
            Ok(id) => ids.push(id),
            Err(_) => {
                return Err(Error::CorruptLog {
                    path: entry.path(),
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
