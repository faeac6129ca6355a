//! The Arrow PyCapsule interface, both ways: rows leave as an `arrow_array_stream` capsule
//! (pyarrow, polars and DataFusion's Python package import it without copying the buffers),
//! and any object with `__arrow_c_stream__` (a pyarrow Table, a polars DataFrame, a weir
//! batch) comes in the same way.

use std::ffi::CStr;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use weir::datafusion::arrow::array::{RecordBatch, RecordBatchIterator, RecordBatchReader};
use weir::datafusion::arrow::datatypes::SchemaRef;
use weir::datafusion::arrow::ffi::FFI_ArrowSchema;
use weir::datafusion::arrow::ffi_stream::{ArrowArrayStreamReader, FFI_ArrowArrayStream};

use crate::runtime::error;

const STREAM: &CStr = c"arrow_array_stream";
const SCHEMA: &CStr = c"arrow_schema";

/// `batches` as an `arrow_array_stream` capsule. The capsule owns the stream: a consumer
/// moves it out (and marks it released); a capsule never consumed releases it when dropped.
pub fn export_stream<'py>(
    py: Python<'py>,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> PyResult<Bound<'py, PyCapsule>> {
    let reader = RecordBatchIterator::new(batches.into_iter().map(Ok), schema);
    let stream = FFI_ArrowArrayStream::new(Box::new(reader));
    PyCapsule::new_with_value(py, stream, STREAM)
}

/// `schema` as an `arrow_schema` capsule.
pub fn export_schema<'py>(py: Python<'py>, schema: &SchemaRef) -> PyResult<Bound<'py, PyCapsule>> {
    let ffi = FFI_ArrowSchema::try_from(schema.as_ref())
        .map_err(|e| error(py, "WeirError", format!("exporting the schema: {e}")))?;
    PyCapsule::new_with_value(py, ffi, SCHEMA)
}

/// Every batch of `obj.__arrow_c_stream__()`, with its schema. `what` names the object in
/// errors ("the rows given to DeltaMerge", ...).
pub fn import_stream(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
    if !obj.hasattr("__arrow_c_stream__")? {
        let kind = obj.get_type().name()?;
        return Err(error(
            py,
            "WeirError",
            format!(
                "{what}: a {kind} is not a table: pass the batch, a pyarrow Table or a polars \
                 DataFrame (anything with __arrow_c_stream__)"
            ),
        ));
    }
    let capsule = obj.call_method0("__arrow_c_stream__")?;
    let capsule = capsule.cast::<PyCapsule>().map_err(PyErr::from)?;
    let ptr = capsule.pointer_checked(Some(STREAM))?;
    // SAFETY: the capsule is named arrow_array_stream, so by the PyCapsule interface its
    // pointer is a valid FFI_ArrowArrayStream that we may move out of; `from_raw` moves it
    // and leaves a released (empty) stream behind, which the capsule's destructor ignores.
    // The capsule object is alive (held by `capsule`) during the call.
    let reader = unsafe { ArrowArrayStreamReader::from_raw(ptr.as_ptr().cast()) }.map_err(|e| {
        error(
            py,
            "WeirError",
            format!("{what}: reading the Arrow stream: {e}"),
        )
    })?;
    let schema = reader.schema();
    let batches = py
        .detach(|| reader.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            error(
                py,
                "WeirError",
                format!("{what}: reading the Arrow stream: {e}"),
            )
        })?;
    Ok((schema, batches))
}
