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
//! WEIR_FAULT=before-user-fn@1:sleep=2000     wait 2 s there in batch 1, then go on
//! ```
//!
//! An entry with another action is an error at every point, so a typo cannot pass for a
//! fault that never fired.
//!
//! Several entries may be given, separated by commas. When the variable is unset the
//! cost is one load of an initialised `OnceLock` per call.

use std::sync::OnceLock;

use crate::error::Error;

/// After `offsets/N` is written.
pub const AFTER_OFFSETS_WRITE: &str = "after-offsets-write";
/// Before the function is called.
pub const BEFORE_USER_FN: &str = "before-user-fn";
/// After the function returned `Ok`.
pub const AFTER_USER_FN: &str = "after-user-fn";
/// Before a stateful operator commits its state version N+1.
pub const BEFORE_STATE_COMMIT: &str = "before-state-commit";
/// After a stateful operator committed its state version N+1.
pub const AFTER_STATE_COMMIT: &str = "after-state-commit";
/// Before `commits/N` is linked into place.
pub const BEFORE_COMMIT_WRITE: &str = "before-commit-write";
/// After `commits/N` is in place.
pub const AFTER_COMMIT_WRITE: &str = "after-commit-write";

/// The runner's points, in the order a batch passes them.
pub const RUNNER_POINTS: &[&str] = &[
    AFTER_OFFSETS_WRITE,
    BEFORE_USER_FN,
    AFTER_USER_FN,
    BEFORE_COMMIT_WRITE,
    AFTER_COMMIT_WRITE,
];

/// The runner's points around the state commit of a query with stateful operators, between
/// `after-user-fn` and `before-commit-write`.
pub const STATE_POINTS: &[&str] = &[BEFORE_STATE_COMMIT, AFTER_STATE_COMMIT];

#[derive(Debug, Clone, PartialEq)]
enum Action {
    Abort,
    Error,
    Sleep(u64),
    Unknown(String),
}

#[derive(Debug)]
struct Fault {
    point: String,
    batch: Option<u64>,
    action: Action,
}

static FAULTS: OnceLock<Vec<Fault>> = OnceLock::new();

fn parse(spec: &str) -> Vec<Fault> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let (entry, action) = match entry.split_once(':') {
                None => (entry, Action::Abort),
                Some((e, "error")) => (e, Action::Error),
                Some((e, a)) => match a.strip_prefix("sleep=").map(str::parse::<u64>) {
                    Some(Ok(ms)) => (e, Action::Sleep(ms)),
                    _ => (e, Action::Unknown(a.to_string())),
                },
            };
            let (point, batch) = match entry.split_once('@') {
                Some((p, b)) => (p, b.parse().ok()),
                None => (entry, None),
            };
            Fault {
                point: point.to_string(),
                batch,
                action,
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
    if let Some(Action::Unknown(a)) = faults
        .iter()
        .map(|f| &f.action)
        .find(|a| matches!(a, Action::Unknown(_)))
    {
        return Err(Error::config(
            "WEIR_FAULT",
            format!("unknown action '{a}' (abort is the default; error, sleep=<ms>)"),
        ));
    }
    let Some(f) = faults
        .iter()
        .find(|f| f.point == point && f.batch.is_none_or(|b| b == batch_id))
    else {
        return Ok(());
    };
    match f.action {
        Action::Error => {
            return Err(Error::FaultInjected {
                point: point.to_string(),
                batch_id,
            });
        }
        Action::Sleep(ms) => {
            // A test hook: blocking one runtime thread for a while is what it is for.
            eprintln!("weir: fault point {point} reached in batch {batch_id}: waiting {ms} ms");
            std::thread::sleep(std::time::Duration::from_millis(ms));
            return Ok(());
        }
        Action::Abort | Action::Unknown(_) => {}
    }
    eprintln!("weir: fault point {point} reached in batch {batch_id}: aborting (WEIR_FAULT)");
    std::process::abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_into_points_batches_and_actions() {
        let f = parse(
            "after-offsets-write@3, before-commit-write,delta-after-commit@2:error,\
             before-user-fn@1:sleep=250,x:explode",
        );
        let got: Vec<_> = f
            .iter()
            .map(|f| (f.point.as_str(), f.batch, f.action.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("after-offsets-write", Some(3), Action::Abort),
                ("before-commit-write", None, Action::Abort),
                ("delta-after-commit", Some(2), Action::Error),
                ("before-user-fn", Some(1), Action::Sleep(250)),
                ("x", None, Action::Unknown("explode".into())),
            ]
        );
    }
}
