//! Stateful operators between the transforms and the function: streaming deduplication.
//!
//! `drop_duplicates(keys)` passes a row only if no row with the same key values came before
//! it, in this batch or any earlier one: what Spark's `dropDuplicates` does on a stream
//! without a watermark (its state grows with the number of distinct keys). The keys seen
//! are kept in the operator's [`StateStore`] (`state/<operator>/0`, one partition): batch N
//! loads version N (the store holds it in memory between batches), and version N+1 is
//! committed after the function returned `Ok` and before `commits/N`. A replay of N loads
//! version N again, so it passes the same rows as the first attempt did.
//!
//! Keys are written in an encoding of weir's own that does not depend on the Arrow version
//! (per column: a NULL marker, then the value in a fixed layout for its type family); the
//! key columns and their type families are recorded in `state/<operator>/_metadata/keys`,
//! and a query whose keys differ from what the state was written with is refused.

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::cast::AsArray;
use datafusion::arrow::array::{Array, ArrayRef, BooleanArray};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, Float32Type, Float64Type, Int8Type,
    Int16Type, Int32Type, Int64Type, Schema, TimeUnit, TimestampMicrosecondType,
    TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use datafusion::datasource::MemTable;
use datafusion::prelude::{DataFrame, SessionContext};

use crate::error::{Error, Result};
use crate::state::{OperatorMetadata, StateConf, StateStore, write_line_once};
use crate::storage::Location;

use super::runner::Transform;

/// The setting errors name (the pipeline file's spelling; `drop_duplicates` in the API).
const KEY: &str = "transform.drop-duplicates";

/// Spark's name for the operator in progress reports and the state metadata.
const OPERATOR_NAME: &str = "dedupe";

/// One `drop_duplicates` of a query.
pub(crate) struct Dedupe {
    operator: u32,
    keys: Vec<String>,
    state_root: Location,
    store: StateStore,
    /// Whether the metadata was checked by this process.
    checked: bool,
    /// Keys added by the current batch.
    added: u64,
    /// Time spent looking up and adding keys in the current batch.
    update_ms: u64,
}

impl Dedupe {
    /// The operator `operator` (its index among the query's stateful operators), whose state
    /// is in `state_root/<operator>`.
    pub(crate) fn new(
        operator: u32,
        keys: Vec<String>,
        state_root: Location,
        conf: StateConf,
    ) -> Self {
        let store = StateStore::new(state_root.join(&format!("{operator}/0")), conf);
        Dedupe {
            operator,
            keys,
            state_root,
            store,
            checked: false,
            added: 0,
            update_ms: 0,
        }
    }

    /// The rows of `df` whose keys were not seen before (batch `batch_id`).
    pub(crate) async fn apply(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        batch_id: u64,
    ) -> Result<DataFrame> {
        let schema = Arc::new(df.schema().as_arrow().clone());
        let columns = key_columns(&schema, &self.keys)?;
        let families: Vec<String> = columns
            .iter()
            .map(|i| {
                let f = schema.field(*i);
                family(f.data_type()).ok_or_else(|| {
                    Error::config(
                        KEY,
                        format!(
                            "column `{}` has type {}, which cannot be a deduplication key",
                            f.name(),
                            f.data_type()
                        ),
                    )
                })
            })
            .collect::<Result<_>>()?;
        if !self.checked {
            self.check_metadata(batch_id, &families).await?;
            self.checked = true;
        }
        if self.store.version().is_none() {
            let newest = self.store.newest_version().await?;
            if newest < batch_id {
                return Err(Error::config(
                    KEY,
                    format!(
                        "the state of stateful operator {} stops at version {newest} (after \
                         batch {}), and this is batch {batch_id}: the query ran batches \
                         without the operator, whose keys are not in the state; a stateful \
                         operator cannot be removed and added back on the same checkpoint, \
                         start the query on a new checkpoint",
                        self.operator,
                        newest.saturating_sub(1),
                    ),
                ));
            }
        }
        self.store.load(batch_id).await?;
        // Partition by partition, in order: the batch holds its files in the order the
        // source took them, so the first row of a key is the same on every attempt.
        let batches: Vec<_> = df
            .collect_partitioned()
            .await
            .map_err(|e| Error::datafusion(format!("batch {batch_id}: drop_duplicates"), e))?
            .into_iter()
            .flatten()
            .collect();
        let started = Instant::now();
        self.added = 0;
        let mut kept = Vec::with_capacity(batches.len());
        let mut key = Vec::new();
        for batch in batches {
            let cols: Vec<&ArrayRef> = columns.iter().map(|i| batch.column(*i)).collect();
            let mut mask = Vec::with_capacity(batch.num_rows());
            for row in 0..batch.num_rows() {
                key.clear();
                for c in &cols {
                    encode_value(&mut key, c, row);
                }
                let new = self.store.get(&key).is_none();
                if new {
                    self.store.put(key.clone(), Vec::new());
                    self.added += 1;
                }
                mask.push(new);
            }
            let filtered = filter_record_batch(&batch, &BooleanArray::from(mask))
                .map_err(|e| Error::datafusion(KEY, e.into()))?;
            if filtered.num_rows() > 0 {
                kept.push(filtered);
            }
        }
        self.update_ms = started.elapsed().as_millis() as u64;
        let table = MemTable::try_new(schema, vec![kept]).map_err(|e| Error::datafusion(KEY, e))?;
        ctx.read_table(Arc::new(table))
            .map_err(|e| Error::datafusion(KEY, e))
    }

    /// Commits the batch's keys as the next version; its progress entry (Spark's fields).
    pub(crate) async fn commit(&mut self) -> Result<serde_json::Value> {
        let started = Instant::now();
        self.store.commit().await?;
        let commit_ms = started.elapsed().as_millis() as u64;
        Ok(serde_json::json!({
            "operatorName": OPERATOR_NAME,
            "numRowsTotal": self.store.len(),
            "numRowsUpdated": self.added,
            "allUpdatesTimeMs": self.update_ms,
            "numRowsRemoved": 0,
            "allRemovalsTimeMs": 0,
            "commitTimeMs": commit_ms,
            "memoryUsedBytes": self.store.memory_bytes(),
            "numRowsDroppedByWatermark": 0,
            "numShufflePartitions": 1,
            "numStateStoreInstances": 1,
            "customMetrics": {}
        }))
    }

    /// Lets retention delete the files no kept version needs (after `commits/N`).
    pub(crate) async fn purge(&mut self) -> Result<()> {
        self.store.purge().await
    }

    /// Writes the operator's metadata and key columns on its first batch; later, refuses
    /// other keys, or state missing for a checkpoint past its first batch.
    async fn check_metadata(&self, batch_id: u64, families: &[String]) -> Result<()> {
        let meta_dir = self
            .state_root
            .join(&format!("{}/_metadata", self.operator));
        let keys_json = serde_json::to_string(
            &self
                .keys
                .iter()
                .zip(families)
                .map(|(k, f)| serde_json::json!({"name": k, "type": f}))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| Error::Internal {
            what: format!("encoding the key columns: {e}"),
        })?;
        if batch_id > 0 && meta_dir.get("keys").await?.is_none() {
            return Err(Error::config(
                KEY,
                format!(
                    "the checkpoint is at batch {batch_id} and holds no state for stateful \
                     operator {} ({} is missing): a stateful operator cannot be added to a \
                     query that already ran; start it on a new checkpoint",
                    self.operator,
                    meta_dir.describe("keys")
                ),
            ));
        }
        OperatorMetadata::new(self.operator, OPERATOR_NAME, 1)
            .ensure(&self.state_root)
            .await?;
        if let Some(found) = write_line_once(&meta_dir, "keys", keys_json.clone()).await?
            && found != keys_json
        {
            return Err(Error::config(
                KEY,
                format!(
                    "the state was written with the key columns {found} ({}); this query has \
                     {keys_json}: the keys of a stateful operator cannot change on the same \
                     checkpoint",
                    meta_dir.describe("keys")
                ),
            ));
        }
        Ok(())
    }
}

/// The indexes of `keys` in `schema`; an error naming the first key it lacks.
fn key_columns(schema: &Schema, keys: &[String]) -> Result<Vec<usize>> {
    if keys.is_empty() {
        return Err(Error::config(KEY, "no key column given"));
    }
    keys.iter()
        .map(|k| {
            schema.index_of(k).map_err(|_| {
                let columns: Vec<&str> =
                    schema.fields().iter().map(|f| f.name().as_str()).collect();
                Error::config(
                    KEY,
                    format!("no column `{k}`; the columns are {}", columns.join(", ")),
                )
            })
        })
        .collect()
}

/// Checks, before the query starts, the keys of the stateful operators that see the
/// source's columns (those before any SQL or DataFrame transform): a typo is refused
/// before anything runs, not at the first batch that brings data.
pub(crate) fn check_keys_at_start(source: &Schema, transforms: &[Transform]) -> Result<()> {
    for t in transforms {
        match t {
            Transform::DropDuplicates(keys) => {
                key_columns(source, keys)?;
            }
            Transform::Sql(_) | Transform::Fn(_) => break,
        }
    }
    Ok(())
}

/// The type family a key column's values are encoded as; `None`: not a key type.
fn family(dt: &DataType) -> Option<String> {
    Some(match dt {
        DataType::Boolean => "boolean".into(),
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => "integer".into(),
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            "unsigned".into()
        }
        DataType::Float32 | DataType::Float64 => "float".into(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => "binary".into(),
        DataType::Date32 => "date".into(),
        DataType::Date64 => "date-ms".into(),
        DataType::Timestamp(unit, _) => format!(
            "timestamp-{}",
            match unit {
                TimeUnit::Second => "s",
                TimeUnit::Millisecond => "ms",
                TimeUnit::Microsecond => "us",
                TimeUnit::Nanosecond => "ns",
            }
        ),
        DataType::Decimal128(p, s) => format!("decimal({p},{s})"),
        _ => return None,
    })
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Floats as Spark compares them for grouping: -0.0 is 0.0 and every NaN is one NaN.
fn put_float(out: &mut Vec<u8>, v: f64) {
    let v = if v == 0.0 {
        0.0
    } else if v.is_nan() {
        f64::NAN
    } else {
        v
    };
    out.extend_from_slice(&v.to_bits().to_le_bytes());
}

/// Appends row `i` of `col` (a type [`family`] accepts) to `out`.
fn encode_value(out: &mut Vec<u8>, col: &ArrayRef, i: usize) {
    if col.is_null(i) {
        out.push(0);
        return;
    }
    out.push(1);
    match col.data_type() {
        DataType::Boolean => out.push(u8::from(col.as_boolean().value(i))),
        DataType::Int8 => put_i64(out, col.as_primitive::<Int8Type>().value(i).into()),
        DataType::Int16 => put_i64(out, col.as_primitive::<Int16Type>().value(i).into()),
        DataType::Int32 => put_i64(out, col.as_primitive::<Int32Type>().value(i).into()),
        DataType::Int64 => put_i64(out, col.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => put_u64(out, col.as_primitive::<UInt8Type>().value(i).into()),
        DataType::UInt16 => put_u64(out, col.as_primitive::<UInt16Type>().value(i).into()),
        DataType::UInt32 => put_u64(out, col.as_primitive::<UInt32Type>().value(i).into()),
        DataType::UInt64 => put_u64(out, col.as_primitive::<UInt64Type>().value(i)),
        DataType::Float32 => put_float(out, col.as_primitive::<Float32Type>().value(i).into()),
        DataType::Float64 => put_float(out, col.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => put_bytes(out, col.as_string::<i32>().value(i).as_bytes()),
        DataType::LargeUtf8 => put_bytes(out, col.as_string::<i64>().value(i).as_bytes()),
        DataType::Utf8View => put_bytes(out, col.as_string_view().value(i).as_bytes()),
        DataType::Binary => put_bytes(out, col.as_binary::<i32>().value(i)),
        DataType::LargeBinary => put_bytes(out, col.as_binary::<i64>().value(i)),
        DataType::BinaryView => put_bytes(out, col.as_binary_view().value(i)),
        DataType::Date32 => put_i64(out, col.as_primitive::<Date32Type>().value(i).into()),
        DataType::Date64 => put_i64(out, col.as_primitive::<Date64Type>().value(i)),
        DataType::Timestamp(TimeUnit::Second, _) => {
            put_i64(out, col.as_primitive::<TimestampSecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Millisecond, _) => {
            put_i64(out, col.as_primitive::<TimestampMillisecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            put_i64(out, col.as_primitive::<TimestampMicrosecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            put_i64(out, col.as_primitive::<TimestampNanosecondType>().value(i))
        }
        DataType::Decimal128(_, _) => {
            out.extend_from_slice(&col.as_primitive::<Decimal128Type>().value(i).to_le_bytes())
        }
        // `family` refused every other type before any row is encoded.
        _ => {}
    }
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, Int64Array, StringArray};

    fn key(cols: &[ArrayRef], row: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in cols {
            encode_value(&mut out, c, row);
        }
        out
    }

    #[test]
    fn keys_tell_nulls_strings_and_floats_apart_as_spark_groups_them() {
        let s: ArrayRef = Arc::new(StringArray::from(vec![
            Some("ab"),
            Some("a"),
            None,
            Some(""),
        ]));
        let t: ArrayRef = Arc::new(StringArray::from(vec![Some("c"), Some("bc"), None, None]));
        // ("ab","c") and ("a","bc") concatenate alike but are different keys.
        assert_ne!(
            key(&[s.clone(), t.clone()], 0),
            key(&[s.clone(), t.clone()], 1)
        );
        // NULL and the empty string differ.
        assert_ne!(
            key(std::slice::from_ref(&s), 2),
            key(std::slice::from_ref(&s), 3)
        );
        let f: ArrayRef = Arc::new(Float64Array::from(vec![0.0, -0.0, f64::NAN, -f64::NAN]));
        assert_eq!(
            key(std::slice::from_ref(&f), 0),
            key(std::slice::from_ref(&f), 1)
        );
        assert_eq!(
            key(std::slice::from_ref(&f), 2),
            key(std::slice::from_ref(&f), 3)
        );
        // The layout is fixed: an i64 key is its marker and 8 little-endian bytes.
        let i: ArrayRef = Arc::new(Int64Array::from(vec![Some(258), None]));
        assert_eq!(
            key(std::slice::from_ref(&i), 0),
            vec![1, 2, 1, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(key(&[i], 1), vec![0]);
        assert_eq!(family(&DataType::Int32).as_deref(), Some("integer"));
        assert_eq!(
            family(&DataType::Timestamp(TimeUnit::Microsecond, None)).as_deref(),
            Some("timestamp-us")
        );
        assert_eq!(family(&DataType::Null), None);
    }
}
