//! What an idempotent sink does with batch N, given what its target already records for the
//! query's app id: a pure decision shared by every sink that keys its writes by batch id
//! (Delta's application transaction, PostgreSQL's ledger).

/// The decision for one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Nothing at or past the batch is recorded: write it.
    Write,
    /// The batch itself is recorded and this is a replay of it: it landed before the crash,
    /// skip it.
    Skip,
    /// The target records this batch on a first attempt, or a later batch: that record
    /// cannot come from this query (another query, or an old checkpoint, uses the same app
    /// id). Carries the recorded batch.
    NotOurs(u64),
}

/// The decision for batch `batch_id` when the target records `recorded` (the newest batch
/// for the app id, `None`: nothing) and the batch `is_replay` or not.
pub fn decide(recorded: Option<u64>, batch_id: u64, is_replay: bool) -> Recorded {
    match recorded {
        None => Recorded::Write,
        Some(r) if r < batch_id => Recorded::Write,
        Some(r) if r == batch_id && is_replay => Recorded::Skip,
        Some(r) => Recorded::NotOurs(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_replay_may_find_its_own_batch_and_nothing_may_be_ahead_of_it() {
        // (recorded, batch, replay) -> decision
        let table = [
            (None, 0, false, Recorded::Write),
            (None, 5, true, Recorded::Write),
            (Some(3), 5, false, Recorded::Write),
            (Some(4), 5, true, Recorded::Write),
            (Some(5), 5, true, Recorded::Skip),
            (Some(5), 5, false, Recorded::NotOurs(5)),
            (Some(6), 5, true, Recorded::NotOurs(6)),
            (Some(9), 5, false, Recorded::NotOurs(9)),
        ];
        for (recorded, batch, replay, want) in table {
            assert_eq!(
                decide(recorded, batch, replay),
                want,
                "{recorded:?} {batch} {replay}"
            );
        }
    }
}
