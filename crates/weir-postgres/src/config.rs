//! The PostgreSQL upsert in a pipeline file, and its reader for checks.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use weir_core::connector::{
    BuildEnv, QueryIdentity, Relocation, SinkConnector, SinkHarness, SinkShape, SinkSpec,
    SinkVerifier, Verdict, secret,
};
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::source::decode;
use weir_core::{Error, ForeachBatch, NullKeys, NullOrdering, Result};

use crate::{LoadMode, PostgresUpsert, quote_ident, upsert_points};

/// The ledger table when none is given.
pub const DEFAULT_LEDGER: &str = "weir_batches";

/// `[[sink]] type = "postgres-upsert"`.
///
/// ```toml
/// [[sink]]
/// type = "postgres-upsert"
/// url = "env:DATABASE_URL"          # libpq form or postgresql:// URL; env:NAME reads it
/// table = "orders"
/// keys = ["order_id"]
/// ordering = "updated_at"
/// create-table = true
/// staging-table = "orders_staging"  # optional: the seed's persistent staging variant
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PostgresUpsertConfig {
    /// libpq form (`host=.. port=.. user=.. dbname=..`) or a `postgresql://` URL; `env:NAME`
    /// reads it from an environment variable (keeps passwords out of files).
    pub url: String,
    pub table: String,
    pub keys: Vec<String>,
    pub ordering: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_app_id_reuse: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedupe: Option<bool>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub create_table: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_table: Option<String>,
    /// `copy` (default) or `insert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub null_keys: Option<NullKeys>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub null_ordering: Option<NullOrdering>,
}

/// How rows reach the server, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadName {
    Copy,
    Insert,
}

impl PostgresUpsertConfig {
    /// The sink, configured.
    pub fn sink(&self) -> Result<PostgresUpsert> {
        if self.keys.is_empty() {
            return Err(Error::config(
                "sink.keys",
                "an upsert needs at least one key column",
            ));
        }
        if let Some(st) = &self.staging_table
            && (st == &self.table || *st == self.ledger_name())
        {
            return Err(Error::config(
                "sink.staging-table",
                format!(
                    "'{st}' is the sink's table or its ledger; the staging table is weir's \
                     own (its rows are deleted after each batch): name another table"
                ),
            ));
        }
        let url = secret("sink.url", &self.url)?;
        let mut p = PostgresUpsert::new(url, &self.table, self.keys.clone(), &self.ordering)
            .dedupe(self.dedupe.unwrap_or(true))
            .create_table(self.create_table)
            .allow_app_id_reuse(self.allow_app_id_reuse)
            .null_keys(self.null_keys.unwrap_or_default())
            .null_ordering(self.null_ordering.unwrap_or_default())
            .load_mode(match self.load {
                None | Some(LoadName::Copy) => LoadMode::Copy,
                Some(LoadName::Insert) => LoadMode::Insert,
            });
        if let Some(l) = &self.ledger {
            p = p.ledger(l);
        }
        if let Some(a) = &self.app_id {
            p = p.app_id(a);
        }
        if let Some(s) = &self.staging_table {
            p = p.staging_table(s);
        }
        Ok(p)
    }

    fn ledger_name(&self) -> String {
        self.ledger.clone().unwrap_or_else(|| DEFAULT_LEDGER.into())
    }
}

#[async_trait]
impl SinkSpec for PostgresUpsertConfig {
    /// Connects (10 s at most), and says the server's version and whether the table and
    /// the ledger are there; a missing table without `create-table` is an error.
    async fn probe(&self, _env: &BuildEnv) -> Result<String> {
        let what = format!("postgres-upsert {}", self.table);
        let url = secret("sink.url", &self.url)?;
        let unreachable = |e: Box<dyn std::error::Error + Send + Sync>| Error::Unreachable {
            what: what.clone(),
            source: e,
        };
        let client = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            crate::ledger::connect(&url),
        )
        .await
        .map_err(|_| unreachable("no answer to the connection in 10 s".into()))?
        .map_err(|e| unreachable(e.into()))?;
        let version: String = client
            .query_one("SHOW server_version", &[])
            .await
            .map_err(|e| unreachable(e.into()))?
            .get(0);
        let exists = |name: String| {
            let client = &client;
            async move {
                client
                    .query_one("SELECT to_regclass($1)::text", &[&name])
                    .await
                    .map(|r| r.get::<_, Option<String>>(0).is_some())
            }
        };
        let table = exists(self.table.clone())
            .await
            .map_err(|e| unreachable(e.into()))?;
        let ledger = exists(self.ledger_name())
            .await
            .map_err(|e| unreachable(e.into()))?;
        if !table && !self.create_table {
            return Err(Error::config(
                "sink.table",
                format!(
                    "the table {} does not exist in the database (PostgreSQL {version}); \
                     create it, or set create-table = true",
                    self.table
                ),
            ));
        }
        Ok(format!(
            "PostgreSQL {version}; table {} {}; ledger {} {}",
            self.table,
            if table {
                "exists"
            } else {
                "is created at the first batch"
            },
            self.ledger_name(),
            if ledger {
                "exists"
            } else {
                "is created at the first batch"
            },
        ))
    }

    fn label(&self, _env: &BuildEnv) -> String {
        format!("postgres-upsert {}", self.table)
    }

    fn build(&self, _env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>> {
        Ok(Arc::new(self.sink()?))
    }

    fn app_id(&self, query: &QueryIdentity) -> Option<String> {
        self.sink().ok().map(|s| s.ledger_key(query))
    }

    fn shape(&self) -> SinkShape {
        SinkShape::Upsert {
            keys: self.keys.clone(),
            ordering: self.ordering.clone(),
        }
    }
}

impl SinkHarness for PostgresUpsertConfig {
    fn fault_points(&self) -> Vec<&'static str> {
        upsert_points(self.staging_table.is_some())
    }

    fn relocate(&mut self, to: &Relocation) -> Result<()> {
        let url = to.postgres.clone().ok_or_else(|| {
            Error::config(
                "sink.url",
                "this pipeline writes to PostgreSQL: give a server (--postgres or DATABASE_URL)",
            )
        })?;
        self.url = url;
        self.table = format!("{}orders_{}", to.prefix, to.index);
        self.ledger = Some(format!("{}batches", to.prefix));
        self.create_table = true;
        if self.staging_table.is_some() {
            self.staging_table = Some(format!("{}staging_{}", to.prefix, to.index));
        }
        Ok(())
    }

    fn verifier(&self, _env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>> {
        Ok(Some(Box::new(PostgresReader {
            url: secret("sink.url", &self.url)?,
            config: self.clone(),
        })))
    }
}

impl SinkConnector for PostgresUpsertConfig {
    const KIND: &'static str = "postgres-upsert";
}

/// Reads a PostgreSQL table back (every row as JSON, decoded into the expected schema) and
/// checks the ledger and the staging table.
pub struct PostgresReader {
    url: String,
    config: PostgresUpsertConfig,
}

impl PostgresReader {
    async fn client(&self) -> Result<tokio_postgres::Client> {
        crate::ledger::connect(&self.url)
            .await
            .map_err(|e| Error::from_source(format!("postgres {}", self.config.table), e))
    }

    fn err(&self, e: tokio_postgres::Error) -> Error {
        Error::from_source(format!("postgres {}", self.config.table), e)
    }
}

#[async_trait]
impl SinkVerifier for PostgresReader {
    async fn rows(&self, schema: &SchemaRef) -> Result<Vec<RecordBatch>> {
        let client = self.client().await?;
        let sql = format!(
            "SELECT row_to_json(t)::text FROM {} t",
            quote_ident(&self.config.table)
        );
        let rows = client.query(&sql, &[]).await.map_err(|e| self.err(e))?;
        let mut buf = Vec::new();
        for r in &rows {
            let line: String = r.try_get(0).map_err(|e| self.err(e))?;
            buf.extend_from_slice(line.as_bytes());
            buf.push(b'\n');
        }
        let batch =
            decode::json_all(schema, &buf, Some(rows.len())).map_err(|e| Error::Internal {
                what: format!("decoding the rows of {}: {e}", self.config.table),
            })?;
        Ok(vec![batch])
    }

    async fn check_bookkeeping(&self, query: &QueryIdentity, committed: u64) -> Result<Verdict> {
        let mut v = Verdict::default();
        let what = format!("postgres {}", self.config.table);
        let client = self.client().await?;
        let ledger = self.config.ledger_name();
        let app = self.config.sink()?.ledger_key(query);
        let ids: Vec<i64> = client
            .query(
                &format!(
                    "SELECT batch_id FROM {} WHERE app_id = $1 ORDER BY batch_id",
                    quote_ident(&ledger)
                ),
                &[&app],
            )
            .await
            .map_err(|e| self.err(e))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // The ledger keeps the newest LEDGER_KEEP_BATCHES batches per app id.
        let first = committed.saturating_sub(crate::LEDGER_KEEP_BATCHES);
        let want: Vec<i64> = (first as i64..committed as i64).collect();
        if ids != want {
            v.mismatches.push(format!(
                "{what}: ledger {ledger} has {} rows for {app}, expected batches {first}..{committed} once each",
                ids.len()
            ));
        }
        v.notes.push(format!("{what}: ledger {} rows", ids.len()));
        if let Some(st) = &self.config.staging_table {
            let left: i64 = client
                .query_one(&format!("SELECT count(*) FROM {}", quote_ident(st)), &[])
                .await
                .map_err(|e| self.err(e))?
                .get(0);
            if left != 0 {
                v.mismatches
                    .push(format!("{what}: {left} rows left in staging table {st}"));
            }
        }
        Ok(v)
    }

    async fn reset(&self) -> Result<()> {
        let client = self.client().await?;
        let tables = [
            Some(self.config.table.clone()),
            self.config.staging_table.clone(),
            Some(self.config.ledger_name()),
        ];
        for t in tables.into_iter().flatten() {
            client
                .batch_execute(&format!("DROP TABLE IF EXISTS {}", quote_ident(&t)))
                .await
                .map_err(|e| self.err(e))?;
        }
        Ok(())
    }
}
