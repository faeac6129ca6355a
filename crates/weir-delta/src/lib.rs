//! # weir-delta
//!
//! Exactly-once Delta Lake sinks for weir, on delta-rs, for tables on a local disk or an
//! object store (`s3://`, `az://`/`abfss://`, `gs://`).
//!
//! | sink | pattern | on replay |
//! |---|---|---|
//! | [`DeltaAppend`] | application transaction `(app_id, version = batch id)` in the same commit as the rows | skipped: the table already records that version |
//! | [`DeltaMerge`] | newest row per key in the batch, MERGE with an ordering guard, the application transaction in the same commit | skipped; idempotent even without the skip |
//!
//! delta-rs records an application transaction but does not skip a write whose version it
//! has seen (unlike Spark's `txnVersion`): these sinks read the recorded version first and
//! skip themselves, and say so in the batch's progress (`sink.metrics`). A recorded version
//! the query cannot have written (beyond the batch, or the batch itself on its first
//! attempt) means another query or an older checkpoint uses the app id: an error, not a
//! silent skip, unless `allow_app_id_reuse` is set.
//!
//! The default application id is the query name (as it was when the checkpoint was
//! created) plus the checkpoint's query id ([`weir_core::BatchContext::app_id`]), so a fresh
//! checkpoint, whose batch ids start again from 0, can never be hidden by the versions an
//! old checkpoint recorded, and renaming a query does not change it.
//!
//! Local tables are written through a store that fsyncs every file and folder, so a commit
//! is durable before the engine writes `commits/N`.
//!
//! On a cluster, [`DeltaAppend`] writes where the batch's plan runs: each task writes data
//! files ([`DeltaFilesExec`], on the wire as [`DELTA_FILES`]) and the driver commits their
//! `add` actions and the transaction in one version; tables with rules delta-rs checks while
//! writing go to the driver's write (see `on_workers.rs`).

// delta-rs and DataFusion errors are large; the error path of a sink is cold.
#![allow(clippy::result_large_err)]

mod append;
mod commit_files;
pub mod compact;
mod config;
mod error;
mod log_cleanup;
mod merge;
mod on_workers;
mod store;
mod table;

pub use append::DeltaAppend;
pub use config::{DeltaAppendConfig, DeltaMergeConfig, DeltaReader};
pub use error::DeltaSinkError;
pub use merge::DeltaMerge;
pub use on_workers::{DELTA_FILES, DeltaFilesExec, FilesWrite};
pub use table::{data_commits, decide_write, open, read_table, recorded_version, table_version};

/// delta-rs, re-exported for reading tables in tests and tools.
pub use deltalake;

/// Before the commit that carries the batch's rows (and its app transaction).
pub const POINT_BEFORE_COMMIT: &str = "delta-before-commit";
/// After that commit.
pub const POINT_AFTER_COMMIT: &str = "delta-after-commit";
/// The fault points of the Delta sinks, in the order a batch passes them.
pub const DELTA_POINTS: &[&str] = &[POINT_BEFORE_COMMIT, POINT_AFTER_COMMIT];
