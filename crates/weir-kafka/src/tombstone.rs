//! Records whose value is null (tombstones), with JSON values (`tombstones = "row" | "skip"
//! | "delete"`, see [`Tombstones`]). The decoder reads a null value as `{}`, a row of NULLs;
//! here that row is kept, dropped, or made a delete of the record's key: the key's JSON
//! object fills the columns it names (the tombstone's Kafka timestamp goes to
//! `tombstone-timestamp`), and `_deleted` (last) is true for it and false for every other
//! row.

use std::sync::Arc;

use weir_core::datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatchOptions, new_null_array,
};
use weir_core::datafusion::arrow::compute::{filter_record_batch, interleave};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::sink::upsert::DELETED;
use weir_core::source::decode::{self, BadRecordMode, Malformed};
use weir_core::{Error, Result};

use crate::options::{KafkaOptions, Tombstones, ValueFormat};

/// A tombstone of a chunk: its index there, its key and its Kafka timestamp (ms).
#[derive(Debug, Clone)]
pub(crate) struct Tomb {
    pub index: usize,
    pub key: Option<Vec<u8>>,
    pub timestamp: Option<i64>,
}

/// Refuses settings that cannot work, naming the key.
pub(crate) fn check(o: &KafkaOptions) -> Result<()> {
    let schema = match &o.value_format {
        ValueFormat::Json { schema, .. } => Some(schema),
        ValueFormat::Raw => None,
    };
    match (o.tombstones, schema) {
        (Tombstones::Row, _) => {}
        (_, None) => {
            return Err(Error::config(
                "source.tombstones",
                "applies to value-format = \"json\" (raw rows keep the null value)",
            ));
        }
        (Tombstones::Delete, Some(s)) if s.field_with_name(DELETED).is_ok() => {
            return Err(Error::config(
                "source.tombstones",
                format!("\"delete\" adds the column {DELETED}, which the schema already has"),
            ));
        }
        _ => {}
    }
    if let Some(c) = &o.tombstone_timestamp {
        if o.tombstones != Tombstones::Delete {
            return Err(Error::config(
                "source.tombstone-timestamp",
                "only used with tombstones = \"delete\"",
            ));
        }
        let ok = schema
            .and_then(|s| s.field_with_name(c).ok())
            .is_some_and(|f| matches!(f.data_type(), DataType::Timestamp(_, _)));
        if !ok {
            return Err(Error::config(
                "source.tombstone-timestamp",
                format!("'{c}' is not a timestamp column of the schema"),
            ));
        }
    }
    Ok(())
}

/// `base` with `_deleted` last for `Tombstones::Delete`.
pub(crate) fn schema(base: SchemaRef, t: Tombstones) -> SchemaRef {
    if t != Tombstones::Delete {
        return base;
    }
    let mut fields: Vec<Field> = base.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(DELETED, DataType::Boolean, true));
    Arc::new(Schema::new(fields))
}

/// Applies `o.tombstones` to `batch`, a chunk's decoded rows (`asked`: the values' schema);
/// a key that is not a JSON object of the schema's columns is a bad record under any mode.
/// The rows, and the tombstones dropped.
pub(crate) fn apply(
    batch: RecordBatch,
    tombs: &[Tomb],
    asked: &SchemaRef,
    o: &KafkaOptions,
) -> std::result::Result<(RecordBatch, u64), Malformed> {
    let internal = |reason: String| Malformed { index: 0, reason };
    match o.tombstones {
        Tombstones::Row => Ok((batch, 0)),
        Tombstones::Skip => {
            if tombs.is_empty() {
                return Ok((batch, 0));
            }
            let mut keep = vec![true; batch.num_rows()];
            for t in tombs {
                keep[t.index] = false;
            }
            let kept = filter_record_batch(&batch, &BooleanArray::from(keep))
                .map_err(|e| internal(e.to_string()))?;
            Ok((kept, tombs.len() as u64))
        }
        Tombstones::Delete => {
            let n = batch.num_rows();
            let mut deleted = vec![false; n];
            let rows = if tombs.is_empty() {
                batch.columns().to_vec()
            } else {
                let lines = tombs
                    .iter()
                    .map(|t| key_line(t, o.tombstone_timestamp.as_deref()))
                    .collect::<std::result::Result<Vec<_>, Malformed>>()?;
                let records: Vec<Option<&[u8]>> =
                    lines.iter().map(|l| Some(l.as_slice())).collect();
                let keys = decode::json_each(asked, &records, BadRecordMode::FailFast)
                    .map_err(|m| Malformed {
                        index: tombs[m.index].index,
                        reason: format!("the tombstone's key: {}", m.reason),
                    })?
                    .batch;
                // Row i of the output: the key row for a tombstone, else the decoded row.
                let mut which: Vec<(usize, usize)> = (0..n).map(|i| (0, i)).collect();
                for (j, t) in tombs.iter().enumerate() {
                    which[t.index] = (1, j);
                    deleted[t.index] = true;
                }
                let mut out: Vec<ArrayRef> = Vec::with_capacity(batch.num_columns());
                for (c, f) in batch.schema().fields().iter().enumerate() {
                    let from_key = match keys.schema().index_of(f.name()) {
                        Ok(k) => keys.column(k).clone(),
                        Err(_) => new_null_array(f.data_type(), tombs.len()),
                    };
                    let sources: [&dyn Array; 2] = [batch.column(c).as_ref(), from_key.as_ref()];
                    out.push(interleave(&sources, &which).map_err(|e| internal(e.to_string()))?);
                }
                out
            };
            let mut columns = rows;
            columns.push(Arc::new(BooleanArray::from(deleted)));
            let out = RecordBatch::try_new_with_options(
                schema(batch.schema(), Tombstones::Delete),
                columns,
                &RecordBatchOptions::new().with_row_count(Some(n)),
            )
            .map_err(|e| internal(e.to_string()))?;
            Ok((out, 0))
        }
    }
}

/// The JSON line a tombstone's row is decoded from: its key object, with the timestamp
/// column set to its Kafka timestamp.
fn key_line(t: &Tomb, ts_column: Option<&str>) -> std::result::Result<Vec<u8>, Malformed> {
    let bad = |reason: String| Malformed {
        index: t.index,
        reason,
    };
    let key = t.key.as_deref().ok_or_else(|| {
        bad("a tombstone without a key cannot be a delete (tombstones = \"delete\")".into())
    })?;
    let mut object: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(key)
        .map_err(|e| {
            bad(format!(
                "a tombstone's key must be a JSON object naming the key columns, e.g. \
                 {{\"order_id\": 7}}: {e}"
            ))
        })?;
    if let Some(c) = ts_column {
        let at = t
            .timestamp
            .and_then(weir_core::datafusion::arrow::temporal_conversions::timestamp_ms_to_datetime)
            .ok_or_else(|| bad("the tombstone has no timestamp for tombstone-timestamp".into()))?;
        object.insert(
            c.to_string(),
            serde_json::Value::String(at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()),
        );
    }
    serde_json::to_vec(&object).map_err(|e| bad(e.to_string()))
}
