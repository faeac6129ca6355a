//! The steps between a source and the function: SQL over the batch, DataFrame functions,
//! and the stateful steps (deduplication, watermark, aggregation) that `engine::stateful`
//! runs. Planning SQL lives here too, so the checks before a run (`weir check`) and the run
//! itself plan a statement the same way.

use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::plan_err;
use datafusion::datasource::{MemTable, TableProvider};
use datafusion::execution::context::SQLOptions;
use datafusion::prelude::{DataFrame, SessionContext};

use super::stateful::{
    Aggregation, DedupeMode, Operator, StateSettings, WATERMARK_KEY, check_watermark_type,
    key_columns,
};
use crate::error::{Error, Result};
use crate::storage::Location;

/// The name under which a SQL transform sees the batch.
pub const BATCH_VIEW: &str = "batch";

/// Plans `sql` over `df`, which it sees as the table [`BATCH_VIEW`] of `ctx` (registered for
/// the planning only).
pub async fn sql_over_batch(
    ctx: &SessionContext,
    df: DataFrame,
    sql: &str,
) -> datafusion::error::Result<DataFrame> {
    sql_over_table(ctx, df.into_view(), sql).await
}

/// [`sql_over_batch`] over a table.
pub(crate) async fn sql_over_table(
    ctx: &SessionContext,
    table: Arc<dyn TableProvider>,
    sql: &str,
) -> datafusion::error::Result<DataFrame> {
    ctx.register_table(BATCH_VIEW, table)?;
    let planned = plan_query(ctx, sql).await;
    ctx.deregister_table(BATCH_VIEW)?;
    planned
}

/// Plans `sql` without running any of it. It must be a query: DDL (`CREATE VIEW`), DML
/// (`INSERT`, `COPY .. TO`) and statements (`SET`) would run when planned or at every
/// batch, outside any sink and its exactly-once, and give nothing to write.
async fn plan_query(ctx: &SessionContext, sql: &str) -> datafusion::error::Result<DataFrame> {
    let plan = ctx.state().create_logical_plan(sql).await?;
    let queries_only = SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false);
    if let Err(e) = queries_only.verify_plan(&plan) {
        return plan_err!(
            "it must be a query (SELECT ...) over `batch`, not a statement ({})",
            e.strip_backtrace()
        );
    }
    ctx.execute_logical_plan(plan).await
}

/// What [`check_transforms`] learned of the columns the function gets.
#[derive(Debug, Clone)]
pub enum TransformOutput {
    /// Names and types: every SQL step was planned.
    Schema(SchemaRef),
    /// The names only: an aggregation's value types come from the data.
    Names(Vec<String>),
    /// Known at run time only: a step (SQL over an aggregation's output, a DataFrame
    /// function) was not planned.
    Unknown,
}

/// Checks `transforms` against the source's columns without data, as far as the columns
/// are known before a batch runs: the start checks of the stateful steps, then every SQL
/// step planned (logical and physical, nothing run) over an empty batch of its input's
/// columns, as `weir check` does.
pub(crate) async fn check_transforms(
    ctx: &SessionContext,
    source: SchemaRef,
    transforms: &[Transform],
) -> Result<TransformOutput> {
    check_at_start(&source, transforms)?;
    let mut schema = source;
    for (i, t) in transforms.iter().enumerate() {
        match t {
            t if t.keeps_columns() => {}
            Transform::Aggregate(a) => {
                let names = a.output_names(&schema)?;
                return Ok(
                    if transforms[i + 1..].iter().all(Transform::keeps_columns) {
                        TransformOutput::Names(names)
                    } else {
                        TransformOutput::Unknown
                    },
                );
            }
            Transform::Sql(sql) => {
                let failed = |e| Error::datafusion(format!("the SQL transform `{sql}`"), e);
                let empty = MemTable::try_new(schema.clone(), vec![vec![]]).map_err(failed)?;
                let df = sql_over_table(ctx, Arc::new(empty), sql)
                    .await
                    .map_err(failed)?;
                schema = df.schema().inner().clone();
                df.create_physical_plan().await.map_err(failed)?;
            }
            // A DataFrame function: its columns are known when it runs.
            _ => return Ok(TransformOutput::Unknown),
        }
    }
    Ok(TransformOutput::Schema(schema))
}

/// A step between the source and the function, in the order the query lists them.
/// `Sql` and `Fn` are stateless; `DropDuplicates`, `DropDuplicatesWithinWatermark` and
/// `Aggregate` keep state across batches (`engine::stateful`), and `Watermark` tracks the
/// event time those use.
#[derive(Clone)]
pub enum Transform {
    /// SQL over the batch, which it sees as the view `batch`.
    Sql(String),
    /// A DataFrame function.
    Fn(Arc<dyn Fn(DataFrame) -> datafusion::error::Result<DataFrame> + Send + Sync>),
    /// Streaming deduplication on these columns: a row passes only if no earlier row, in
    /// this batch or any before it, had the same values (see `engine::stateful`).
    DropDuplicates(Vec<String>),
    /// Spark's `withWatermark`: the event-time column and how late its rows may come.
    Watermark { column: String, delay: Duration },
    /// Spark's `dropDuplicatesWithinWatermark`: a row passes unless a row with the same
    /// values came before it less than the watermark's delay earlier (in event time).
    DropDuplicatesWithinWatermark(Vec<String>),
    /// A streaming aggregation (see [`Aggregation`]).
    Aggregate(Aggregation),
}

impl Transform {
    /// Whether the step passes rows on with the columns they came with (watermark,
    /// deduplication).
    pub(crate) fn keeps_columns(&self) -> bool {
        matches!(
            self,
            Transform::Watermark { .. }
                | Transform::DropDuplicates(_)
                | Transform::DropDuplicatesWithinWatermark(_)
        )
    }
}

impl Transform {
    /// The stateful operator that runs this step, the `index`-th of its query; `None` for a
    /// stateless step.
    pub(crate) fn operator(
        &self,
        index: u32,
        state_root: &Location,
        settings: StateSettings,
    ) -> Result<Option<Operator>> {
        Ok(match self {
            Transform::DropDuplicates(keys) => Some(Operator::dedupe(
                index,
                keys.clone(),
                DedupeMode::Plain,
                state_root,
                settings,
            )),
            Transform::DropDuplicatesWithinWatermark(keys) => Some(Operator::dedupe(
                index,
                keys.clone(),
                DedupeMode::WithinWatermark,
                state_root,
                settings,
            )),
            Transform::Aggregate(a) => {
                Some(Operator::aggregate(index, a.clone(), state_root, settings)?)
            }
            Transform::Sql(_) | Transform::Fn(_) | Transform::Watermark { .. } => None,
        })
    }
}

/// Checks, before the query starts, what can be checked without data: one watermark at
/// most, aggregates that parse, and the columns of the steps that see the source's columns
/// (those before any SQL, DataFrame or aggregation step): a typo is refused before anything
/// runs, not at the first batch that brings data.
pub(crate) fn check_at_start(source: &Schema, transforms: &[Transform]) -> Result<()> {
    check_steps(transforms)?;
    for t in transforms {
        match t {
            Transform::DropDuplicates(keys) => {
                key_columns(source, keys, DedupeMode::Plain.key())?;
            }
            Transform::DropDuplicatesWithinWatermark(keys) => {
                key_columns(source, keys, DedupeMode::WithinWatermark.key())?;
            }
            Transform::Watermark { column, .. } => {
                let i = key_columns(source, std::slice::from_ref(column), WATERMARK_KEY)?[0];
                check_watermark_type(column, source.field(i).data_type())?;
            }
            Transform::Aggregate(a) => {
                a.check_columns(source)?;
                break;
            }
            Transform::Sql(_) | Transform::Fn(_) => break,
        }
    }
    Ok(())
}

/// The checks of [`check_at_start`] that need no schema: one watermark at most, aggregates
/// that parse, append mode with a watermark to close by, dedupe within a watermark after one.
pub fn check_steps(transforms: &[Transform]) -> Result<()> {
    let watermarks = transforms
        .iter()
        .filter(|t| matches!(t, Transform::Watermark { .. }))
        .count();
    if watermarks > 1 {
        return Err(Error::config(
            WATERMARK_KEY,
            format!(
                "the query has {watermarks} watermarks; a weir query reads one source and takes one"
            ),
        ));
    }
    let mut watermark = None;
    for t in transforms {
        match t {
            Transform::Watermark { column, .. } => watermark = Some(column.as_str()),
            Transform::Aggregate(a) => {
                a.validate()?;
                a.check_watermark(watermark)?;
            }
            Transform::DropDuplicatesWithinWatermark(_) if watermark.is_none() => {
                return Err(Error::config(
                    DedupeMode::WithinWatermark.key(),
                    "drop_duplicates_within_watermark needs a watermark: put with_watermark \
                     (`transform.with-watermark`) before it",
                ));
            }
            _ => {}
        }
    }
    Ok(())
}
