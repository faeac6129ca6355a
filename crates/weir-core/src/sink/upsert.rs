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

use datafusion::functions_window::expr_fn::row_number;
use datafusion::logical_expr::{ExprFunctionExt, SortExpr};
use datafusion::prelude::{DataFrame, Expr, col, lit};
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

/// The columns that decide which row of a key wins, most significant first: the ordering
/// column, then every other non-key column of `columns` in order.
pub fn order_columns(columns: &[String], keys: &[String], ordering: &str) -> Vec<String> {
    let mut out = vec![ordering.to_string()];
    out.extend(
        columns
            .iter()
            .filter(|c| *c != ordering && !keys.contains(c))
            .cloned(),
    );
    out
}

/// Keeps the greatest row per key by [`order_columns`] (see the module docs): needed before
/// a MERGE or an `ON CONFLICT DO UPDATE`, which both refuse two source rows for one target
/// row. A replay keeps the same row.
pub fn dedupe_latest(df: DataFrame, keys: &[String], ordering: &str) -> Result<DataFrame> {
    let ctx = || format!("dedupe latest per ({}) by {ordering}", keys.join(", "));
    let names: Vec<String> = df
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    check_columns(&names, keys, ordering, &ctx())?;
    let order: Vec<SortExpr> = order_columns(&names, keys, ordering)
        .iter()
        .map(|n| col(quote(n)).sort(false, false))
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

/// Applies the NULL rules to a batch for sink `sink`: returns the rows to write and how many
/// were dropped, or the error of the default rule.
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
    let names: Vec<String> = df
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    check_columns(&names, keys, ordering, sink)?;
    let any_null_key = keys
        .iter()
        .map(|k| col(quote(k)).is_null())
        .reduce(Expr::or)
        .unwrap_or_else(|| lit(false));
    let null_keys_n = df
        .clone()
        .filter(any_null_key.clone())
        .map_err(|e| Error::datafusion(what(), e))?
        .count()
        .await
        .map_err(|e| Error::datafusion(what(), e))?;
    let mut df = df;
    let mut dropped = 0u64;
    if null_keys_n > 0 {
        match null_keys {
            NullKeys::Error => {
                return Err(Error::NullValues {
                    sink: sink.to_string(),
                    batch_id,
                    column: keys.join(", "),
                    rows: null_keys_n as u64,
                    hint: "a NULL key never matches a stored row, so every batch would insert \
                           it again; filter such rows out, or set null-keys = \"drop\" to drop \
                           them (counted in the progress)"
                        .into(),
                });
            }
            NullKeys::Drop => {
                df = df
                    .filter(!any_null_key)
                    .map_err(|e| Error::datafusion(what(), e))?;
                dropped = null_keys_n as u64;
            }
        }
    }
    if null_ordering == NullOrdering::Error {
        let n = df
            .clone()
            .filter(col(quote(ordering)).is_null())
            .map_err(|e| Error::datafusion(what(), e))?
            .count()
            .await
            .map_err(|e| Error::datafusion(what(), e))?;
        if n > 0 {
            return Err(Error::NullValues {
                sink: sink.to_string(),
                batch_id,
                column: ordering.to_string(),
                rows: n as u64,
                hint: "the ordering column decides which row of a key is newest; fill it, or set \
                       null-ordering = \"oldest\" to take NULL as older than any value"
                    .into(),
            });
        }
    }
    Ok((df, dropped))
}

/// `col` parses dots and case; a quoted identifier is taken as it is.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
