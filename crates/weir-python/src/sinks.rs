//! The sinks weir ships, called from Python inside the batch function:
//! `sink(batch, batch_id)` with the same exactly-once behaviour as in Rust, and the
//! PostgreSQL ledger for the user's own statements.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::FutureExt;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use tokio_postgres::types::ToSql;
use weir::config::SinkConfig;
use weir::connector::BuildEnv;
use weir::postgres::PostgresLedger;
use weir::sink::{SinkMetric, error_chain};
use weir::storage::StorageOptions;
use weir::{BatchContext, ForeachBatch};

use crate::arrow::import_stream;
use crate::batch::Batch;
use crate::query::{active_batch, is_active};
use crate::runtime::{block_on, engine_error, error};

/// One of weir's sinks, built from its config (the same keys as a pipeline file's
/// `[[sink]]`, which the Python classes fill in from their arguments).
#[pyclass(module = "weir._weir", frozen)]
pub struct Sink {
    sink: Arc<dyn ForeachBatch>,
    label: String,
    points: Vec<&'static str>,
    /// Queries (by run) whose start checks this sink has run.
    opened: Mutex<HashSet<uuid::Uuid>>,
}

fn build_env(py: Python<'_>, storage: &str, base: Option<String>) -> PyResult<BuildEnv> {
    let values: BTreeMap<String, String> = serde_json::from_str(storage)
        .map_err(|e| error(py, "ConfigError", format!("storage options: {e}")))?;
    Ok(BuildEnv {
        base: base.map(Into::into),
        storage: StorageOptions::new(values).map_err(|e| engine_error(py, &e))?,
    })
}

/// The batch context and rows for a sink call: a weir batch carries its own context;
/// other rows (pyarrow, polars) take the context of the batch being handled with that id.
fn rows_and_context(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    batch_id: u64,
    what: &str,
) -> PyResult<(weir::datafusion::prelude::DataFrame, BatchContext)> {
    if let Ok(b) = data.cast::<Batch>() {
        let b = b.get();
        if b.ctx.batch_id != batch_id {
            return Err(error(
                py,
                "WeirError",
                format!(
                    "{what}: called with batch_id {batch_id} for the rows of batch {}: pass \
                     the batch id your function was given",
                    b.ctx.batch_id
                ),
            ));
        }
        if !is_active(&b.ctx) {
            return Err(ended(py, what, batch_id));
        }
        return Ok((b.frame(py)?, b.ctx.clone()));
    }
    let ctx = active_batch(py, batch_id, what)?;
    let (schema, batches) = import_stream(py, data, what)?;
    let frame = weir::datafusion::datasource::MemTable::try_new(schema, vec![batches])
        .and_then(|t| ctx.session.read_table(Arc::new(t)))
        .map_err(|e| error(py, "WeirError", format!("{what}: batch {batch_id}: {e}")))?;
    Ok((frame, ctx))
}

/// The error for rows of a batch whose function has returned.
fn ended(py: Python<'_>, what: &str, batch_id: u64) -> PyErr {
    error(
        py,
        "WeirError",
        format!(
            "{what}: batch {batch_id} is no longer being handled (its function returned, so it \
             may be committed): write inside the function, before it returns"
        ),
    )
}

#[pymethods]
impl Sink {
    /// `config_json`: a pipeline file's `[[sink]]` table as JSON (`{"type": "delta-merge",
    /// ...}`); `storage_json`: object-store settings as JSON; `base`: the folder relative
    /// paths are taken from.
    #[new]
    #[pyo3(signature = (config_json, storage_json="{}", base=None))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        storage_json: &str,
        base: Option<String>,
    ) -> PyResult<Self> {
        let env = build_env(py, storage_json, base)?;
        let config: SinkConfig = serde_json::from_str(config_json)
            .map_err(|e| error(py, "ConfigError", format!("sink: {e}")))?;
        let spec = config.spec();
        let sink = spec.build(&env).map_err(|e| engine_error(py, &e))?;
        Ok(Sink {
            sink,
            label: spec.label(&env),
            points: config.harness().fault_points(),
            opened: Mutex::new(HashSet::new()),
        })
    }

    /// The sink's name in progress reports and errors (its kind and where it writes).
    #[getter]
    fn label(&self) -> String {
        self.label.clone()
    }

    /// Writes `data` (the batch, a batch from `batch.sql`/`weir.cache`, or any Arrow table
    /// such as a polars DataFrame) as batch `batch_id`. A replay of a batch the sink already
    /// holds changes nothing. Raises `SinkError` naming the sink and the batch: let it
    /// propagate, so the batch is not committed.
    fn __call__(&self, py: Python<'_>, data: &Bound<'_, PyAny>, batch_id: u64) -> PyResult<()> {
        let (frame, ctx) = rows_and_context(py, data, batch_id, &self.label)?;
        let first = self
            .opened
            .lock()
            .map(|mut o| o.insert(ctx.run_id))
            .unwrap_or(true);
        let sink = self.sink.clone();
        let started = Instant::now();
        let rows_before = ctx.metrics.output_rows();
        let c = ctx.clone();
        let result = block_on(py, async move {
            if first {
                sink.open(&c.query()).await?;
            }
            sink.call(frame, c).await
        })?;
        result.map_err(|e| {
            error(
                py,
                "SinkError",
                format!(
                    "{}: batch {batch_id}: {}",
                    self.label,
                    error_chain(e.as_ref())
                ),
            )
        })?;
        // As a fan-out records them: time and rows per sink in the batch's progress.
        ctx.metrics.record(
            &self.label,
            SinkMetric::DurationMs,
            started.elapsed().as_millis(),
        );
        let rows_after = ctx.metrics.output_rows();
        if rows_after != rows_before {
            ctx.metrics.record(
                &self.label,
                SinkMetric::Rows,
                rows_after - rows_before.max(0),
            );
        }
        Ok(())
    }

    /// The fault points a batch passes in this sink, in order (`WEIR_FAULT`, for crash
    /// tests).
    #[getter]
    fn fault_points(&self) -> Vec<&'static str> {
        self.points.clone()
    }

    fn __repr__(&self) -> String {
        format!("Sink({})", self.label)
    }
}

/// A SQL parameter from Python.
#[derive(Debug)]
enum Param {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

impl Param {
    fn from_py(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Self> {
        if v.is_none() {
            Ok(Param::Null)
        } else if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
            Ok(Param::Bool(b.is_true()))
        } else if let Ok(i) = v.extract::<i64>() {
            Ok(Param::Int(i))
        } else if let Ok(f) = v.extract::<f64>() {
            Ok(Param::Float(f))
        } else if let Ok(s) = v.extract::<String>() {
            Ok(Param::Text(s))
        } else {
            Err(error(
                py,
                "ConfigError",
                format!(
                    "a SQL parameter of type {} is not supported: use None, bool, int, float \
                     or str (cast in SQL: $1::timestamptz)",
                    v.get_type().name()?
                ),
            ))
        }
    }

    fn to_sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Param::Null => &None::<String>,
            Param::Bool(b) => b,
            Param::Int(i) => i,
            Param::Float(f) => f,
            Param::Text(s) => s,
        }
    }
}

/// The statements of a list (or tuple) of them.
fn statement_list(
    py: Python<'_>,
    what: &str,
    list: &Bound<'_, PyAny>,
) -> PyResult<Vec<(String, Vec<Param>)>> {
    if !(list.is_instance_of::<PyList>() || list.is_instance_of::<PyTuple>()) {
        return Err(error(
            py,
            "ConfigError",
            format!("{what}: give a list of statements (or a function returning one)"),
        ));
    }
    statements(py, list)
}

/// `(sql, [params])` or `sql`.
fn statements(py: Python<'_>, list: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Vec<Param>)>> {
    let mut out = Vec::new();
    for item in list.try_iter()? {
        let item = item?;
        if let Ok(sql) = item.extract::<String>() {
            out.push((sql, Vec::new()));
        } else if let Ok(t) = item.cast::<PyTuple>() {
            if t.len() != 2 {
                return Err(error(
                    py,
                    "ConfigError",
                    "a statement is a SQL string or a (sql, params) pair",
                ));
            }
            let sql: String = t.get_item(0)?.extract()?;
            let params = t
                .get_item(1)?
                .try_iter()?
                .map(|p| p.and_then(|p| Param::from_py(py, &p)))
                .collect::<PyResult<Vec<_>>>()?;
            out.push((sql, params));
        } else {
            return Err(error(
                py,
                "ConfigError",
                "a statement is a SQL string or a (sql, params) pair",
            ));
        }
    }
    Ok(out)
}

/// Any transactional SQL, exactly once per batch: the ledger row and the statements commit
/// together; a replayed batch finds its ledger row and runs nothing.
#[pyclass(module = "weir._weir", frozen)]
pub struct Ledger {
    ledger: PostgresLedger,
    table: String,
}

#[pymethods]
impl Ledger {
    #[new]
    #[pyo3(signature = (url, ledger, app_id=None))]
    fn new(py: Python<'_>, url: &str, ledger: &str, app_id: Option<String>) -> PyResult<Self> {
        let url = weir::connector::secret("url", url).map_err(|e| engine_error(py, &e))?;
        let mut l = PostgresLedger::new(url, ledger);
        if let Some(a) = app_id {
            l = l.app_id(a);
        }
        Ok(Ledger {
            ledger: l,
            table: ledger.to_string(),
        })
    }

    /// Runs `statements` (SQL strings or `(sql, params)` pairs, or a function returning
    /// them, called only when the batch has not landed yet) in one transaction with the
    /// ledger row of batch `batch_id`. True if they ran, False if the batch had landed.
    fn run_once(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyAny>,
        batch_id: u64,
        statements_or_fn: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let what = format!("postgres-ledger {}", self.table);
        let ctx = match batch.cast::<Batch>() {
            Ok(b) if is_active(&b.get().ctx) => b.get().ctx.clone(),
            Ok(_) => return Err(ended(py, &what, batch_id)),
            Err(_) => active_batch(py, batch_id, &what)?,
        };
        if ctx.batch_id != batch_id {
            return Err(error(
                py,
                "WeirError",
                format!(
                    "{what}: called with batch_id {batch_id} for batch {}",
                    ctx.batch_id
                ),
            ));
        }
        // A list is checked now; a function is called only once the batch is claimed in the
        // ledger (not for a batch that already landed), inside the transaction.
        let given = if statements_or_fn.is_callable() {
            None
        } else {
            Some(statement_list(py, &what, statements_or_fn)?)
        };
        let make: Py<PyAny> = statements_or_fn.clone().unbind();
        let table = self.table.clone();
        let ran = block_on(py, async move {
            self.ledger
                .run_once(&ctx, move |tx| {
                    async move {
                        let stmts = match given {
                            Some(s) => s,
                            None => Python::attach(|py| {
                                let list = make.call0(py)?;
                                statement_list(py, &what, list.bind(py))
                            })
                            .map_err(|e| Box::new(e) as weir::BoxError)?,
                        };
                        let mut rows = 0u64;
                        for (sql, params) in &stmts {
                            let p: Vec<&(dyn ToSql + Sync)> =
                                params.iter().map(Param::to_sql).collect();
                            rows += tx
                                .execute(sql.as_str(), &p)
                                .await
                                .map_err(|e| format!("`{sql}`: {}", error_chain(&e)))?;
                        }
                        Ok(rows)
                    }
                    .boxed()
                })
                .await
        })?;
        ran.map_err(|e| {
            error(
                py,
                "SinkError",
                format!(
                    "postgres-ledger {table}: batch {batch_id}: {}",
                    error_chain(&e)
                ),
            )
        })
    }
}
