//! weir on many machines, on datafusion-distributed (Arrow Flight workers).
//!
//! Spark's driver and executors, with weir's contract unchanged:
//!
//! - `weir run` with a `[cluster]` is the **driver**. It alone owns the checkpoint: it plans
//!   batch N's range, writes `offsets/N`, runs the batch's plan on the workers, calls the
//!   function with the rows and writes `commits/N` after it. One batch id, one commit.
//! - `weir worker --listen HOST:PORT` is a **worker** ([`worker::serve`]): no durable state,
//!   it runs the plan stages a driver sends. A worker checks every request for the driver's
//!   weir version and the cluster token, and refuses a mismatch naming it.
//! - The batch's **scan runs on the workers**: each task reads its share of the recorded
//!   input, the files `sources/<i>/N` listed or the Kafka ranges of `offsets/N`
//!   ([`weir_core::source::leaf::WorkerScan`]s of the kinds the binary lists, sent by
//!   [`codec::WeirCodec`]). The stateless steps (SQL, DataFrame functions) are planned on
//!   the distributed session, so their shuffles are the planner's hash repartitions.
//! - **Failures**: a plan that fails on a worker (killed, cut off) is run again with the
//!   same range on the workers left (`max-batch-attempts`); the workers are resolved and
//!   checked again before every attempt ([`driver::WeirCluster`]), so one that comes back
//!   joins at the next attempt or batch.
//!
//! - **Writes**: a sink that writes on the workers (Parquet, alone) puts a
//!   [`weir_core::sink::WorkerWrite`] on top of the plan; each task writes its rows and the
//!   driver commits what they wrote, once.
//!
//! - **TLS**: workers listed as `https://` serve TLS ([`tls`]); the driver and the other
//!   workers check their certificates against `tls-ca`.
//!
//! - **State**: the state partitions of a deduplication and of an aggregation are loaded,
//!   worked and committed on the workers (`weir_core::engine::state_nodes`, carried by the
//!   codec), one task per live worker, routed to the same worker every batch.
//!
//! Not distributed yet: a second stateful step (it runs on the driver over the first one's
//! output), and several sinks together or a function (the driver writes what the workers
//! computed).

pub mod codec;
pub mod config;
pub mod driver;
pub mod tls;
pub mod worker;

pub use config::ClusterConfig;
pub use driver::WeirCluster;

/// The version a driver and its workers must share (the workspace's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The header carrying the cluster token on every request to a worker.
pub const TOKEN_HEADER: &str = "x-weir-cluster-token";
/// The header carrying the driver's weir version on every request to a worker.
pub const VERSION_HEADER: &str = "x-weir-version";

/// What can go wrong on a cluster, with the worker or setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `[cluster]` setting is wrong.
    #[error("cluster.{key}: {reason}")]
    Config { key: String, reason: String },

    /// No worker of the list can take plans.
    #[error("no usable worker: {0}")]
    NoWorker(String),

    /// A setting read with weir-core's parsers, or the engine's own error.
    #[error(transparent)]
    Core(#[from] weir_core::Error),

    /// A TLS file (`what`: the setting or flag that names it) cannot be used.
    #[error("{what}: {reason}")]
    Tls { what: String, reason: String },

    /// The worker could not be served.
    #[error("serving the worker on {addr}: {reason}")]
    Serve { addr: String, reason: String },
}

/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
