//! The NULL rules of the upsert sinks (see the parent module), and `-0.0` as `0.0`.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, AsArray, BooleanArray, BooleanBufferBuilder, Float32Array, Float64Array,
};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::{DataFrame, SessionContext, col, lit};
use serde::{Deserialize, Serialize};

use super::{NullKeys, NullOrdering, checked_columns, quote};
use crate::error::{Error, Result};

/// Applies the NULL rules to a batch for sink `sink`, and writes every `-0.0` of a float
/// column as `0.0` (the two are equal in SQL but not in the order that picks a row, so a
/// batch could keep one and the guard the other). Returns the rows to write and how many were
/// dropped, or the error of the default rule naming the columns.
pub async fn apply_null_rules(
    df: DataFrame,
    keys: &[String],
    ordering: &str,
    null_keys: NullKeys,
    null_ordering: NullOrdering,
    sink: &str,
    batch_id: u64,
) -> Result<(DataFrame, u64)> {
    let what = || format!("{sink}: batch {batch_id}: looking for NULL keys");
    let names = checked_columns(&df, keys, ordering, sink)?;
    let session = SessionContext::new();
    let schema = df.schema().inner().clone();
    let batches = df
        .collect()
        .await
        .map_err(|e| Error::datafusion(what(), e))?;
    let screen = NullScreen::new(&names, keys, ordering);
    let mut found = NullCount::default();
    let mut out = Vec::with_capacity(batches.len());
    for b in batches {
        out.push(
            screen
                .apply(b, &mut found)
                .map_err(|e| Error::datafusion(what(), e.into()))?,
        );
    }
    let dropped = found.verdict(null_keys, null_ordering, ordering, sink, batch_id)?;
    let df = if out.is_empty() {
        session.read_batch(RecordBatch::new_empty(schema))
    } else {
        session.read_batches(out)
    }
    .map_err(|e| Error::datafusion(what(), e))?;
    Ok((df, dropped))
}

/// What the NULL rules found in some rows: a batch's, or one task's share of it (the
/// shares are [`NullCount::add`]ed before the [`NullCount::verdict`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NullCount {
    /// Rows with a NULL in any key column.
    pub key_rows: u64,
    /// Per key column, the rows with a NULL in it.
    pub in_keys: BTreeMap<String, u64>,
    /// Rows with a key but a NULL ordering value.
    pub ordering_rows: u64,
}

impl NullCount {
    /// `other`'s rows counted in too.
    pub fn add(&mut self, other: &NullCount) {
        self.key_rows += other.key_rows;
        self.ordering_rows += other.ordering_rows;
        for (k, n) in &other.in_keys {
            *self.in_keys.entry(k.clone()).or_default() += n;
        }
    }

    /// What the rules say of the rows counted: the rows dropped, or the error of a rule
    /// that refuses them, naming the sink, batch, columns and rows.
    pub fn verdict(
        &self,
        null_keys: NullKeys,
        null_ordering: NullOrdering,
        ordering: &str,
        sink: &str,
        batch_id: u64,
    ) -> Result<u64> {
        if self.key_rows > 0 && null_keys == NullKeys::Error {
            return Err(Error::NullValues {
                sink: sink.to_string(),
                batch_id,
                column: self.in_keys.keys().cloned().collect::<Vec<_>>().join(", "),
                rows: self.key_rows,
                hint: "a NULL key never matches a stored row, so every batch would insert \
                       it again; filter such rows out, or set null-keys = \"drop\" to drop \
                       them (counted in the progress)"
                    .into(),
            });
        }
        if self.ordering_rows > 0 && null_ordering == NullOrdering::Error {
            return Err(Error::NullValues {
                sink: sink.to_string(),
                batch_id,
                column: ordering.to_string(),
                rows: self.ordering_rows,
                hint: "the ordering column decides which row of a key is newest; fill it, or \
                       set null-ordering = \"oldest\" to take NULL as older than any value"
                    .into(),
            });
        }
        Ok(if null_keys == NullKeys::Drop {
            self.key_rows
        } else {
            0
        })
    }
}

/// The NULL rules applied to one record batch at a time, where its rows are (the driver,
/// or a task on a worker): rows with a NULL key are counted and removed (the rules either
/// drop them or fail the batch once every row is counted), NULL ordering values counted,
/// and every `-0.0` written as `0.0`.
#[derive(Debug, Clone)]
pub struct NullScreen {
    keys: Vec<(String, usize)>,
    ordering: usize,
}

impl NullScreen {
    /// For rows with columns `names` (which hold the keys and the ordering column).
    pub fn new(names: &[String], keys: &[String], ordering: &str) -> Self {
        let index = |c: &str| names.iter().position(|n| n == c).unwrap_or(0);
        NullScreen {
            keys: keys.iter().map(|k| (k.clone(), index(k))).collect(),
            ordering: index(ordering),
        }
    }

    /// `b` without its rows with a NULL key and with `0.0` for `-0.0`; what it found is
    /// counted into `found`.
    pub fn apply(
        &self,
        b: RecordBatch,
        found: &mut NullCount,
    ) -> std::result::Result<RecordBatch, ArrowError> {
        let mut keep = BooleanBufferBuilder::new(b.num_rows());
        let mut any = false;
        for r in 0..b.num_rows() {
            let mut null_key = false;
            for (k, i) in &self.keys {
                if b.column(*i).is_null(r) {
                    null_key = true;
                    *found.in_keys.entry(k.clone()).or_default() += 1;
                }
            }
            found.key_rows += u64::from(null_key);
            any |= null_key;
            found.ordering_rows += u64::from(!null_key && b.column(self.ordering).is_null(r));
            keep.append(!null_key);
        }
        let b = canonical_zeros(b)?;
        if any {
            filter_record_batch(&b, &BooleanArray::new(keep.finish(), None))
        } else {
            Ok(b)
        }
    }
}

/// `df` with `0.0` for every `-0.0` of its float columns, as a plan (see
/// [`canonical_zeros`]; `x + 0.0` would be simplified away).
pub(super) fn zeros_as_zero(df: DataFrame) -> datafusion::error::Result<DataFrame> {
    use datafusion::prelude::when;
    let exprs = df
        .schema()
        .fields()
        .iter()
        .map(|f| {
            let c = col(quote(f.name()));
            let zero = match f.data_type() {
                DataType::Float64 => Some(lit(0.0f64)),
                DataType::Float32 => Some(lit(0.0f32)),
                _ => None,
            };
            Ok(match zero {
                Some(z) => when(c.clone().eq(z.clone()), z)
                    .otherwise(c)?
                    .alias(f.name()),
                None => c,
            })
        })
        .collect::<datafusion::error::Result<Vec<_>>>()?;
    df.select(exprs)
}

/// `-0.0` as `0.0` in every float column (`x + 0.0` is `x`, except that it turns `-0.0`
/// into `0.0`).
fn canonical_zeros(b: RecordBatch) -> std::result::Result<RecordBatch, ArrowError> {
    let mut cols = b.columns().to_vec();
    let mut changed = false;
    for c in cols.iter_mut() {
        match c.data_type() {
            DataType::Float64 => {
                let a: Float64Array = c.as_primitive::<Float64Type>().unary(|v| v + 0.0);
                *c = Arc::new(a);
                changed = true;
            }
            DataType::Float32 => {
                let a: Float32Array = c.as_primitive::<Float32Type>().unary(|v| v + 0.0);
                *c = Arc::new(a);
                changed = true;
            }
            _ => {}
        }
    }
    if !changed {
        return Ok(b);
    }
    RecordBatch::try_new(b.schema(), cols)
}
