//! What the batch loop does next: a pure decision, tested by the table below.
//!
//! The loop (`engine::runner`) gathers what it knows into a [`Cursor`] and acts on the
//! [`Step`] it gets; all I/O (asking the source, writing the logs, waiting) stays in the
//! loop. It asks twice when the source may have new data: first with the source not asked
//! ([`Answer::NotAsked`]: replay, read-ahead or plan), then, if planning found nothing, with
//! the source's answer (no-data batch, idle, stop, or an error for an available-now query
//! that cannot finish). [`Position`] is where the loop stands between batches.

use super::trigger::Trigger;
use crate::checkpoint::{Checkpoint, OffsetSeq, StartPoint};
use crate::error::Result;
use crate::source::SourceOffset;

/// What the source said when it was asked for new data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Not asked yet for this batch.
    NotAsked,
    /// Nothing past the last batch's end.
    NoNewData,
    /// Nothing past the last batch's end, and an available-now query has read everything
    /// that was there when it started.
    Drained,
}

/// What the loop knows before its next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cursor {
    /// `stop()` was called.
    pub stop_requested: bool,
    /// This run has run a batch already.
    pub ran_a_batch: bool,
    /// The checkpoint holds `offsets/N` without `commits/N`: batch N runs again first.
    pub replay_pending: bool,
    /// The rows after the last batch's end were read while that batch ran.
    pub read_ahead: bool,
    /// The source's answer to "anything new?" for this batch.
    pub source: Answer,
    /// The watermark moved past the one the last batch ran with.
    pub watermark_moved: bool,
    /// The query has a watermark and a stateful operator that evicts by it.
    pub evicts_state: bool,
    /// A batch was committed before (there is a range to run a no-data batch over).
    pub has_start: bool,
}

/// The loop's next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Run the pending batch again with its recorded offsets and id.
    Replay,
    /// Record and run the batch whose rows were read ahead.
    ReadAhead,
    /// Ask the source for new data; if it has some, record and run that batch.
    Plan,
    /// Record and run a batch without new rows (Spark's no-data batch): the watermark moved,
    /// so windows close and state is evicted although nothing new came.
    NoData,
    /// Wait for the next trigger tick (or new data), then decide again.
    Idle,
    /// The query ends without an error.
    Stop,
    /// An available-now query found no new offset while data that was there when it
    /// started is still unread: it stops with an error rather than end with data unread.
    Unfinished,
}

/// Whether the next batch is read while the current one's function writes: when it starts
/// right after this one (available-now, or no trigger interval).
pub(crate) fn reads_ahead(trigger: &Trigger) -> bool {
    match trigger {
        Trigger::AvailableNow => true,
        Trigger::ProcessingTime(d) => d.is_zero(),
        Trigger::Once | Trigger::Continuous(_) => false,
    }
}

/// The loop's next step for `cursor` under `trigger`.
pub(crate) fn next_step(cursor: &Cursor, trigger: &Trigger) -> Step {
    if cursor.stop_requested {
        return Step::Stop;
    }
    // A once-trigger runs one batch (the pending one, if any) and ends.
    if *trigger == Trigger::Once && cursor.ran_a_batch {
        return Step::Stop;
    }
    if cursor.replay_pending {
        return Step::Replay;
    }
    match cursor.source {
        Answer::NotAsked if cursor.read_ahead => Step::ReadAhead,
        Answer::NotAsked => Step::Plan,
        Answer::NoNewData | Answer::Drained => {
            if *trigger != Trigger::Once
                && cursor.watermark_moved
                && cursor.evicts_state
                && cursor.has_start
            {
                return Step::NoData;
            }
            match (trigger, cursor.source) {
                (Trigger::Once, _) => Step::Stop,
                (Trigger::AvailableNow, Answer::Drained) => Step::Stop,
                (Trigger::AvailableNow, _) => Step::Unfinished,
                _ => Step::Idle,
            }
        }
    }
}

/// Where the loop stands between batches.
pub(crate) struct Position {
    /// The id of the next batch.
    pub next_id: u64,
    /// Where the next batch starts (`None`: at the source's beginning).
    pub start: Option<SourceOffset>,
    /// A recorded batch without its commit, run again first.
    pub pending: Option<OffsetSeq>,
    /// The watermark the next new batch runs with.
    pub watermark_ms: i64,
    /// The watermark the last batch ran with (the next batch filters late rows with it, as
    /// Spark does since 3.4).
    pub last_watermark_ms: i64,
}

impl Position {
    /// Where the first batch of a run starts, from the checkpoint's start point.
    pub(crate) fn at(start: StartPoint, checkpoint: &Checkpoint) -> Result<Position> {
        let path_of = |id: u64, cp: &Checkpoint| cp.offsets_name(id);
        let (watermark_ms, last_watermark_ms) = match &start {
            StartPoint::Fresh => (0, 0),
            StartPoint::Replay { batch, start, .. } => (
                batch.metadata.batch_watermark_ms,
                start.as_ref().map_or(0, |s| s.metadata.batch_watermark_ms),
            ),
            StartPoint::Next {
                previous, commit, ..
            } => (
                commit.next_batch_watermark_ms,
                previous.metadata.batch_watermark_ms,
            ),
        };
        let (next_id, start, pending) = match start {
            StartPoint::Fresh => (0, None, None),
            StartPoint::Replay {
                batch_id,
                start,
                batch,
            } => {
                let start = match start {
                    Some(s) => Some(s.source(0, &path_of(batch_id - 1, checkpoint))?),
                    None => None,
                };
                (batch_id, start, Some(batch))
            }
            StartPoint::Next {
                batch_id, previous, ..
            } => (
                batch_id,
                Some(previous.source(0, &path_of(batch_id - 1, checkpoint))?),
                None,
            ),
        };
        Ok(Position {
            next_id,
            start,
            pending,
            watermark_ms,
            last_watermark_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const BASE: Cursor = Cursor {
        stop_requested: false,
        ran_a_batch: false,
        replay_pending: false,
        read_ahead: false,
        source: Answer::NotAsked,
        watermark_moved: false,
        evicts_state: false,
        has_start: true,
    };

    fn triggers() -> [(&'static str, Trigger); 4] {
        [
            ("once", Trigger::Once),
            ("available-now", Trigger::AvailableNow),
            ("processing-time 0", Trigger::ProcessingTime(Duration::ZERO)),
            (
                "processing-time 5s",
                Trigger::ProcessingTime(Duration::from_secs(5)),
            ),
        ]
    }

    #[test]
    fn reads_ahead_only_when_the_next_batch_follows_at_once() {
        let expected = [false, true, true, false];
        for ((name, trigger), want) in triggers().into_iter().zip(expected) {
            assert_eq!(reads_ahead(&trigger), want, "{name}");
        }
        assert!(!reads_ahead(&Trigger::Continuous(Duration::from_secs(1))));
    }

    /// One row per situation: the cursor, then the step expected under each trigger, in the
    /// order once, available-now, processing-time 0, processing-time 5s.
    #[test]
    fn next_step_for_every_trigger_and_read_ahead_case() {
        use Step::*;
        let with = |f: fn(&mut Cursor)| {
            let mut c = BASE;
            f(&mut c);
            c
        };
        let table: Vec<(&str, Cursor, [Step; 4])> = vec![
            (
                "a stop request wins over everything",
                with(|c| {
                    c.stop_requested = true;
                    c.replay_pending = true;
                    c.read_ahead = true;
                }),
                [Stop, Stop, Stop, Stop],
            ),
            (
                "a pending batch runs again first",
                with(|c| c.replay_pending = true),
                [Replay, Replay, Replay, Replay],
            ),
            (
                "a pending batch wins over rows read ahead",
                with(|c| {
                    c.replay_pending = true;
                    c.read_ahead = true;
                }),
                [Replay, Replay, Replay, Replay],
            ),
            (
                "a once-trigger ends after its batch",
                with(|c| c.ran_a_batch = true),
                [Stop, Plan, Plan, Plan],
            ),
            (
                "a once-trigger ends after its replay",
                with(|c| {
                    c.ran_a_batch = true;
                    c.replay_pending = true;
                }),
                [Stop, Replay, Replay, Replay],
            ),
            (
                "nothing known yet: ask the source",
                BASE,
                [Plan, Plan, Plan, Plan],
            ),
            (
                "rows read ahead are used",
                with(|c| c.read_ahead = true),
                [ReadAhead, ReadAhead, ReadAhead, ReadAhead],
            ),
            (
                "no new data",
                with(|c| c.source = Answer::NoNewData),
                [Stop, Unfinished, Idle, Idle],
            ),
            (
                "no new data and everything read",
                with(|c| c.source = Answer::Drained),
                [Stop, Stop, Idle, Idle],
            ),
            (
                "the watermark moved over evicting state",
                with(|c| {
                    c.source = Answer::NoNewData;
                    c.watermark_moved = true;
                    c.evicts_state = true;
                }),
                [Stop, NoData, NoData, NoData],
            ),
            (
                "the watermark moved over evicting state, everything read",
                with(|c| {
                    c.source = Answer::Drained;
                    c.watermark_moved = true;
                    c.evicts_state = true;
                }),
                [Stop, NoData, NoData, NoData],
            ),
            (
                "the watermark moved but no state evicts by it",
                with(|c| {
                    c.source = Answer::Drained;
                    c.watermark_moved = true;
                }),
                [Stop, Stop, Idle, Idle],
            ),
            (
                "evicting state but the watermark stayed",
                with(|c| {
                    c.source = Answer::NoNewData;
                    c.evicts_state = true;
                }),
                [Stop, Unfinished, Idle, Idle],
            ),
            (
                "no batch committed yet: no range for a no-data batch",
                with(|c| {
                    c.source = Answer::NoNewData;
                    c.watermark_moved = true;
                    c.evicts_state = true;
                    c.has_start = false;
                }),
                [Stop, Unfinished, Idle, Idle],
            ),
            (
                "rows read ahead are not looked at once the source answered",
                with(|c| {
                    c.source = Answer::NoNewData;
                    c.read_ahead = true;
                }),
                [Stop, Unfinished, Idle, Idle],
            ),
        ];
        for (case, cursor, expected) in table {
            for ((name, trigger), want) in triggers().into_iter().zip(expected) {
                assert_eq!(
                    next_step(&cursor, &trigger),
                    want,
                    "{case}, {name}: {cursor:?}"
                );
            }
        }
    }
}
