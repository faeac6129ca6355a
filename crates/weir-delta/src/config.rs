//! The Delta sinks in a pipeline file, and their reader for checks.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use weir_core::connector::{
    BuildEnv, DurationText, QueryIdentity, Relocation, SinkConnector, SinkHarness, SinkShape,
    SinkSpec, SinkVerifier, Verdict,
};
use weir_core::datafusion::arrow::compute::cast;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::SessionContext;
use weir_core::storage::Location;
use weir_core::{Error, ForeachBatch, NullKeys, NullOrdering, Result};

use crate::table::{data_commits, read_table, recorded_version, table_version};
use crate::{DELTA_POINTS, DeltaAppend, DeltaMerge};

/// `[[sink]] type = "delta-append"`.
///
/// ```toml
/// [[sink]]
/// type = "delta-append"
/// path = "orders_raw"               # or s3://lake/orders_raw, abfss://..., gs://...
/// app-id = "orders-v1"              # optional; default: query name + checkpoint query id
/// partition-by = ["day"]
/// optimize-every = 0                # compaction: default after every 100 small batches
///                                   # (under 8 MiB); N: after every N batches; 0: off
/// deleted-file-retention = "7d"     # delta.deletedFileRetentionDuration of a table the
///                                   # sink creates (default 1d; see weir_delta::compact)
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DeltaAppendConfig {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_app_id_reuse: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partition_by: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_file_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimize_every: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted_file_retention: Option<DurationText>,
}

/// `[[sink]] type = "delta-merge"`.
///
/// ```toml
/// [[sink]]
/// type = "delta-merge"
/// path = "silver_orders"
/// keys = ["order_id"]
/// ordering = "updated_at"
/// null-keys = "error"               # or "drop"
/// null-ordering = "error"           # or "oldest"
/// optimize-every = 0                # as for delta-append
/// deleted-file-retention = "7d"     # as for delta-append
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DeltaMergeConfig {
    pub path: String,
    pub keys: Vec<String>,
    pub ordering: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_app_id_reuse: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedupe: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_condition: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prune_by: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partition_by: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimize_every: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub null_keys: Option<NullKeys>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub null_ordering: Option<NullOrdering>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted_file_retention: Option<DurationText>,
}

/// The table's location. delta-rs reads `%XX` in a local folder name as an escape (the table
/// `victim%41` would be read and written as `victimA`): such a name is refused before
/// anything runs rather than written somewhere else.
fn table_location(env: &BuildEnv, path: &str) -> Result<Location> {
    let at = env.location("sink.path", path)?;
    if at
        .local_path()
        .is_some_and(|p| p.to_string_lossy().contains('%'))
    {
        return Err(Error::config(
            "sink.path",
            format!(
                "'{path}': a '%' in a local Delta table's folder name is not supported (delta-rs \
                 reads it as an escape and would use another folder); rename the folder"
            ),
        ));
    }
    Ok(at)
}

impl DeltaAppendConfig {
    /// The sink, configured.
    pub fn sink(&self, env: &BuildEnv) -> Result<DeltaAppend> {
        let mut d = DeltaAppend::new(table_location(env, &self.path)?)
            .partition_by(self.partition_by.clone())
            .allow_app_id_reuse(self.allow_app_id_reuse);
        if let Some(a) = &self.app_id {
            d = d.app_id(a);
        }
        if let Some(n) = self.target_file_size {
            d = d.target_file_size(n);
        }
        if let Some(n) = self.optimize_every {
            d = d.optimize_every(n);
        }
        if let Some(r) = self.deleted_file_retention {
            d = d.deleted_file_retention(r.0);
        }
        Ok(d)
    }
}

impl DeltaMergeConfig {
    /// The sink, configured and checked.
    pub fn sink(&self, env: &BuildEnv) -> Result<DeltaMerge> {
        let mut d = DeltaMerge::new(
            table_location(env, &self.path)?,
            self.keys.clone(),
            &self.ordering,
        )
        .dedupe(self.dedupe.unwrap_or(true))
        .partition_by(self.partition_by.clone())
        .allow_app_id_reuse(self.allow_app_id_reuse)
        .null_keys(self.null_keys.unwrap_or_default())
        .null_ordering(self.null_ordering.unwrap_or_default());
        if let Some(a) = &self.app_id {
            d = d.app_id(a);
        }
        if let Some(c) = &self.update_condition {
            d = d.update_condition(c);
        }
        if let Some(p) = &self.prune_by {
            d = d.prune_by(p);
        }
        if let Some(n) = self.optimize_every {
            d = d.optimize_every(n);
        }
        if let Some(r) = self.deleted_file_retention {
            d = d.deleted_file_retention(r.0);
        }
        d.check()
            .map_err(|e| Error::config("sink", weir_core::sink::error_chain(&e)))?;
        Ok(d)
    }
}

fn label(kind: &str, env: &BuildEnv, path: &str) -> String {
    match env.location("sink.path", path) {
        Ok(l) => format!("{kind} {l}"),
        Err(_) => format!("{kind} {path}"),
    }
}

/// The app id a Delta sink writes with: the explicit one, or the query's default.
fn app_id(explicit: Option<&str>, query: &QueryIdentity) -> String {
    explicit.map_or_else(|| query.default_app_id(), str::to_string)
}

/// The reader that checks a Delta sink's table (one commit per batch, OPTIMIZE aside).
fn reader(
    env: &BuildEnv,
    path: &str,
    app_id: &Option<String>,
) -> Result<Option<Box<dyn SinkVerifier>>> {
    Ok(Some(Box::new(DeltaReader {
        at: env.location("sink.path", path)?,
        app_id: app_id.clone(),
        strict_versions: true,
    })))
}

impl SinkSpec for DeltaAppendConfig {
    fn label(&self, env: &BuildEnv) -> String {
        label(Self::KIND, env, &self.path)
    }

    fn build(&self, env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>> {
        Ok(Arc::new(self.sink(env)?))
    }

    fn app_id(&self, query: &QueryIdentity) -> Option<String> {
        Some(app_id(self.app_id.as_deref(), query))
    }

    fn location(&self, env: &BuildEnv) -> Option<Location> {
        env.location("sink.path", &self.path).ok()
    }

    fn shape(&self) -> SinkShape {
        SinkShape::Append
    }
}

impl SinkHarness for DeltaAppendConfig {
    fn fault_points(&self) -> Vec<&'static str> {
        DELTA_POINTS.to_vec()
    }

    fn relocate(&mut self, to: &Relocation) -> Result<()> {
        self.path = to.dir.url_string();
        Ok(())
    }

    fn verifier(&self, env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>> {
        reader(env, &self.path, &self.app_id)
    }
}

impl SinkConnector for DeltaAppendConfig {
    const KIND: &'static str = "delta-append";
}

impl SinkSpec for DeltaMergeConfig {
    fn label(&self, env: &BuildEnv) -> String {
        label(Self::KIND, env, &self.path)
    }

    fn build(&self, env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>> {
        Ok(Arc::new(self.sink(env)?))
    }

    fn app_id(&self, query: &QueryIdentity) -> Option<String> {
        Some(app_id(self.app_id.as_deref(), query))
    }

    fn location(&self, env: &BuildEnv) -> Option<Location> {
        env.location("sink.path", &self.path).ok()
    }

    fn shape(&self) -> SinkShape {
        SinkShape::Upsert {
            keys: self.keys.clone(),
            ordering: self.ordering.clone(),
        }
    }
}

impl SinkHarness for DeltaMergeConfig {
    fn fault_points(&self) -> Vec<&'static str> {
        DELTA_POINTS.to_vec()
    }

    fn relocate(&mut self, to: &Relocation) -> Result<()> {
        self.path = to.dir.url_string();
        Ok(())
    }

    fn verifier(&self, env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>> {
        reader(env, &self.path, &self.app_id)
    }
}

impl SinkConnector for DeltaMergeConfig {
    const KIND: &'static str = "delta-merge";
}

/// Reads a Delta table back and checks its versions and app transaction.
pub struct DeltaReader {
    pub at: Location,
    /// The explicit app id, if the sink has one.
    pub app_id: Option<String>,
    /// One commit per batch exactly, compactions (OPTIMIZE commits) aside.
    pub strict_versions: bool,
}

fn sink_err(at: &Location, e: crate::DeltaSinkError) -> Error {
    Error::Sink {
        sink: format!("delta {at}"),
        batch_id: 0,
        source: Box::new(e),
    }
}

#[async_trait]
impl SinkVerifier for DeltaReader {
    async fn rows(&self, schema: &SchemaRef) -> Result<Vec<RecordBatch>> {
        let ctx = SessionContext::new();
        if table_version(&self.at)
            .await
            .map_err(|e| sink_err(&self.at, e))?
            .is_none()
        {
            return Ok(Vec::new());
        }
        let df = read_table(&ctx, &self.at)
            .await
            .map_err(|e| sink_err(&self.at, e))?;
        let batches = df
            .collect()
            .await
            .map_err(|e| Error::datafusion(format!("reading {}", self.at), e))?;
        let mut out = Vec::new();
        for b in batches {
            let mut cols = Vec::new();
            for f in schema.fields() {
                let c = b.column_by_name(f.name()).ok_or_else(|| Error::Internal {
                    what: format!("Delta table {}: no column '{}'", self.at, f.name()),
                })?;
                cols.push(cast(c, f.data_type()).map_err(|e| Error::Internal {
                    what: format!("Delta table {}: column '{}': {e}", self.at, f.name()),
                })?);
            }
            out.push(
                RecordBatch::try_new(schema.clone(), cols).map_err(|e| Error::Internal {
                    what: format!("Delta table {}: {e}", self.at),
                })?,
            );
        }
        Ok(out)
    }

    async fn check_bookkeeping(&self, query: &QueryIdentity, committed: u64) -> Result<Verdict> {
        let mut v = Verdict::default();
        let what = format!("delta {}", self.at);
        let version = table_version(&self.at)
            .await
            .map_err(|e| sink_err(&self.at, e))?;
        let last = committed.checked_sub(1);
        if self.strict_versions {
            let commits = data_commits(&self.at)
                .await
                .map_err(|e| sink_err(&self.at, e))?;
            if commits.unwrap_or(0) != committed {
                v.mismatches.push(format!(
                    "{what}: {commits:?} commits besides compactions (table version {version:?}), expected one for each of {committed} batches"
                ));
            }
        }
        let app = self
            .app_id
            .clone()
            .unwrap_or_else(|| query.default_app_id());
        let txn = recorded_version(&self.at, &app)
            .await
            .map_err(|e| sink_err(&self.at, e))?;
        if txn != last.map(|l| l as i64) {
            v.mismatches.push(format!(
                "{what}: app transaction {app} at {txn:?}, expected the last batch {last:?}"
            ));
        }
        v.notes.push(format!(
            "{what}: version {}, txn {}",
            version.map_or("none".into(), |x| x.to_string()),
            txn.map_or("none".into(), |x| x.to_string())
        ));
        Ok(v)
    }
}
