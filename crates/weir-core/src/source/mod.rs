//! Sources: where batches come from.
//!
//! A source turns "everything up to now" into an offset, and an offset range into rows.
//! The engine records the end offset of every batch in `offsets/N` before it reads the
//! range, so a source must return the same rows for the same range, today and after a
//! crash. Kafka and files can; a socket cannot, and is not a source here.

pub mod dead_letter;
pub mod decode;
pub mod file;
pub mod flat_json;
pub mod leaf;
pub mod memory;
pub mod rate;
pub mod timeout;
pub mod validate;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::prelude::{DataFrame, SessionContext};

use crate::error::Result;
use crate::storage::Location;

pub use decode::BadRecordMode;
pub use file::{CleanSource, FileFormat, FileSource, FileSourceOptions};
pub use memory::MemorySource;
pub use rate::RateSource;
pub use timeout::WithSourceTimeout;

/// A position in a source, opaque to the engine and stored as JSON in the offset log
/// (Kafka: `{"orders":{"0":123}}`, files: `{"logOffset":4}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceOffset(serde_json::Value);

impl SourceOffset {
    /// Wraps a JSON value.
    pub fn new(value: serde_json::Value) -> Self {
        SourceOffset(value)
    }

    /// The JSON value.
    pub fn json(&self) -> &serde_json::Value {
        &self.0
    }
}

impl fmt::Display for SourceOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How much one batch may take: Spark's `maxFilesPerTrigger`, `maxOffsetsPerTrigger` and
/// `minOffsetsPerTrigger` with `maxTriggerDelay`. A source applies the limits it
/// understands and ignores the others; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadLimit {
    /// At most this many files per batch (file sources). At least one is always taken.
    pub max_files: Option<usize>,
    /// At most this many rows or records per batch (rate, memory and Kafka sources).
    pub max_rows: Option<u64>,
    /// Wait for at least this many new rows or records, but no longer than the delay
    /// since the last batch (Kafka's `minOffsetsPerTrigger` and `maxTriggerDelay`).
    pub min_rows: Option<(u64, Duration)>,
}

impl ReadLimit {
    /// No limit: everything available.
    pub const ALL: ReadLimit = ReadLimit {
        max_files: None,
        max_rows: None,
        min_rows: None,
    };
}

/// What the engine gives a source once, before the first batch.
#[derive(Debug, Clone)]
pub struct SourceInit {
    /// `<checkpoint>/sources/<i>`: the source's own log folder, for sources that keep one
    /// (write entries with [`Location::put_new`]: an existing entry means another query).
    pub log: Location,
    /// How many batches of the source's own log to keep (the query's retention).
    pub retain_batches: u64,
    /// The checkpoint's query id: names what the source writes outside its log (a dead
    /// letter's files), so that two queries, or a new checkpoint, never take another's.
    pub query_id: uuid::Uuid,
}

/// A replayable source of rows.
///
/// Call order for one query: `open` once; then per batch `latest_offset`, (the engine writes
/// `offsets/N`), `read_range`, (the function runs), `before_commit`, (the engine writes
/// `commits/N`), `commit`.
/// After a crash the engine calls `read_range` again with the range recorded in
/// `offsets/N`, which must return the same rows.
#[async_trait]
pub trait Source: Send + Sync {
    /// A short name for logs and progress, e.g. `FileStreamSource[file:/data/in]`.
    fn description(&self) -> String;

    /// The schema of every batch this source returns.
    fn schema(&self) -> SchemaRef;

    /// Whether `read_range`, on a session whose plans run on a cluster, returns a plan that
    /// reads the range on the workers (the file source does). A query on a cluster refuses
    /// a source that does not before anything runs.
    fn reads_on_workers(&self) -> bool {
        false
    }

    /// Called before any other method. A source that keeps its own log opens it here. It is
    /// called again when the query starts over in the same process after a failure that
    /// may pass (`engine::retry`): the source then starts from its log as a new process
    /// would, forgetting what it planned or queued since.
    async fn open(&self, _init: &SourceInit) -> Result<()> {
        Ok(())
    }

    /// For `Trigger::AvailableNow`: fixes the data that counts as "available now", so
    /// that the query stops after reaching it even while more arrives.
    async fn prepare_available_now(&self) -> Result<()> {
        Ok(())
    }

    /// For `Trigger::AvailableNow`: true when everything fixed by `prepare_available_now`
    /// has been handed out by `latest_offset`. The engine asks when `latest_offset` returned
    /// nothing new; `false` then is an error (the query would end with data unread), never
    /// a quiet stop.
    async fn reached_available_now(&self) -> Result<bool> {
        Ok(true)
    }

    /// The newest offset available now, at most `limit` beyond `start` (`None`: from
    /// the beginning). Returns `start` itself (or `None` when `start` is `None`) when
    /// there is nothing new. It may be called again for the same `start` after a crash
    /// and must then not lose or duplicate data; it may record what it decided in its
    /// own log, durably, before returning.
    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>>;

    /// The rows in `(start, end]`, as a DataFrame on `ctx`. Same range, same rows.
    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame>;

    /// The newest offset the source saw at the last `latest_offset`, before any read
    /// limit: the progress report's `latestOffset` (`None`: the same as the batch's end).
    fn latest_seen(&self) -> Option<SourceOffset> {
        None
    }

    /// Figures for the progress report's `sources[].metrics` (e.g. Kafka's
    /// `maxOffsetsBehindLatest`), as of the last `latest_offset`.
    fn metrics(&self) -> std::collections::BTreeMap<String, String> {
        std::collections::BTreeMap::new()
    }

    /// Batch `batch_id`, the range `(start, end]`, ran: its function and state succeeded,
    /// and `commits/N` is next. A source writes here what its read of the range owes
    /// outside the rows (the Kafka source's dead letter). A replay of the batch calls it
    /// again with the same id and range: the second write must leave one copy. May run
    /// while the next batch is read ahead. An error fails the batch (it runs again).
    async fn before_commit(
        &self,
        _batch_id: u64,
        _start: Option<&SourceOffset>,
        _end: &SourceOffset,
    ) -> Result<()> {
        Ok(())
    }

    /// Batch up to `end` is committed: the source may forget what lies before it. Errors
    /// here do not un-commit the batch; they stop the query.
    async fn commit(&self, _end: &SourceOffset) -> Result<()> {
        Ok(())
    }
}
