//! # weir-http
//!
//! The monitoring endpoint of a weir query: Prometheus metrics, health and readiness
//! checks, the recent progress reports, and a live page in the spirit of Spark's Structured
//! Streaming tab, all from one small HTTP/1 server (hyper).
//!
//! ```no_run
//! # async fn f(writer: weir_core::DataStreamWriter) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! let monitor = Arc::new(weir_http::Monitor::new("orders", Duration::from_secs(30),
//!                                                 Duration::from_secs(300)));
//! let _endpoint = weir_http::serve("127.0.0.1:9464", monitor.clone()).await?;
//! let query = writer.listener(monitor).start().await?;
//! query.await_termination().await?;
//! # Ok(()) }
//! ```
//!
//! Every metric carries the query's name as the `query` label; the names follow
//! Prometheus' conventions (`weir_` prefix, seconds, `_total` counters). The page reads
//! `/api/progress` and `/api/status` once a second and needs nothing from the network.

mod error;
pub mod expo;
mod histogram;
mod monitor;
mod process;
mod server;

pub use error::HttpError;
pub use monitor::{Behind, LagLimits, Monitor, NextAttempt, Phase, RECENT, Status};
pub use process::{ProcessStats, process_stats};
pub use server::{Endpoint, metrics_text, serve, serve_with_token};
