//! Records whose value is null (tombstones), with JSON values (`tombstones = "row" | "skip"
//! | "delete"`, see [`Tombstones`]). The decoder reads a null value as `{}`, a row of NULLs;
//! here that row is kept, dropped, or made a delete of the record's key: the key's JSON
//! object fills the columns it names (the tombstone's Kafka timestamp goes to
//! `tombstone-timestamp`), and `_deleted` (last) is true for it and false for every other
//! row.

use std::sync::Arc;

use weir_core::datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatchOptions, StringArray, new_null_array,
};
use weir_core::datafusion::arrow::compute::{concat_batches, filter_record_batch, interleave};
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

/// The tombstones' keys, decoded: for each tombstone (in order) its key's row, or why it
/// cannot be a delete (not a JSON object, or a value its column cannot hold). Only for
/// `Tombstones::Delete`.
pub(crate) fn check_keys(
    tombs: &[Tomb],
    asked: &SchemaRef,
    o: &KafkaOptions,
) -> Vec<std::result::Result<RecordBatch, Malformed>> {
    if o.tombstones != Tombstones::Delete {
        return Vec::new();
    }
    tombs
        .iter()
        .map(|t| {
            let line = key_line(t, o.tombstone_timestamp.as_deref())?;
            decode::json_each(asked, &[Some(line.as_slice())], BadRecordMode::FailFast)
                .map(|d| d.batch)
                .map_err(|m| Malformed {
                    index: t.index,
                    reason: format!("the tombstone's key: {}", m.reason),
                })
        })
        .collect()
}

/// Applies `o.tombstones` to `batch`, a chunk's decoded rows (`keys`: [`check_keys`]'
/// answer). A tombstone whose key cannot be a delete is a bad record
/// under `mode`: under FAILFAST the caller reported it already; DROPMALFORMED drops its row,
/// PERMISSIVE keeps it as a row of NULLs (not a delete) with the key in `_corrupt_record`.
/// The rows, and the tombstones dropped.
pub(crate) fn apply(
    batch: RecordBatch,
    tombs: &[Tomb],
    keys: &[std::result::Result<RecordBatch, Malformed>],
    o: &KafkaOptions,
    mode: BadRecordMode,
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
            if let Some(Err(m)) = keys.iter().find(|k| k.is_err())
                && mode == BadRecordMode::FailFast
            {
                return Err(m.clone());
            }
            let n = batch.num_rows();
            let mut deleted = vec![false; n];
            let mut keep = vec![true; n];
            // The good keys' rows, and which tombstone each is.
            let mut key_rows: Vec<&RecordBatch> = Vec::new();
            let mut which: Vec<(usize, usize)> = (0..n).map(|i| (0, i)).collect();
            let mut corrupt: Vec<Option<String>> = vec![None; n];
            for (t, k) in tombs.iter().zip(keys) {
                match k {
                    Ok(row) => {
                        which[t.index] = (1, key_rows.len());
                        deleted[t.index] = true;
                        key_rows.push(row);
                    }
                    Err(_) if mode == BadRecordMode::DropMalformed => keep[t.index] = false,
                    Err(_) => {
                        corrupt[t.index] = Some(
                            String::from_utf8_lossy(t.key.as_deref().unwrap_or_default())
                                .into_owned(),
                        );
                    }
                }
            }
            let mut columns = if key_rows.is_empty() {
                batch.columns().to_vec()
            } else {
                let rows = concat_batches(&key_rows[0].schema(), key_rows.iter().copied())
                    .map_err(|e| internal(e.to_string()))?;
                let mut out: Vec<ArrayRef> = Vec::with_capacity(batch.num_columns());
                for (c, f) in batch.schema().fields().iter().enumerate() {
                    let from_key = match rows.schema().index_of(f.name()) {
                        Ok(k) => rows.column(k).clone(),
                        Err(_) => new_null_array(f.data_type(), key_rows.len()),
                    };
                    let sources: [&dyn Array; 2] = [batch.column(c).as_ref(), from_key.as_ref()];
                    out.push(interleave(&sources, &which).map_err(|e| internal(e.to_string()))?);
                }
                out
            };
            if corrupt.iter().any(Option::is_some)
                && let Ok(c) = batch.schema().index_of(decode::CORRUPT_RECORD)
            {
                let given = columns[c].as_any().downcast_ref::<StringArray>().cloned();
                let merged: StringArray = (0..n)
                    .map(|i| {
                        corrupt[i].clone().or_else(|| {
                            given
                                .as_ref()
                                .filter(|g| g.is_valid(i))
                                .map(|g| g.value(i).to_string())
                        })
                    })
                    .collect();
                columns[c] = Arc::new(merged);
            }
            columns.push(Arc::new(BooleanArray::from(deleted)));
            let out = RecordBatch::try_new_with_options(
                schema(batch.schema(), Tombstones::Delete),
                columns,
                &RecordBatchOptions::new().with_row_count(Some(n)),
            )
            .map_err(|e| internal(e.to_string()))?;
            let dropped = keep.iter().filter(|k| !**k).count();
            if dropped == 0 {
                return Ok((out, 0));
            }
            let kept = filter_record_batch(&out, &BooleanArray::from(keep))
                .map_err(|e| internal(e.to_string()))?;
            Ok((kept, 0))
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
