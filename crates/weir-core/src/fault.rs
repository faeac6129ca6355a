//! Fault points for crash tests.
//!
//! The engine and every sink call [`hit`] between their durable steps. When the
//! environment variable `WEIR_FAULT` names the point, the process aborts there (as a kill
//! would leave it), or returns an error when the entry ends in `:error`:
//!
//! ```text
//! WEIR_FAULT=after-offsets-write@3          abort at that point in batch 3
//! WEIR_FAULT=before-commit-write            abort there in the first batch that gets there
//! WEIR_FAULT=delta-after-commit@2:error     fail batch 2 there with an error
//! ```
//!
//! Several entries may be given, separated by commas. When the variable is unset the
//! cost is one load of an initialised `OnceLock` per call.

use std::sync::OnceLock;

use crate::error::Error;

/// The runner's points, in the order a batch passes them.
pub const RUNNER_POINTS: &[&str] = &[
    "after-offsets-write",
    "before-user-fn",
    "after-user-fn",
    "before-commit-write",
    "after-commit-write",
];

#[derive(Debug)]
struct Fault {
    point: String,
    batch: Option<u64>,
    error: bool,
}

static FAULTS: OnceLock<Vec<Fault>> = OnceLock::new();

fn parse(spec: &str) -> Vec<Fault> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let (entry, error) = match entry.strip_suffix(":error") {
                Some(e) => (e, true),
                None => (entry, false),
            };
            let (point, batch) = match entry.split_once('@') {
                Some((p, b)) => (p, b.parse().ok()),
                None => (entry, None),
            };
            Fault {
                point: point.to_string(),
                batch,
                error,
            }
        })
        .collect()
}

/// Passes the fault point `point` in batch `batch_id`. Aborts the process, or returns
/// `Error::FaultInjected`, when `WEIR_FAULT` names it; otherwise does nothing.
pub fn hit(point: &str, batch_id: u64) -> Result<(), Error> {
    let faults = FAULTS.get_or_init(|| {
        std::env::var("WEIR_FAULT")
            .map(|s| parse(&s))
            .unwrap_or_default()
    });
    if faults.is_empty() {
        return Ok(());
    }
    let Some(f) = faults
        .iter()
        .find(|f| f.point == point && f.batch.is_none_or(|b| b == batch_id))
    else {
        return Ok(());
    };
    if f.error {
        return Err(Error::FaultInjected {
            point: point.to_string(),
            batch_id,
        });
    }
    eprintln!("weir: fault point {point} reached in batch {batch_id}: aborting (WEIR_FAULT)");
    std::process::abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_into_points_batches_and_modes() {
        let f = parse("after-offsets-write@3, before-commit-write,delta-after-commit@2:error");
        assert_eq!(f.len(), 3);
        assert_eq!(
            (f[0].point.as_str(), f[0].batch, f[0].error),
            ("after-offsets-write", Some(3), false)
        );
        assert_eq!(
            (f[1].point.as_str(), f[1].batch, f[1].error),
            ("before-commit-write", None, false)
        );
        assert_eq!(
            (f[2].point.as_str(), f[2].batch, f[2].error),
            ("delta-after-commit", Some(2), true)
        );
    }
}
