//! The file source's log, `<checkpoint>/sources/<i>/N`: one JSON line per file taken by
//! log offset N, in Spark's shape (`{"path":..,"timestamp":..,"batchId":..}`) plus the
//! file's size and ETag, which Spark does not record and weir checks on every read. Every
//! 10th entry is written as `N.compact` holding every entry still needed (see
//! [`super::FileSource`]), after which older plain entries may be deleted.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::logfile::{parse_line, parse_versioned, render};
use crate::storage::{Location, WriteOutcome, is_hidden};

pub(super) const COMPACT_INTERVAL: u64 = 10;

/// One file taken by a batch: a line of `sources/<i>/N`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    /// The file's URI: `file:///abs/path` (percent-encoded) or `s3://bucket/key`.
    pub path: String,
    /// Modification time in ms since the epoch.
    pub timestamp: i64,
    /// The log offset (batch) that took the file.
    pub batch_id: u64,
    /// Size in bytes when the file was taken (absent in Spark's logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The object's ETag when it was taken (object stores only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
}

impl FileEntry {
    /// The file's name inside the input folder (the last path segment, decoded).
    pub fn name(&self) -> String {
        let last = self.path.rsplit('/').next().unwrap_or_default();
        crate::storage::percent_decode(last)
    }
}

/// The file name of log offset `id`: every 10th is a compact file.
pub(super) fn entry_name(id: u64) -> String {
    if (id + 1).is_multiple_of(COMPACT_INTERVAL) {
        format!("{id}.compact")
    } else {
        id.to_string()
    }
}

/// Writes log offset `id` holding `lines`; an existing entry means another query.
pub(super) async fn write(log: &Location, id: u64, lines: &[&FileEntry]) -> Result<()> {
    let name = entry_name(id);
    let body = render(
        lines
            .iter()
            .map(|e| serde_json::to_string(e).unwrap_or_default()),
    );
    match log.put_new(&name, body).await? {
        WriteOutcome::Written => Ok(()),
        WriteOutcome::AlreadyExists => Err(Error::CheckpointInUse {
            dir: log.to_string(),
            detail: format!("{} was written by someone else", log.describe(&name)),
        }),
    }
}

/// Reads the log: the newest `N.compact`, then every plain entry after it, by batch.
pub(super) async fn read(log: &Location) -> Result<BTreeMap<u64, Vec<FileEntry>>> {
    let mut plain = Vec::new();
    let mut compacts = Vec::new();
    for name in log.list_names().await? {
        if is_hidden(&name) {
            continue;
        }
        let (id, compact) = match name.strip_suffix(".compact") {
            Some(n) => (n.parse::<u64>(), true),
            None => (name.parse::<u64>(), false),
        };
        let id = id.map_err(|_| Error::CorruptLog {
            path: log.describe(&name),
            reason: "Unexpected file in a file source log".into(),
        })?;
        if compact {
            compacts.push(id)
        } else {
            plain.push(id)
        }
    }
    let base = compacts.iter().copied().max();
    let mut names: Vec<String> = Vec::new();
    if let Some(c) = base {
        names.push(format!("{c}.compact"));
    }
    plain.sort_unstable();
    let after: Vec<u64> = plain
        .into_iter()
        .filter(|&id| base.is_none_or(|c| id > c))
        .collect();
    let first = base.map_or(after.first().copied().unwrap_or(0), |c| c + 1);
    for (expect, id) in (first..).zip(&after) {
        if *id != expect {
            return Err(Error::CorruptLog {
                path: log.describe(&expect.to_string()),
                reason: "Missing entry in the file source log".into(),
            });
        }
    }
    names.extend(after.iter().map(u64::to_string));
    let mut out: BTreeMap<u64, Vec<FileEntry>> = BTreeMap::new();
    for name in names {
        let path = log.describe(&name);
        let Some(bytes) = log.get(&name).await? else {
            return Err(Error::CorruptLog {
                path,
                reason: "The entry vanished while the log was read".into(),
            });
        };
        let lines = parse_versioned(&bytes, &path, 1, "file source log")?;
        for (i, line) in lines
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let e: FileEntry = parse_line(&path, i + 2, line)?;
            out.entry(e.batch_id).or_default().push(e);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_decode_from_uris_and_entries_keep_sparks_shape() {
        let e = FileEntry {
            path: "file:///data/in/a%5B1%5D%20b%25.json".into(),
            timestamp: 5,
            batch_id: 0,
            size: None,
            etag: None,
        };
        assert_eq!(e.name(), "a[1] b%.json");
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"path":"file:///data/in/a%5B1%5D%20b%25.json","timestamp":5,"batchId":0}"#
        );
        assert_eq!(crate::storage::percent_decode("100%"), "100%");
        assert_eq!(entry_name(9), "9.compact");
        assert_eq!(entry_name(10), "10");
    }
}
