//! What retention deletes, decided without I/O.

use std::ops::Range;

/// Which log entries to delete when batches below `keep_from` fall out of retention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purge {
    /// Nothing new fell out.
    Nothing,
    /// Not known what an earlier run left: list the folder and delete every id below this.
    ListBelow(u64),
    /// Exactly these ids (everything below was deleted before in this run).
    Range(Range<u64>),
}

/// `purged_below`: ids below it were deleted earlier in this run (`None`: nothing known).
pub fn purge(purged_below: Option<u64>, keep_from: u64) -> Purge {
    match purged_below {
        Some(b) if keep_from <= b => Purge::Nothing,
        Some(b) => Purge::Range(b..keep_from),
        None if keep_from == 0 => Purge::Nothing,
        None => Purge::ListBelow(keep_from),
    }
}

/// The first batch whose logs are kept after committing `committed`, keeping `retain`
/// batches; `None` while nothing falls out.
pub fn keep_from(committed: u64, retain: u64) -> Option<u64> {
    (committed + 1).checked_sub(retain).filter(|k| *k > 0)
}

/// The file source log: the first entry kept after committing log offset `end`, keeping
/// `retain` batches and the newest compact entry (every `interval`-th) at or below `end`;
/// `None` while there is no compact entry yet.
pub fn log_keep_from(end: u64, retain: u64, interval: u64) -> Option<u64> {
    let compact = (0..=end)
        .rev()
        .find(|id| (id + 1).is_multiple_of(interval))?;
    let floor = (end + 1).saturating_sub(retain);
    Some(floor.min(compact))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_deletes_each_entry_once_and_lists_only_at_the_first_commit() {
        assert_eq!(purge(None, 0), Purge::Nothing);
        assert_eq!(purge(None, 7), Purge::ListBelow(7));
        assert_eq!(purge(Some(7), 8), Purge::Range(7..8));
        assert_eq!(purge(Some(8), 8), Purge::Nothing);
        assert_eq!(keep_from(1, 100), None);
        assert_eq!(keep_from(99, 100), None);
        assert_eq!(keep_from(100, 100), Some(1));
        assert_eq!(keep_from(24, 3), Some(22));
        // File source log, compact every 10th: keep the newest compact and what follows.
        assert_eq!(log_keep_from(5, 3, 10), None);
        assert_eq!(log_keep_from(9, 3, 10), Some(7));
        assert_eq!(log_keep_from(24, 3, 10), Some(19));
        assert_eq!(log_keep_from(24, 100, 10), Some(0));
    }
}
