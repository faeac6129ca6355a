//! # weir-core
//!
//! The engine of weir: Spark Structured Streaming's `foreachBatch` contract for Rust.
//!
//! For each micro-batch N the engine writes the offset range to `<checkpoint>/offsets/N`
//! before running anything, hands the rows to the user's function as an ordinary DataFusion
//! [`DataFrame`](datafusion::prelude::DataFrame) with `ctx.batch_id == N`, and writes
//! `<checkpoint>/commits/N` only after the function returns `Ok`. After a crash the newest
//! uncommitted batch runs again with exactly its recorded offsets and the same id, so a sink
//! that keys its writes by batch id (see [`sink`]) turns the second write into a no-op.
//!
//! Modules: [`checkpoint`] (logs, recovery, the lock), [`source`] (files, rate, memory),
//! [`engine`] (runner, triggers, progress), [`sink`] (the contract, Parquet, console),
//! [`storage`] (local folders and object stores), [`fault`] (fault points for crash tests).

pub mod api;
pub mod checkpoint;
pub mod connector;
pub mod engine;
pub mod error;
pub mod fault;
pub mod logfile;
pub mod sink;
pub mod source;
pub mod state;
pub mod storage;

/// The cores this process may use, asked once: `available_parallelism` reads the cgroup
/// files on every call, which showed in the profile of small batches.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

pub use api::{
    DataStreamReader, DataStreamWriter, IntoLocation, LocationSpec, StreamingDataFrame, WeirSession,
};
pub use engine::{
    Aggregation, OutputMode, QueryListener, RetryPolicy, StreamingQuery, StreamingQueryProgress,
    Trigger,
};
pub use error::{BoxError, Error, Result};
pub use sink::{
    BatchContext, FanOut, ForeachBatch, NullKeys, NullOrdering, ParquetCompression, ParquetSink,
    SinkMetric, SinkMetrics, dedupe_latest,
};
pub use source::{
    BadRecordMode, CleanSource, FileFormat, FileSource, FileSourceOptions, MemorySource,
    RateSource, ReadLimit, Source, SourceOffset,
};
pub use storage::{Location, StorageOptions};

/// The DataFusion this engine is built on, re-exported so users link the same version.
pub use datafusion;
