//! The error type of `weir-core`.
//!
//! Every variant carries the context a person needs to act on it: the batch id, the file,
//! the sink or the setting at fault. Errors from other crates (DataFusion, object stores, a
//! sink's own error type, the user's function) are kept as the `source()` of the variant that
//! wraps them, so a caller can walk the chain or downcast; [`error_chain`]
//! prints the whole chain on one line. The engine never logs an error and carries on.

use std::path::PathBuf;
use std::sync::Arc;

/// An error that a user's function (or a sink) returns to the engine.
///
/// `anyhow::Error`, `datafusion::error::DataFusionError`, `std::io::Error` and [`Error`]
/// all convert into it with `?`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a local file or folder failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// An object store (S3, Azure, GCS) refused or failed a request.
    #[error("{action} {location}")]
    Store {
        action: &'static str,
        location: String,
        #[source]
        source: Box<object_store::Error>,
    },

    /// A checkpoint log file exists but cannot be used (empty, garbage, bad JSON,
    /// unknown version). Nothing is restarted from zero: fix or remove the file.
    #[error("Failed to read log file {path}. {reason}")]
    CorruptLog { path: String, reason: String },

    /// A state file of a stateful operator is missing, cut short or not what its name says.
    /// State is never rebuilt from less than all of its files: restore the file, or start
    /// the query on a new checkpoint.
    #[error("state file {path} cannot be used: {reason}")]
    CorruptState { path: String, reason: String },

    /// The logs of a checkpoint contradict each other (a gap, a commit without an
    /// offset entry, more than one uncommitted batch).
    #[error("checkpoint {dir} is inconsistent: {source}")]
    InconsistentCheckpoint {
        dir: String,
        #[source]
        source: RecoveryError,
    },

    /// Another query holds the checkpoint (its lock file or lease), or wrote a log file
    /// that this query was about to write.
    #[error(
        "another query is using the checkpoint {dir} ({detail}); stop it, or give this \
         query its own checkpoint"
    )]
    CheckpointInUse { dir: String, detail: String },

    /// The user's function (or a sink called from it) returned an error for a batch.
    /// The batch was not committed; the next start runs it again with the same id.
    #[error("query '{query}': batch {batch_id} failed in foreachBatch and was not committed")]
    BatchFailed {
        query: String,
        batch_id: u64,
        #[source]
        source: BoxError,
    },

    /// The user's function panicked. The batch was not committed.
    #[error(
        "query '{query}': batch {batch_id}: the foreachBatch function panicked: {message}; \
         the batch was not committed"
    )]
    BatchPanicked {
        query: String,
        batch_id: u64,
        message: String,
    },

    /// Code outside the user's function panicked (a transform, a listener, the engine).
    #[error("query '{query}': a panic {}: {message}", match last_batch {
        Some(b) => format!("after batch {b}"),
        None => "before the first batch".to_string(),
    })]
    Panicked {
        query: String,
        /// The last batch the query had started, if any.
        last_batch: Option<u64>,
        message: String,
    },

    /// A source could not list, plan or read its input; `source` is the source's own error.
    #[error("source {source_name}")]
    Source {
        source_name: String,
        #[source]
        source: BoxError,
    },

    /// A recorded input file changed (or vanished) after its batch was planned: replaying
    /// the batch would read other data.
    #[error(
        "input file {file}, taken by batch {batch_id}, {change}: files must stay as they are \
         until their batch is committed (the batch runs again on what it took); put the file \
         back as it was (its bytes and modification time); to get past a bad record in it, \
         run once with mode = \"DROPMALFORMED\" on the source and trigger = \"once\" (which \
         replays only that batch, without the record), then set FAILFAST and the trigger back"
    )]
    InputChanged {
        file: String,
        batch_id: u64,
        change: String,
    },

    /// A line of an input file could not be parsed (FAILFAST); `line` 0: the file as a
    /// whole (a Parquet file), whose reason names the row.
    #[error("malformed record in {file}{}: {reason}{}", at_line(*line), way_out(*line))]
    MalformedInput {
        file: String,
        line: u64,
        reason: String,
    },

    /// An upsert sink found NULLs where its rules refuse them (see `sink::upsert`).
    #[error("{sink}: batch {batch_id}: {rows} row(s) have a NULL in {column}: {hint}")]
    NullValues {
        sink: String,
        batch_id: u64,
        column: String,
        rows: u64,
        hint: String,
    },

    /// DataFusion failed while planning or executing, with what weir was doing.
    #[error("{context}")]
    DataFusion {
        context: String,
        #[source]
        source: datafusion::error::DataFusionError,
    },

    /// A checkpoint written by Spark that weir cannot continue (a pending batch, a stateful
    /// query); `reason` says what to do.
    #[error("checkpoint {dir} was written by Spark and cannot be continued by weir: {reason}")]
    SparkCheckpoint { dir: String, reason: String },

    /// A setting has a value weir cannot use; `key` names it.
    #[error("invalid setting '{key}': {reason}")]
    Config { key: String, reason: String },

    /// Spark's own words, so people who know Spark recognise it.
    #[error("'foreachBatch' is not supported with continuous trigger.")]
    ContinuousTriggerUnsupported,

    /// A sink failed between its durable steps; it names the sink and the batch, and keeps
    /// the sink's own error as the source.
    #[error("sink {sink}: batch {batch_id}")]
    Sink {
        sink: String,
        batch_id: u64,
        #[source]
        source: BoxError,
    },

    /// `weir check --connect`: a place or server the pipeline uses could not be reached.
    #[error("{what} cannot be reached")]
    Unreachable {
        what: String,
        #[source]
        source: BoxError,
    },

    /// A sink refused to start (it checks where it writes before the first batch).
    #[error("a sink refused to start; nothing was run")]
    SinkRefused {
        #[source]
        source: BoxError,
    },

    /// A step of the engine failed for a batch; `stage` says which.
    #[error("query '{query}': batch {batch_id}: {stage} failed")]
    Batch {
        query: String,
        batch_id: u64,
        stage: &'static str,
        #[source]
        source: Box<Error>,
    },

    /// A fault point named in `WEIR_FAULT` with `:error` was reached (crash tests).
    #[error("fault injected at {point} in batch {batch_id} (WEIR_FAULT)")]
    FaultInjected { point: String, batch_id: u64 },

    /// A query stopped with an error; the source is the first error it met.
    #[error("query '{name}' [id = {id}, runId = {run_id}] terminated with an error")]
    QueryTerminated {
        name: String,
        id: String,
        run_id: String,
        #[source]
        source: Arc<Error>,
    },

    /// Something that should not happen did (a task the engine started ended abnormally).
    #[error("internal error: {what}")]
    Internal { what: String },

    /// A write took longer than its `timeout` and was cancelled (its future dropped: a
    /// transaction not committed rolls back, a commit not made is not made). It may pass:
    /// the batch runs again after a pause.
    #[error(
        "sink {sink}: batch {batch_id}: {what} took longer than its timeout of {after_ms} ms and \
         was cancelled"
    )]
    TimedOut {
        sink: String,
        batch_id: u64,
        what: &'static str,
        after_ms: u64,
    },

    /// A source's call took longer than its `timeout` and was cancelled. It may pass: the
    /// query starts again from its checkpoint after a pause.
    #[error(
        "source {source_name}: {what} took longer than its timeout of {after_ms} ms and was \
         cancelled"
    )]
    SourceTimedOut {
        source_name: String,
        what: &'static str,
        after_ms: u64,
    },

    /// The cluster the query runs on refused or failed it (no worker reachable, a worker
    /// of another version or without the token, a task that failed on a worker).
    #[error("cluster: {reason}")]
    Cluster { reason: String },
}

impl Error {
    /// An `Io` error for `path` while doing `action` ("reading", "creating", ...).
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// A `DataFusion` error with what weir was doing when it happened.
    pub fn datafusion(
        context: impl Into<String>,
        source: datafusion::error::DataFusionError,
    ) -> Self {
        Error::DataFusion {
            context: context.into(),
            source,
        }
    }

    /// The batch the error is about, when it is about one (for a log line's `batch_id`).
    pub fn batch_id(&self) -> Option<u64> {
        match self {
            Error::BatchFailed { batch_id, .. }
            | Error::BatchPanicked { batch_id, .. }
            | Error::InputChanged { batch_id, .. }
            | Error::Sink { batch_id, .. }
            | Error::Batch { batch_id, .. }
            | Error::FaultInjected { batch_id, .. }
            | Error::TimedOut { batch_id, .. } => Some(*batch_id),
            Error::Panicked { last_batch, .. } => *last_batch,
            Error::QueryTerminated { source, .. } => source.batch_id(),
            _ => None,
        }
    }

    /// A `Config` error naming `key`.
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// A `Source` error: the source's own error, with the source's description.
    pub fn from_source(source_name: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Source {
            source_name: source_name.into(),
            source: source.into(),
        }
    }
}

/// For a bad line: how to get past it, since the file may not be repaired.
fn way_out(line: u64) -> &'static str {
    if line == 0 {
        ""
    } else {
        " (FAILFAST; the file must stay as it was taken until its batch commits: to go on, \
         run once with mode = \"DROPMALFORMED\" on the source and trigger = \"once\", which \
         replays only that batch, without the record, and counts it; then set FAILFAST and \
         the trigger back)"
    }
}

/// ` at line N`, or nothing for line 0 (a file that has no lines, such as Parquet).
fn at_line(line: u64) -> String {
    if line == 0 {
        String::new()
    } else {
        format!(" at line {line}")
    }
}

/// `err: cause: cause`, for messages that must carry the whole chain in one line.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = c.source();
    }
    out
}

/// Why a spawned task ended without a result: cancelled, or the message of its panic.
pub fn join_text(join: tokio::task::JoinError) -> String {
    if join.is_cancelled() {
        return "the query task was cancelled".into();
    }
    panic_text(join.into_panic().as_ref())
}

/// The message a panic carried (`panic!("...")`), for errors that report one.
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Why the logs cannot be trusted. The caller wraps it in an error naming the folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryError {
    /// `offsets/{missing}` is absent between retained entries.
    OffsetGap { missing: u64 },
    /// `commits/{commit}` exists but `offsets/{commit}` does not.
    CommitWithoutOffsets { commit: u64 },
    /// More than one batch is written to the offset log but not committed.
    CommitLogBehind {
        latest_offset: u64,
        latest_commit: Option<u64>,
    },
    /// `offsets/{batch}` must run again but `offsets/{batch - 1}`, where it starts, is gone.
    ReplayStartMissing { batch: u64 },
}

impl std::error::Error for RecoveryError {}

impl std::fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoveryError::OffsetGap { missing } => {
                write!(
                    f,
                    "offsets/{missing} is missing between older and newer entries"
                )
            }
            RecoveryError::CommitWithoutOffsets { commit } => write!(
                f,
                "commits/{commit} exists but offsets/{commit} does not; the offset log was \
                 truncated or belongs to another query"
            ),
            RecoveryError::ReplayStartMissing { batch } => write!(
                f,
                "offsets/{batch} must be run again but offsets/{}, where it starts, is missing",
                batch.saturating_sub(1)
            ),
            RecoveryError::CommitLogBehind {
                latest_offset,
                latest_commit,
            } => {
                let commit =
                    latest_commit.map_or("no commit".to_string(), |c| format!("commits/{c}"));
                write!(
                    f,
                    "offsets/{latest_offset} is the newest offset entry but the newest commit is \
                     {commit}: more than one batch is uncommitted, which a single query never \
                     leaves behind; the commit log was truncated or edited"
                )
            }
        }
    }
}

/// What ends the text of a task's error that running the task again would repeat (a value
/// the sink cannot take, a table of another shape, a malformed record of a source): the cluster does not run such a batch
/// again on other workers, it fails at once.
const NOT_RETRIED: &str =
    " (a property of the batch's rows: running it again would fail the same way)";

/// A task's error that running it again would repeat ([`NOT_RETRIED`]).
pub fn task_data_error(e: impl std::error::Error + 'static) -> datafusion::error::DataFusionError {
    datafusion::error::DataFusionError::Execution(format!("{}{NOT_RETRIED}", error_chain(&e)))
}

/// Whether `e` came from [`task_data_error`].
pub fn is_data_error(e: &(dyn std::error::Error + 'static)) -> bool {
    error_chain(e).contains(NOT_RETRIED)
}

/// A failure that is expected to pass: a server down or restarting, a connection refused
/// or cut, a timeout. A connector wraps such an error of its own in it (it knows its
/// client's error types; the engine does not), and the query then runs the batch again
/// after a pause ([`crate::RetryPolicy`]) instead of stopping. It shows as the error it
/// wraps.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Transient(BoxError);

impl Transient {
    pub fn new(e: impl Into<BoxError>) -> Self {
        Transient(e.into())
    }
}

/// `e` as an engine [`Error`], also when it is one held in a `Box` or an `Arc`: that is
/// what the `source()` of `Error::Batch` and `Error::QueryTerminated` gives, so a walk down
/// a chain that only downcast to `Error` would step over their causes.
pub fn as_engine_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
    e.downcast_ref::<Error>()
        .or_else(|| e.downcast_ref::<Box<Error>>().map(|b| b.as_ref()))
        .or_else(|| e.downcast_ref::<Arc<Error>>().map(|a| a.as_ref()))
}

/// Whether `e`, or an error it was caused by, is one that running the batch again later
/// may not meet: a [`Transient`], or an I/O error of a refused, reset or cut connection,
/// an unreachable network or a timeout (the errors connectors hand on from the network,
/// checked by their type, never by their text). Anything else (bad data, a refused setting
/// or schema, authentication, a corrupt checkpoint) is not.
pub fn is_transient(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::*;
    let mut cur = Some(e);
    while let Some(err) = cur {
        let engine = as_engine_error(err);
        if err.downcast_ref::<Transient>().is_some()
            || matches!(
                engine,
                Some(Error::TimedOut { .. } | Error::SourceTimedOut { .. })
            )
        {
            return true;
        }
        // An object store's request that could not connect, was cut or timed out (the
        // store already retried it; `HttpErrorKind::Decode`/`Unknown` are not network).
        if let Some(http) = err.downcast_ref::<object_store::client::HttpError>()
            && matches!(
                http.kind(),
                object_store::client::HttpErrorKind::Connect
                    | object_store::client::HttpErrorKind::Request
                    | object_store::client::HttpErrorKind::Timeout
                    | object_store::client::HttpErrorKind::Interrupted
            )
        {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                ConnectionRefused
                    | ConnectionReset
                    | ConnectionAborted
                    | NotConnected
                    | BrokenPipe
                    | TimedOut
                    | HostUnreachable
                    | NetworkUnreachable
                    | NetworkDown
            )
        {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_inside_a_batch_error_is_transient() {
        let e = Error::Batch {
            query: "q".into(),
            batch_id: 4,
            stage: "asking the source for new data",
            source: Box::new(Error::SourceTimedOut {
                source_name: "KafkaV2[Subscribe[t]]".into(),
                what: "planning the next batch",
                after_ms: 2000,
            }),
        };
        assert!(is_transient(&e));
    }

    #[test]
    fn transient_errors_are_found_by_type_anywhere_in_the_chain() {
        let io = |kind| std::io::Error::new(kind, "x");
        let refused = Error::Sink {
            sink: "pg".into(),
            batch_id: 3,
            source: Box::new(io(std::io::ErrorKind::ConnectionRefused)),
        };
        let in_batch = Error::BatchFailed {
            query: "q".into(),
            batch_id: 3,
            source: Box::new(refused),
        };
        let marked = Error::BatchFailed {
            query: "q".into(),
            batch_id: 3,
            source: Box::new(Transient::new("the server is shutting down")),
        };
        let cases: Vec<(Box<dyn std::error::Error + 'static>, bool)> = vec![
            (Box::new(in_batch), true),
            (Box::new(marked), true),
            (Box::new(io(std::io::ErrorKind::TimedOut)), true),
            (Box::new(io(std::io::ErrorKind::ConnectionReset)), true),
            // A file cut short or missing is not a network's failure.
            (Box::new(io(std::io::ErrorKind::UnexpectedEof)), false),
            (Box::new(io(std::io::ErrorKind::NotFound)), false),
            (Box::new(io(std::io::ErrorKind::PermissionDenied)), false),
            (Box::new(Error::config("query.trigger", "bad")), false),
            // The text of an error does not count, only its type.
            (
                Box::new(Error::Cluster {
                    reason: "connection refused".into(),
                }),
                false,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(
                is_transient(e.as_ref()),
                want,
                "{}",
                error_chain(e.as_ref())
            );
        }
        // It shows as what it wraps.
        assert_eq!(
            Transient::new("the server is down").to_string(),
            "the server is down"
        );
    }
}
