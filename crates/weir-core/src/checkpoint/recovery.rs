//! What to do at start, decided from the two logs alone.
//!
//! This is a pure function of the batch ids found in `offsets/` and `commits/` (after
//! retention has deleted old ones, both logs hold a contiguous run of ids). Reading and
//! validating the files themselves is the caller's job; see `Checkpoint::recover`.

/// The decision taken at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Neither log has an entry: the first batch is 0 and the sources start from scratch.
    Fresh,
    /// `offsets/N` has no `commits/N`: batch N runs again with exactly its recorded
    /// offsets, its id and its recorded batch timestamp.
    Replay(u64),
    /// The newest batch (N - 1) is committed: batch N starts where it ended.
    Next(u64),
}

/// Why the logs cannot be trusted (an error type, so it lives with the crate's errors).
pub use crate::error::RecoveryError;

/// Decides what to run first. `offsets` and `commits` are the ids present in each log,
/// in any order.
pub fn decide(offsets: &[u64], commits: &[u64]) -> Result<Recovery, RecoveryError> {
    let mut offsets = offsets.to_vec();
    offsets.sort_unstable();
    offsets.dedup();
    let latest_commit = commits.iter().copied().max();
    let Some(&latest_offset) = offsets.last() else {
        return match latest_commit {
            None => Ok(Recovery::Fresh),
            Some(commit) => Err(RecoveryError::CommitWithoutOffsets { commit }),
        };
    };
    if let Some(pair) = offsets.windows(2).find(|w| w[1] != w[0] + 1) {
        return Err(RecoveryError::OffsetGap {
            missing: pair[0] + 1,
        });
    }
    match latest_commit {
        Some(c) if c > latest_offset => Err(RecoveryError::CommitWithoutOffsets { commit: c }),
        Some(c) if c == latest_offset => Ok(Recovery::Next(c + 1)),
        Some(c) if c + 1 == latest_offset => Ok(Recovery::Replay(latest_offset)),
        None if offsets.len() == 1 && latest_offset == 0 => Ok(Recovery::Replay(0)),
        _ => Err(RecoveryError::CommitLogBehind {
            latest_offset,
            latest_commit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::Recovery::*;
    use super::RecoveryError::*;
    use super::*;

    #[test]
    fn every_shape_of_the_two_logs_gets_the_expected_decision() {
        type Case = (
            &'static [u64],
            &'static [u64],
            Result<Recovery, RecoveryError>,
        );
        let cases: &[Case] = &[
            // fresh start
            (&[], &[], Ok(Fresh)),
            // first batch written, not committed
            (&[0], &[], Ok(Replay(0))),
            // first batch committed
            (&[0], &[0], Ok(Next(1))),
            // steady state, last committed
            (&[0, 1, 2], &[0, 1, 2], Ok(Next(3))),
            // steady state, last not committed
            (&[0, 1, 2, 3], &[0, 1, 2], Ok(Replay(3))),
            // after retention deleted old entries
            (&[100, 101, 102], &[100, 101], Ok(Replay(102))),
            (&[100, 101], &[100, 101], Ok(Next(102))),
            // listing order does not matter
            (&[2, 0, 1], &[1, 0], Ok(Replay(2))),
            // commit log behind by more than one
            (
                &[0, 1, 2],
                &[0],
                Err(CommitLogBehind {
                    latest_offset: 2,
                    latest_commit: Some(0),
                }),
            ),
            (
                &[0, 1],
                &[],
                Err(CommitLogBehind {
                    latest_offset: 1,
                    latest_commit: None,
                }),
            ),
            (
                &[5],
                &[],
                Err(CommitLogBehind {
                    latest_offset: 5,
                    latest_commit: None,
                }),
            ),
            // a gap in the offset log
            (&[0, 1, 3], &[0, 1, 3], Err(OffsetGap { missing: 2 })),
            // commits without offsets
            (&[], &[0], Err(CommitWithoutOffsets { commit: 0 })),
            (&[0, 1], &[0, 1, 2], Err(CommitWithoutOffsets { commit: 2 })),
        ];
        for (offsets, commits, want) in cases {
            assert_eq!(
                &decide(offsets, commits),
                want,
                "offsets {offsets:?} commits {commits:?}"
            );
        }
    }

    #[test]
    fn errors_say_which_file_is_at_fault() {
        let msg = decide(&[0, 1, 3], &[]).unwrap_err().to_string();
        assert!(msg.contains("offsets/2"), "{msg}");
        let msg = decide(&[0, 1, 2], &[0]).unwrap_err().to_string();
        assert!(
            msg.contains("offsets/2") && msg.contains("commits/0"),
            "{msg}"
        );
    }
}
