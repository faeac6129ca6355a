//! The newest row per key, found where a batch's plan runs (a cluster's workers).

use datafusion::arrow::array::AsArray;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::{DataFrame, SessionContext, col, lit};

use super::nulls::{NullCount, NullScreen, zeros_as_zero};
use super::{NullKeys, NullOrdering, checked_columns, dedupe_ordered, quote};
use crate::error::{Error, Result};

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
