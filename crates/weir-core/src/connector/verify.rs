//! Reference checks for sink contents: every input row once (append), or the newest row per
//! key (upsert). Written without the engine's own dedupe, so a bug there shows up here.

use std::collections::HashMap;

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::compute::{SortOptions, cast};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::arrow::util::display::array_value_to_string;

use super::Verdict;
use crate::error::{Error, Result};

fn arrow_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Internal {
        what: format!("{what}: {e}"),
    }
}

/// The columns of `b` named in `schema`, cast to its types.
fn columns(b: &RecordBatch, schema: &SchemaRef, what: &str) -> Result<Vec<ArrayRef>> {
    schema
        .fields()
        .iter()
        .map(|f| {
            let c = b.column_by_name(f.name()).ok_or_else(|| Error::Internal {
                what: format!("{what}: no column '{}'", f.name()),
            })?;
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                cast(c, f.data_type()).map_err(|e| arrow_err(what, e))
            }
        })
        .collect()
}

/// Each row as text, column by column in `schema`'s order: the unit both sides are
/// compared in.
fn row_strings(batches: &[RecordBatch], schema: &SchemaRef, what: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for b in batches {
        let cols = columns(b, schema, what)?;
        for r in 0..b.num_rows() {
            let cells: Vec<String> = cols
                .iter()
                .map(|c| {
                    if c.is_null(r) {
                        Ok("NULL".to_string())
                    } else {
                        array_value_to_string(c, r).map_err(|e| arrow_err(what, e))
                    }
                })
                .collect::<Result<_>>()?;
            out.push(cells.join("|"));
        }
    }
    Ok(out)
}

/// The newest row of every key of `input`: the greatest by `ordering`, then by every other
/// column in schema order, NULL below every value. This is the total order the upsert sinks
/// document, so the result does not depend on how rows were grouped into batches.
pub fn newest_per_key(
    input: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[String],
    ordering: &str,
) -> Result<Vec<RecordBatch>> {
    let what = "computing the newest row per key";
    let index = |name: &str| {
        schema.index_of(name).map_err(|_| Error::Internal {
            what: format!("{what}: no column '{name}'"),
        })
    };
    let key_idx: Vec<usize> = keys.iter().map(|k| index(k)).collect::<Result<_>>()?;
    let ordering_idx = index(ordering)?;
    let mut order_idx = vec![ordering_idx];
    order_idx
        .extend((0..schema.fields().len()).filter(|i| !key_idx.contains(i) && *i != ordering_idx));
    let field = |i: &usize| {
        SortField::new_with_options(
            schema.field(*i).data_type().clone(),
            SortOptions {
                descending: false,
                nulls_first: true,
            },
        )
    };
    let key_conv =
        RowConverter::new(key_idx.iter().map(field).collect()).map_err(|e| arrow_err(what, e))?;
    let order_conv =
        RowConverter::new(order_idx.iter().map(field).collect()).map_err(|e| arrow_err(what, e))?;
    // key bytes -> (order bytes, batch, row)
    let mut best: HashMap<Vec<u8>, (Vec<u8>, usize, usize)> = HashMap::new();
    let mut cast_batches = Vec::with_capacity(input.len());
    for (bi, b) in input.iter().enumerate() {
        let cols = columns(b, schema, what)?;
        let krows = key_conv
            .convert_columns(&key_idx.iter().map(|i| cols[*i].clone()).collect::<Vec<_>>())
            .map_err(|e| arrow_err(what, e))?;
        let orows = order_conv
            .convert_columns(
                &order_idx
                    .iter()
                    .map(|i| cols[*i].clone())
                    .collect::<Vec<_>>(),
            )
            .map_err(|e| arrow_err(what, e))?;
        for r in 0..b.num_rows() {
            let k = krows.row(r).as_ref().to_vec();
            let o = orows.row(r).as_ref().to_vec();
            match best.get(&k) {
                Some((cur, _, _)) if *cur >= o => {}
                _ => {
                    best.insert(k, (o, bi, r));
                }
            }
        }
        cast_batches
            .push(RecordBatch::try_new(schema.clone(), cols).map_err(|e| arrow_err(what, e))?);
    }
    let mut out = Vec::with_capacity(best.len());
    for (_, bi, r) in best.values() {
        out.push(cast_batches[*bi].slice(*r, 1));
    }
    Ok(out)
}

fn multiset(rows: Vec<String>) -> HashMap<String, i64> {
    let mut m = HashMap::new();
    for r in rows {
        *m.entry(r).or_default() += 1;
    }
    m
}

fn diff(what: &str, got: Vec<String>, want: Vec<String>, unit: &str) -> Verdict {
    let n = got.len();
    let mut count = multiset(want);
    for r in got {
        *count.entry(r).or_default() -= 1;
    }
    let mut missing: Vec<(&String, i64)> = count
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(r, n)| (r, *n))
        .collect();
    let mut extra: Vec<(&String, i64)> = count
        .iter()
        .filter(|(_, n)| **n < 0)
        .map(|(r, n)| (r, -*n))
        .collect();
    missing.sort();
    extra.sort();
    let mut v = Verdict {
        rows: n,
        notes: vec![format!("{what}: {n} rows")],
        ..Verdict::default()
    };
    let total = |xs: &[(&String, i64)]| xs.iter().map(|x| x.1).sum::<i64>();
    if !missing.is_empty() {
        v.mismatches.push(format!(
            "{what}: {} {unit} missing, e.g. {}",
            total(&missing),
            missing
                .iter()
                .take(3)
                .map(|(r, _)| r.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    if !extra.is_empty() {
        v.mismatches.push(format!(
            "{what}: {} rows extra, doubled or stale, e.g. {}",
            total(&extra),
            extra
                .iter()
                .take(3)
                .map(|(r, _)| r.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    v
}

/// An append sink must hold every input row exactly once.
pub fn compare_append(
    what: &str,
    got: &[RecordBatch],
    input: &[RecordBatch],
    schema: &SchemaRef,
) -> Result<Verdict> {
    Ok(diff(
        what,
        row_strings(got, schema, what)?,
        row_strings(input, schema, "the input")?,
        "input rows",
    ))
}

/// An upsert sink must hold exactly the newest row of every key of the input.
pub fn compare_upsert(
    what: &str,
    got: &[RecordBatch],
    input: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[String],
    ordering: &str,
) -> Result<Verdict> {
    let want = newest_per_key(input, schema, keys, ordering)?;
    Ok(diff(
        what,
        row_strings(got, schema, what)?,
        row_strings(&want, schema, "the reference")?,
        "newest rows",
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn batch(rows: &[(i64, Option<i64>, &str)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("ts", DataType::Int64, true),
            Field::new("v", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(
                    rows.iter().map(|r| r.0).collect::<Vec<_>>(),
                )),
                Arc::new(Int64Array::from(
                    rows.iter().map(|r| r.1).collect::<Vec<_>>(),
                )),
                Arc::new(StringArray::from(
                    rows.iter().map(|r| r.2).collect::<Vec<_>>(),
                )),
            ],
        )
        .unwrap()
    }

    #[test]
    fn the_newest_row_wins_ties_break_on_the_other_columns_and_null_is_oldest() {
        let input = vec![
            batch(&[(1, Some(5), "a"), (2, None, "x")]),
            batch(&[(1, Some(5), "b"), (2, Some(1), "y"), (1, Some(4), "z")]),
        ];
        let schema = input[0].schema();
        let got = newest_per_key(&input, &schema, &["k".into()], "ts").unwrap();
        let mut rows = row_strings(&got, &schema, "t").unwrap();
        rows.sort();
        assert_eq!(rows, vec!["1|5|b", "2|1|y"]);
        let v = compare_upsert("t", &got, &input, &schema, &["k".into()], "ts").unwrap();
        assert!(v.mismatches.is_empty(), "{v:?}");
        let stale = vec![batch(&[
            (1, Some(5), "a"),
            (2, Some(1), "y"),
            (2, Some(1), "y"),
        ])];
        let v = compare_upsert("t", &stale, &input, &schema, &["k".into()], "ts").unwrap();
        assert_eq!(v.mismatches.len(), 2, "{v:?}");
        let v = compare_append("t", &input, &input, &schema).unwrap();
        assert!(v.mismatches.is_empty());
        let v = compare_append("t", &input[..1], &input, &schema).unwrap();
        assert!(v.mismatches[0].contains("3 input rows missing"), "{v:?}");
    }
}
