//! # weir-postgres
//!
//! Exactly-once PostgreSQL writes for weir. The seed article's staging table and
//! `stream_batches` ledger, done better because the whole write runs in one process:
//!
//! ```text
//! BEGIN;
//! INSERT INTO <ledger> (app_id, batch_id, rows) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING;
//!   -- unless a later batch is recorded; the same statement deletes the app id's rows
//!   -- older than its newest 1,000 batches
//! -- 0 rows inserted: this batch already landed -> COMMIT, report "skipped", return
//! COPY <temp table> FROM STDIN (FORMAT binary);          -- temp table ON COMMIT DROP
//! INSERT INTO <target> AS t (...) SELECT ... FROM <temp>
//!   ON CONFLICT (<key>) DO UPDATE SET ... WHERE t.<ordering> < EXCLUDED.<ordering>;
//! COMMIT;
//! ```
//!
//! - [`PostgresUpsert`]: the above, with in-batch dedupe (PostgreSQL refuses an
//!   `ON CONFLICT DO UPDATE` that touches one row twice), binary COPY, quoted identifiers,
//!   values only as COPY data or bind parameters, and the seed's persistent-staging variant
//!   for writers that cannot share one transaction.
//! - [`PostgresLedger`]: makes any transactional SQL of yours exactly-once per batch.

mod config;
mod error;
mod ledger;
mod types;
mod upsert;

pub use config::{DEFAULT_LEDGER, LoadName, PostgresReader, PostgresUpsertConfig};
pub use error::PostgresSinkError;
pub use ledger::{LEDGER_KEEP_BATCHES, PostgresLedger};
pub use types::pg_type;
pub use upsert::{LoadMode, PG_STAGING, PgStagingExec, PostgresUpsert, StagingWrite};

/// With a persistent staging table: after the batch's rows are staged (outside the
/// transaction).
pub const POINT_AFTER_STAGING: &str = "pg-after-staging";
/// Before `BEGIN`.
pub const POINT_BEFORE_BEGIN: &str = "pg-before-begin";
/// Inside the transaction, after the rows are copied into the temp table.
pub const POINT_AFTER_COPY: &str = "pg-after-copy";
/// Inside the transaction, before `COMMIT`.
pub const POINT_BEFORE_COMMIT: &str = "pg-before-commit";
/// After `COMMIT`.
pub const POINT_AFTER_COMMIT: &str = "pg-after-commit";

/// The fault points of an upsert, in the order a batch passes them.
pub fn upsert_points(staging: bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    if staging {
        out.push(POINT_AFTER_STAGING);
    }
    out.push(POINT_BEFORE_BEGIN);
    if !staging {
        out.push(POINT_AFTER_COPY);
    }
    out.extend([POINT_BEFORE_COMMIT, POINT_AFTER_COMMIT]);
    out
}

/// tokio-postgres, re-exported for `PostgresLedger::run_once` closures.
pub use tokio_postgres;

/// `"name"` with inner quotes doubled; `a.b` becomes `"a"."b"`.
pub fn quote_ident(name: &str) -> String {
    name.split('.')
        .map(|p| format!("\"{}\"", p.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// Quoted identifiers separated by commas: `"a", "b"`.
pub(crate) fn quote_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| quote_ident(n))
        .collect::<Vec<_>>()
        .join(", ")
}
