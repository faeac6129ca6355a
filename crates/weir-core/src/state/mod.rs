//! The versioned state store of stateful operators, in the checkpoint.
//!
//! Laid out as Spark lays it out: `state/<operator>/<partition>/<version>.delta` holds the
//! keys one batch put or removed, every [`StateConf::snapshot_every`]-th version also a
//! `<version>.snapshot` with every key, and `state/<operator>/_metadata/metadata` the
//! operator's name and number of partitions. The encoding is weir's own (Arrow IPC files,
//! see [`encode`]); keys and values are bytes to the store (an operator writes them in an encoding it keeps stable across releases, with its schema in the operator's metadata: Arrow's row format may change between Arrow versions).
//!
//! The contract with the engine: batch N loads version N, changes keys, and commits version
//! N+1 before `commits/N`, then (after `commits/N`) calls [`StateStore::purge`]. Version 0
//! is the empty state and has no file. A replay of batch N (after a crash at any point before
//! `commits/N`) loads version N again, so it never sees its first attempt's changes; its
//! commit first deletes whatever files of N+1 the first attempt left, then writes its own
//! once (`put_new`, as the logs are written: a file that appears meanwhile means another
//! writer, [`Error::CheckpointInUse`]). Only files of the version after the newest committed
//! one are ever deleted that way; a file of a later version makes the commit fail.
//!
//! A store keeps its version in memory between batches, so a batch reads no file: files are
//! read when a store first loads (or loads a version other than the one it holds), and the
//! folder is listed once then. A missing or damaged file is an error naming it
//! ([`Error::CorruptState`]), never an empty or shorter state. Retention keeps the newest
//! [`StateConf::retain`] versions loadable (Spark's `minBatchesToRetain`) and deletes what
//! only older versions needed.

mod encode;
pub mod files;
mod flat;
pub mod partitioned;

pub use partitioned::{PartitionedStore, partition_of};

use crate::error::{Error, Result};
use crate::storage::Location;

use files::{Files, Kind, file_name};
use flat::FlatMap;

/// How a store writes and keeps its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateConf {
    snapshot_every: u64,
    retain: u64,
}

impl StateConf {
    /// A snapshot every `snapshot_every` versions (Spark: `minDeltasForSnapshot`, 10), the
    /// newest `retain` versions kept loadable (Spark: `minBatchesToRetain`, 100; at least 2,
    /// so the version a replay loads is never let go).
    pub fn new(snapshot_every: u64, retain: u64) -> Result<Self> {
        if snapshot_every == 0 {
            return Err(Error::config(
                "state snapshot interval",
                "must be at least 1 (a snapshot every N versions)",
            ));
        }
        if retain < 2 {
            return Err(Error::config(
                "min-batches-to-retain",
                format!("{retain} would let go of the state a replay loads; use 2 or more"),
            ));
        }
        Ok(StateConf {
            snapshot_every,
            retain,
        })
    }

    /// Versions between snapshots.
    pub fn snapshot_every(&self) -> u64 {
        self.snapshot_every
    }

    /// Versions kept loadable.
    pub fn retain(&self) -> u64 {
        self.retain
    }
}

impl Default for StateConf {
    fn default() -> Self {
        StateConf {
            snapshot_every: 10,
            retain: 100,
        }
    }
}

/// The state of one partition of one operator.
#[derive(Debug)]
pub struct StateStore {
    dir: Location,
    conf: StateConf,
    /// The files there are, once listed (`None`: not listed yet).
    files: Option<Files>,
    /// The version `committed` holds (`None`: nothing loaded).
    version: Option<u64>,
    /// The version's keys (never a removal).
    committed: FlatMap,
    /// This attempt's changes: `Some`: put, `None`: removed.
    pending: FlatMap,
}

impl StateStore {
    /// The store whose files are in `dir` (`state/<operator>/<partition>`).
    pub fn new(dir: Location, conf: StateConf) -> Self {
        StateStore {
            dir,
            conf,
            files: None,
            version: None,
            committed: FlatMap::default(),
            pending: FlatMap::default(),
        }
    }

    /// The version loaded (`None` before the first [`Self::load`]).
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// The newest version the store's files hold (0: none), listing them if not yet known.
    pub async fn newest_version(&mut self) -> Result<u64> {
        if self.files.is_none() {
            let names = self.dir.list_names().await?;
            self.files = Some(Files::from_names(names.iter().map(String::as_str)));
        }
        Ok(self.files.as_ref().map_or(0, Files::newest))
    }

    /// Lists the store's files again, keeping the version held: another process may have
    /// written versions since this one listed them (a store kept by a worker between the
    /// batches it ran, while another worker ran one of its partition's batches).
    pub async fn relist(&mut self) -> Result<u64> {
        self.files = None;
        self.newest_version().await
    }

    /// Makes the store hold `version`, dropping changes not committed. A store that holds
    /// it already reads nothing.
    pub async fn load(&mut self, version: u64) -> Result<()> {
        self.pending.clear();
        if self.version == Some(version) {
            return Ok(());
        }
        self.version = None;
        self.committed = FlatMap::default();
        let loaded = self.read_version(version).await;
        if loaded.is_err() {
            self.committed = FlatMap::default();
        }
        loaded
    }

    async fn read_version(&mut self, version: u64) -> Result<()> {
        let files = match self.files.take() {
            Some(f) => f,
            None => {
                let names = self.dir.list_names().await?;
                Files::from_names(names.iter().map(String::as_str))
            }
        };
        let plan = files.plan(version);
        self.files = Some(files);
        let plan = plan.map_err(|missing| Error::CorruptState {
            path: self.dir.describe(&file_name(missing, Kind::Delta)),
            reason: format!(
                "it is missing, and version {version} of the state needs it{}",
                self.files
                    .as_ref()
                    .and_then(|f| f.oldest_loadable())
                    .filter(|oldest| version < *oldest)
                    .map_or(String::new(), |oldest| format!(
                        " (retention kept versions from {oldest} on)"
                    ))
            ),
        })?;
        if let Some(s) = plan.snapshot {
            let bytes = self.read(s, Kind::Snapshot).await?;
            let map = &mut self.committed;
            encode::decode(bytes, Kind::Snapshot, s, |k, v| apply(map, k, v))
                .map_err(|reason| self.corrupt(s, Kind::Snapshot, reason))?;
        }
        for v in plan.deltas {
            let bytes = self.read(v, Kind::Delta).await?;
            let map = &mut self.committed;
            encode::decode(bytes, Kind::Delta, v, |k, value| apply(map, k, value))
                .map_err(|reason| self.corrupt(v, Kind::Delta, reason))?;
        }
        self.committed.compact();
        self.version = Some(version);
        Ok(())
    }

    /// The value of `key` as this attempt sees it.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        match self.pending.get(key) {
            Some(change) => change,
            None => self.committed.get(key).flatten(),
        }
    }

    /// Sets `key` to `value`.
    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.pending.insert(&key, Some(&value));
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: Vec<u8>) {
        if self.committed.contains_key(&key) {
            self.pending.insert(&key, None);
        } else {
            // Not in the committed version: nothing to write down.
            self.pending.remove(&key);
        }
    }

    /// Every key and value as this attempt sees them, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let committed = self
            .committed
            .iter()
            .filter(|(k, _)| !self.pending.contains_key(k))
            .filter_map(|(k, v)| Some((k, v?)));
        let pending = self.pending.iter().filter_map(|(k, v)| Some((k, v?)));
        committed.chain(pending)
    }

    /// Keys in the committed version.
    pub fn len(&self) -> usize {
        self.committed.len()
    }

    /// Whether this attempt changed anything (puts or removals not committed yet).
    pub fn has_changes(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether the committed version holds no key.
    pub fn is_empty(&self) -> bool {
        self.committed.is_empty()
    }

    /// Memory the committed version takes, estimated (progress's `memoryUsedBytes`).
    pub fn memory_bytes(&self) -> usize {
        self.committed.memory_bytes()
    }

    /// Whether the next commit writes a snapshot besides the delta.
    pub fn snapshot_due(&self) -> bool {
        self.version
            .is_some_and(|v| (v + 1).is_multiple_of(self.conf.snapshot_every))
    }

    /// Writes this attempt's changes as the next version (its delta, and a snapshot when one
    /// is due), durably, and makes it the version held. Returns the version written.
    ///
    /// Files of the next version left by an attempt that was never committed (a crash before
    /// `commits/N`) are deleted first, so no file of that attempt survives to be loaded
    /// later; the new files are then written once (`put_new`). A file of a later version
    /// is refused: that version was committed on top of a different one. On any error the
    /// store holds nothing, and only [`Self::load`] makes it usable again.
    pub async fn commit(&mut self) -> Result<u64> {
        let snapshot = self.snapshot_due();
        let mut result = self.write_next().await;
        if let Ok(next) = result {
            for (k, v) in self.pending.iter() {
                apply(&mut self.committed, k, v);
            }
            self.pending.clear();
            self.committed.compact();
            // The snapshot is the version's keys, now all in `committed`: written from
            // there in key order (a sorted list of offsets, not of the keys).
            if snapshot {
                result = self.write_snapshot(next).await.map(|()| next);
            }
        }
        match &result {
            Ok(next) => self.version = Some(*next),
            Err(_) => {
                self.version = None;
                self.pending.clear();
            }
        }
        result
    }

    async fn write_snapshot(&mut self, version: u64) -> Result<()> {
        let rows = self.committed.sorted().map(|(k, v)| (k, Some(v)));
        let snapshot = encode::encode(Kind::Snapshot, version, rows)
            .map_err(|e| self.encoding(version, Kind::Snapshot, e))?;
        self.write_once(version, Kind::Snapshot, snapshot).await
    }

    async fn write_next(&mut self) -> Result<u64> {
        let base = self.version.ok_or_else(|| Error::Internal {
            what: format!("state {}: commit without a loaded version", self.dir),
        })?;
        let next = base + 1;
        let files = self.files.get_or_insert_with(Files::default);
        if let Some((v, kind)) = files.beyond(next) {
            return Err(Error::CorruptState {
                path: self.dir.describe(&file_name(v, kind)),
                reason: format!(
                    "a later version than {next}, the one being written, is there: the \
                     state was loaded at version {base}, older than the newest committed"
                ),
            });
        }
        let stale = files.at(next);
        if !stale.is_empty() {
            let names = stale.iter().map(|(v, k)| file_name(*v, *k)).collect();
            self.dir.delete_many(names).await?;
            for (v, k) in stale {
                files.remove(v, k);
            }
        }
        let mut changes: Vec<(&[u8], Option<&[u8]>)> = self.pending.iter().collect();
        // Sorted: a replay making the same changes writes the same bytes, and reading back
        // checks the order.
        changes.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let delta = encode::encode(Kind::Delta, next, changes.into_iter())
            .map_err(|e| self.encoding(next, Kind::Delta, e))?;
        self.dir.create_dir().await?;
        self.write_once(next, Kind::Delta, delta).await?;
        Ok(next)
    }

    /// Writes a version's file once. A file of that name written meanwhile by someone
    /// else is taken when its bytes are these: the same changes on the same version (a
    /// cluster task of a driver killed mid-batch, still running beside the replay's) give
    /// the same bytes. Other bytes mean another query uses the checkpoint.
    async fn write_once(&mut self, version: u64, kind: Kind, bytes: bytes::Bytes) -> Result<()> {
        let name = file_name(version, kind);
        let same = match self.dir.put_new(&name, bytes.clone()).await? {
            crate::storage::WriteOutcome::Written => true,
            crate::storage::WriteOutcome::AlreadyExists => self
                .dir
                .get(&name)
                .await?
                .is_some_and(|found| found == bytes),
        };
        if !same {
            return Err(Error::CheckpointInUse {
                dir: self.dir.to_string(),
                detail: format!("{} was written by someone else", self.dir.describe(&name)),
            });
        }
        if let Some(f) = self.files.as_mut() {
            f.add(version, kind);
        }
        Ok(())
    }

    /// Deletes the files no version among the newest `retain` (counting the one held, which
    /// must be committed: call this after `commits/N`) needs. A failure leaves the files
    /// there for the next call.
    pub async fn purge(&mut self) -> Result<()> {
        let (Some(version), Some(files)) = (self.version, self.files.as_ref()) else {
            return Ok(());
        };
        let gone = files.purge(version, self.conf.retain);
        if gone.is_empty() {
            return Ok(());
        }
        let names = gone.iter().map(|(v, k)| file_name(*v, *k)).collect();
        self.dir.delete_many(names).await?;
        if let Some(f) = self.files.as_mut() {
            for (v, k) in gone {
                f.remove(v, k);
            }
        }
        Ok(())
    }

    fn encoding(&self, version: u64, kind: Kind, reason: String) -> Error {
        Error::Internal {
            what: format!(
                "encoding state file {}: {reason}",
                self.dir.describe(&file_name(version, kind))
            ),
        }
    }

    async fn read(&self, version: u64, kind: Kind) -> Result<bytes::Bytes> {
        let name = file_name(version, kind);
        self.dir
            .get(&name)
            .await?
            .ok_or_else(|| Error::CorruptState {
                path: self.dir.describe(&name),
                reason: "it is missing".into(),
            })
    }

    fn corrupt(&self, version: u64, kind: Kind, reason: String) -> Error {
        Error::CorruptState {
            path: self.dir.describe(&file_name(version, kind)),
            reason,
        }
    }
}

/// A change to a version's keys: `Some` puts, `None` removes.
fn apply(map: &mut FlatMap, key: &[u8], value: Option<&[u8]>) {
    match value {
        Some(v) => map.insert(key, Some(v)),
        None => {
            map.remove(key);
        }
    }
}

/// `state/<operator>/_metadata/metadata`: what the operator's state was written by.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorMetadata {
    pub operator_info: OperatorInfo,
    pub state_store_info: Vec<StoreInfo>,
}

/// The operator part of [`OperatorMetadata`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorInfo {
    pub operator_id: u32,
    pub operator_name: String,
}

/// One store of an operator in [`OperatorMetadata`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreInfo {
    pub store_name: String,
    pub num_cols_prefix_key: u32,
    pub num_partitions: u32,
}

impl OperatorMetadata {
    /// Spark's shape for an operator with one store (`default`) of `partitions` partitions.
    pub fn new(operator_id: u32, operator_name: &str, partitions: u32) -> Self {
        OperatorMetadata {
            operator_info: OperatorInfo {
                operator_id,
                operator_name: operator_name.to_string(),
            },
            state_store_info: vec![StoreInfo {
                store_name: "default".into(),
                num_cols_prefix_key: 0,
                num_partitions: partitions,
            }],
        }
    }

    /// The metadata of operator `operator_id` under `state_root`, if it was written.
    pub async fn read(state_root: &Location, operator_id: u32) -> Result<Option<Self>> {
        let dir = state_root.join(&format!("{operator_id}/_metadata"));
        match read_line(&dir, "metadata").await? {
            Some(line) => Self::parse(&dir.describe("metadata"), &line).map(Some),
            None => Ok(None),
        }
    }

    fn parse(path: &str, line: &str) -> Result<Self> {
        crate::logfile::parse_line(path, 2, line)
    }

    /// Writes this as operator `operator_info.operator_id`'s metadata under `state_root`
    /// (the checkpoint's `state` folder) the first time; later, refuses a query whose
    /// operator or number of partitions differs from what the state was written with.
    pub async fn ensure(&self, state_root: &Location) -> Result<()> {
        let dir = state_root.join(&format!("{}/_metadata", self.operator_info.operator_id));
        let json = serde_json::to_string(self).map_err(|e| Error::Internal {
            what: format!("encoding state metadata: {e}"),
        })?;
        let Some(line) = write_line_once(&dir, "metadata", json).await? else {
            return Ok(());
        };
        let path = dir.describe("metadata");
        let found = Self::parse(&path, &line)?;
        if found != *self {
            return Err(Error::Config {
                key: "state".into(),
                reason: format!(
                    "the checkpoint's state for operator {} was written by {} with {} \
                     partition(s) ({path}); this query has {} with {}: a stateful query's \
                     operators and partitions cannot change on the same checkpoint",
                    found.operator_info.operator_id,
                    found.operator_info.operator_name,
                    partitions(&found),
                    self.operator_info.operator_name,
                    partitions(self),
                ),
            });
        }
        Ok(())
    }
}

/// Writes `v1` and `line` as `dir/name` if there is no such file (`None`); otherwise the
/// line the file holds, for the caller to compare with its own.
pub(crate) async fn write_line_once(
    dir: &Location,
    name: &str,
    line: String,
) -> Result<Option<String>> {
    dir.create_dir().await?;
    let bytes = crate::logfile::render([line]);
    if let crate::storage::WriteOutcome::Written = dir.put_new(name, bytes).await? {
        return Ok(None);
    }
    read_line(dir, name)
        .await?
        .map(Some)
        .ok_or_else(|| Error::CorruptState {
            path: dir.describe(name),
            reason: "it vanished while being read".into(),
        })
}

/// The line a file written by [`write_line_once`] holds, if there is one.
pub(crate) async fn read_line(dir: &Location, name: &str) -> Result<Option<String>> {
    let Some(found) = dir.get(name).await? else {
        return Ok(None);
    };
    let path = dir.describe(name);
    let lines = crate::logfile::parse_versioned(&found, &path, 1, "state metadata")?;
    Ok(Some(lines.into_iter().next().unwrap_or_default()))
}

fn partitions(m: &OperatorMetadata) -> u32 {
    m.state_store_info.first().map_or(0, |s| s.num_partitions)
}

#[cfg(test)]
mod tests;
