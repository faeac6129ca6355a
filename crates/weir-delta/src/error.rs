use std::path::PathBuf;

/// Errors of the Delta sinks. Each names the table and, where there is one, the batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaSinkError {
    /// delta-rs failed (I/O, protocol, a concurrent commit, a MERGE that matched one
    /// target row with several source rows, ...).
    #[error("Delta table {table}: batch {batch_id}: {action}: {source}")]
    Delta {
        table: PathBuf,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: deltalake::DeltaTableError,
    },

    /// Computing the batch's rows failed.
    #[error("Delta table {table}: batch {batch_id}: {action}: {source}")]
    DataFusion {
        table: PathBuf,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: weir_core::datafusion::error::DataFusionError,
    },

    /// The engine failed in a step the sink runs (dedupe, fault points).
    #[error("Delta table {table}: batch {batch_id}: {source}")]
    Engine {
        table: PathBuf,
        batch_id: u64,
        #[source]
        source: weir_core::Error,
    },

    /// With dedupe turned off, two rows of the batch have the same key.
    #[error(
        "Delta table {table}: batch {batch_id}: MERGE would match one target row with several \
         source rows: key {key} appears {count} times in the batch; turn dedupe on or remove the duplicates"
    )]
    DuplicateKey {
        table: PathBuf,
        batch_id: u64,
        key: String,
        count: i64,
    },

    /// A setting is unusable; `key` names it.
    #[error("Delta table {table}: invalid setting '{key}': {reason}")]
    Config {
        table: PathBuf,
        key: &'static str,
        reason: String,
    },
}
