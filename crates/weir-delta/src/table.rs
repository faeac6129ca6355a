//! Opening tables, reading the recorded application version, reading rows back.

use std::path::{Path, PathBuf};

use deltalake::DeltaTable;
use weir_core::datafusion::prelude::{DataFrame, SessionContext};

use crate::error::DeltaSinkError;

/// Opens the table at `path` (a local folder), which may not exist yet.
pub(crate) async fn open(path: &Path, batch_id: u64) -> Result<DeltaTable, DeltaSinkError> {
    let err = |action, source| DeltaSinkError::Delta {
        table: path.to_path_buf(),
        batch_id,
        action,
        source,
    };
    let abs = absolute(path);
    let url = deltalake::ensure_table_uri(abs.to_string_lossy())
        .map_err(|e| err("resolving the table location", e))?;
    DeltaTable::try_from_url(url)
        .await
        .map_err(|e| err("opening the table", e))
}

/// The version recorded for `app_id` in the table (`None`: no table, or never written).
pub(crate) async fn recorded(
    table: &DeltaTable,
    app_id: &str,
) -> Result<Option<i64>, deltalake::DeltaTableError> {
    if table.version().is_none() {
        return Ok(None);
    }
    table
        .snapshot()?
        .transaction_version(table.log_store().as_ref(), app_id)
        .await
}

/// The application version that the table at `path` records for `app_id`.
pub async fn recorded_version(path: &Path, app_id: &str) -> Result<Option<i64>, DeltaSinkError> {
    let table = open(path, 0).await?;
    recorded(&table, app_id)
        .await
        .map_err(|source| DeltaSinkError::Delta {
            table: path.to_path_buf(),
            batch_id: 0,
            action: "reading the application transaction",
            source,
        })
}

/// The table's current version (`None` when there is no table at `path` yet).
pub async fn table_version(path: &Path) -> Result<Option<u64>, DeltaSinkError> {
    Ok(open(path, 0).await?.version())
}

/// The table's current rows as a DataFrame on `ctx`.
pub async fn read_table(ctx: &SessionContext, path: &Path) -> Result<DataFrame, DeltaSinkError> {
    let table = open(path, 0).await?;
    let err = |action, source| DeltaSinkError::Delta {
        table: path.to_path_buf(),
        batch_id: 0,
        action,
        source,
    };
    table
        .update_datafusion_session(&ctx.state())
        .map_err(|e| err("registering the table's store", e))?;
    let provider = table.table_provider().await.map_err(|e| {
        err(
            "building the table provider",
            deltalake::DeltaTableError::from(e),
        )
    })?;
    ctx.read_table(provider)
        .map_err(|source| DeltaSinkError::DataFusion {
            table: path.to_path_buf(),
            batch_id: 0,
            action: "reading the table",
            source,
        })
}

pub(crate) fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    }
}

/// An open table and whether batch `batch_id` still has to be written to it.
pub(crate) struct Prepared {
    pub table: DeltaTable,
    pub app_id: String,
    /// False when the table already records this batch for the app id.
    pub write: bool,
}

/// Opens the table and reads the version recorded for the app id; logs and counts a skip.
pub(crate) async fn prepare(
    path: &Path,
    sink: &str,
    explicit_app_id: Option<&str>,
    ctx: &weir_core::BatchContext,
) -> Result<Prepared, DeltaSinkError> {
    let batch_id = ctx.batch_id;
    let table = open(path, batch_id).await?;
    let app_id = explicit_app_id.map_or_else(|| ctx.app_id(), str::to_string);
    let version = recorded(&table, &app_id)
        .await
        .map_err(|source| DeltaSinkError::Delta {
            table: path.to_path_buf(),
            batch_id,
            action: "reading the application transaction",
            source,
        })?;
    if explicit_app_id.is_some()
        && ctx.checkpoint_is_new
        && batch_id == 0
        && let Some(v) = version
    {
        tracing::warn!(
            table = %path.display(),
            "the checkpoint is new (batch ids start again at 0) but the table already records \
             version {v} for app id '{app_id}': batches up to {v} will be skipped as already \
             written; give this query a new app id"
        );
    }
    let done = version.is_some_and(|v| v >= batch_id as i64);
    if done {
        tracing::info!(
            table = %path.display(),
            "batch {batch_id} skipped: the table already records version {} for app id '{app_id}'",
            version.unwrap_or_default()
        );
        ctx.metrics.add_skipped(sink);
    }
    Ok(Prepared {
        table,
        app_id,
        write: !done,
    })
}
