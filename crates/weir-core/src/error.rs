//! The error type of `weir-core`.
//!
//! Every variant carries the context a person needs to act on it: the batch id, the
//! file or the setting at fault. The engine never logs an error and carries on.

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
    /// Reading or writing a file or folder failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint log file exists but cannot be used (empty, garbage, bad JSON,
    /// unknown version). Nothing is restarted from zero: fix or remove the file.
    #[error("Failed to read log file {path}. {reason}")]
    CorruptLog { path: PathBuf, reason: String },

    /// The logs of a checkpoint contradict each other (a gap, a commit without an
    /// offset entry, more than one uncommitted batch).
    #[error("checkpoint {dir} is inconsistent: {reason}")]
    InconsistentCheckpoint { dir: PathBuf, reason: String },

    /// A log file that this query was about to write already exists: another query is
    /// running on the same checkpoint (or ran after this one started).
    #[error(
        "{path} already exists: another query is using the checkpoint {dir}; \
         stop it, or give this query its own checkpoint"
    )]
    CheckpointInUse { dir: PathBuf, path: PathBuf },

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

    /// A source could not list, plan or read its input.
    #[error("source {source_name}: {reason}")]
    Source { source_name: String, reason: String },

    /// DataFusion failed while planning or executing, with what weir was doing.
    #[error("{context}: {source}")]
    DataFusion {
        context: String,
        #[source]
        source: datafusion::error::DataFusionError,
    },

    /// A setting has a value weir cannot use; `key` names it.
    #[error("invalid setting '{key}': {reason}")]
    Config { key: String, reason: String },

    /// Spark's own words, so people who know Spark recognise it.
    #[error("'foreachBatch' is not supported with continuous trigger.")]
    ContinuousTriggerUnsupported,

    /// A sink failed between its durable steps; it names the sink and the batch.
    #[error("sink {sink}: batch {batch_id}: {reason}")]
    Sink {
        sink: String,
        batch_id: u64,
        reason: String,
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

    /// A `Config` error naming `key`.
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            reason: reason.into(),
        }
    }
}
