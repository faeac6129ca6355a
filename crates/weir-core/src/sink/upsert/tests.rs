use datafusion::arrow::array::{Float64Array, Int64Array};
use datafusion::arrow::datatypes::{Field, Int64Type, Schema};

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float64Type};
use datafusion::prelude::SessionContext;

use super::*;
use crate::error::Result;

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
