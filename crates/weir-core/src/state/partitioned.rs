//! An operator's state split into partitions by key hash (`state-partitions`, Spark's
//! `spark.sql.shuffle.partitions` for state): partition `p` is its own [`StateStore`] in
//! `state/<operator>/<p>/`, loaded, committed and purged on its own, so the partitions'
//! work can run on several cores (and, later, on several machines).
//!
//! A key's partition is [`partition_of`] its encoded bytes: a hash of weir's own, fixed
//! across releases and machines, because the partition a key was written to must be the one
//! it is read from for the life of the checkpoint. The number of partitions is recorded in
//! the operator's metadata when its state is first written and cannot change afterwards
//! (Spark refuses a changed `spark.sql.shuffle.partitions` on the same checkpoint too).
//!
//! Every partition commits version N+1 for batch N, with or without rows of that batch, so
//! every partition can load every retained version.

use futures::future::try_join_all;

use super::{StateConf, StateStore};
use crate::error::{Error, Result};
use crate::storage::Location;

/// The most partitions an operator's state may have: each batch writes a file per
/// partition, so more is only a cost.
pub const MAX_PARTITIONS: u32 = 1024;

/// The partition, of `partitions`, that `key` (an operator's encoded key) lives in.
///
/// FNV-1a over the bytes, then MurmurHash3's 64-bit finalizer so that every bit of the hash
/// depends on every byte (FNV alone spreads short keys badly over a small modulus). The
/// value is part of the checkpoint's format: it must never change.
pub fn partition_of(key: &[u8], partitions: u32) -> usize {
    if partitions <= 1 {
        return 0;
    }
    let mut h = crate::storage::fnv1a(key);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (h % u64::from(partitions)) as usize
}

/// Checks a `state-partitions` setting: at least 1, at most [`MAX_PARTITIONS`].
pub fn check_partitions(key: &str, n: u32) -> Result<u32> {
    if n == 0 || n > MAX_PARTITIONS {
        return Err(Error::config(
            key,
            format!(
                "{n} state partitions: use 1 to {MAX_PARTITIONS} (each batch writes a state \
                 file per partition and operator)"
            ),
        ));
    }
    Ok(n)
}

/// The state of one operator, in partitions.
#[derive(Debug)]
pub struct PartitionedStore {
    parts: Vec<StateStore>,
}

impl PartitionedStore {
    /// The store of the operator whose folder is `dir` (`state/<operator>`), in
    /// `partitions` partitions (`dir/0` .. `dir/<partitions - 1>`); nothing is read yet.
    pub fn new(dir: &Location, partitions: u32, conf: StateConf) -> Self {
        let parts = (0..partitions.max(1))
            .map(|p| StateStore::new(dir.join(&p.to_string()), conf))
            .collect();
        PartitionedStore { parts }
    }

    /// The number of partitions.
    pub fn partitions(&self) -> u32 {
        self.parts.len() as u32
    }

    /// Runs `work` on every partition (its index and store), on up to as many threads as
    /// the machine has cores when `parallel`, else on this one; the results in partition
    /// order. A panic in `work` is raised again here.
    pub fn each_part<T: Send>(
        &mut self,
        parallel: bool,
        work: impl Fn(usize, &mut StateStore) -> T + Sync,
    ) -> Vec<T> {
        let threads = if parallel {
            std::thread::available_parallelism()
                .map_or(1, std::num::NonZeroUsize::get)
                .min(self.parts.len())
        } else {
            1
        };
        if threads <= 1 {
            return self
                .parts
                .iter_mut()
                .enumerate()
                .map(|(p, s)| work(p, s))
                .collect();
        }
        let chunk = self.parts.len().div_ceil(threads);
        let work = &work;
        std::thread::scope(|scope| {
            let running: Vec<_> = self
                .parts
                .chunks_mut(chunk)
                .enumerate()
                .map(|(i, stores)| {
                    scope.spawn(move || {
                        stores
                            .iter_mut()
                            .enumerate()
                            .map(|(j, s)| work(i * chunk + j, s))
                            .collect::<Vec<T>>()
                    })
                })
                .collect();
            running
                .into_iter()
                .flat_map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }

    /// Puts `store` in as partition `p`'s, giving back the one it held (a worker swaps in
    /// the partitions it owns, kept from an earlier batch).
    pub fn replace(&mut self, p: usize, store: StateStore) -> Option<StateStore> {
        self.parts
            .get_mut(p)
            .map(|slot| std::mem::replace(slot, store))
    }

    /// Partition `p`'s store.
    pub fn store_mut(&mut self, p: usize) -> Option<&mut StateStore> {
        self.parts.get_mut(p)
    }

    /// The version every partition holds (`None` if any holds none or another one).
    pub fn version(&self) -> Option<u64> {
        let first = self.parts.first()?.version()?;
        self.parts
            .iter()
            .all(|p| p.version() == Some(first))
            .then_some(first)
    }

    /// The newest version each partition's files hold (0: none), in partition order: a
    /// commit cut off between partitions leaves some a version ahead, and a partition far
    /// behind the others lost files.
    pub async fn newest_versions(&mut self) -> Result<Vec<u64>> {
        try_join_all(self.parts.iter_mut().map(StateStore::newest_version)).await
    }

    /// Makes every partition hold `version` (see [`StateStore::load`]), reading them at once.
    pub async fn load(&mut self, version: u64) -> Result<()> {
        try_join_all(self.parts.iter_mut().map(|p| p.load(version))).await?;
        Ok(())
    }

    fn part(&self, key: &[u8]) -> &StateStore {
        &self.parts[partition_of(key, self.partitions())]
    }

    fn part_mut(&mut self, key: &[u8]) -> &mut StateStore {
        let p = partition_of(key, self.partitions());
        &mut self.parts[p]
    }

    /// The value of `key` as this attempt sees it.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.part(key).get(key)
    }

    /// Sets `key` to `value`.
    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.part_mut(&key).put(key, value);
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: Vec<u8>) {
        self.part_mut(&key).remove(key);
    }

    /// Every key and value as this attempt sees them, partition by partition.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.parts.iter().flat_map(StateStore::iter)
    }

    /// Keys in the committed version.
    pub fn len(&self) -> usize {
        self.parts.iter().map(StateStore::len).sum()
    }

    /// Whether the committed version holds no key.
    pub fn is_empty(&self) -> bool {
        self.parts.iter().all(StateStore::is_empty)
    }

    /// Memory the committed version takes, estimated.
    pub fn memory_bytes(&self) -> usize {
        self.parts.iter().map(StateStore::memory_bytes).sum()
    }

    /// Commits every partition's changes as the next version, the partitions' files
    /// written at once (see [`StateStore::commit`]). An error leaves the partitions that
    /// failed holding nothing, so the batch's replay loads every one again.
    pub async fn commit(&mut self) -> Result<u64> {
        // A version with snapshots holds a partition's whole state, sorted and encoded,
        // while it is written: one partition after another then, so that the memory this
        // takes is one partition's, not the operator's.
        let versions = if self.parts.iter().any(StateStore::snapshot_due) {
            let mut versions = Vec::with_capacity(self.parts.len());
            for part in self.parts.iter_mut() {
                versions.push(part.commit().await?);
            }
            versions
        } else {
            try_join_all(self.parts.iter_mut().map(StateStore::commit)).await?
        };
        versions.into_iter().max().ok_or_else(|| Error::Internal {
            what: "a state store without partitions".into(),
        })
    }

    /// Lets retention delete what no kept version needs, in every partition.
    pub async fn purge(&mut self) -> Result<()> {
        try_join_all(self.parts.iter_mut().map(StateStore::purge)).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash is part of the checkpoint's format: these values must never change.
    #[test]
    fn a_key_s_partition_is_fixed() {
        let cases: &[(&[u8], u32, usize)] = &[
            (b"", 1, 0),
            (b"anything", 1, 0),
            (b"", 8, 6),
            (b"order-1", 200, 157),
        ];
        for (key, n, want) in cases {
            assert_eq!(partition_of(key, *n), *want, "{key:?} of {n}");
        }
        let fixed: Vec<usize> = (0u64..8)
            .map(|i| partition_of(&i.to_le_bytes(), 8))
            .collect();
        assert_eq!(fixed, [6, 6, 2, 2, 1, 3, 2, 5], "0..8 as 8-byte keys, of 8");
    }

    #[test]
    fn keys_spread_over_partitions() {
        for n in [2u32, 3, 8, 200] {
            let mut counts = vec![0u32; n as usize];
            let keys = 20_000u64;
            for i in 0..keys {
                counts[partition_of(&i.to_be_bytes(), n)] += 1;
            }
            let mean = keys as f64 / f64::from(n);
            // Within 5 standard deviations of a uniform spread.
            let bound = 5.0 * mean.sqrt();
            for (p, c) in counts.iter().enumerate() {
                let off = (f64::from(*c) - mean).abs();
                assert!(
                    off < bound,
                    "{n} partitions: partition {p} has {c}, mean {mean}"
                );
            }
        }
    }

    #[test]
    fn the_setting_is_checked() {
        assert!(check_partitions("query.state-partitions", 0).is_err());
        assert!(check_partitions("query.state-partitions", MAX_PARTITIONS + 1).is_err());
        assert_eq!(check_partitions("query.state-partitions", 8).ok(), Some(8));
    }
}
