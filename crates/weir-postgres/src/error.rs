/// Errors of the PostgreSQL sink. Each names the table and the batch; connection strings
/// (which may hold passwords) are never part of a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresSinkError {
    /// The server refused or dropped the connection, or a statement failed.
    #[error("PostgreSQL table {table}: batch {batch_id}: {action}: {source}")]
    Db {
        table: String,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },

    /// Computing the batch's rows failed.
    #[error("PostgreSQL table {table}: batch {batch_id}: {action}: {source}")]
    DataFusion {
        table: String,
        batch_id: u64,
        action: &'static str,
        #[source]
        source: weir_core::datafusion::error::DataFusionError,
    },

    /// The engine failed in a step the sink runs (dedupe, fault points).
    #[error("PostgreSQL table {table}: batch {batch_id}: {source}")]
    Engine {
        table: String,
        batch_id: u64,
        #[source]
        source: weir_core::Error,
    },

    /// A column has an Arrow type the sink cannot write; nothing was written.
    #[error(
        "PostgreSQL table {table}: column '{column}' has type {data_type}, which the sink cannot write \
         (supported: Utf8, LargeUtf8, Int8-64, UInt8-32, Float32/64, Boolean, Date32, Timestamp, \
         Decimal128, Binary, LargeBinary); cast it in the query"
    )]
    UnsupportedType {
        table: String,
        column: String,
        data_type: String,
    },

    /// A value cannot be written exactly (a timestamp outside PostgreSQL's range, ...);
    /// nothing was written.
    #[error(
        "PostgreSQL table {table}: batch {batch_id}: column '{column}': {reason}; nothing was written"
    )]
    BadValue {
        table: String,
        batch_id: u64,
        column: String,
        reason: String,
    },

    /// The ledger holds this batch for the app id although this is the batch's first
    /// attempt, or a later batch: another query (or an older checkpoint) uses the same
    /// ledger key.
    #[error(
        "PostgreSQL table {table}: batch {batch_id}: the ledger {ledger} already holds batch \
         {recorded} for '{app_id}', which this query did not write (a new checkpoint starts again \
         at batch 0, or another query uses the same app id). Writing would skip this query's \
         batches: give the sink a new app-id (or leave it unset: the default is unique per \
         checkpoint), or set allow-app-id-reuse = true if skipping them is what you mean"
    )]
    AppIdInUse {
        table: String,
        batch_id: u64,
        ledger: String,
        app_id: String,
        recorded: u64,
    },

    /// The driver's connection does not find the rows the tasks on the workers staged:
    /// they reached another server (a `localhost` URL names each machine's own). Nothing
    /// was upserted.
    #[error(
        "PostgreSQL table {table}: batch {batch_id}: the tasks on the workers staged {staged} \
         rows in {staging}, but the driver's connection finds {found} there: the driver and \
         every worker must reach the same PostgreSQL server with the sink's url (`localhost` \
         names each machine's own); nothing was upserted"
    )]
    StagingMissing {
        table: String,
        batch_id: u64,
        staging: String,
        staged: u64,
        found: u64,
    },

    /// A setting is unusable; `key` names it.
    #[error("PostgreSQL table {table}: invalid setting '{key}': {reason}")]
    Config {
        table: String,
        key: &'static str,
        reason: String,
    },

    /// The user's function given to `PostgresLedger::run_once` failed; rolled back.
    #[error(
        "PostgreSQL ledger {ledger}: batch {batch_id}: the transactional write failed and was rolled back"
    )]
    User {
        ledger: String,
        batch_id: u64,
        #[source]
        source: weir_core::BoxError,
    },
}

impl PostgresSinkError {
    /// An error that the same rows give again: a value or type the sink cannot write, or a
    /// statement the server refuses for the data or the table's shape (SQLSTATE classes 22,
    /// data exception, and 42, e.g. an unknown column), not a lost connection.
    pub(crate) fn is_data_error(&self) -> bool {
        match self {
            PostgresSinkError::BadValue { .. } | PostgresSinkError::UnsupportedType { .. } => true,
            PostgresSinkError::Db { source, .. } => source
                .code()
                .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("42")),
            _ => false,
        }
    }

    /// A failure that may pass (`weir_core::error::is_transient` then runs the batch again
    /// after a pause): the connection refused, cut or closed, the server shutting down or
    /// starting, out of resources (SQLSTATE class 08, 57P01-57P03, class 53: connection
    /// slots, disk, memory), a statement cancelled by a timeout or a lock not available
    /// (57014, 55P03), a serialization failure or a deadlock (40001, 40P01). Decided by the
    /// error's type and SQLSTATE, never its text.
    pub(crate) fn is_transient(&self) -> bool {
        let engine = |e: &(dyn std::error::Error + 'static)| weir_core::error::is_transient(e);
        match self {
            PostgresSinkError::Db { source, .. } => transient_db(source),
            PostgresSinkError::DataFusion { source, .. } => engine(source),
            PostgresSinkError::Engine { source, .. } => engine(source),
            PostgresSinkError::User { source, .. } => engine(source.as_ref()),
            _ => false,
        }
    }

    /// The error as the engine takes it: marked `Transient` when it may pass.
    pub(crate) fn boxed(self) -> weir_core::BoxError {
        if self.is_transient() {
            Box::new(weir_core::error::Transient::new(self))
        } else {
            Box::new(self)
        }
    }

    /// A connection slot left empty (`Conn::get` connects when it holds no client, so this
    /// is not expected).
    pub(crate) fn no_connection(table: &str) -> Self {
        PostgresSinkError::Config {
            table: table.to_string(),
            key: "url",
            reason: "no connection".into(),
        }
    }
}

/// See [`PostgresSinkError::is_transient`].
fn transient_db(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(state) = e.code() {
        let code = state.code();
        // 08: connection exceptions; 53: insufficient resources (disk full, out of memory,
        // too many connections); 57014: a statement cancelled (statement_timeout,
        // lock_timeout, pg_cancel_backend); 55P03: a lock not available (NOWAIT);
        // 57P01-57P03: the server shutting down or starting; 40001 and 40P01: a
        // serialization failure or a deadlock.
        return code.starts_with("08")
            || code.starts_with("53")
            || matches!(
                code,
                "57014" | "55P03" | "57P01" | "57P02" | "57P03" | "40001" | "40P01"
            );
    }
    // A refused or cut connection: the I/O error it carries.
    weir_core::error::is_transient(e)
}
