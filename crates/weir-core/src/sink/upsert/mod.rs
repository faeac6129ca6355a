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

//!
//! The null rules are in `nulls`, the newest row per key found on a cluster's workers in
//! `on_workers`.

mod nulls;
mod on_workers;
#[cfg(test)]
mod tests;

use datafusion::functions_window::expr_fn::row_number;
use datafusion::logical_expr::{ExprFunctionExt, SortExpr};
use datafusion::prelude::{DataFrame, col, lit};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use nulls::{NullCount, NullScreen, apply_null_rules};
pub use on_workers::newest_on_workers;

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

/// `name` as a quoted SQL identifier (`col` parses dots and case; a quoted identifier is
/// taken as it is).
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
