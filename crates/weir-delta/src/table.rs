//! Opening tables, the cached table between batches, the recorded application version,
//! reading rows back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use deltalake::kernel::transaction::CommitProperties;
use deltalake::{DeltaTable, DeltaTableBuilder};
use futures::TryStreamExt;
use tokio::sync::Mutex;
use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::sink::recorded::{Recorded, decide};
use weir_core::storage::Location;
use weir_core::{BatchContext, SinkMetric};

use crate::error::DeltaSinkError;
use crate::log_cleanup::LogCleanup;
use crate::store;

/// Opens the table at `at` (which may not exist yet: the first write creates it).
pub async fn open(at: &Location, batch_id: u64) -> Result<DeltaTable, DeltaSinkError> {
    // delta-rs refuses a local folder that does not exist yet; the first write creates
    // the table in it.
    at.create_dir()
        .await
        .map_err(|source| DeltaSinkError::Engine {
            table: at.to_string(),
            batch_id,
            source,
        })?;
    let mut table = unloaded(at, batch_id)?;
    match table.load().await {
        Ok(()) | Err(deltalake::DeltaTableError::NotATable(_)) => Ok(table),
        Err(e) => Err(DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id,
            action: "loading the table",
            source: e,
        }),
    }
}

/// The table at `at`, not loaded: its log store, for writing data files.
pub(crate) fn unloaded(at: &Location, batch_id: u64) -> Result<DeltaTable, DeltaSinkError> {
    store::register();
    let err = |action, source| DeltaSinkError::Delta {
        table: at.to_string(),
        batch_id,
        action,
        source,
    };
    // A local folder through from_directory_path: its name is percent-encoded, so `#`, `?`
    // or `%41` in it stay part of the name (as text, `sales#staging` would be the table
    // `sales` with a fragment).
    let url = match at.local_path() {
        Some(p) => url::Url::from_directory_path(p).map_err(|()| {
            err(
                "resolving the table location",
                deltalake::DeltaTableError::Generic(format!("{} is not absolute", p.display())),
            )
        }),
        None => url::Url::parse(&at.url_string()).map_err(|e| {
            err(
                "resolving the table location",
                deltalake::DeltaTableError::Generic(e.to_string()),
            )
        }),
    }?;
    let options: HashMap<String, String> = at
        .options()
        .as_map()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    DeltaTableBuilder::from_url(url)
        .and_then(|b| b.with_storage_options(options).build())
        .map_err(|e| err("opening the table", e))
}

/// The version recorded for `app_id` (`None`: no table, or never written).
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

/// The application version that the table at `at` records for `app_id`.
pub async fn recorded_version(at: &Location, app_id: &str) -> Result<Option<i64>, DeltaSinkError> {
    let table = open(at, 0).await?;
    recorded(&table, app_id)
        .await
        .map_err(|source| DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id: 0,
            action: "reading the application transaction",
            source,
        })
}

/// The table's current version (`None` when there is no table yet).
pub async fn table_version(at: &Location) -> Result<Option<u64>, DeltaSinkError> {
    Ok(open(at, 0).await?.version())
}

/// How many of the table's commits are not compactions (OPTIMIZE): with one commit per
/// batch, the number of batches written (`None` when there is no table yet).
pub async fn data_commits(at: &Location) -> Result<Option<u64>, DeltaSinkError> {
    let table = open(at, 0).await?;
    if table.version().is_none() {
        return Ok(None);
    }
    let infos: Vec<_> =
        table
            .history(None)
            .try_collect()
            .await
            .map_err(|source| DeltaSinkError::Delta {
                table: at.to_string(),
                batch_id: 0,
                action: "reading the table's history",
                source,
            })?;
    let optimize = infos
        .iter()
        .filter(|c| c.operation.as_deref() == Some("OPTIMIZE"))
        .count();
    Ok(Some((infos.len() - optimize) as u64))
}

/// The table's current rows as a DataFrame on `ctx`.
pub async fn read_table(ctx: &SessionContext, at: &Location) -> Result<DataFrame, DeltaSinkError> {
    let table = open(at, 0).await?;
    let err = |action, source| DeltaSinkError::Delta {
        table: at.to_string(),
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
            table: at.to_string(),
            batch_id: 0,
            action: "reading the table",
            source,
        })
}

/// After this many versions past the last full load, a cached table is loaded afresh.
///
/// delta-rs brings a table up to date by appending the new commits to the log segment it
/// loaded, and never adopts the checkpoints written since: every lookup of the application
/// transaction and every snapshot update then replays all commits since the load (one JSON
/// file per batch, so per-batch cost grew with the batch count). A fresh load starts from
/// the newest checkpoint (delta-rs writes one every 100 versions by default), so the replayed
/// segment stays under about twice this many commits.
pub(crate) const RELOAD_EVERY_VERSIONS: u64 = 100;

/// The commit properties of every commit a sink makes: without delta-rs's per-commit log
/// cleanup, which lists the whole `_delta_log` folder after each commit (a cost that grew
/// with every batch until the log retention, 30 days by default, let files go). The
/// cleanup runs instead when the cached table is loaded afresh, as Delta does it at
/// checkpoints ([`Cached::take`]), and looks only at the versions that expired since the
/// last run ([`crate::log_cleanup`]).
pub(crate) fn commit_properties() -> CommitProperties {
    CommitProperties::default().with_cleanup_expired_logs(Some(false))
}

/// A sink's table, kept open between batches: each batch catches up on new commits
/// (others' included) instead of loading the table from scratch, and loads it afresh every
/// [`RELOAD_EVERY_VERSIONS`] versions.
#[derive(Debug)]
pub(crate) struct Cached {
    table: Mutex<Option<DeltaTable>>,
    /// The version the table was last fully loaded at.
    loaded_at: AtomicU64,
    log_cleanup: LogCleanup,
}

impl Cached {
    pub(crate) fn new() -> Self {
        Cached {
            table: Mutex::new(None),
            loaded_at: AtomicU64::new(0),
            log_cleanup: LogCleanup::default(),
        }
    }

    /// The table, brought up to date. The caller gives it back with [`Self::put`] after a
    /// successful write; after a failure it is simply dropped and reopened next time.
    pub(crate) async fn take(
        &self,
        at: &Location,
        batch_id: u64,
    ) -> Result<DeltaTable, DeltaSinkError> {
        let cached = self.table.lock().await.take();
        let mut t = match cached {
            Some(t) if t.version().is_some() => t,
            _ => return self.load(at, batch_id).await,
        };
        t.update_incremental(None)
            .await
            .map_err(|source| DeltaSinkError::Delta {
                table: at.to_string(),
                batch_id,
                action: "reading new commits of the table",
                source,
            })?;
        if needs_reload(self.loaded_at.load(Ordering::Relaxed), t.version()) {
            let removed = self.log_cleanup.run(&t, at, batch_id).await?;
            if removed > 0 {
                tracing::info!(table = %at, "removed {removed} expired log files");
            }
            drop(t);
            return self.load(at, batch_id).await;
        }
        Ok(t)
    }

    async fn load(&self, at: &Location, batch_id: u64) -> Result<DeltaTable, DeltaSinkError> {
        let t = open(at, batch_id).await?;
        self.loaded_at
            .store(t.version().unwrap_or(0), Ordering::Relaxed);
        Ok(t)
    }

    pub(crate) async fn put(&self, table: DeltaTable) {
        *self.table.lock().await = Some(table);
    }
}

/// Whether a table loaded at `loaded_at` and now at `now` should be loaded afresh.
pub(crate) fn needs_reload(loaded_at: u64, now: Option<u64>) -> bool {
    now.is_some_and(|v| v.saturating_sub(loaded_at) >= RELOAD_EVERY_VERSIONS)
}

/// The table, when batch `batch_id` still has to be written to it (`None`: skipped, the
/// table went back to the cache), and the app id.
pub(crate) struct WriteDecision {
    pub table: Option<DeltaTable>,
    pub app_id: String,
}

/// Whether batch `batch_id` must be written given the version the table records for the app
/// id: a pure decision. `Err` when the recorded version cannot come from this query: beyond
/// the batch, or equal to it on a first attempt (this query never ran the batch before).
pub fn decide_write(recorded: Option<i64>, batch_id: u64, is_replay: bool) -> Result<bool, i64> {
    // A negative version is below every batch.
    match decide(
        recorded.and_then(|v| u64::try_from(v).ok()),
        batch_id,
        is_replay,
    ) {
        Recorded::Write => Ok(true),
        Recorded::Skip => Ok(false),
        Recorded::NotOurs(v) => Err(v as i64),
    }
}

/// Brings the table up to date, reads the version recorded for the app id, and decides.
pub(crate) async fn prepare(
    cached: &Cached,
    at: &Location,
    sink: &str,
    explicit_app_id: Option<&str>,
    allow_app_id_reuse: bool,
    ctx: &BatchContext,
) -> Result<WriteDecision, DeltaSinkError> {
    let batch_id = ctx.batch_id;
    let table = cached.take(at, batch_id).await?;
    let app_id = explicit_app_id.map_or_else(|| ctx.app_id(), str::to_string);
    let version = recorded(&table, &app_id)
        .await
        .map_err(|source| DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id,
            action: "reading the application transaction",
            source,
        })?;
    let write = match decide_write(version, batch_id, ctx.is_replay) {
        Ok(w) => w,
        Err(v) if allow_app_id_reuse => {
            tracing::warn!(
                table = %at,
                "batch {batch_id} skipped: the table records version {v} for app id '{app_id}' \
                 (allow-app-id-reuse is on)"
            );
            false
        }
        Err(v) => {
            return Err(DeltaSinkError::AppIdInUse {
                table: at.to_string(),
                batch_id,
                app_id,
                recorded: v,
            });
        }
    };
    if !write {
        tracing::info!(
            table = %at,
            "batch {batch_id} skipped: the table already records version {} for app id '{app_id}'",
            version.unwrap_or_default()
        );
        ctx.metrics.add_skipped(sink);
        cached.put(table).await;
        return Ok(WriteDecision {
            table: None,
            app_id,
        });
    }
    Ok(WriteDecision {
        table: Some(table),
        app_id,
    })
}

/// Records the version a commit made in the batch's progress.
pub(crate) fn note_version(ctx: &BatchContext, sink: &str, table: &DeltaTable) {
    if let Some(v) = table.version() {
        ctx.metrics.record(sink, SinkMetric::Version, v);
    }
}

#[cfg(test)]
mod tests {
    use super::{RELOAD_EVERY_VERSIONS, decide_write, needs_reload};

    #[test]
    fn a_cached_table_is_loaded_afresh_once_it_is_a_checkpoint_interval_past_its_load() {
        assert!(!needs_reload(0, None));
        assert!(!needs_reload(0, Some(RELOAD_EVERY_VERSIONS - 1)));
        assert!(needs_reload(0, Some(RELOAD_EVERY_VERSIONS)));
        assert!(!needs_reload(250, Some(250 + RELOAD_EVERY_VERSIONS - 1)));
        assert!(needs_reload(250, Some(250 + RELOAD_EVERY_VERSIONS)));
    }

    #[test]
    fn a_recorded_version_is_a_skip_only_for_a_replay_of_that_batch() {
        // (recorded, batch, replay) -> decision
        type Case = (Option<i64>, u64, bool, Result<bool, i64>);
        let cases: &[Case] = &[
            (None, 0, false, Ok(true)),
            (Some(2), 3, false, Ok(true)),
            (Some(2), 3, true, Ok(true)),
            (Some(3), 3, true, Ok(false)),
            // A first attempt never finds its own version: another query wrote it.
            (Some(3), 3, false, Err(3)),
            // Beyond the batch: another query (an old checkpoint) went further.
            (Some(57), 0, false, Err(57)),
            (Some(57), 0, true, Err(57)),
        ];
        for (rec, id, replay, want) in cases {
            assert_eq!(
                decide_write(*rec, *id, *replay),
                *want,
                "{rec:?} {id} {replay}"
            );
        }
    }
}
