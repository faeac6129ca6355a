//! The process's tokio runtime, and how engine errors become Python exceptions.

use std::future::Future;
use std::sync::OnceLock;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use weir::sink::error_chain;

static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();

/// The runtime every query and sink of this process runs on (built on first use).
pub fn handle(py: Python<'_>) -> PyResult<tokio::runtime::Handle> {
    let rt = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("weir")
            .build()
            .map_err(|e| e.to_string())
    });
    match rt {
        Ok(rt) => Ok(rt.handle().clone()),
        Err(e) => Err(error(
            py,
            "WeirError",
            format!("starting the engine's runtime: {e}"),
        )),
    }
}

/// Runs `fut` to completion on the runtime with the GIL released.
pub fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let h = handle(py)?;
    Ok(py.detach(move || h.block_on(fut)))
}

/// An instance of `weir.errors.<class>` with `message` (RuntimeError if that module cannot
/// be imported, which only happens when the native module is used on its own).
pub fn error(py: Python<'_>, class: &str, message: impl Into<String>) -> PyErr {
    let message = message.into();
    let made = py
        .import("weir.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((message.clone(),)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// An engine error as `weir.errors.ConfigError` (a bad setting) or `WeirError`, with its
/// whole chain of causes.
pub fn engine_error(py: Python<'_>, e: &(dyn std::error::Error + 'static)) -> PyErr {
    let class = if is_config(e) {
        "ConfigError"
    } else {
        "WeirError"
    };
    error(py, class, error_chain(e))
}

fn is_config(e: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        e.downcast_ref::<weir::Error>(),
        Some(weir::Error::Config { .. })
    )
}
