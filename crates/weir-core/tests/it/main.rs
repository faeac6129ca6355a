//! weir-core integration tests: the runner against real checkpoint folders and files.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod files;
mod runner;
mod state_partitions;
mod stateful;

use std::sync::Arc;

use weir_core::datafusion::arrow::array::{Int64Array, StringArray};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use weir_core::datafusion::arrow::record_batch::RecordBatch;

pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
    ]))
}

/// Rows `from..to` as a record batch.
pub fn rows(from: i64, to: i64) -> RecordBatch {
    let ids: Vec<i64> = (from..to).collect();
    let names: Vec<String> = ids.iter().map(|i| format!("n{i}")).collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids)),
            Arc::new(StringArray::from(names)),
        ],
    )
    .unwrap()
}

/// The `id` column of collected batches, sorted.
pub fn ids(batches: &[RecordBatch]) -> Vec<i64> {
    let mut out: Vec<i64> = batches
        .iter()
        .flat_map(|b| {
            let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            a.values().to_vec()
        })
        .collect();
    out.sort_unstable();
    out
}
