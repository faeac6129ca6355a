//! # weir-delta
//!
//! Exactly-once Delta Lake sinks for weir, on delta-rs.
//!
//! | sink | pattern | on replay |
//! |---|---|---|
//! | [`DeltaAppend`] | application transaction `(app_id, version = batch id)` in the same commit as the rows | skipped: the table already records that version |
//! | [`DeltaMerge`] | newest row per key in the batch, MERGE with an ordering guard, the application transaction in the same commit | skipped; idempotent even without the skip |
//!
//! delta-rs records an application transaction but does not skip a write whose version it
//! has seen (unlike Spark's `txnVersion`): these sinks read the recorded version first and
//! skip themselves, and say so in the batch's progress (`sink.metrics`).
//!
//! The default application id is the query name plus the checkpoint's query id
//! ([`weir_core::BatchContext::app_id`]), so a fresh checkpoint, whose batch ids start
//! again from 0, can never be hidden by the versions an old checkpoint recorded.

// delta-rs and DataFusion errors are large; the error path of a sink is cold.
#![allow(clippy::result_large_err)]

mod append;
mod error;
mod merge;
mod table;

pub use append::DeltaAppend;
pub use error::DeltaSinkError;
pub use merge::DeltaMerge;
pub use table::{read_table, recorded_version, table_version};

/// delta-rs, re-exported for reading tables in tests and tools.
pub use deltalake;
