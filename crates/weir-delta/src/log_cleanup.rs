//! Expired log files, removed at a cost per newly expired version, not per log file.
//!
//! A table written once a second gains 86,400 commit files a day and keeps them for the
//! table's `delta.logRetentionDuration` (30 days by default). delta-rs's `cleanup_metadata`
//! lists the whole `_delta_log` (and, locally, stats every file) to find the expired ones:
//! run at every reload of the cached table, its cost and memory grew with every batch (the
//! slowest 1% of a rate -> Delta append soak went from 6% to 15% of its time over 35,000
//! batches). This does the same work from what it already knows: commit files are named by
//! version, so each run looks (`HEAD`) only at the versions after the last one it found
//! expired, stops at the first commit still within the retention, and deletes the commit and
//! checkpoint files below the newest checkpoint among the expired versions.
//!
//! The rule is delta-rs's (and Delta's): a file goes only if its version is below a
//! checkpoint that is itself at or below every version still within the retention, so every
//! version a reader may still ask for keeps its checkpoint and the commits after it. The
//! lowest version present is found by one listing, the first time a process cleans a table
//! (or a table made again at the same place: the scan is kept with the table's id). A run
//! looks at [`MAX_VERSIONS_PER_RUN`] versions at most.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use deltalake::table::config::TablePropertiesExt;
use deltalake::{DeltaTable, ObjectStore, ObjectStoreError, Path};
use futures::TryStreamExt;
use object_store::ObjectStoreExt as _;
use weir_core::storage::Location;

use crate::error::DeltaSinkError;

/// What earlier runs found, so the next one starts where they stopped.
#[derive(Debug, Default)]
pub(crate) struct LogCleanup {
    scan: Mutex<Option<Scan>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Scan {
    /// The table's id (`metaData.id`): a table made again at the same place starts afresh.
    table_id: String,
    /// The lowest version whose files may still be there.
    low: u64,
    /// The commits of `low..next` were older than the cutoff when looked at (the cutoff only
    /// moves forward while the retention stays the same).
    next: u64,
    /// The versions of `low..next` with a single-file checkpoint, oldest first (seen while
    /// scanning, so removing them needs no request for the versions without one).
    checkpoints: VecDeque<u64>,
    /// The retention the scan was made with.
    retention_ms: u64,
}

fn commit_path(log: &Path, v: u64) -> Path {
    log.clone().join(format!("{v:020}.json").as_str())
}

fn checkpoint_path(log: &Path, v: u64) -> Path {
    log.clone()
        .join(format!("{v:020}.checkpoint.parquet").as_str())
}

/// The version of a commit file's name (`00000000000000000042.json`).
fn commit_version(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".json")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Versions looked at per run at most: a run after a long stop catches up over several
/// reloads instead of holding one batch for hundreds of thousands of requests.
const MAX_VERSIONS_PER_RUN: u64 = 2_000;

impl LogCleanup {
    /// Removes the log files of `table` that its log retention lets go; the number removed.
    pub(crate) async fn run(
        &self,
        table: &DeltaTable,
        at: &Location,
        batch_id: u64,
    ) -> Result<usize, DeltaSinkError> {
        let err = |action, source: deltalake::DeltaTableError| DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id,
            action,
            source,
        };
        let store_err = |action, source: ObjectStoreError| err(action, source.into());
        let Some(now) = table.version() else {
            return Ok(0);
        };
        let snapshot = table
            .snapshot()
            .map_err(|e| err("reading the log retention", e))?;
        let config = snapshot.table_config();
        if !config.enable_expired_log_cleanup() {
            return Ok(0);
        }
        let table_id = snapshot.metadata().id().to_string();
        let retention_ms =
            u64::try_from(config.log_retention_duration().as_millis()).unwrap_or(u64::MAX);
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let cutoff =
            i64::try_from(now_ms.saturating_sub(u128::from(retention_ms))).unwrap_or(i64::MAX);
        let store = table.log_store().object_store(None);
        let log = table.log_store().log_path().clone();

        let known = self.scan.lock().ok().and_then(|mut s| s.take());
        let mut scan = match known {
            Some(s) if s.table_id == table_id && s.low <= now => {
                if s.retention_ms == retention_ms {
                    s
                } else {
                    Scan {
                        next: s.low,
                        checkpoints: VecDeque::new(),
                        retention_ms,
                        ..s
                    }
                }
            }
            // None yet, or another table made at the same place since: look afresh.
            _ => {
                let low = lowest_commit(store.as_ref(), &log)
                    .await
                    .map_err(|e| store_err("listing the log to clean it", e))?
                    .unwrap_or(now);
                Scan {
                    table_id,
                    low,
                    next: low,
                    checkpoints: VecDeque::new(),
                    retention_ms,
                }
            }
        };
        let result = advance(&mut scan, store.as_ref(), &log, now, cutoff).await;
        // Kept whatever happened: what was learned or removed stays known.
        if let Ok(mut s) = self.scan.lock() {
            *s = Some(scan);
        }
        result.map_err(|(action, e)| store_err(action, e))
    }
}

/// Looks at the commits not yet known to be expired and removes what the newest checkpoint
/// among the expired versions makes unnecessary; the number of files removed.
async fn advance(
    scan: &mut Scan,
    store: &dyn ObjectStore,
    log: &Path,
    now: u64,
    cutoff: i64,
) -> Result<usize, (&'static str, ObjectStoreError)> {
    // Up to the first commit still within the retention (or the table's version).
    let stop = now.min(scan.next.saturating_add(MAX_VERSIONS_PER_RUN));
    while scan.next < stop {
        match store.head(&commit_path(log, scan.next)).await {
            Ok(m) if m.last_modified.timestamp_millis() >= cutoff => break,
            Ok(_) | Err(ObjectStoreError::NotFound { .. }) => {}
            Err(e) => return Err(("reading a log file's time", e)),
        }
        if exists(store, &checkpoint_path(log, scan.next))
            .await
            .map_err(|e| ("looking for a checkpoint", e))?
        {
            scan.checkpoints.push_back(scan.next);
        }
        scan.next += 1;
    }
    // A checkpoint at the first version not known to be expired is at or below every
    // version still within the retention: as good as one below it.
    let safe = if exists(store, &checkpoint_path(log, scan.next))
        .await
        .map_err(|e| ("looking for a checkpoint", e))?
    {
        Some(scan.next)
    } else {
        scan.checkpoints.back().copied()
    };
    let mut removed = 0;
    if let Some(safe) = safe {
        for v in scan.low..safe {
            let mut paths = vec![commit_path(log, v)];
            if scan.checkpoints.front() == Some(&v) {
                paths.push(checkpoint_path(log, v));
            }
            for path in paths {
                match store.delete(&path).await {
                    Ok(()) => removed += 1,
                    Err(ObjectStoreError::NotFound { .. }) => {}
                    Err(e) => return Err(("removing an expired log file", e)),
                }
            }
            // Remembered as it goes: a failure later does not make the next run redo it.
            if scan.checkpoints.front() == Some(&v) {
                scan.checkpoints.pop_front();
            }
            scan.low = v + 1;
        }
    }
    Ok(removed)
}

async fn exists(store: &dyn ObjectStore, path: &Path) -> Result<bool, ObjectStoreError> {
    match store.head(path).await {
        Ok(_) => Ok(true),
        Err(ObjectStoreError::NotFound { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The lowest version with a commit file in the log (`None`: none).
async fn lowest_commit(
    store: &dyn ObjectStore,
    log: &Path,
) -> Result<Option<u64>, ObjectStoreError> {
    store
        .list(Some(log))
        .try_fold(None, |low: Option<u64>, meta| async move {
            let v = meta.location.filename().and_then(commit_version);
            Ok(match (low, v) {
                (Some(l), Some(v)) => Some(l.min(v)),
                (l, v) => l.or(v),
            })
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::commit_version;

    #[test]
    fn only_commit_file_names_have_a_version() {
        assert_eq!(commit_version("00000000000000000042.json"), Some(42));
        assert_eq!(
            commit_version("00000000000000000042.checkpoint.parquet"),
            None
        );
        assert_eq!(commit_version("0000000000000000042.json"), None);
        assert_eq!(commit_version("0000000000000000004x.json"), None);
        assert_eq!(commit_version("_last_checkpoint"), None);
    }
}
