//! # weir
//!
//! Micro-batch stream processing with the contract of Spark Structured Streaming's
//! `foreachBatch`, in one Rust binary: each batch reads a recorded offset range, is handed
//! to your function as a DataFusion `DataFrame` with its batch id, and is committed only
//! after the function succeeds. After a crash the uncommitted batch runs again with the
//! same offsets and id, and every sink weir ships makes that second write a no-op.
//!
//! This crate re-exports the engine ([`weir_core`]) and, with the `delta` feature (on by
//! default), the Delta Lake sinks ([`delta`]).

pub use weir_core::*;

/// The console sink (a demo sink that prints each batch).
pub use weir_console::ConsoleSink;

/// Delta Lake sinks: idempotent append and MERGE upsert.
#[cfg(feature = "delta")]
pub use weir_delta as delta;

/// PostgreSQL sinks: exactly-once upsert and the ledger helper.
#[cfg(feature = "postgres")]
pub use weir_postgres as postgres;

/// The Kafka source.
#[cfg(feature = "kafka")]
pub use weir_kafka as kafka;

/// The monitoring endpoint: Prometheus metrics, health and readiness, a live page.
#[cfg(feature = "http")]
pub use weir_http as http;

/// The connectors' configs by kind (pipeline files, the Python package).
#[cfg(all(feature = "delta", feature = "postgres", feature = "kafka"))]
pub mod config;
