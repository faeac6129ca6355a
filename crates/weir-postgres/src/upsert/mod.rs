//! Upsert by key with an ordering guard, exactly once per batch.

mod on_workers;
mod rows;
mod sql;
mod tables;

pub use on_workers::{PG_STAGING, PgStagingExec, StagingWrite};

use async_trait::async_trait;
use tokio_postgres::Client;
use tokio_postgres::types::Type;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::{BatchContext, BoxError, ForeachBatch, dedupe_latest, fault};

use weir_core::sink::PlanRunner;
use weir_core::sink::upsert::apply_null_rules;
use weir_core::{NullKeys, NullOrdering, SinkMetric};

use crate::error::PostgresSinkError;
use crate::ledger::{Claim, Conn, claim};
use crate::types::{Cell, is_text, pg_type, prepare_columns};
use crate::{
    POINT_AFTER_COMMIT, POINT_AFTER_COPY, POINT_AFTER_STAGING, POINT_BEFORE_BEGIN,
    POINT_BEFORE_COMMIT, quote_ident, quote_list,
};

/// Bytes of COPY data encoded before they are handed to the connection.
const COPY_CHUNK: usize = 256 * 1024;

/// How rows reach the temp table inside the transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadMode {
    /// Binary `COPY ... FROM STDIN` (default, fastest).
    #[default]
    Copy,
    /// Multi-row `INSERT ... VALUES` with bind parameters, for servers or poolers without
    /// COPY support; slower (see the bench).
    Insert,
}

/// Upserts each batch into a PostgreSQL table by key, newest `ordering` wins, exactly once
/// per batch id. See the crate docs for the transaction it runs. Cheap to clone (clones
/// share the connection).
#[derive(Debug, Clone)]
pub struct PostgresUpsert {
    conn: std::sync::Arc<Conn>,
    table: String,
    keys: Vec<String>,
    ordering: String,
    ledger: String,
    app_id: Option<String>,
    dedupe: bool,
    create_table: bool,
    staging: Option<String>,
    load: LoadMode,
    allow_app_id_reuse: bool,
    null_keys: NullKeys,
    null_ordering: NullOrdering,
    /// The transaction [`ForeachBatch::stage`] left open, for the `call` of the same attempt.
    staged: std::sync::Arc<tokio::sync::Mutex<Option<Open>>>,
    /// The table (`create_table`) and the staging table exist: made or found by an earlier
    /// batch of this sink, so later batches skip the `CREATE .. IF NOT EXISTS` round trips
    /// (and the server's NOTICE that each logged).
    made: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// An attempt's transaction, open: the batch claimed in the ledger and its rows upserted
/// (or, for a batch that had landed, its staging rows cleared), not yet committed. It holds
/// the connection; dropped without [`Open::commit`], it is rolled back.
#[derive(Debug)]
struct Open {
    /// (run id, batch id) of the attempt.
    attempt: (u128, u64),
    guard: Option<tokio::sync::OwnedMutexGuard<Option<Client>>>,
    rows: usize,
    /// `false`: the ledger had the batch; committing only clears its staging rows.
    new: bool,
}

impl Open {
    async fn commit(mut self) -> Result<(), tokio_postgres::Error> {
        if let Some(client) = self.guard.as_mut().and_then(|g| g.as_mut()) {
            client.batch_execute("COMMIT").await?;
        }
        // Committed: nothing to roll back.
        self.guard = None;
        Ok(())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        // Not committed (an error, or a sink before this one failed): roll back before the
        // connection is used again; the task holds it until then. A client that cannot roll
        // back is dropped (the server ends its transaction) and the next use reconnects.
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            *guard = None;
            return;
        };
        rt.spawn(async move {
            let failed = match guard.as_mut() {
                Some(c) => c.batch_execute("ROLLBACK").await.is_err(),
                None => false,
            };
            if failed {
                *guard = None;
            }
        });
    }
}

/// A batch's rows checked and loaded as far as an attempt goes before its transaction.
#[derive(Debug)]
struct Loaded {
    cols: Columns,
    rows: usize,
    /// The rows for the transaction to load (empty when they are in the staging table).
    batches: Vec<crate::types::CopyRows>,
    /// The connection the load used, kept for the transaction.
    guard: tokio::sync::OwnedMutexGuard<Option<Client>>,
}

#[derive(Debug)]
struct Columns {
    names: Vec<String>,
    types: Vec<Type>,
    sql_types: Vec<String>,
    text: Vec<bool>,
}

impl Columns {
    /// The columns the table stores: all but `_deleted`.
    fn stored(&self) -> Columns {
        let keep: Vec<usize> = (0..self.names.len())
            .filter(|i| self.names[*i] != weir_core::sink::upsert::DELETED)
            .collect();
        Columns {
            names: keep.iter().map(|i| self.names[*i].clone()).collect(),
            types: keep.iter().map(|i| self.types[*i].clone()).collect(),
            sql_types: keep.iter().map(|i| self.sql_types[*i].clone()).collect(),
            text: keep.iter().map(|i| self.text[*i]).collect(),
        }
    }
}

impl PostgresUpsert {
    /// Upserts into `table` (may be `schema.table`) reached with `url` (libpq style:
    /// `host=.. port=.. user=.. dbname=..` or `postgresql://...`).
    pub fn new(
        url: impl Into<String>,
        table: impl Into<String>,
        keys: impl IntoIterator<Item = impl Into<String>>,
        ordering: impl Into<String>,
    ) -> Self {
        PostgresUpsert {
            conn: std::sync::Arc::new(Conn::new(url.into())),
            table: table.into(),
            keys: keys.into_iter().map(Into::into).collect(),
            ordering: ordering.into(),
            ledger: crate::DEFAULT_LEDGER.into(),
            app_id: None,
            dedupe: true,
            create_table: false,
            staging: None,
            load: LoadMode::Copy,
            allow_app_id_reuse: false,
            null_keys: NullKeys::Error,
            null_ordering: NullOrdering::Error,
            staged: Default::default(),
            made: Default::default(),
        }
    }

    /// Skip (with a warning) instead of failing when the ledger holds a batch of the app id
    /// that this query cannot have written.
    pub fn allow_app_id_reuse(mut self, yes: bool) -> Self {
        self.allow_app_id_reuse = yes;
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

    /// The target table.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The ledger key this sink uses for `query`: the default app id and the table, so two
    /// upserts of one query into one database do not hide each other.
    pub fn ledger_key(&self, query: &weir_core::connector::QueryIdentity) -> String {
        self.app_id
            .clone()
            .unwrap_or_else(|| format!("{}/{}", query.default_app_id(), self.table))
    }

    /// How rows reach the temp table (default binary COPY).
    pub fn load_mode(mut self, mode: LoadMode) -> Self {
        self.load = mode;
        self
    }

    /// The ledger table (default `weir_batches`, created if missing).
    pub fn ledger(mut self, name: impl Into<String>) -> Self {
        self.ledger = name.into();
        self
    }

    /// An explicit ledger key instead of `<query name>-<query id>/<table>`.
    pub fn app_id(mut self, id: impl Into<String>) -> Self {
        self.app_id = Some(id.into());
        self
    }

    /// Keep only the newest row per key of each batch (default on).
    pub fn dedupe(mut self, on: bool) -> Self {
        self.dedupe = on;
        self
    }

    /// Create the target table from the batch schema (primary key = the keys) if missing.
    pub fn create_table(mut self, on: bool) -> Self {
        self.create_table = on;
        // Not the flag of a sink this was cloned from, which may have made other tables.
        self.made = Default::default();
        self
    }

    /// The seed's variant: stage rows in this persistent table (cleared for the batch at the
    /// start of each attempt), then run the ledger transaction from it. For set-ups where
    /// the rows are loaded by another writer than the one that runs the upsert.
    pub fn staging_table(mut self, name: impl Into<String>) -> Self {
        self.staging = Some(name.into());
        self.made = Default::default();
        self
    }

    /// The sink's name in progress and errors.
    pub fn label(&self) -> String {
        format!("postgres-upsert {}", self.table)
    }

    fn db(
        &self,
        batch_id: u64,
        action: &'static str,
    ) -> impl Fn(tokio_postgres::Error) -> PostgresSinkError + '_ {
        move |source| PostgresSinkError::Db {
            table: self.table.clone(),
            batch_id,
            action,
            source,
        }
    }

    fn engine(&self, batch_id: u64) -> impl Fn(weir_core::Error) -> PostgresSinkError + '_ {
        move |source| PostgresSinkError::Engine {
            table: self.table.clone(),
            batch_id,
            source,
        }
    }

    /// Maps every column before anything is written; an unsupported type is refused.
    fn columns(&self, schema: &SchemaRef) -> Result<Columns, PostgresSinkError> {
        let mut c = Columns {
            names: Vec::new(),
            types: Vec::new(),
            sql_types: Vec::new(),
            text: Vec::new(),
        };
        for f in schema.fields() {
            let (t, s) =
                pg_type(f.data_type()).ok_or_else(|| PostgresSinkError::UnsupportedType {
                    table: self.table.clone(),
                    column: f.name().clone(),
                    data_type: f.data_type().to_string(),
                })?;
            c.names.push(f.name().clone());
            c.types.push(t);
            c.sql_types.push(s);
            c.text.push(is_text(f.data_type()));
        }
        let wanted = self.keys.iter().map(|k| ("keys", k));
        for (key, k) in wanted.chain([("ordering", &self.ordering)]) {
            if !c.names.contains(k) {
                return Err(PostgresSinkError::Config {
                    table: self.table.clone(),
                    key,
                    reason: format!(
                        "the batch has no column '{k}' (columns: {})",
                        c.names.join(", ")
                    ),
                });
            }
        }
        Ok(c)
    }

    /// What every attempt does before its transaction: checks and prepares the rows, makes
    /// the tables, and in the staging variant clears and loads the batch's staging rows.
    async fn load(
        &self,
        batch: DataFrame,
        ctx: &BatchContext,
    ) -> Result<Loaded, PostgresSinkError> {
        let id = ctx.batch_id;
        self.check_keys()?;
        let sink = self.label();
        let cols = self.columns(batch.schema().inner())?;
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
        if dropped > 0 {
            ctx.metrics.record(&sink, SinkMetric::Dropped, dropped);
        }
        let source = if self.dedupe {
            dedupe_latest(batch, &self.keys, &self.ordering).map_err(self.engine(id))?
        } else {
            batch
        };
        let batches: Vec<RecordBatch> =
            source
                .collect()
                .await
                .map_err(|source| PostgresSinkError::DataFusion {
                    table: self.table.clone(),
                    batch_id: id,
                    action: "computing the batch",
                    source,
                })?;
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        // Every value is checked before anything is written.
        let batches = batches
            .iter()
            .map(|b| prepare_columns(b.columns(), &cols.names))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|(column, reason)| PostgresSinkError::BadValue {
                table: self.table.clone(),
                batch_id: id,
                column,
                reason,
            })?;
        let app_id = self.ledger_key(&ctx.query());
        let mut guard = self
            .conn
            .get(&self.ledger)
            .await
            .map_err(self.db(id, "connecting"))?;
        let client = guard
            .as_mut()
            .ok_or_else(|| PostgresSinkError::no_connection(&self.table))?;
        if self.staging.is_some() {
            self.check_staging_names(&cols)?;
        }
        self.make_tables(client, &cols, self.staging.as_deref(), id)
            .await?;
        let list = quote_list(&cols.names);
        if let Some(staging) = &self.staging {
            // The seed's variant: stage outside the transaction, cleared per attempt.
            let st = quote_ident(staging);
            let clear = format!("DELETE FROM {st} WHERE weir_app_id = $1 AND weir_batch_id = $2");
            client
                .execute(&clear, &[&app_id, &(id as i64)])
                .await
                .map_err(self.db(id, "clearing the batch's staging rows"))?;
            let copy = format!(
                "COPY {st} ({list}, weir_app_id, weir_batch_id) FROM STDIN (FORMAT binary)"
            );
            let action = "COPY into the staging table";
            let sink = client.copy_in(&copy).await.map_err(self.db(id, action))?;
            let extra = [Cell::Text(&app_id), Cell::I64(id as i64)];
            self.copy_rows(id, action, sink, &cols, &batches, &extra)
                .await?;
            fault::hit(POINT_AFTER_STAGING, id).map_err(self.engine(id))?;
        }
        Ok(Loaded {
            cols,
            rows,
            batches: if self.staging.is_some() {
                Vec::new()
            } else {
                batches
            },
            guard,
        })
    }

    async fn upsert(&self, batch: DataFrame, ctx: &BatchContext) -> Result<(), PostgresSinkError> {
        let id = ctx.batch_id;
        // Opened beside the sinks before this one (a fan-out), or now.
        let staged = self.staged.lock().await.take();
        let open = match staged.filter(|o| o.attempt == (ctx.run_id.as_u128(), id)) {
            Some(o) => o,
            None => self.open(batch, ctx).await?,
        };
        // Killed here, the open transaction (ledger row included) is rolled back.
        fault::hit(POINT_BEFORE_COMMIT, id).map_err(self.engine(id))?;
        let (rows, new) = (open.rows, open.new);
        open.commit().await.map_err(self.db(id, "COMMIT"))?;
        fault::hit(POINT_AFTER_COMMIT, id).map_err(self.engine(id))?;
        if new {
            ctx.metrics.add_output_rows(rows as u64);
        } else {
            tracing::info!(table = %self.table, "batch {id} skipped: the ledger {} already has it", self.ledger);
            ctx.metrics.add_skipped(&self.label());
        }
        Ok(())
    }

    /// Everything of an attempt but its COMMIT: load the rows, BEGIN, claim the batch in
    /// the ledger, upsert (or, for a batch that landed, clear its staging rows).
    async fn open(&self, batch: DataFrame, ctx: &BatchContext) -> Result<Open, PostgresSinkError> {
        let opened = self.open_tx(batch, ctx).await;
        if let Err(PostgresSinkError::Db { .. }) = &opened {
            // A table dropped meanwhile (or any failed statement): the next attempt makes the
            // tables again if they are missing.
            self.made.store(false, std::sync::atomic::Ordering::Release);
        }
        opened
    }

    async fn open_tx(
        &self,
        batch: DataFrame,
        ctx: &BatchContext,
    ) -> Result<Open, PostgresSinkError> {
        let id = ctx.batch_id;
        let Loaded {
            cols,
            rows,
            batches,
            guard,
        } = self.load(batch, ctx).await?;
        let list = quote_list(&cols.names);
        let app_id = self.ledger_key(&ctx.query());
        fault::hit(POINT_BEFORE_BEGIN, id).map_err(self.engine(id))?;
        let mut open = Open {
            attempt: (ctx.run_id.as_u128(), id),
            guard: Some(guard),
            rows,
            new: true,
        };
        let client = open
            .guard
            .as_mut()
            .and_then(|g| g.as_mut())
            .ok_or_else(|| PostgresSinkError::no_connection(&self.table))?;
        // From here on, an error drops `open`, which rolls back.
        client
            .batch_execute("BEGIN")
            .await
            .map_err(self.db(id, "BEGIN"))?;
        let claimed = claim(&*client, &self.ledger, &app_id, id, rows as i64)
            .await
            .map_err(self.db(id, "claiming the batch in the ledger"))?;
        if claimed != Claim::New {
            self.landed_before(claimed, id, ctx.is_replay, &app_id)?;
            if let Some(staging) = &self.staging {
                let clear = format!(
                    "DELETE FROM {} WHERE weir_app_id = $1 AND weir_batch_id = $2",
                    quote_ident(staging)
                );
                client
                    .execute(&clear, &[&app_id, &(id as i64)])
                    .await
                    .map_err(self.db(id, "clearing the batch's staging rows"))?;
            }
            open.new = false;
            return Ok(open);
        }
        self.write_in_tx(client, &cols, &batches, &list, &app_id, id)
            .await?;
        Ok(open)
    }

    async fn write_in_tx(
        &self,
        tx: &Client,
        cols: &Columns,
        batches: &[crate::types::CopyRows],
        list: &str,
        app_id: &str,
        id: u64,
    ) -> Result<(), PostgresSinkError> {
        let sql = match &self.staging {
            Some(staging) => {
                let filter = " WHERE weir_app_id = $1 AND weir_batch_id = $2";
                for sql in self.apply_sql(cols, &quote_ident(staging), filter) {
                    tx.execute(&sql, &[&app_id, &(id as i64)])
                        .await
                        .map_err(self.db(id, "upserting from the staging table"))?;
                }
                format!(
                    "DELETE FROM {} WHERE weir_app_id = $1 AND weir_batch_id = $2",
                    quote_ident(staging)
                )
            }
            None => {
                let temp = "weir_stage";
                tx.batch_execute(&format!(
                    "CREATE TEMP TABLE {temp} ({}) ON COMMIT DROP",
                    Self::column_defs(cols)
                ))
                .await
                .map_err(self.db(id, "creating the temp table"))?;
                match self.load {
                    LoadMode::Copy => {
                        let copy = format!("COPY {temp} ({list}) FROM STDIN (FORMAT binary)");
                        let action = "COPY into the temp table";
                        let sink = tx.copy_in(&copy).await.map_err(self.db(id, action))?;
                        self.copy_rows(id, action, sink, cols, batches, &[]).await?;
                    }
                    LoadMode::Insert => Self::insert_rows(tx, temp, list, cols, batches)
                        .await
                        .map_err(self.db(id, "INSERT into the temp table"))?,
                }
                fault::hit(POINT_AFTER_COPY, id).map_err(self.engine(id))?;
                for sql in self.apply_sql(cols, temp, "") {
                    tx.execute(&sql, &[])
                        .await
                        .map_err(self.db(id, "upserting"))?;
                }
                return Ok(());
            }
        };
        tx.execute(&sql, &[&app_id, &(id as i64)])
            .await
            .map_err(self.db(id, "clearing the batch's staging rows"))?;
        Ok(())
    }
}

#[async_trait]
impl ForeachBatch for PostgresUpsert {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        self.upsert(batch, &ctx)
            .await
            .map_err(PostgresSinkError::boxed)
    }

    /// Everything but the COMMIT, beside the sinks before this one in a fan-out: rows
    /// loaded, ledger claimed and upsert run in a transaction left open; `call` commits it
    /// after them, so this table still changes after theirs, and a failure before that rolls
    /// it back.
    async fn stage(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        // One left by an attempt that never reached its call is rolled back first.
        drop(self.staged.lock().await.take());
        let open = self
            .open(batch, &ctx)
            .await
            .map_err(PostgresSinkError::boxed)?;
        *self.staged.lock().await = Some(open);
        Ok(())
    }

    /// Binary COPY works from tasks; the `insert` load (for servers or poolers without
    /// COPY) stays in this process.
    fn writes_on_workers(&self) -> bool {
        self.load == LoadMode::Copy
    }

    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        self.upsert_on_workers(batch, &ctx, run)
            .await
            .map_err(PostgresSinkError::boxed)
    }

    async fn discard(&self, ctx: BatchContext) {
        let mut staged = self.staged.lock().await;
        if staged
            .as_ref()
            .is_some_and(|o| o.attempt == (ctx.run_id.as_u128(), ctx.batch_id))
        {
            // Rolled back on drop.
            *staged = None;
        }
    }
}
