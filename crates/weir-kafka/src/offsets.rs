//! Offsets in Spark's shape and the pure decisions made on them: the rate limit split and
//! the data-loss check.

use std::collections::BTreeMap;

use crate::PartitionOffsets;
use crate::error::KafkaSourceError;

/// `{"t":{"0":1}}` into offsets.
pub(crate) fn parse(v: &serde_json::Value) -> Result<PartitionOffsets, KafkaSourceError> {
    let bad = || KafkaSourceError::Invalid {
        what: "Kafka offset".into(),
        reason: format!("{v} is not {{\"topic\":{{\"partition\":offset}}}}"),
    };
    let mut out = PartitionOffsets::new();
    for (t, ps) in v.as_object().ok_or_else(bad)? {
        let m = out.entry(t.clone()).or_default();
        for (p, o) in ps.as_object().ok_or_else(bad)? {
            m.insert(p.parse().map_err(|_| bad())?, o.as_i64().ok_or_else(bad)?);
        }
    }
    Ok(out)
}

/// Offsets as Spark's JSON.
pub(crate) fn to_json(o: &PartitionOffsets) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (t, ps) in o {
        let inner: serde_json::Map<String, serde_json::Value> = ps
            .iter()
            .map(|(p, o)| (p.to_string(), serde_json::Value::from(*o)))
            .collect();
        m.insert(t.clone(), serde_json::Value::Object(inner));
    }
    serde_json::Value::Object(m)
}

/// Spark's rate limit: each partition gets its share of `limit` by backlog; a share below
/// one record is rounded up, so that no partition with a backlog starves, and the others are
/// rounded down (the total may exceed the limit by less than one record per partition, as
/// in Spark).
pub fn split_limit(
    backlog: &BTreeMap<(String, i32), i64>,
    limit: u64,
) -> BTreeMap<(String, i32), i64> {
    let total: i64 = backlog.values().sum();
    backlog
        .iter()
        .map(|(tp, &size)| {
            if total <= limit as i64 || total == 0 {
                return (tp.clone(), size);
            }
            let prorate = limit as f64 * (size as f64 / total as f64);
            let n = if prorate < 1.0 {
                prorate.ceil()
            } else {
                prorate.floor()
            } as i64;
            (tp.clone(), n.min(size))
        })
        .collect()
}

/// Spark's `minOffsetsPerTrigger` gate: wait (plan no batch) while fewer than `min` new
/// records are available, unless `delay` has passed since the last batch.
pub(crate) fn wait_for_more(
    available: u64,
    min: u64,
    waited: std::time::Duration,
    delay: std::time::Duration,
) -> bool {
    available < min && waited < delay
}

/// Checks `begin` against the partition's watermarks: data loss is an error, or (with
/// failOnDataLoss=false) a warning and a start at the earliest offset still there.
pub fn check_loss(
    fail: bool,
    topic: &str,
    p: i32,
    begin: i64,
    low: i64,
    high: i64,
) -> Result<i64, KafkaSourceError> {
    let detail = if begin < low {
        format!("offsets {begin}..{low} were deleted (earliest available is {low})")
    } else if begin > high {
        format!(
            "the recorded offset {begin} is beyond the latest {high}: the topic was recreated or truncated"
        )
    } else {
        return Ok(begin);
    };
    if fail {
        return Err(KafkaSourceError::DataLoss {
            topic: topic.into(),
            partition: p,
            detail,
        });
    }
    // Once per loss: the same partition is checked again at every trigger until a batch
    // moves past it, and again when the batch is read.
    if first_report(topic, p, begin, low) {
        tracing::warn!(
            "topic {topic} partition {p}: {detail}; reading on from {low} (failOnDataLoss=false)"
        );
    }
    Ok(low)
}

/// True the first time this process reports the loss of `begin..low` in a partition.
fn first_report(topic: &str, p: i32, begin: i64, low: i64) -> bool {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    type Seen = Mutex<HashSet<(String, i32, i64, i64)>>;
    static SEEN: OnceLock<Seen> = OnceLock::new();
    SEEN.get_or_init(Default::default)
        .lock()
        .map(|mut s| s.insert((topic.to_string(), p, begin, low)))
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(sizes: &[i64]) -> BTreeMap<(String, i32), i64> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, s)| (("t".to_string(), i as i32), *s))
            .collect()
    }

    #[test]
    fn the_rate_limit_is_split_by_backlog_like_spark_and_starves_no_partition() {
        let take = |sizes: &[i64], limit| {
            split_limit(&backlog(sizes), limit)
                .values()
                .copied()
                .collect::<Vec<_>>()
        };
        assert_eq!(take(&[100, 300, 0], 100), vec![25, 75, 0]);
        assert_eq!(take(&[100, 300, 0], 1000), vec![100, 300, 0]);
        // Three partitions of one record, limit 2: every share is 2/3, rounded up.
        assert_eq!(take(&[1, 1, 1], 2), vec![1, 1, 1]);
        // A small partition next to big ones still gets a record each batch.
        assert_eq!(take(&[1_000_000, 1_000_000, 3], 10), vec![4, 4, 1]);
    }

    #[test]
    fn min_offsets_wait_for_enough_records_or_the_delay() {
        use std::time::Duration;
        let s = Duration::from_secs;
        assert!(wait_for_more(3, 100, s(1), s(15)));
        assert!(!wait_for_more(3, 100, s(15), s(15)), "the delay passed");
        assert!(!wait_for_more(100, 100, s(0), s(15)), "enough records");
    }

    #[test]
    fn offsets_round_trip_in_sparks_shape() {
        let v: serde_json::Value = serde_json::from_str(r#"{"orders":{"0":123,"1":456}}"#).unwrap();
        let o = parse(&v).unwrap();
        assert_eq!(to_json(&o), v);
        assert!(parse(&serde_json::json!({"orders": [1]})).is_err());
    }

    #[test]
    fn data_loss_fails_or_moves_on() {
        assert!(matches!(
            check_loss(true, "t", 0, 5, 10, 20),
            Err(KafkaSourceError::DataLoss { .. })
        ));
        assert_eq!(check_loss(false, "t", 0, 5, 10, 20).unwrap(), 10);
        assert!(
            !first_report("t", 0, 5, 10),
            "reported once, by the call above"
        );
        assert!(first_report("t", 0, 6, 10), "another loss is reported");
        assert_eq!(check_loss(true, "t", 0, 15, 10, 20).unwrap(), 15);
        assert!(
            check_loss(true, "t", 0, 25, 0, 3)
                .unwrap_err()
                .to_string()
                .contains("recreated")
        );
    }
}
