/// Errors of the Delta sinks. Each names the table and, where there is one, the batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaSinkError {
    /// delta-rs failed (I/O, protocol, a concurrent commit, a MERGE that matched one
    /// target row with several source rows, ...).
    #[error("Delta table {table}: batch {batch_id}: {action}")]
    Delta {
        table: String,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: deltalake::DeltaTableError,
    },

    /// Computing the batch's rows failed.
    #[error("Delta table {table}: batch {batch_id}: {action}")]
    DataFusion {
        table: String,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: weir_core::datafusion::error::DataFusionError,
    },

    /// The engine failed in a step the sink runs (dedupe, NULL rules, fault points).
    #[error("Delta table {table}: batch {batch_id}")]
    Engine {
        table: String,
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
        table: String,
        batch_id: u64,
        key: String,
        count: i64,
    },

    /// The table records a version for the app id that this query cannot have written: the
    /// app id is used by another query or an older checkpoint.
    #[error(
        "Delta table {table}: batch {batch_id}: the table records version {recorded} for app id \
         '{app_id}', which this query did not write (a new checkpoint starts again at batch 0, or \
         another query uses the same app id). Writing would skip this query's batches up to \
         {recorded}: give the sink a new app-id (or leave it unset: the default is unique per \
         checkpoint), or set allow-app-id-reuse = true if skipping them is what you mean"
    )]
    AppIdInUse {
        table: String,
        batch_id: u64,
        app_id: String,
        recorded: i64,
    },

    /// A row of the batch has a NULL in a column the table declares NOT NULL.
    #[error(
        "Delta table {table}: batch {batch_id}: column '{column}' is NOT NULL in the table, and \
         the batch has a NULL in it"
    )]
    NullInNotNull {
        table: String,
        batch_id: u64,
        column: String,
    },

    /// A data file a worker wrote to a local table is not in the driver's folder.
    #[error(
        "Delta table {table}: batch {batch_id}: the data file '{file}' that a worker wrote is not \
         in the table's folder here: on a cluster a local table must be on a folder the driver \
         and every worker share (or use an object store)"
    )]
    NotShared {
        table: String,
        batch_id: u64,
        file: String,
    },

    /// A setting is unusable; `key` names it.
    #[error("Delta table {table}: invalid setting '{key}': {reason}")]
    Config {
        table: String,
        key: &'static str,
        reason: String,
    },
}
