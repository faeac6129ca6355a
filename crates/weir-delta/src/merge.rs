//! MERGE upsert: newest row per key, guarded update, insert of new keys, and the
//! application transaction in the MERGE commit.

use std::sync::Arc;

use async_trait::async_trait;
use deltalake::kernel::Transaction;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::common::{Column, ScalarValue};
use weir_core::datafusion::functions_aggregate::expr_fn::count;
use weir_core::datafusion::logical_expr::{Operator, binary_expr};
use weir_core::datafusion::prelude::{DataFrame, Expr, SessionContext, lit};
use weir_core::sink::PlanRunner;
use weir_core::sink::upsert::{
    DELETED, apply_null_rules, newest_on_workers, order_columns, quote, stored_columns,
};
use weir_core::storage::Location;
use weir_core::{
    BatchContext, BoxError, ForeachBatch, NullKeys, NullOrdering, SinkMetric, dedupe_latest, fault,
};

use crate::append::{WriteOptions, write_with_txn};
use crate::compact::{Compaction, batch_bytes};
use crate::error::DeltaSinkError;
use crate::table::{Cached, commit_properties, note_version, prepare};
use crate::{POINT_AFTER_COMMIT, POINT_BEFORE_COMMIT};

/// Upserts each batch into a Delta table by key: Spark's
/// `MERGE ... WHEN MATCHED AND <s is newer than t> THEN UPDATE SET * WHEN NOT MATCHED THEN
/// INSERT *`, exactly once per batch id.
///
/// - In-batch dedupe (on by default) keeps the newest row per key, since a MERGE refuses two
///   source rows for one target row. With it off, such a batch fails naming the key.
/// - "Newer" is the total order of `weir_core::sink::upsert`: the ordering column, then the
///   other non-key columns, NULL lowest; so a late, older event never overwrites a newer
///   one, ties are decided the same way whatever the batches, and a replay (or any re-run)
///   of a batch changes nothing even without the skip.
/// - Rows with a NULL key (and, by default, a NULL ordering) fail the batch with an error
///   naming them; see [`NullKeys`] and [`NullOrdering`].
/// - The application transaction rides in the MERGE commit. delta-rs does not commit a MERGE
///   that changes no row; then the transaction is recorded by an empty append, so
///   "batch N is applied" is always provable and the replay is skipped without a scan.
/// - `prune_by` (a key column) adds `t.<col> IN (<values in the batch>)` to the match
///   condition, so the MERGE reads only the target files that can match (e.g. a date
///   partition that is part of the key).
#[derive(Debug, Clone)]
pub struct DeltaMerge {
    at: Location,
    keys: Vec<String>,
    ordering: String,
    app_id: Option<String>,
    allow_app_id_reuse: bool,
    dedupe: bool,
    update_condition: Option<String>,
    prune_by: Option<String>,
    write: WriteOptions,
    compaction: Compaction,
    null_keys: NullKeys,
    null_ordering: NullOrdering,
    table: Arc<Cached>,
}

impl DeltaMerge {
    /// Upserts into the table at `at` by `keys`, newest `ordering` wins.
    pub fn new(
        at: impl Into<Location>,
        keys: impl IntoIterator<Item = impl Into<String>>,
        ordering: impl Into<String>,
    ) -> Self {
        DeltaMerge {
            at: at.into(),
            keys: keys.into_iter().map(Into::into).collect(),
            ordering: ordering.into(),
            app_id: None,
            allow_app_id_reuse: false,
            dedupe: true,
            update_condition: None,
            prune_by: None,
            write: WriteOptions::default(),
            compaction: Compaction::default(),
            null_keys: NullKeys::Error,
            null_ordering: NullOrdering::Error,
            table: Arc::new(Cached::new()),
        }
    }

    /// An explicit application id instead of the query name plus query id.
    pub fn app_id(mut self, id: impl Into<String>) -> Self {
        self.app_id = Some(id.into());
        self
    }

    /// Skip (with a warning) instead of failing when the table records a version of the
    /// app id that this query did not write.
    pub fn allow_app_id_reuse(mut self, yes: bool) -> Self {
        self.allow_app_id_reuse = yes;
        self
    }

    /// Keep only the newest row per key of each batch (default on).
    pub fn dedupe(mut self, on: bool) -> Self {
        self.dedupe = on;
        self
    }

    /// The condition for updating a matched row, as SQL over `s` (batch) and `t` (table);
    /// default: `s` is newer than `t` by the total order.
    pub fn update_condition(mut self, sql: impl Into<String>) -> Self {
        self.update_condition = Some(sql.into());
        self
    }

    /// A key column whose batch values are added to the match condition to prune the scan.
    pub fn prune_by(mut self, column: impl Into<String>) -> Self {
        self.prune_by = Some(column.into());
        self
    }

    /// Partition columns for a table this sink creates.
    pub fn partition_by(mut self, cols: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.write.partition_by = cols.into_iter().map(Into::into).collect();
        self
    }

    /// How long a table this sink creates keeps tombstones of replaced files in its
    /// checkpoints (`delta.deletedFileRetentionDuration`); default one day, see
    /// [`crate::compact`]. An existing table keeps its own.
    pub fn deleted_file_retention(mut self, retention: std::time::Duration) -> Self {
        self.write.deleted_file_retention = retention;
        self
    }

    /// OPTIMIZE after every `n` batches; `0` turns compaction off. Default: after every
    /// 100 small batches (see [`crate::compact`]).
    pub fn optimize_every(mut self, n: u64) -> Self {
        self.compaction = Compaction::every(n);
        self
    }

    /// What rows with a NULL key do (default: the batch fails, naming them).
    pub fn null_keys(mut self, rule: NullKeys) -> Self {
        self.null_keys = rule;
        self
    }

    /// What rows with a NULL ordering value do (default: the batch fails, naming them).
    pub fn null_ordering(mut self, rule: NullOrdering) -> Self {
        self.null_ordering = rule;
        self
    }

    /// The table's location.
    pub fn location(&self) -> &Location {
        &self.at
    }

    /// The sink's name in progress and errors.
    pub fn label(&self) -> String {
        format!("delta-merge {}", self.at)
    }

    /// The settings that can be checked without data.
    pub fn check(&self) -> Result<(), DeltaSinkError> {
        let bad = |key, reason: String| DeltaSinkError::Config {
            table: self.at.to_string(),
            key,
            reason,
        };
        if self.keys.is_empty() {
            return Err(bad("keys", "a MERGE needs at least one key column".into()));
        }
        if let Some(p) = &self.prune_by
            && !self.keys.contains(p)
        {
            return Err(bad(
                "prune-by",
                format!(
                    "'{p}' is not a key column: a key whose {p} changed would not be found and \
                     would be inserted a second time. Add it to keys (e.g. keys = [\"{p}\", ...]) \
                     if it never changes for a key"
                ),
            ));
        }
        Ok(())
    }

    fn df_err(
        &self,
        batch_id: u64,
        action: &'static str,
    ) -> impl Fn(weir_core::datafusion::error::DataFusionError) -> DeltaSinkError + '_ {
        move |source| DeltaSinkError::DataFusion {
            table: self.at.to_string(),
            batch_id,
            action,
            source,
        }
    }

    fn engine(&self, batch_id: u64) -> impl Fn(weir_core::Error) -> DeltaSinkError + '_ {
        move |source| DeltaSinkError::Engine {
            table: self.at.to_string(),
            batch_id,
            source,
        }
    }

    /// The MERGE of `batch`: with `run` (a cluster), the NULL rules and the newest row per
    /// key are computed on the workers and only the winners come here for the MERGE.
    async fn merge(
        &self,
        batch: DataFrame,
        ctx: &BatchContext,
        run: Option<&dyn PlanRunner>,
    ) -> Result<(), DeltaSinkError> {
        let id = ctx.batch_id;
        self.check()?;
        let sink = self.label();
        let prepared = prepare(
            &self.table,
            &self.at,
            &sink,
            self.app_id.as_deref(),
            self.allow_app_id_reuse,
            ctx,
        )
        .await?;
        let Some(table) = prepared.table else {
            return Ok(());
        };
        let (source, dropped) = match run {
            Some(run) if self.dedupe => newest_on_workers(
                batch,
                &self.keys,
                &self.ordering,
                self.null_keys,
                self.null_ordering,
                &sink,
                id,
                run,
            )
            .await
            .map_err(self.engine(id))?,
            _ => {
                let (batch, dropped) = apply_null_rules(
                    batch,
                    &self.keys,
                    &self.ordering,
                    self.null_keys,
                    self.null_ordering,
                    &sink,
                    id,
                )
                .await
                .map_err(self.engine(id))?;
                let source = if self.dedupe {
                    dedupe_latest(batch, &self.keys, &self.ordering).map_err(self.engine(id))?
                } else {
                    self.refuse_duplicates(batch.clone(), id).await?;
                    batch
                };
                (source, dropped)
            }
        };
        if dropped > 0 {
            ctx.metrics.record(&sink, SinkMetric::Dropped, dropped);
        }
        let schema = source.schema().inner().clone();
        let all_columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        // A batch with `_deleted` carries deletes: the column steers the MERGE and is not
        // stored (see `weir_core::sink::upsert`).
        let deletes = all_columns.iter().any(|c| c == DELETED);
        let columns = stored_columns(&all_columns);
        let mut batches = source
            .collect()
            .await
            .map_err(self.df_err(id, "computing the batch"))?;
        batches.retain(|b| b.num_rows() > 0);
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        let bytes = batch_bytes(&batches);
        let app_id = prepared.app_id;
        let before = table.version();
        let commit = |table, batches: Vec<RecordBatch>| {
            write_with_txn(table, batches, &self.write, &app_id, &self.at, id)
        };
        if before.is_some()
            && let Ok(snap) = table.snapshot()
        {
            let stored: Vec<String> = snap
                .schema()
                .fields()
                .map(|f| f.name().to_string())
                .collect();
            if let Some(c) = columns.iter().find(|c| !stored.contains(c)) {
                return Err(DeltaSinkError::Config {
                    table: self.at.to_string(),
                    key: "columns",
                    reason: format!(
                        "batch {id} has a column '{c}' that the table does not (table columns: \
                         {}); select the table's columns in the query, or add the column to the table",
                        stored.join(", ")
                    ),
                });
            }
        }
        let schema = if deletes {
            let (kept, stored) =
                without_deletes(&batches, &schema).map_err(self.df_err(id, "holding the batch"))?;
            if before.is_none() {
                // No table to delete from: the first batch writes its other rows.
                batches = kept;
            }
            stored
        } else {
            schema
        };
        let table = if before.is_none() || rows == 0 {
            // No table yet: the first batch creates it. No rows: only the transaction.
            if batches.is_empty() {
                batches.push(RecordBatch::new_empty(schema.clone()));
            }
            let t = commit(table, batches).await?;
            if before.is_none() {
                ctx.metrics.record(&sink, SinkMetric::Inserted, rows);
            }
            t
        } else {
            let mut predicate = self
                .keys
                .iter()
                .map(|k| qualified("t", k).eq(qualified("s", k)))
                .reduce(Expr::and)
                .unwrap_or_else(|| lit(true));
            if let Some(p) = &self.prune_by {
                predicate = predicate.and(self.prune_condition(&batches, p, id)?);
            }
            let session = SessionContext::new();
            let source_df = session
                .read_batches(batches)
                .map_err(self.df_err(id, "holding the batch"))?;
            let guard = newer(&order_columns(&columns, &self.keys, &self.ordering));
            let txn = Transaction::new(&app_id, id as i64);
            let delta_err = |action, source| DeltaSinkError::Delta {
                table: self.at.to_string(),
                batch_id: id,
                action,
                source,
            };
            // A delete is a row with `_deleted` true; the others upsert (NULL: not a delete).
            let is_delete = qualified("s", DELETED).is_true();
            let upsert = qualified("s", DELETED).is_not_true();
            let builder = table
                .merge(source_df, predicate)
                .with_source_alias("s")
                .with_target_alias("t")
                .with_commit_properties(commit_properties().with_application_transaction(txn))
                .when_matched_update(|u| {
                    let u = match (&self.update_condition, deletes) {
                        (Some(sql), false) => u.predicate(sql.clone()),
                        (Some(sql), true) => {
                            u.predicate(format!("s.{} IS NOT TRUE AND ({sql})", quote(DELETED)))
                        }
                        (None, false) => u.predicate(guard.clone()),
                        (None, true) => u.predicate(upsert.clone().and(guard.clone())),
                    };
                    columns
                        .iter()
                        .fold(u, |u, c| u.update(c.as_str(), qualified("s", c)))
                })
                .map_err(|e| delta_err("planning the MERGE update", e))?;
            let builder = if deletes {
                // Unless the stored row is newer on the ordering column (NULL lowest).
                let stored_newer = qualified("t", &self.ordering).is_not_null().and(
                    qualified("s", &self.ordering)
                        .is_null()
                        .or(qualified("t", &self.ordering).gt(qualified("s", &self.ordering))),
                );
                builder
                    .when_matched_delete(|d| {
                        d.predicate(is_delete.and(std::ops::Not::not(stored_newer)))
                    })
                    .map_err(|e| delta_err("planning the MERGE delete", e))?
            } else {
                builder
            };
            let builder = builder
                .when_not_matched_insert(|i| {
                    let i = if deletes { i.predicate(upsert) } else { i };
                    columns
                        .iter()
                        .fold(i, |i, c| i.set(c.as_str(), qualified("s", c)))
                })
                .map_err(|e| delta_err("planning the MERGE insert", e))?;
            fault::hit(POINT_BEFORE_COMMIT, id).map_err(self.engine(id))?;
            let (table, metrics) = builder
                .await
                .map_err(|e| delta_err("running the MERGE", e))?;
            ctx.metrics.record(
                &sink,
                SinkMetric::Inserted,
                metrics.num_target_rows_inserted,
            );
            ctx.metrics
                .record(&sink, SinkMetric::Updated, metrics.num_target_rows_updated);
            if deletes {
                ctx.metrics
                    .record(&sink, SinkMetric::Deleted, metrics.num_target_rows_deleted);
            }
            if table.version() == before {
                // Nothing changed, so nothing was committed: record the transaction alone.
                commit(table, vec![RecordBatch::new_empty(schema)]).await?
            } else {
                fault::hit(POINT_AFTER_COMMIT, id).map_err(self.engine(id))?;
                table
            }
        };
        ctx.metrics.add_output_rows(rows as u64);
        note_version(ctx, &sink, &table);
        let table = self
            .compaction
            .after_commit(table, bytes, &self.at, id)
            .await?;
        self.table.put(table).await;
        Ok(())
    }

    /// `t.<col> IN (<distinct values of col in the batch>)`.
    fn prune_condition(
        &self,
        batches: &[RecordBatch],
        column: &str,
        id: u64,
    ) -> Result<Expr, DeltaSinkError> {
        let mut values: Vec<ScalarValue> = Vec::new();
        for b in batches {
            let idx = b
                .schema()
                .index_of(column)
                .map_err(|_| DeltaSinkError::Config {
                    table: self.at.to_string(),
                    key: "prune-by",
                    reason: format!("the batch has no column '{column}'"),
                })?;
            let arr = b.column(idx);
            for row in 0..b.num_rows() {
                let v = ScalarValue::try_from_array(arr, row)
                    .map_err(self.df_err(id, "reading prune values"))?;
                if !values.contains(&v) {
                    values.push(v);
                }
            }
        }
        Ok(qualified("t", column).in_list(values.into_iter().map(lit).collect(), false))
    }

    async fn refuse_duplicates(&self, batch: DataFrame, id: u64) -> Result<(), DeltaSinkError> {
        let keys: Vec<Expr> = self
            .keys
            .iter()
            .map(|k| Expr::Column(Column::new_unqualified(k)))
            .collect();
        let dup = batch
            .aggregate(keys, vec![count(lit(1)).alias("n")])
            .and_then(|d| d.filter(Expr::Column(Column::new_unqualified("n")).gt(lit(1i64))))
            .and_then(|d| d.limit(0, Some(1)))
            .map_err(self.df_err(id, "checking for duplicate keys"))?
            .collect()
            .await
            .map_err(self.df_err(id, "checking for duplicate keys"))?;
        let Some(b) = dup.iter().find(|b| b.num_rows() > 0) else {
            return Ok(());
        };
        let mut key = Vec::new();
        for (i, k) in self.keys.iter().enumerate() {
            let v = ScalarValue::try_from_array(b.column(i), 0)
                .map_err(self.df_err(id, "reading the key"))?;
            key.push(format!("{k}={v}"));
        }
        let n = ScalarValue::try_from_array(b.column(self.keys.len()), 0)
            .ok()
            .and_then(|v| match v {
                ScalarValue::Int64(Some(n)) => Some(n),
                _ => None,
            })
            .unwrap_or(2);
        Err(DeltaSinkError::DuplicateKey {
            table: self.at.to_string(),
            batch_id: id,
            key: key.join(", "),
            count: n,
        })
    }
}

fn qualified(alias: &str, name: &str) -> Expr {
    Expr::Column(Column::new(Some(alias), name))
}

/// `s` is greater than `t` in the lexicographic order of `columns`, NULL lowest:
/// `gt(c0) OR (eq(c0) AND (gt(c1) OR (eq(c1) AND ...)))`.
/// The rows of `batches` that are not deletes, without the `_deleted` column, and the
/// schema without it.
fn without_deletes(
    batches: &[RecordBatch],
    schema: &weir_core::datafusion::arrow::datatypes::SchemaRef,
) -> weir_core::datafusion::error::Result<(
    Vec<RecordBatch>,
    weir_core::datafusion::arrow::datatypes::SchemaRef,
)> {
    use weir_core::datafusion::arrow::array::{Array, AsArray, BooleanArray};
    use weir_core::datafusion::arrow::compute::filter_record_batch;
    let at = schema.index_of(DELETED)?;
    let keep: Vec<usize> = (0..schema.fields().len()).filter(|i| *i != at).collect();
    let stored = Arc::new(schema.project(&keep)?);
    let mut out = Vec::with_capacity(batches.len());
    for b in batches {
        let flags = b.column(at).as_boolean_opt().ok_or_else(|| {
            weir_core::datafusion::error::DataFusionError::Plan(format!(
                "column {DELETED} must be a boolean, not {}",
                b.column(at).data_type()
            ))
        })?;
        let upserts: BooleanArray = (0..flags.len())
            .map(|i| Some(flags.is_null(i) || !flags.value(i)))
            .collect();
        out.push(filter_record_batch(&b.project(&keep)?, &upserts)?);
    }
    Ok((out, stored))
}

pub(crate) fn newer(columns: &[String]) -> Expr {
    let gt = |c: &str| {
        qualified("s", c).is_not_null().and(
            qualified("t", c)
                .is_null()
                .or(qualified("s", c).gt(qualified("t", c))),
        )
    };
    let eq = |c: &str| {
        binary_expr(
            qualified("s", c),
            Operator::IsNotDistinctFrom,
            qualified("t", c),
        )
    };
    let mut expr: Option<Expr> = None;
    for c in columns.iter().rev() {
        expr = Some(match expr {
            None => gt(c),
            Some(rest) => gt(c).or(eq(c).and(rest)),
        });
    }
    expr.unwrap_or_else(|| lit(false))
}

#[async_trait]
impl ForeachBatch for DeltaMerge {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        Ok(self.merge(batch, &ctx, None).await?)
    }

    /// With the in-batch dedupe on, the batch's rows stay on the workers, which find the
    /// newest row of each key; the MERGE (delta-rs plans it over the table, in one process)
    /// runs here on those rows only.
    fn writes_on_workers(&self) -> bool {
        self.dedupe
    }

    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        Ok(self.merge(batch, &ctx, Some(run)).await?)
    }
}
