//! The ledger: one row per (app id, batch id) written in the same transaction as the data.

use futures::future::BoxFuture;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Transaction};
use weir_core::sink::recorded::{Recorded, decide};
use weir_core::{BatchContext, BoxError};

use crate::error::PostgresSinkError;
use crate::quote_ident;

/// A client of the server at `url`, its connection driven on a task of its own (which
/// ends when the client is dropped; how it ended is logged at debug level).
pub(crate) async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("PostgreSQL connection ended: {e}");
        }
    });
    Ok(client)
}

/// A connection that reconnects when the server dropped it.
pub(crate) struct Conn {
    url: String,
    client: std::sync::Arc<Mutex<Option<Client>>>,
}

impl Conn {
    pub(crate) fn new(url: String) -> Self {
        Conn {
            url,
            client: Default::default(),
        }
    }

    /// The server, as given (may hold a password: never shown).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// A live client (connecting if there is none or it closed). A new connection first
    /// creates `ledger` if it is missing, so batches do not pay for that statement.
    pub(crate) async fn get(
        &self,
        ledger: &str,
    ) -> Result<tokio::sync::OwnedMutexGuard<Option<Client>>, tokio_postgres::Error> {
        let mut guard = self.client.clone().lock_owned().await;
        if guard.as_ref().is_none_or(Client::is_closed) {
            let client = connect(&self.url).await?;
            // Timestamps are UTC instants: a `timestamp` column gets UTC wall time, never
            // the server's local time.
            client.batch_execute("SET TIME ZONE 'UTC'").await?;
            create_if_missing(&client, &create_ledger_sql(ledger)).await?;
            *guard = Some(client);
        }
        Ok(guard)
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.write_str("Conn(..)")
    }
}

/// Runs a `CREATE .. IF NOT EXISTS`. Two sessions creating the same table at once can both
/// pass the check; the loser then fails on the catalog's unique index although the table
/// is there, which is what it wanted.
pub(crate) async fn create_if_missing(
    client: &Client,
    sql: &str,
) -> Result<(), tokio_postgres::Error> {
    use tokio_postgres::error::SqlState;
    match client.batch_execute(sql).await {
        Err(e)
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION)
                || e.code() == Some(&SqlState::DUPLICATE_TABLE) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// `CREATE TABLE IF NOT EXISTS <ledger> (...)`.
fn create_ledger_sql(ledger: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (app_id text NOT NULL, batch_id bigint NOT NULL, \
         rows bigint NOT NULL, done_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (app_id, batch_id))",
        quote_ident(ledger)
    )
}

/// Ledger rows kept per app id: those of the newest this many batches. The transaction that
/// claims a batch deletes the rows of older ones, so the ledger stays bounded however long
/// the query runs. A replay only ever looks for the newest batch, and another query's rows
/// are told apart by their being beyond the batch (as Delta's application version is).
pub const LEDGER_KEEP_BATCHES: u64 = 1_000;

/// What the ledger said to a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// This transaction is the first to write the batch.
    New,
    /// The batch already landed.
    Landed,
    /// A later batch is recorded for the app id: not this query's (nothing claimed).
    Later(u64),
}

impl Claim {
    /// What the sink does with batch `batch_id` after this answer: write it (claimed), skip
    /// a replay of a batch that landed, or refuse a record that cannot be this query's.
    pub(crate) fn decide(self, batch_id: u64, is_replay: bool) -> Recorded {
        let recorded = match self {
            Claim::New => return Recorded::Write,
            Claim::Landed => batch_id,
            Claim::Later(n) => n,
        };
        decide(Some(recorded), batch_id, is_replay)
    }
}

/// Claims (app id, batch id) in the ledger inside `tx`, and deletes the rows of the app id's
/// batches older than [`LEDGER_KEEP_BATCHES`], at most 1,000 a batch (a ledger written by an
/// older weir, one row per batch ever, shrinks over a few batches instead of in one long
/// transaction): one statement, one round trip.
pub(crate) async fn claim(
    tx: &(impl tokio_postgres::GenericClient + Sync),
    ledger: &str,
    app_id: &str,
    batch_id: u64,
    rows: i64,
) -> Result<Claim, tokio_postgres::Error> {
    let l = quote_ident(ledger);
    let sql = format!(
        "WITH newest AS (SELECT max(batch_id) AS m FROM {l} WHERE app_id = $1), \
         ins AS (INSERT INTO {l} (app_id, batch_id, rows) SELECT $1, $2, $3 \
                 WHERE coalesce((SELECT m FROM newest), -1) <= $2 \
                 ON CONFLICT DO NOTHING RETURNING 1), \
         del AS (DELETE FROM {l} WHERE ctid IN (SELECT ctid FROM {l} \
                 WHERE app_id = $1 AND batch_id <= $2 - $4 LIMIT 1000) \
                 AND EXISTS (SELECT 1 FROM ins)) \
         SELECT (SELECT m FROM newest), (SELECT count(*) FROM ins)"
    );
    let id = batch_id as i64;
    let keep = LEDGER_KEEP_BATCHES as i64;
    let row = tx.query_one(&sql, &[&app_id, &id, &rows, &keep]).await?;
    let newest: Option<i64> = row.get(0);
    let inserted: i64 = row.get(1);
    Ok(match newest {
        _ if inserted == 1 => Claim::New,
        Some(n) if n > id => Claim::Later(n as u64),
        _ => Claim::Landed,
    })
}

/// Makes any transactional SQL exactly-once per batch: the ledger row and your statements
/// commit together, and a replayed batch finds its ledger row and runs nothing.
#[derive(Debug)]
pub struct PostgresLedger {
    conn: Conn,
    ledger: String,
    app_id: Option<String>,
}

impl PostgresLedger {
    /// A ledger table (created if missing) reached with `url`.
    pub fn new(url: impl Into<String>, ledger: impl Into<String>) -> Self {
        PostgresLedger {
            conn: Conn::new(url.into()),
            ledger: ledger.into(),
            app_id: None,
        }
    }

    /// An explicit application id instead of the query name plus query id.
    pub fn app_id(mut self, id: impl Into<String>) -> Self {
        self.app_id = Some(id.into());
        self
    }

    /// Runs `f` in a transaction that also claims the batch in the ledger. `f` returns the
    /// number of rows it wrote (recorded in the ledger). Returns `Ok(false)` without calling
    /// `f` when the batch already landed; an error from `f` rolls everything back.
    pub async fn run_once<F>(&self, ctx: &BatchContext, f: F) -> Result<bool, PostgresSinkError>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<u64, BoxError>>,
    {
        let id = ctx.batch_id;
        let db = |action, source| PostgresSinkError::Db {
            table: self.ledger.clone(),
            batch_id: id,
            action,
            source,
        };
        let app_id = self.app_id.clone().unwrap_or_else(|| ctx.app_id());
        let mut guard = self
            .conn
            .get(&self.ledger)
            .await
            .map_err(|e| db("connecting", e))?;
        let client = guard
            .as_mut()
            .ok_or_else(|| PostgresSinkError::no_connection(&self.ledger))?;
        let tx = client.transaction().await.map_err(|e| db("BEGIN", e))?;
        let claimed = claim(&tx, &self.ledger, &app_id, id, 0)
            .await
            .map_err(|e| db("claiming the batch", e))?;
        if claimed != Claim::New {
            let recorded = match claimed.decide(id, ctx.is_replay) {
                Recorded::NotOurs(n) => n,
                _ => {
                    tx.commit().await.map_err(|e| db("COMMIT", e))?;
                    ctx.metrics
                        .add_skipped(&format!("postgres-ledger {}", self.ledger));
                    return Ok(false);
                }
            };
            return Err(PostgresSinkError::AppIdInUse {
                table: self.ledger.clone(),
                batch_id: id,
                ledger: self.ledger.clone(),
                app_id,
                recorded,
            });
        }
        let rows = f(&tx).await.map_err(|source| PostgresSinkError::User {
            ledger: self.ledger.clone(),
            batch_id: id,
            source,
        })?;
        let sql = format!(
            "UPDATE {} SET rows = $3 WHERE app_id = $1 AND batch_id = $2",
            quote_ident(&self.ledger)
        );
        tx.execute(&sql, &[&app_id, &(id as i64), &(rows as i64)])
            .await
            .map_err(|e| db("recording the row count", e))?;
        tx.commit().await.map_err(|e| db("COMMIT", e))?;
        ctx.metrics.add_output_rows(rows);
        Ok(true)
    }
}
