//! Telling a topic that was deleted and made again from the one the query read.
//!
//! A recreated topic that has grown past the recorded offsets looks like the old one to
//! every offset check: the batch's start lies between the new topic's watermarks, and the
//! new topic's first records (before that start) would be skipped without a word. Spark
//! has the same blind spot. Topic ids would tell, but not every broker gives one (the test
//! broker answers all-zero ids), so weir checks the records themselves, on any broker:
//!
//! - each read keeps a mark of the last record it read in each partition: its offset, its
//!   Kafka timestamp and a hash of its key and value;
//! - the marks are kept in memory and, before each batch's commit, in the source's own
//!   log (`sources/0/marks`, a few per partition), so a restart checks too;
//! - a read starting at `from` with a mark at `from - 1` starts one record earlier and
//!   compares that record with the mark ([`compare`]); a different record means a new
//!   topic: data loss (an error, or with `failOnDataLoss = false` a warning and the read
//!   goes on).
//!
//! What it cannot see: a record at `from - 1` that is gone (compacted, or a transaction
//! marker there) is not checked; a new topic whose record at that offset has the same
//! timestamp, key and value as the old one passes.
//!
//! On a cluster the workers read: the plan carries the driver's marks of the partitions
//! read (as they are when the plan is sent), each task checks its ranges against them, and
//! the driver reads the last record of each range itself before the commit to keep its
//! mark (one record per partition and batch).

use std::collections::BTreeMap;

use rdkafka::message::{BorrowedMessage, Message};
use serde::{Deserialize, Serialize};

/// A record as the check sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Mark {
    pub offset: i64,
    pub timestamp: Option<i64>,
    pub hash: u64,
}

impl Mark {
    pub(crate) fn of(m: &BorrowedMessage<'_>) -> Mark {
        let key = weir_core::storage::fnv1a(m.key().unwrap_or_default());
        let value = match m.payload() {
            Some(v) => weir_core::storage::fnv1a(v),
            None => 0,
        };
        Mark {
            offset: m.offset(),
            timestamp: m.timestamp().to_millis(),
            hash: key.rotate_left(1) ^ value,
        }
    }
}

/// How many marks a partition keeps: the batch that runs, the one read ahead, and a
/// replay's start after a crash between them.
const KEEP: usize = 4;

/// The marks of every partition read, newest last.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Marks(BTreeMap<String, BTreeMap<i32, Vec<Mark>>>);

impl Marks {
    /// Adds `mark` for a partition (replacing one at the same offset).
    pub(crate) fn add(&mut self, topic: &str, partition: i32, mark: Mark) {
        let v = self
            .0
            .entry(topic.to_string())
            .or_default()
            .entry(partition)
            .or_default();
        v.retain(|m| m.offset != mark.offset);
        v.push(mark);
        v.sort_by_key(|m| m.offset);
        if v.len() > KEEP {
            v.remove(0);
        }
    }

    /// The mark at `offset` of a partition, if one was kept.
    pub(crate) fn at(&self, topic: &str, partition: i32, offset: i64) -> Option<Mark> {
        self.0
            .get(topic)?
            .get(&partition)?
            .iter()
            .find(|m| m.offset == offset)
            .copied()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The marks of the partitions `parts` only (what a task reading them needs).
    pub(crate) fn only<'a>(&self, parts: impl Iterator<Item = (&'a str, i32)>) -> Marks {
        let mut out = Marks::default();
        for (t, p) in parts {
            if let Some(m) = self.0.get(t).and_then(|ps| ps.get(&p)) {
                out.0.entry(t.to_string()).or_default().insert(p, m.clone());
            }
        }
        out
    }
}

/// Compares the record found at a mark's offset with the mark: `None` when it is the same
/// record, else what differs.
pub(crate) fn compare(seen: &Mark, now: &Mark) -> Option<String> {
    if seen.offset != now.offset {
        return None;
    }
    let shown = |t: Option<i64>| t.map_or("none".to_string(), |t| format!("{t} ms"));
    if seen.timestamp != now.timestamp {
        return Some(format!(
            "the record at offset {} is not the one an earlier batch read there (timestamp {} then, {} now): the topic was deleted and made again, and its records before offset {} were never read",
            now.offset,
            shown(seen.timestamp),
            shown(now.timestamp),
            now.offset + 1
        ));
    }
    if seen.hash != now.hash {
        return Some(format!(
            "the record at offset {} is not the one an earlier batch read there (same timestamp, another key or value): the topic was deleted and made again, and its records before offset {} were never read",
            now.offset,
            now.offset + 1
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(offset: i64, timestamp: Option<i64>, hash: u64) -> Mark {
        Mark {
            offset,
            timestamp,
            hash,
        }
    }

    #[test]
    fn a_record_that_differs_from_its_mark_is_a_new_topic() {
        for (seen, now, differs) in [
            (mark(9, Some(1), 7), mark(9, Some(1), 7), false),
            (mark(9, Some(1), 7), mark(9, Some(2), 7), true),
            (mark(9, Some(1), 7), mark(9, Some(1), 8), true),
            (mark(9, None, 7), mark(9, Some(1), 7), true),
            // Another offset is no evidence (the record at the mark's offset is gone).
            (mark(9, Some(1), 7), mark(10, Some(2), 8), false),
        ] {
            let got = compare(&seen, &now);
            assert_eq!(got.is_some(), differs, "{seen:?} {now:?}: {got:?}");
            if let Some(why) = got {
                assert!(
                    why.contains("offset 9") && why.contains("before offset 10"),
                    "{why}"
                );
            }
        }
    }

    #[test]
    fn a_partition_keeps_its_newest_marks_and_finds_them_by_offset() {
        let mut m = Marks::default();
        for o in [5, 9, 2, 14, 20, 9] {
            m.add("t", 0, mark(o, Some(o), 0));
        }
        assert_eq!(m.at("t", 0, 2), None, "the oldest went");
        assert_eq!(m.at("t", 0, 9), Some(mark(9, Some(9), 0)));
        assert_eq!(m.at("t", 1, 9), None);
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<Marks>(&json).unwrap(), m);
    }
}
