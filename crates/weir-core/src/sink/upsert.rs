//! What the upsert sinks (Delta MERGE, PostgreSQL) share: the order that decides which row
//! of a key wins, the in-batch dedupe, and what rows with NULL keys or orderings do.
//!
//! **The order.** Among rows with the same key, the winner is the greatest by the ordering
//! column, then by every other non-key column in schema order; NULL is below every value.
//! In-batch dedupe keeps the greatest row, and the guard of the MERGE / `ON CONFLICT`
//! replaces a stored row only with a greater one, so the final row of a key is the greatest
//! of all its rows, however the rows were split into batches (and however often a batch
//! was replayed). Two rows equal in every column are the same row.
//!
//! **NULLs.** A row whose key has a NULL column can never match a stored row (NULL is not
//! equal to NULL), so every batch would insert it again. By default such a batch fails with
//! an error naming the sink, the batch, the column and the number of rows; with
//! [`NullKeys::Drop`] the rows are dropped and counted in the progress (`<sink>.dropped`).
//! A NULL ordering value is refused the same way by default; with [`NullOrdering::Oldest`]
//! it is taken as older than any value (such a row never replaces a stored one with a
//! value, and any row with a value replaces it).
//!
//! **Deletes.** A batch with a boolean column [`DELETED`] (`_deleted`, which the Kafka
//! source's `tombstones = "delete"` adds) carries deletes: a row with `_deleted` true
//! deletes its key's stored row. It takes part in the order like any other change: in the
//! in-batch dedupe it comes right after the ordering column (so at the same ordering value a
//! delete wins over an upsert), and it deletes a stored row unless that row's ordering value
//! is greater (NULL lowest). The column itself is never stored. A delete leaves nothing to
//! compare with: an older change of that key arriving in a later batch inserts it again.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, AsArray, BooleanArray, BooleanBufferBuilder, Float32Array, Float64Array,
};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::functions_window::expr_fn::row_number;
use datafusion::logical_expr::{ExprFunctionExt, SortExpr};
use datafusion::prelude::{DataFrame, SessionContext, col, lit};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const RN: &str = "__weir_rn";

/// What rows with a NULL in a key column do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NullKeys {
    /// The batch fails, naming the sink, the column and the rows (default).
    #[default]
    Error,
    /// The rows are dropped and counted (`<sink>.dropped`).
    Drop,
}

/// What rows with a NULL ordering value do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NullOrdering {
    /// The batch fails, naming the sink, the column and the rows (default).
    #[default]
    Error,
    /// NULL is older than any value.
    Oldest,
}

/// The column that marks a row of a batch as a delete of its key (see the module docs).
pub const DELETED: &str = "_deleted";

/// The columns that decide which row of a key wins, most significant first: the ordering
/// column, [`DELETED`] if `columns` has it, then every other non-key column of `columns` in
/// order.
pub fn order_columns(columns: &[String], keys: &[String], ordering: &str) -> Vec<String> {
    let mut out = vec![ordering.to_string()];
    if columns.iter().any(|c| c == DELETED) {
        out.push(DELETED.to_string());
    }
    out.extend(
        columns
            .iter()
            .filter(|c| *c != ordering && *c != DELETED && !keys.contains(c))
            .cloned(),
    );
    out
}

/// `columns` without [`DELETED`]: what a table stores, and what its guard compares.
pub fn stored_columns(columns: &[String]) -> Vec<String> {
    columns.iter().filter(|c| *c != DELETED).cloned().collect()
}

/// Keeps the greatest row per key by [`order_columns`] (see the module docs): needed before
/// a MERGE or an `ON CONFLICT DO UPDATE`, which both refuse two source rows for one target
/// row. A replay keeps the same row.
pub fn dedupe_latest(df: DataFrame, keys: &[String], ordering: &str) -> Result<DataFrame> {
    dedupe_ordered(df, keys, ordering, false)
}

/// [`dedupe_latest`], or with `null_ordering_first` a row with a NULL ordering value winning
/// its key (to find such rows among the winners).
fn dedupe_ordered(
    df: DataFrame,
    keys: &[String],
    ordering: &str,
    null_ordering_first: bool,
) -> Result<DataFrame> {
    let ctx = || format!("dedupe latest per ({}) by {ordering}", keys.join(", "));
    let names = checked_columns(&df, keys, ordering, &ctx())?;
    let order: Vec<SortExpr> = order_columns(&names, keys, ordering)
        .iter()
        .enumerate()
        .map(|(i, n)| col(quote(n)).sort(false, i == 0 && null_ordering_first))
        .collect();
    let rn = row_number()
        .partition_by(keys.iter().map(|k| col(quote(k))).collect())
        .order_by(order)
        .build()
        .map_err(|e| Error::datafusion(ctx(), e))?
        .alias(RN);
    let mut select: Vec<_> = names.iter().map(|n| col(quote(n))).collect();
    select.push(rn);
    df.select(select)
        .and_then(|d| d.filter(col(RN).eq(lit(1u64))))
        .and_then(|d| d.drop_columns(&[RN]))
        .map_err(|e| Error::datafusion(ctx(), e))
}

/// The frame's column names, once the keys and the ordering column are found among them.
fn checked_columns(
    df: &DataFrame,
    keys: &[String],
    ordering: &str,
    what: &str,
) -> Result<Vec<String>> {
    let names: Vec<String> = df
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    check_columns(&names, keys, ordering, what)?;
    Ok(names)
}

fn check_columns(names: &[String], keys: &[String], ordering: &str, what: &str) -> Result<()> {
    for k in keys
        .iter()
        .map(String::as_str)
        .chain(std::iter::once(ordering))
    {
        if !names.iter().any(|n| n == k) {
            return Err(Error::config(
                k,
                format!(
                    "{what}: the batch has no column '{k}' (columns: {})",
                    names.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

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

/// What [`apply_null_rules`] then [`dedupe_latest`] give, with the rows computed where the
/// batch's plan runs (`run`: a cluster's workers) and only the newest row of each key
/// brought here: for a sink whose final write must run in this process (a Delta MERGE).
///
/// One pass finds the winners, in which a NULL key (its rows share a partition) or, under
/// [`NullOrdering::Error`], a NULL ordering value (it then wins its key) shows whenever the
/// batch has one; only then a second pass counts them over the whole batch, so the rules'
/// errors and the dropped count are the batch's, as in one process.
#[allow(clippy::too_many_arguments)]
pub async fn newest_on_workers(
    df: DataFrame,
    keys: &[String],
    ordering: &str,
    null_keys: NullKeys,
    null_ordering: NullOrdering,
    sink: &str,
    batch_id: u64,
    run: &dyn crate::sink::PlanRunner,
) -> Result<(DataFrame, u64)> {
    let what = || format!("{sink}: batch {batch_id}: the newest row per key on the workers");
    let names = checked_columns(&df, keys, ordering, sink)?;
    let df = zeros_as_zero(df).map_err(|e| Error::datafusion(what(), e))?;
    let winners = dedupe_ordered(
        df.clone(),
        keys,
        ordering,
        null_ordering == NullOrdering::Error,
    )?;
    let schema = winners.schema().inner().clone();
    let screen = NullScreen::new(&names, keys, ordering);
    let mut seen = NullCount::default();
    let mut kept = Vec::new();
    for b in run.run(winners).await? {
        kept.push(
            screen
                .apply(b, &mut seen)
                .map_err(|e| Error::datafusion(what(), e.into()))?,
        );
    }
    let dropped =
        if seen.key_rows > 0 || (seen.ordering_rows > 0 && null_ordering == NullOrdering::Error) {
            count_nulls(df, keys, ordering, run).await?.verdict(
                null_keys,
                null_ordering,
                ordering,
                sink,
                batch_id,
            )?
        } else {
            0
        };
    kept.retain(|b| b.num_rows() > 0);
    let session = SessionContext::new();
    let df = if kept.is_empty() {
        session.read_batch(RecordBatch::new_empty(schema))
    } else {
        session.read_batches(kept)
    }
    .map_err(|e| Error::datafusion(what(), e))?;
    Ok((df, dropped))
}

/// The NULLs of `df`'s keys and ordering column, counted where its plan runs.
async fn count_nulls(
    df: DataFrame,
    keys: &[String],
    ordering: &str,
    run: &dyn crate::sink::PlanRunner,
) -> Result<NullCount> {
    use datafusion::functions_aggregate::expr_fn::sum;
    use datafusion::prelude::{Expr, when};
    let what = || "counting the batch's NULL keys".to_string();
    let one_if = |e: Expr| {
        when(e, lit(1i64))
            .otherwise(lit(0i64))
            .map(sum)
            .map_err(|e| Error::datafusion(what(), e))
    };
    let any_null = keys
        .iter()
        .map(|k| col(quote(k)).is_null())
        .reduce(Expr::or)
        .unwrap_or(lit(false));
    let mut aggs = vec![
        one_if(any_null.clone())?,
        one_if(std::ops::Not::not(any_null).and(col(quote(ordering)).is_null()))?,
    ];
    for k in keys {
        aggs.push(one_if(col(quote(k)).is_null())?);
    }
    let aggs = aggs
        .into_iter()
        .enumerate()
        .map(|(i, a)| a.alias(format!("n{i}")))
        .collect::<Vec<_>>();
    let plan = df
        .aggregate(vec![], aggs)
        .map_err(|e| Error::datafusion(what(), e))?;
    let out = run.run(plan).await?;
    let mut sums = vec![0u64; keys.len() + 2];
    for b in &out {
        for (i, n) in sums.iter_mut().enumerate() {
            let c = b
                .column(i)
                .as_primitive::<datafusion::arrow::datatypes::Int64Type>();
            *n += c.iter().flatten().map(|v| v.max(0) as u64).sum::<u64>();
        }
    }
    Ok(NullCount {
        key_rows: sums[0],
        ordering_rows: sums[1],
        in_keys: keys
            .iter()
            .zip(&sums[2..])
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| (k.clone(), *n))
            .collect(),
    })
}

/// `df` with `0.0` for every `-0.0` of its float columns, as a plan (see
/// [`canonical_zeros`]; `x + 0.0` would be simplified away).
fn zeros_as_zero(df: DataFrame) -> datafusion::error::Result<DataFrame> {
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

/// `col` parses dots and case; a quoted identifier is taken as it is.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Float64Array, Int64Array};
    use datafusion::arrow::datatypes::{Field, Int64Type, Schema};

    use super::*;

    fn frame(ids: Vec<Option<i64>>, xs: Vec<Option<f64>>) -> DataFrame {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(Float64Array::from(xs)),
            ],
        )
        .unwrap();
        SessionContext::new().read_batch(b).unwrap()
    }

    async fn rows(df: DataFrame) -> Vec<(Option<i64>, Option<f64>)> {
        let mut out = Vec::new();
        for b in df.collect().await.unwrap() {
            let ids = b.column(0).as_primitive::<Int64Type>();
            let xs = b.column(1).as_primitive::<Float64Type>();
            for i in 0..b.num_rows() {
                out.push((
                    ids.is_valid(i).then(|| ids.value(i)),
                    xs.is_valid(i).then(|| xs.value(i)),
                ));
            }
        }
        out
    }

    #[tokio::test]
    async fn null_keys_fail_or_drop_and_negative_zero_becomes_zero() {
        let keys = ["id".to_string()];
        let df = || {
            frame(
                vec![Some(1), None, Some(2)],
                vec![Some(-0.0), Some(1.0), None],
            )
        };
        let e = apply_null_rules(
            df(),
            &keys,
            "x",
            NullKeys::Error,
            NullOrdering::Oldest,
            "s",
            7,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("batch 7") && e.contains("id") && e.contains("1 row"),
            "{e}"
        );
        let e = apply_null_rules(
            df(),
            &keys,
            "x",
            NullKeys::Drop,
            NullOrdering::Error,
            "s",
            7,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("x"), "{e}");
        let (out, dropped) = apply_null_rules(
            df(),
            &keys,
            "x",
            NullKeys::Drop,
            NullOrdering::Oldest,
            "s",
            7,
        )
        .await
        .unwrap();
        assert_eq!(dropped, 1);
        let got = rows(out).await;
        assert_eq!(got, vec![(Some(1), Some(0.0)), (Some(2), None)]);
        assert!(got[0].1.unwrap().is_sign_positive());
    }

    /// Runs plans here, as a cluster of one would.
    struct Here;

    #[async_trait::async_trait]
    impl crate::sink::PlanRunner for Here {
        async fn run(&self, plan: DataFrame) -> Result<Vec<RecordBatch>> {
            plan.collect()
                .await
                .map_err(|e| Error::datafusion("here".to_string(), e))
        }
    }

    #[tokio::test]
    async fn the_newest_rows_found_on_workers_are_one_process_s_under_every_null_rule() {
        type Ids = Vec<Option<i64>>;
        type Xs = Vec<Option<f64>>;
        let cases: Vec<(Ids, Xs)> = vec![
            (
                vec![Some(1), Some(1), Some(2)],
                vec![Some(1.0), Some(2.0), Some(-0.0)],
            ),
            // NULL keys, one of them winning nothing.
            (
                vec![None, Some(1), None, Some(1)],
                vec![Some(5.0), Some(1.0), None, Some(0.0)],
            ),
            // A NULL ordering beside a value of the same key (hidden by the NULLS LAST
            // winner unless looked for).
            (
                vec![Some(1), Some(1), Some(2)],
                vec![Some(3.0), None, Some(1.0)],
            ),
            (vec![Some(4), Some(4)], vec![None, None]),
        ];
        let keys = ["id".to_string()];
        for (ids, xs) in cases {
            for null_keys in [NullKeys::Error, NullKeys::Drop] {
                for null_ordering in [NullOrdering::Error, NullOrdering::Oldest] {
                    let here = async {
                        let (df, dropped) = apply_null_rules(
                            frame(ids.clone(), xs.clone()),
                            &keys,
                            "x",
                            null_keys,
                            null_ordering,
                            "s",
                            1,
                        )
                        .await?;
                        let df = dedupe_latest(df, &keys, "x")?;
                        Ok::<_, Error>((sorted(rows(df).await), dropped))
                    }
                    .await
                    .map_err(|e| e.to_string());
                    let there = async {
                        let (df, dropped) = newest_on_workers(
                            frame(ids.clone(), xs.clone()),
                            &keys,
                            "x",
                            null_keys,
                            null_ordering,
                            "s",
                            1,
                            &Here,
                        )
                        .await?;
                        Ok::<_, Error>((sorted(rows(df).await), dropped))
                    }
                    .await
                    .map_err(|e| e.to_string());
                    assert_eq!(
                        here, there,
                        "{ids:?} {xs:?} {null_keys:?} {null_ordering:?}"
                    );
                }
            }
        }
    }

    fn sorted(mut v: Vec<(Option<i64>, Option<f64>)>) -> Vec<(Option<i64>, Option<f64>)> {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v
    }

    #[tokio::test]
    async fn the_greatest_row_of_a_key_wins_and_ties_go_to_the_other_columns() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("t", DataType::Int64, true),
            Field::new("v", DataType::Utf8, true),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![1, 1, 1, 2, 2])),
                Arc::new(Int64Array::from(vec![
                    Some(5),
                    Some(5),
                    Some(4),
                    None,
                    Some(1),
                ])),
                Arc::new(datafusion::arrow::array::StringArray::from(vec![
                    "a", "c", "z", "q", "p",
                ])),
            ],
        )
        .unwrap();
        let df = SessionContext::new().read_batch(b).unwrap();
        let out = dedupe_latest(df, &["id".to_string()], "t")
            .unwrap()
            .sort(vec![col("id").sort(true, true)])
            .unwrap()
            .collect()
            .await
            .unwrap();
        let b = &out[0];
        let v = b.column(2).as_string::<i32>();
        assert_eq!((b.num_rows(), v.value(0), v.value(1)), (2, "c", "p"));
    }
}
