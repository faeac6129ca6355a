//! The tables an upsert writes besides its target's rows: the target made from the batch
//! (`create_table`), the staging table kept in the batch's shape, and the checks that keep
//! a batch from clashing with them or with the ledger.

use tokio_postgres::Client;
use weir_core::sink::recorded::Recorded;

use super::{Columns, PostgresUpsert, on_workers};
use crate::error::PostgresSinkError;
use crate::ledger::{Claim, create_if_missing};
use crate::{quote_ident, quote_list};

impl PostgresUpsert {
    pub(super) fn check_keys(&self) -> Result<(), PostgresSinkError> {
        if self.keys.is_empty() {
            return Err(PostgresSinkError::Config {
                table: self.table.clone(),
                key: "keys",
                reason: "an upsert needs at least one key column".into(),
            });
        }
        Ok(())
    }

    /// The target table (with `create_table`) and the staging table, unless an earlier
    /// batch of this sink made or found them.
    pub(super) async fn make_tables(
        &self,
        client: &Client,
        cols: &Columns,
        staging: Option<&str>,
        id: u64,
    ) -> Result<(), PostgresSinkError> {
        if self.made.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        if self.create_table {
            let keys = quote_list(&self.keys);
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({keys}))",
                quote_ident(&self.table),
                Self::column_defs(&cols.stored())
            );
            create_if_missing(client, &sql)
                .await
                .map_err(self.db(id, "creating the table"))?;
        }
        if let Some(staging) = staging {
            self.make_staging(client, cols, staging, id).await?;
        }
        self.made.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The staging table with the batch's columns and its own (`weir_app_id`,
    /// `weir_batch_id`, `weir_task`). Its rows only live from an attempt to its commit, so
    /// one of another shape (made for an earlier version of the query) is made again.
    async fn make_staging(
        &self,
        client: &Client,
        cols: &Columns,
        staging: &str,
        id: u64,
    ) -> Result<(), PostgresSinkError> {
        let st = quote_ident(staging);
        let defs = format!(
            "{}, weir_app_id text NOT NULL, weir_batch_id bigint NOT NULL, weir_task text",
            Self::column_defs(cols)
        );
        // UNLOGGED: staging rows are cleared on every attempt anyway, so they need no WAL
        // (a server crash empties the table, which is harmless).
        let create = format!("CREATE UNLOGGED TABLE IF NOT EXISTS {st} ({defs})");
        let made = self.db(id, "creating the staging table");
        create_if_missing(client, &create).await.map_err(&made)?;
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS pg_temp.weir_shape; CREATE TEMP TABLE weir_shape ({defs})"
            ))
            .await
            .map_err(&made)?;
        let cols_of = |rel: &str| {
            format!(
                "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = {rel} \
                 AND attnum > 0 AND NOT attisdropped"
            )
        };
        let (want, have) = (
            cols_of("'pg_temp.weir_shape'::regclass"),
            cols_of("to_regclass($1)"),
        );
        let differ: i64 = client
            .query_one(
                &format!(
                    "SELECT count(*) FROM (({want} EXCEPT {have}) UNION ALL ({have} EXCEPT {want})) d"
                ),
                &[&st],
            )
            .await
            .map_err(self.db(id, "checking the staging table's columns"))?
            .get(0);
        client
            .batch_execute("DROP TABLE pg_temp.weir_shape")
            .await
            .map_err(&made)?;
        if differ > 0 {
            tracing::warn!(
                table = %self.table,
                "the staging table {staging} has other columns than the batch's (made for an \
                 earlier version of the query?): making it again"
            );
            client
                .batch_execute(&format!("DROP TABLE IF EXISTS {st}"))
                .await
                .map_err(&made)?;
            create_if_missing(client, &create).await.map_err(&made)?;
        }
        Ok(())
    }

    /// The batch has none of the staging table's own columns.
    pub(super) fn check_staging_names(&self, cols: &Columns) -> Result<(), PostgresSinkError> {
        match cols
            .names
            .iter()
            .find(|n| on_workers::STAGING_COLUMNS.contains(&n.as_str()))
        {
            Some(n) => Err(PostgresSinkError::Config {
                table: self.table.clone(),
                key: "columns",
                reason: format!(
                    "the batch has a column '{n}', a name the staging table keeps for itself \
                     ({}); rename it in the query",
                    on_workers::STAGING_COLUMNS.join(", ")
                ),
            }),
            None => Ok(()),
        }
    }

    /// The ledger has a row for the batch (or a later one): fine for a replay of this
    /// query's batch; otherwise the rows were written by another query with the same ledger
    /// key, which is an error unless `allow_app_id_reuse`.
    pub(super) fn landed_before(
        &self,
        claimed: Claim,
        id: u64,
        is_replay: bool,
        app_id: &str,
    ) -> Result<(), PostgresSinkError> {
        // Only a replay can find its own ledger row, and nothing of this query can be
        // beyond the batch.
        let Recorded::NotOurs(recorded) = claimed.decide(id, is_replay) else {
            return Ok(());
        };
        if !self.allow_app_id_reuse {
            return Err(PostgresSinkError::AppIdInUse {
                table: self.table.clone(),
                batch_id: id,
                ledger: self.ledger.clone(),
                app_id: app_id.to_string(),
                recorded,
            });
        }
        tracing::warn!(
            table = %self.table,
            "batch {id} skipped: the ledger {} holds batch {recorded} for app id \
             '{app_id}' (allow-app-id-reuse is on)",
            self.ledger
        );
        Ok(())
    }
}
