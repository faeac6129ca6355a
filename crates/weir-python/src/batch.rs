//! `weir._weir.Batch`: one micro-batch as the user's function sees it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use weir::BatchContext;
use weir::datafusion::arrow::datatypes::SchemaRef;
use weir::datafusion::prelude::DataFrame;
use weir::engine::sql_over_batch;
use weir::sink::CACHE_DURATION_KEY;

use crate::arrow::{export_schema, export_stream};
use crate::runtime::{block_on, error};

/// The rows of one batch (a DataFusion plan, run when the rows are asked for) and what the
/// engine knows about the batch. Implements the Arrow PyCapsule interface, so
/// `pyarrow.table(batch)` and `polars.DataFrame(batch)` take its rows without a copy.
#[pyclass(module = "weir._weir", frozen)]
pub struct Batch {
    /// `None` once unpersisted.
    frame: Mutex<Option<DataFrame>>,
    schema: SchemaRef,
    pub(crate) ctx: BatchContext,
    cached: bool,
}

impl Batch {
    pub fn new(frame: DataFrame, ctx: BatchContext, cached: bool) -> Self {
        let schema = Arc::new(frame.schema().as_arrow().clone());
        Batch {
            frame: Mutex::new(Some(frame)),
            schema,
            ctx,
            cached,
        }
    }

    /// The rows' plan (an error once the batch was unpersisted).
    pub fn frame(&self, py: Python<'_>) -> PyResult<DataFrame> {
        let guard = self
            .frame
            .lock()
            .map_err(|_| error(py, "WeirError", "a batch's lock was poisoned"))?;
        guard.clone().ok_or_else(|| {
            error(
                py,
                "WeirError",
                format!(
                    "batch {}: this cached batch was unpersisted (the `with weir.cache(batch)` \
                     block ended); use it inside the block",
                    self.ctx.batch_id
                ),
            )
        })
    }

    fn collect(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<weir::datafusion::arrow::array::RecordBatch>> {
        let frame = self.frame(py)?;
        let id = self.ctx.batch_id;
        block_on(py, frame.collect())?.map_err(|e| {
            error(
                py,
                "WeirError",
                format!("batch {id}: reading the rows: {e}"),
            )
        })
    }
}

#[pymethods]
impl Batch {
    /// The batch id (the same on a replay).
    #[getter]
    fn batch_id(&self) -> u64 {
        self.ctx.batch_id
    }

    /// True when an earlier run planned this batch and it is being run again.
    #[getter]
    fn is_replay(&self) -> bool {
        self.ctx.is_replay
    }

    /// The query id from the checkpoint (the same across restarts).
    #[getter]
    fn query_id(&self) -> String {
        self.ctx.query_id.to_string()
    }

    /// The application id the sinks record for this query (query name + query id).
    #[getter]
    fn app_id(&self) -> String {
        self.ctx.app_id()
    }

    /// The column names.
    #[getter]
    fn columns(&self) -> Vec<String> {
        self.schema
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    }

    /// True for the result of `weir.cache(batch)` / `batch.cache()`.
    #[getter]
    fn is_cached(&self) -> bool {
        self.cached
    }

    /// The rows as an Arrow C stream (the PyCapsule interface). The plan runs here, with
    /// the GIL released; `requested_schema` is not applied (the interface allows that).
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema;
        let batches = self.collect(py)?;
        export_stream(py, self.schema.clone(), batches)
    }

    /// The schema as an Arrow C schema (the PyCapsule interface).
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        export_schema(py, &self.schema)
    }

    /// The number of rows.
    fn count(&self, py: Python<'_>) -> PyResult<usize> {
        let frame = self.frame(py)?;
        let id = self.ctx.batch_id;
        block_on(py, frame.count())?.map_err(|e| {
            error(
                py,
                "WeirError",
                format!("batch {id}: counting the rows: {e}"),
            )
        })
    }

    /// SQL over this batch, which the query sees as the table `batch`, run by weir's
    /// DataFusion: another batch (planned now, run when its rows are asked for).
    fn sql(&self, py: Python<'_>, query: &str) -> PyResult<Batch> {
        let frame = self.frame(py)?;
        let session = self.ctx.session.clone();
        let id = self.ctx.batch_id;
        let sql = query.to_string();
        let planned = block_on(
            py,
            async move { sql_over_batch(&session, frame, &sql).await },
        )?;
        let planned = planned.map_err(|e| {
            error(
                py,
                "WeirError",
                format!("batch {id}: the SQL `{query}`: {e}"),
            )
        })?;
        Ok(Batch::new(planned, self.ctx.clone(), false))
    }

    /// Runs the plan once and keeps the rows in memory (Spark's `persist()`): every reader
    /// of the result reads the same rows without running the plan again. Prefer
    /// `with weir.cache(batch) as cached:`, which also releases them.
    fn cache(&self, py: Python<'_>) -> PyResult<Batch> {
        let frame = self.frame(py)?;
        let started = Instant::now();
        let cached = block_on(py, frame.cache())?.map_err(|e| {
            error(
                py,
                "WeirError",
                format!("batch {}: caching the rows: {e}", self.ctx.batch_id),
            )
        })?;
        self.ctx.metrics.note(
            CACHE_DURATION_KEY.into(),
            started.elapsed().as_millis().to_string(),
        );
        Ok(Batch::new(cached, self.ctx.clone(), true))
    }

    /// Releases the rows (Spark's `unpersist()`); the batch cannot be read afterwards.
    fn unpersist(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self
            .frame
            .lock()
            .map_err(|_| error(py, "WeirError", "a batch's lock was poisoned"))?;
        *guard = None;
        Ok(())
    }

    /// The rows as a `pyarrow.Table` (needs pyarrow).
    fn to_pyarrow<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("pyarrow")?.call_method1("table", (slf,))
    }

    /// The rows as a `polars.DataFrame` (needs polars).
    fn to_polars<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("polars")?.call_method1("DataFrame", (slf,))
    }

    fn __repr__(&self) -> String {
        format!(
            "Batch(batch_id={}, columns={:?}{})",
            self.ctx.batch_id,
            self.columns(),
            if self.cached { ", cached" } else { "" }
        )
    }
}
