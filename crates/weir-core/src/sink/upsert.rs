use datafusion::functions_window::expr_fn::row_number;
use datafusion::logical_expr::{ExprFunctionExt, SortExpr};
use datafusion::prelude::{DataFrame, col, lit};

use crate::error::{Error, Result};

const RN: &str = "__weir_rn";

/// Keeps the newest row per key: `row_number() over (partition by keys order by ordering
/// desc)`, then `rn = 1`. Ties on `ordering` are broken by the other columns (descending),
/// so a replay keeps the same row. Needed before a MERGE or an `ON CONFLICT DO UPDATE`,
/// which both refuse two source rows for one target row.
pub fn dedupe_latest(df: DataFrame, keys: &[String], ordering: &str) -> Result<DataFrame> {
    let ctx = || format!("dedupe latest per ({}) by {ordering}", keys.join(", "));
    let names: Vec<String> = df
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    for k in keys
        .iter()
        .map(String::as_str)
        .chain(std::iter::once(ordering))
    {
        if !names.iter().any(|n| n == k) {
            return Err(Error::config(
                k,
                format!(
                    "{}: the batch has no column '{k}' (columns: {})",
                    ctx(),
                    names.join(", ")
                ),
            ));
        }
    }
    let mut order: Vec<SortExpr> = vec![col(quote(ordering)).sort(false, false)];
    order.extend(
        names
            .iter()
            .filter(|n| *n != ordering && !keys.contains(n))
            .map(|n| col(quote(n)).sort(false, false)),
    );
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

/// `col` parses dots and case; a quoted identifier is taken as it is.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
