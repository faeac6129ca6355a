//! The native half of the Python package `weir` (`weir._weir`).
//!
//! The Python half (`python/weir`) gives the PySpark-shaped API; this module gives it the
//! engine: a query started from a source config and a Python function, the batch handed to
//! that function as an Arrow stream ([`batch::Batch`]), the sinks weir ships
//! ([`sinks::Sink`], [`sinks::Ledger`]).
//!
//! Threads: the engine runs on one tokio runtime per process ([`runtime`]). The user's
//! function runs on a blocking-pool thread that takes the GIL; the engine awaits it without
//! holding the GIL or blocking a worker. Every call from Python into the engine (a sink
//! write, SQL on a batch, waiting for a query) releases the GIL while it waits.

mod arrow;
mod batch;
mod query;
mod runtime;
mod sinks;

use pyo3::prelude::*;

#[pymodule]
fn _weir(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The engine's fault points a batch passes, in order (`WEIR_FAULT`, for crash tests).
    m.add("RUNNER_POINTS", weir::fault::RUNNER_POINTS.to_vec())?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<query::Query>()?;
    m.add_class::<sinks::Sink>()?;
    m.add_class::<sinks::Ledger>()?;
    m.add_function(wrap_pyfunction!(query::start_query, m)?)?;
    m.add_function(wrap_pyfunction!(query::check_schema, m)?)?;
    Ok(())
}
