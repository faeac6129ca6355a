//! Starting a query from the Python API's spec, calling the Python function per batch, and
//! the handle Python holds (`weir._weir.Query`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyConnectionError, PyKeyboardInterrupt, PyTimeoutError};
use pyo3::prelude::*;
use serde::Deserialize;
use weir::config::SourceConfig;
use weir::connector::{BuildEnv, DurationText, RetryConfig};
use weir::datafusion::prelude::DataFrame;
use weir::engine::{Transform, check_steps};
use weir::storage::StorageOptions;
use weir::{
    BatchContext, BoxError, ForeachBatch, RetryPolicy, StreamingQuery, Trigger, WeirSession,
};
use weir_cluster::{ClusterConfig, WeirCluster};

use crate::batch::Batch;
use crate::runtime::{block_on, engine_error, error, handle};

/// What `DataStreamWriter.start()` sends: the Python API has already turned Spark's option
/// names into the connectors' config keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct QuerySpec {
    /// `{"type": "files", ...}`: a pipeline file's `[source]` table.
    source: SourceConfig,
    #[serde(default)]
    storage: BTreeMap<String, String>,
    /// `Session(cluster=...)`: a pipeline file's `[cluster]` table.
    #[serde(default)]
    cluster: Option<ClusterConfig>,
    #[serde(default)]
    steps: Vec<Step>,
    name: String,
    checkpoint: String,
    trigger: String,
    /// `.option("statePartitions", n)` (`None`: what the state recorded, or the default).
    #[serde(default)]
    state_partitions: Option<u32>,
    /// `.option("retryAttempts" | "retryInitial" | "retryMax", ...)`.
    #[serde(default)]
    retry: RetryConfig,
    /// `.option("leaseWait" | "leaseTtl", ...)`: as `[query] lease-wait` and `lease-ttl`.
    #[serde(default)]
    lease_wait: Option<DurationText>,
    #[serde(default)]
    lease_ttl: Option<DurationText>,
    /// Relative paths are taken from here (the Python process's working folder).
    base: Option<std::path::PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
enum Step {
    WithWatermark { column: String, delay: DurationText },
    DropDuplicates(Vec<String>),
    DropDuplicatesWithinWatermark(Vec<String>),
}

/// A parsed and checked query spec.
struct Parsed {
    source: SourceConfig,
    cluster: Option<Arc<WeirCluster>>,
    env: BuildEnv,
    steps: Vec<Transform>,
    name: String,
    checkpoint: String,
    trigger: Trigger,
    state_partitions: Option<u32>,
    retry: RetryPolicy,
    lease_wait: Option<DurationText>,
    lease_ttl: Option<DurationText>,
}

fn parse(py: Python<'_>, spec: &str) -> PyResult<Parsed> {
    let bad = |m: String| error(py, "ConfigError", m);
    let spec: QuerySpec =
        serde_json::from_str(spec).map_err(|e| bad(format!("the query's settings: {e}")))?;
    let source = spec.source;
    // A source that cannot read on workers, or a stateful step, is refused when the query
    // starts, as in a pipeline.
    let cluster = spec
        .cluster
        .as_ref()
        .map(|c| WeirCluster::new(c, weir::config::NODES).map(Arc::new))
        .transpose()
        .map_err(|e| bad(e.to_string()))?;
    let env = BuildEnv {
        base: spec.base,
        storage: StorageOptions::new(spec.storage).map_err(|e| engine_error(py, &e))?,
    };
    let steps: Vec<Transform> = spec
        .steps
        .into_iter()
        .map(|s| match s {
            Step::WithWatermark { column, delay } => Transform::Watermark {
                column,
                delay: delay.0,
            },
            Step::DropDuplicates(keys) => Transform::DropDuplicates(keys),
            Step::DropDuplicatesWithinWatermark(keys) => {
                Transform::DropDuplicatesWithinWatermark(keys)
            }
        })
        .collect();
    check_steps(&steps).map_err(|e| engine_error(py, &e))?;
    let trigger: Trigger = spec.trigger.parse().map_err(|e| engine_error(py, &e))?;
    let retry = spec.retry.policy();
    retry.check("retry").map_err(|e| engine_error(py, &e))?;
    source
        .spec()
        .check(&env)
        .and_then(|()| source.spec().read_limit().map(|_| ()))
        .and_then(|()| {
            env.location("checkpointLocation", &spec.checkpoint)
                .map(|_| ())
        })
        .map_err(|e| engine_error(py, &e))?;
    Ok(Parsed {
        source,
        cluster,
        env,
        steps,
        name: spec.name,
        checkpoint: spec.checkpoint,
        trigger,
        state_partitions: spec.state_partitions,
        retry,
        lease_wait: spec.lease_wait,
        lease_ttl: spec.lease_ttl,
    })
}

/// Starts a query whose batches go to `func(batch, batch_id)`. Returns once the query has
/// opened its checkpoint, source and sinks (errors there are raised here).
/// Checks the columns of a reader's `.schema(...)` (`"name type"` each) as the engine will
/// read them, so a bad type is refused where it was written, naming it.
#[pyfunction]
pub fn check_schema(py: Python<'_>, columns: Vec<String>) -> PyResult<()> {
    weir::connector::parse_schema("schema", &columns)
        .map(|_| ())
        .map_err(|e| engine_error(py, &e))
}

#[pyfunction]
pub fn start_query(py: Python<'_>, spec: &str, func: Py<PyAny>) -> PyResult<Query> {
    let p = parse(py, spec)?;
    let failure = Arc::new(Mutex::new(None));
    let sink = PythonFunction {
        func: Arc::new(func),
        failure: failure.clone(),
    };
    let started = block_on(py, async move {
        let mut session = WeirSession::new().storage_options(p.env.storage.clone());
        if let Some(c) = p.cluster {
            session = session.cluster(c);
        }
        let mut frame = p.source.load(&session, &p.env).await?;
        for step in p.steps {
            frame = frame.then(step);
        }
        let mut writer = frame.write_stream();
        if let Some(n) = p.state_partitions {
            writer = writer.state_partitions(n);
        }
        if let Some(t) = p.lease_wait {
            writer = writer.lease_wait(t.0);
        }
        if let Some(t) = p.lease_ttl {
            writer = writer.lease_ttl(t.0);
        }
        writer
            .retry(p.retry)
            .query_name(&p.name)
            .checkpoint(p.env.location("checkpointLocation", &p.checkpoint)?)
            .trigger(p.trigger)
            .sink(sink)
            .start()
            .await
    })?;
    let query = started.map_err(|e| engine_error(py, &e))?;
    Ok(Query { query, failure })
}

/// The batches in the hands of Python functions right now, for sinks called with rows that
/// are not a weir batch (a polars DataFrame, a pyarrow Table): they find the batch's
/// context here by its id.
static ACTIVE: Mutex<Vec<BatchContext>> = Mutex::new(Vec::new());

/// True while a Python function is handling the batch of `ctx` (sinks refuse rows of a
/// batch whose function returned: that batch may be committed already).
pub fn is_active(ctx: &BatchContext) -> bool {
    ACTIVE.lock().is_ok_and(|a| {
        a.iter()
            .any(|c| c.run_id == ctx.run_id && c.batch_id == ctx.batch_id)
    })
}

/// The context of the batch `batch_id` that a Python function is handling now.
pub fn active_batch(py: Python<'_>, batch_id: u64, what: &str) -> PyResult<BatchContext> {
    let active = ACTIVE
        .lock()
        .map_err(|_| error(py, "WeirError", "the list of running batches was poisoned"))?;
    let found: Vec<&BatchContext> = active.iter().filter(|c| c.batch_id == batch_id).collect();
    match found.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(error(
            py,
            "WeirError",
            format!(
                "{what}: no batch {batch_id} is being handled: call it inside the function \
                 given to foreach_batch, with that function's batch_id"
            ),
        )),
        _ => Err(error(
            py,
            "WeirError",
            format!(
                "{what}: two queries are handling a batch {batch_id}: pass the weir batch (or \
                 a table made from it with batch.sql) rather than other rows"
            ),
        )),
    }
}

thread_local! {
    /// True on the thread running a Python batch function (for `stop()` called inside it).
    static IN_BATCH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Removes a context from [`ACTIVE`] when the function returns, whatever happened.
struct ActiveGuard(uuid::Uuid, u64);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        IN_BATCH.with(|b| b.set(false));
        if let Ok(mut a) = ACTIVE.lock() {
            a.retain(|c| !(c.run_id == self.0 && c.batch_id == self.1));
        }
    }
}

/// The Python function as the engine's `ForeachBatch`.
struct PythonFunction {
    func: Arc<Py<PyAny>>,
    /// The exception the function raised, for `await_termination` to chain.
    failure: Arc<Mutex<Option<PyErr>>>,
}

/// What the engine is told when the Python function raises.
#[derive(Debug)]
struct PythonFailure {
    traceback: String,
}

impl std::fmt::Display for PythonFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the Python function raised:\n{}",
            self.traceback.trim_end()
        )
    }
}

impl std::error::Error for PythonFailure {}

fn format_traceback(py: Python<'_>, err: &PyErr) -> String {
    let formatted = py.import("traceback").and_then(|tb| {
        let value = err.value(py);
        let lines = tb.call_method1(
            "format_exception",
            (value.get_type(), value, err.traceback(py)),
        )?;
        lines.extract::<Vec<String>>()
    });
    match formatted {
        Ok(lines) => lines.concat(),
        Err(_) => err.to_string(),
    }
}

#[async_trait::async_trait]
impl ForeachBatch for PythonFunction {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let func = self.func.clone();
        let failure = self.failure.clone();
        // The function runs on a blocking thread that takes the GIL: the engine's workers
        // never wait for the GIL.
        let joined = tokio::task::spawn_blocking(move || {
            if let Ok(mut a) = ACTIVE.lock() {
                a.push(ctx.clone());
            }
            let _guard = ActiveGuard(ctx.run_id, ctx.batch_id);
            IN_BATCH.with(|b| b.set(true));
            // The cause of the query's failure is the last call's exception, if it raised.
            if let Ok(mut f) = failure.lock() {
                *f = None;
            }
            Python::attach(|py| {
                let id = ctx.batch_id;
                let result = Py::new(py, Batch::new(batch, ctx, false))
                    .and_then(|b| func.call1(py, (b, id)));
                match result {
                    Ok(_) => Ok(()),
                    Err(e) => {
                        let traceback = format_traceback(py, &e);
                        // Python's own types for a failure that may pass: the query runs
                        // the batch again after a pause (`retry`) instead of stopping.
                        let transient = e.is_instance_of::<PyConnectionError>(py)
                            || e.is_instance_of::<PyTimeoutError>(py);
                        if let Ok(mut f) = failure.lock() {
                            *f = Some(e);
                        }
                        let failed = PythonFailure { traceback };
                        Err(if transient {
                            Box::new(weir::error::Transient::new(failed)) as BoxError
                        } else {
                            Box::new(failed) as BoxError
                        })
                    }
                }
            })
        })
        .await;
        match joined {
            Ok(r) => r,
            Err(e) => Err(format!("the thread running the Python function failed: {e}").into()),
        }
    }
}

/// A started query (`weir.StreamingQuery` wraps it).
#[pyclass(module = "weir._weir", frozen)]
pub struct Query {
    query: StreamingQuery,
    failure: Arc<Mutex<Option<PyErr>>>,
}

/// How often a wait looks for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(100);

impl Query {
    /// The query's end as a Python result: `StreamingQueryException` (with the Python
    /// function's exception as its cause) if it failed.
    fn outcome(&self, py: Python<'_>) -> PyResult<()> {
        let Some(e) = self.query.exception() else {
            return Ok(());
        };
        let err = error(
            py,
            "StreamingQueryException",
            format!(
                "query {} (id {}, run {}) failed: {}",
                self.query.name(),
                self.query.id(),
                self.query.run_id(),
                weir::sink::error_chain(e.as_ref())
            ),
        );
        let cause = self
            .failure
            .lock()
            .ok()
            .and_then(|f| f.as_ref().map(|c| c.clone_ref(py)));
        if let Some(cause) = cause {
            err.set_cause(py, Some(cause));
        }
        Err(err)
    }
}

#[pymethods]
impl Query {
    #[getter]
    fn id(&self) -> String {
        self.query.id().to_string()
    }

    #[getter]
    fn run_id(&self) -> String {
        self.query.run_id().to_string()
    }

    #[getter]
    fn name(&self) -> String {
        self.query.name().to_string()
    }

    #[getter]
    fn is_active(&self) -> bool {
        self.query.is_active()
    }

    /// The newest progress report as JSON (Spark's field names), or None.
    fn last_progress(&self) -> PyResult<Option<String>> {
        self.query
            .last_progress()
            .map(|p| serde_json::to_string(&p))
            .transpose()
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
    }

    /// Up to the last 100 progress reports as JSON, oldest first.
    fn recent_progress(&self) -> PyResult<Vec<String>> {
        self.query
            .recent_progress()
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<_, _>>()
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
    }

    /// The error the query failed with, as `StreamingQueryException`, or None.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        self.outcome(py).err()
    }

    /// Waits until the query ends (or `timeout` seconds pass: then returns False). Raises
    /// `StreamingQueryException` if it failed. Ctrl-C asks the query to stop after the
    /// batch in progress and goes on waiting; a second Ctrl-C stops waiting (the batch is
    /// not committed and runs again on the next start).
    #[pyo3(signature = (timeout=None))]
    fn await_termination(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline =
            timeout.map(|t| std::time::Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        let mut interrupted = false;
        loop {
            let slice = match deadline {
                Some(d) => d
                    .saturating_duration_since(std::time::Instant::now())
                    .min(SIGNAL_POLL),
                None => SIGNAL_POLL,
            };
            let q = self.query.clone();
            let done = block_on(py, async move { q.await_termination_timeout(slice).await })?;
            match done {
                Ok(true) => return self.outcome(py).map(|()| true),
                Err(_) => return self.outcome(py).map(|()| true),
                Ok(false) => {}
            }
            if let Err(e) = py.check_signals() {
                if !e.is_instance_of::<PyKeyboardInterrupt>(py) || interrupted {
                    return Err(e);
                }
                interrupted = true;
                let q = self.query.clone();
                handle(py)?.spawn(async move { q.stop().await });
                eprintln!(
                    "weir: stopping query {} after the batch in progress (Ctrl-C again to stop waiting)",
                    self.query.name()
                );
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Ok(false);
            }
        }
    }

    /// Stops the query after the batch in progress (which is committed, not cut off) and
    /// waits for it. A query that already failed is not raised here (see `exception()`).
    /// Called inside a batch function, it only asks: waiting there would wait for itself.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let q = self.query.clone();
        if IN_BATCH.with(|b| b.get()) {
            handle(py)?.spawn(async move { q.stop().await });
            return Ok(());
        }
        let _ = block_on(py, async move { q.stop().await })?;
        Ok(())
    }
}
