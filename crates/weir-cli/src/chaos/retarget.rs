//! Pointing a pipeline at the chaos run's own input, folders and tables, through each
//! connector's own `relocate`: no connector's fields are known here.

use std::path::Path;

use anyhow::{Result, bail};
use weir_core::connector::{Feed, Relocation, SinkShape};
use weir_core::storage::Location;

use crate::pipeline::Pipeline;

/// Where a chaos (or bench) run points a pipeline.
pub(crate) struct Target<'a> {
    /// The run's folder (local).
    pub dir: &'a Path,
    /// Where the checkpoint and the sinks' files go (the run's folder, or an object-store
    /// prefix).
    pub store: Location,
    pub feed: Feed,
    pub postgres: Option<&'a str>,
    /// Rows per batch (Kafka) or one file per batch (files).
    pub batch_rows: u64,
    /// min-batches-to-retain for the query, to exercise purging.
    pub retain: Option<u64>,
}

/// The table-name prefix of chaos runs.
pub(super) const PREFIX: &str = "weir_chaos_";

/// Retargets `p` in place: checkpoint, trigger available-now, the source onto the feed, each
/// sink into a fresh place. Refuses what chaos cannot check.
pub(crate) fn retarget(p: &mut Pipeline, t: &Target<'_>) -> Result<()> {
    p.base = Some(t.dir.to_path_buf());
    p.query.checkpoint = t.store.join("checkpoint").url_string();
    p.query.trigger = Some("available-now".into());
    if let Some(r) = t.retain {
        p.query.min_batches_to_retain = Some(r);
    }
    p.source.harness_mut().relocate(&t.feed, t.batch_rows)?;
    // After SQL no reference exists for an append sink; after stateful steps alone, the
    // chaos check computes what they pass on.
    let transform = p.transform.as_ref().is_some_and(|t| t.sql.is_some());
    for (i, s) in p.sinks.iter_mut().enumerate() {
        let kind = s.kind();
        if transform && s.spec().shape() == SinkShape::Append {
            bail!("sink[{i}] ({kind}): an append sink after a transform has no reference to check");
        }
        s.harness_mut().relocate(&Relocation {
            dir: t.store.join(&format!("{}_{i}", kind.replace('-', "_"))),
            postgres: t.postgres.map(str::to_string),
            prefix: PREFIX.into(),
            index: i,
        })?;
    }
    Ok(())
}
