//! When batches run.

use std::time::Duration;

use crate::error::{Error, Result};

/// Spark's triggers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A batch at every multiple of the interval (from the query's start) when there is
    /// new data; a batch that overruns the interval is followed at once by the next, with
    /// a warning. `Duration::ZERO`: as fast as possible.
    ProcessingTime(Duration),
    /// Everything present at start, in as many batches as the read limits require, then stop.
    AvailableNow,
    /// One batch (the pending replay, if there is one), then stop.
    Once,
    /// Spark's continuous mode: refused with `foreach_batch`, as in Spark.
    Continuous(Duration),
}

impl Default for Trigger {
    fn default() -> Self {
        Trigger::ProcessingTime(Duration::ZERO)
    }
}

impl Trigger {
    /// The interval in ms for the falling-behind check (0 where it does not apply).
    pub fn interval_ms(&self) -> u64 {
        match self {
            Trigger::ProcessingTime(d) => d.as_millis() as u64,
            _ => 0,
        }
    }
}

impl std::str::FromStr for Trigger {
    type Err = Error;

    /// `available-now`, `once`, `continuous:<duration>`, or a processing-time interval:
    /// `0`, `500ms`, `30s`, `5m`, `processing-time:30s`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        match s {
            "available-now" => Ok(Trigger::AvailableNow),
            "once" => Ok(Trigger::Once),
            _ => {
                if let Some(d) = s.strip_prefix("continuous:") {
                    return Ok(Trigger::Continuous(parse_duration("trigger", d)?));
                }
                let d = s.strip_prefix("processing-time:").unwrap_or(s);
                parse_duration("trigger", d).map(Trigger::ProcessingTime).map_err(|e| {
                    if d.starts_with(|c: char| c.is_ascii_digit()) {
                        // A number with a unit: the duration's own complaint is the useful one.
                        return e;
                    }
                    Error::config(
                        "trigger",
                        format!(
                            "'{s}' is not a trigger: use available-now, once, or an interval such as 30s"
                        ),
                    )
                })
            }
        }
    }
}

/// Parses `250ms`, `30s`, `5m`, `2h`, `7d` or `0`, or Spark's spellings (`10 minutes`,
/// `30 seconds`, `1 hour`, `2 days`, `500 milliseconds`); errors name `key`.
pub fn parse_duration(key: &str, s: &str) -> Result<Duration> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        Error::config(
            key,
            format!("'{s}' is not a duration such as 500ms, 30s, 5m, 2h, 7d or 10 minutes"),
        )
    })?;
    let factor: u64 = match unit.trim() {
        "ms" | "millisecond" | "milliseconds" => 1,
        "s" | "second" | "seconds" => 1000,
        "m" | "min" | "minute" | "minutes" => 60_000,
        "h" | "hour" | "hours" => 3_600_000,
        "d" | "day" | "days" => 86_400_000,
        other => {
            return Err(Error::config(
                key,
                format!("'{other}' in '{s}' is not a unit: use ms, s, m, h or d"),
            ));
        }
    };
    let ms = n.checked_mul(factor).ok_or_else(|| {
        Error::config(
            key,
            format!("'{s}' is too long (more than {} ms)", u64::MAX),
        )
    })?;
    Ok(Duration::from_millis(ms))
}

/// The next start time at a multiple of `interval` after `origin`, as Spark's
/// `ProcessingTimeExecutor` computes it.
pub fn next_tick(origin_ms: u64, now_ms: u64, interval_ms: u64) -> u64 {
    if interval_ms == 0 {
        return now_ms;
    }
    let since = now_ms.saturating_sub(origin_ms);
    origin_ms + (since / interval_ms + 1) * interval_ms
}

/// `v` milliseconds.
pub(super) fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Waits until `deadline`, or until the query is told to stop.
pub(super) async fn wait_until(
    deadline: tokio::time::Instant,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    tokio::select! {
        _ = tokio::time::sleep_until(deadline) => {}
        _ = stop.wait_for(|s| *s) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triggers_and_durations_parse() {
        assert_eq!(
            "available-now".parse::<Trigger>().unwrap(),
            Trigger::AvailableNow
        );
        assert_eq!("once".parse::<Trigger>().unwrap(), Trigger::Once);
        assert_eq!(
            "30s".parse::<Trigger>().unwrap(),
            Trigger::ProcessingTime(Duration::from_secs(30))
        );
        assert_eq!(
            "0".parse::<Trigger>().unwrap(),
            Trigger::ProcessingTime(Duration::ZERO)
        );
        assert_eq!(
            "continuous:1s".parse::<Trigger>().unwrap(),
            Trigger::Continuous(Duration::from_secs(1))
        );
        let err = "soon".parse::<Trigger>().unwrap_err().to_string();
        assert!(err.contains("'trigger'") && err.contains("soon"), "{err}");
        assert!(
            parse_duration("max-file-age", "3x")
                .unwrap_err()
                .to_string()
                .contains("max-file-age")
        );
        assert_eq!(
            parse_duration("k", "7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(
            parse_duration("k", "10 minutes").unwrap(),
            Duration::from_secs(600)
        );
        assert!(parse_duration("k", "18446744073709551615s").is_err());
        assert!("3000000000000000h".parse::<Trigger>().is_err());
    }

    #[test]
    fn next_tick_is_the_next_multiple_of_the_interval() {
        assert_eq!(next_tick(0, 0, 1000), 1000);
        assert_eq!(next_tick(0, 999, 1000), 1000);
        assert_eq!(next_tick(0, 1000, 1000), 2000);
        assert_eq!(next_tick(500, 2600, 1000), 3500);
        assert_eq!(next_tick(0, 1234, 0), 1234);
    }
}
