//! Which state files a version needs and which retention lets go, decided without I/O.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

/// The two kinds of state file of one (operator, partition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `<version>.delta`: the keys one batch put or removed.
    Delta,
    /// `<version>.snapshot`: every key of the version.
    Snapshot,
}

impl Kind {
    /// The file name's suffix, also written into the file and checked when it is read back.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Delta => "delta",
            Kind::Snapshot => "snapshot",
        }
    }
}

/// The file name of `version` of this kind (`7.delta`, `10.snapshot`), as Spark names them.
pub fn file_name(version: u64, kind: Kind) -> String {
    format!("{version}.{}", kind.label())
}

/// The version and kind of a state file's name; `None` for any other name (temporary files,
/// `.crc` files Spark leaves, `_metadata`).
pub fn parse_name(name: &str) -> Option<(u64, Kind)> {
    let (digits, suffix) = name.split_once('.')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // `007.delta` is not the name weir gives version 7.
    if digits.len() > 1 && digits.starts_with('0') {
        return None;
    }
    let kind = match suffix {
        "delta" => Kind::Delta,
        "snapshot" => Kind::Snapshot,
        _ => return None,
    };
    Some((digits.parse().ok()?, kind))
}

/// The state files one (operator, partition) has: listed once, then kept up to date by what
/// the store writes and deletes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Files {
    deltas: BTreeSet<u64>,
    snapshots: BTreeSet<u64>,
}

/// How to build a version: start from `snapshot` (none: the empty state of version 0) and
/// apply the deltas of `deltas` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    pub snapshot: Option<u64>,
    pub deltas: RangeInclusive<u64>,
}

impl Files {
    /// The state files among a folder's `names`.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Files {
        let mut f = Files::default();
        for (v, kind) in names.into_iter().filter_map(parse_name) {
            f.add(v, kind);
        }
        f
    }

    /// Notes a file written.
    pub fn add(&mut self, version: u64, kind: Kind) {
        match kind {
            Kind::Delta => self.deltas.insert(version),
            Kind::Snapshot => self.snapshots.insert(version),
        };
    }

    /// Notes a file deleted.
    pub fn remove(&mut self, version: u64, kind: Kind) {
        match kind {
            Kind::Delta => self.deltas.remove(&version),
            Kind::Snapshot => self.snapshots.remove(&version),
        };
    }

    /// The newest version any file holds (0 when there is none).
    pub fn newest(&self) -> u64 {
        let d = self.deltas.last().copied().unwrap_or(0);
        let s = self.snapshots.last().copied().unwrap_or(0);
        d.max(s)
    }

    /// A file of a version after `version`, if there is one.
    pub fn beyond(&self, version: u64) -> Option<(u64, Kind)> {
        let d = self
            .deltas
            .range(version + 1..)
            .next()
            .map(|v| (*v, Kind::Delta));
        let s = self
            .snapshots
            .range(version + 1..)
            .next()
            .map(|v| (*v, Kind::Snapshot));
        d.into_iter().chain(s).min()
    }

    /// The files of `version`.
    pub fn at(&self, version: u64) -> Vec<(u64, Kind)> {
        let d = self
            .deltas
            .contains(&version)
            .then_some((version, Kind::Delta));
        let s = self
            .snapshots
            .contains(&version)
            .then_some((version, Kind::Snapshot));
        d.into_iter().chain(s).collect()
    }

    /// The oldest version the files can build, once retention has let older ones go.
    pub fn oldest_loadable(&self) -> Option<u64> {
        let first_delta = self.deltas.first().copied()?;
        if first_delta <= 1 {
            return None;
        }
        self.snapshots
            .range(first_delta.saturating_sub(1)..)
            .next()
            .copied()
    }

    /// Version 0 is the empty state: a `0.snapshot` (no store writes one) is never used.
    fn newest_snapshot_at_or_below(&self, version: u64) -> Option<u64> {
        self.snapshots
            .range(..=version)
            .next_back()
            .copied()
            .filter(|s| *s > 0)
    }

    /// How to build `version`: the newest snapshot at or below it and every delta after
    /// that. `Err(v)`: the delta of version `v` is needed and not there (state is never
    /// rebuilt from less than all of its files).
    pub fn plan(&self, version: u64) -> Result<LoadPlan, u64> {
        let snapshot = self.newest_snapshot_at_or_below(version);
        let from = snapshot.map_or(1, |s| s + 1);
        if let Some(missing) = (from..=version).find(|v| !self.deltas.contains(v)) {
            return Err(missing);
        }
        Ok(LoadPlan {
            snapshot,
            deltas: from..=version,
        })
    }

    /// The files retention lets go once `version` is committed and the `retain` newest
    /// versions must stay loadable: everything below the newest snapshot at or below the
    /// oldest version kept (that snapshot and what follows it rebuild every kept version).
    pub fn purge(&self, version: u64, retain: u64) -> Vec<(u64, Kind)> {
        let Some(oldest_kept) = (version + 1).checked_sub(retain.max(1)) else {
            return Vec::new();
        };
        let Some(base) = self.newest_snapshot_at_or_below(oldest_kept) else {
            return Vec::new();
        };
        let deltas = self.deltas.range(..=base).map(|v| (*v, Kind::Delta));
        let snapshots = self.snapshots.range(..base).map(|v| (*v, Kind::Snapshot));
        deltas.chain(snapshots).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_other_files_are_ignored() {
        assert_eq!(file_name(7, Kind::Delta), "7.delta");
        assert_eq!(file_name(10, Kind::Snapshot), "10.snapshot");
        assert_eq!(parse_name("7.delta"), Some((7, Kind::Delta)));
        assert_eq!(parse_name("10.snapshot"), Some((10, Kind::Snapshot)));
        for other in [
            ".7.delta.crc",
            "7.delta.tmp",
            "_metadata",
            "x.delta",
            ".delta",
            "7",
        ] {
            assert_eq!(parse_name(other), None, "{other}");
        }
    }

    /// (snapshot, deltas) of the plan for `version`.
    fn plan(f: &Files, version: u64) -> Result<(Option<u64>, Vec<u64>), u64> {
        f.plan(version).map(|p| (p.snapshot, p.deltas.collect()))
    }

    #[test]
    fn a_version_is_built_from_the_newest_snapshot_and_the_deltas_after_it() {
        let f = Files::from_names(["1.delta", "2.delta", "3.delta", "3.snapshot", "4.delta"]);
        assert_eq!(plan(&f, 0), Ok((None, vec![])));
        assert_eq!(plan(&f, 2), Ok((None, vec![1, 2])));
        assert_eq!(plan(&f, 3), Ok((Some(3), vec![])));
        assert_eq!(plan(&f, 4), Ok((Some(3), vec![4])));
        // Version 5 has no delta: an error naming it, never a shorter state.
        assert_eq!(plan(&f, 5), Err(5));
        let gap = Files::from_names(["1.delta", "3.delta"]);
        assert_eq!(plan(&gap, 3), Err(2));
        assert_eq!(f.beyond(3), Some((4, Kind::Delta)));
        assert_eq!(f.beyond(4), None);
        assert_eq!(f.at(3), vec![(3, Kind::Delta), (3, Kind::Snapshot)]);
    }

    #[test]
    fn retention_keeps_the_snapshot_that_rebuilds_the_oldest_kept_version() {
        let mut f = Files::default();
        for v in 1..=25 {
            f.add(v, Kind::Delta);
            if v % 10 == 0 {
                f.add(v, Kind::Snapshot);
            }
        }
        // Keeping 10 versions after 25: 16..=25 must load; snapshot 10 and deltas 11.. do it.
        let mut gone = f.purge(25, 10);
        gone.sort_by_key(|(v, k)| (*v, *k == Kind::Snapshot));
        assert_eq!(gone, (1..=10).map(|v| (v, Kind::Delta)).collect::<Vec<_>>());
        for (v, k) in gone {
            f.remove(v, k);
        }
        for v in 11..=25 {
            assert!(f.plan(v).is_ok(), "{v}");
        }
        // Nothing new to let go until a newer snapshot is at or below the oldest kept version.
        assert!(f.purge(29, 11).is_empty());
        // After 30 with 5 kept (26..=30): snapshot 20 covers 26; snapshot 10 and deltas to 20 go.
        for v in 26..=30 {
            f.add(v, Kind::Delta);
        }
        f.add(30, Kind::Snapshot);
        let gone = f.purge(30, 5);
        assert!(gone.contains(&(10, Kind::Snapshot)), "{gone:?}");
        assert!(gone.contains(&(20, Kind::Delta)), "{gone:?}");
        assert!(!gone.contains(&(20, Kind::Snapshot)), "{gone:?}");
        assert!(!gone.contains(&(21, Kind::Delta)), "{gone:?}");
        assert!(Files::default().purge(3, 100).is_empty());
    }
}
