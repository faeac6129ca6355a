//! `weir checkpoint show DIR`.

use anyhow::Result;
use weir_core::checkpoint::{Checkpoint, StartPoint};
use weir_core::storage::{Location, StorageOptions};

pub(crate) async fn show(at: &str, storage: &[String]) -> Result<()> {
    let root = checkpoint_at(at, storage)?;
    let mut out = String::new();
    let r = show_into(root, &mut out).await;
    // A reader that went away (`| head`) is not an error.
    use std::io::Write;
    match std::io::stdout().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    r
}

/// The checkpoint `at` names: a pipeline file's (with its `[storage]`, and `--storage` on
/// top), or a folder or URL with the `--storage` settings.
fn checkpoint_at(at: &str, storage: &[String]) -> Result<Location> {
    let mut values = std::collections::BTreeMap::new();
    for kv in storage {
        let Some((k, v)) = kv.split_once('=') else {
            anyhow::bail!("--storage {kv}: give KEY=VALUE, e.g. aws_region=us-east-1");
        };
        let key = k.trim();
        values.insert(
            key.to_string(),
            weir_core::connector::secret(&format!("--storage {key}"), v.trim())?,
        );
    }
    let path = std::path::Path::new(at);
    if path.is_file() {
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            anyhow::bail!(
                "{at} is a file, not a checkpoint folder: give the checkpoint folder or URL,                  or a pipeline file (.toml)"
            );
        }
        let pipeline = crate::pipeline::Pipeline::load(path)?;
        let mut env = pipeline.env()?;
        if !values.is_empty() {
            let mut merged = env.storage.as_map().clone();
            merged.extend(values);
            env.storage = StorageOptions::new(merged)?;
        }
        return Ok(env.location("query.checkpoint", &pipeline.query.checkpoint)?);
    }
    Ok(Location::parse(
        "checkpoint",
        at,
        None,
        &StorageOptions::new(values)?,
    )?)
}

async fn show_into(root: Location, out: &mut String) -> Result<()> {
    use std::fmt::Write;
    macro_rules! say {
        ($($t:tt)*) => {{
            let _ = writeln!(out, $($t)*);
        }};
    }
    let Some(cp) = Checkpoint::inspect(root.clone()).await? else {
        anyhow::bail!("{root} is not a checkpoint: it has no metadata file");
    };
    let (offsets, commits) = cp.batch_ids().await?;
    // What the next start would refuse: printed in place, and the exit status.
    let mut problem: Option<String> = None;
    say!("checkpoint {root}");
    say!("query id   {}", cp.query_id());
    if let Some(n) = cp.created_name() {
        say!("created as {n}");
    }
    match (offsets.first(), offsets.last()) {
        (Some(a), Some(b)) => say!(
            "batches    {a}..={b} in the offset log, {} committed",
            commits.len()
        ),
        _ => say!("batches    none yet"),
    }
    // The stateful operators' state: what wrote it, in how many partitions.
    let state = cp.state_root();
    for op in 0u32.. {
        let Some(meta) = weir_core::state::OperatorMetadata::read(&state, op).await? else {
            break;
        };
        let parts = meta
            .state_store_info
            .first()
            .map_or(0, |s| s.num_partitions);
        say!(
            "state      operator {op}: {}, {parts} partition(s) (state/{op}/0..{})",
            meta.operator_info.operator_name,
            parts.saturating_sub(1)
        );
    }
    match cp.recover().await {
        Ok(StartPoint::Fresh) => say!("next start fresh: batch 0"),
        Ok(StartPoint::Next { batch_id, .. }) => say!("next start new batch {batch_id}"),
        Ok(StartPoint::Replay { batch_id, .. }) => {
            say!("pending    batch {batch_id} is not committed: the next start runs it again")
        }
        Err(e) => {
            let text = weir_core::sink::error_chain(&e);
            say!("problem    {text}");
            problem = Some(text);
        }
    }
    let log = cp.source_log(0);
    for id in &offsets {
        let state = if commits.contains(id) {
            "committed"
        } else {
            "PENDING"
        };
        match cp.read_offsets(*id).await {
            Ok(seq) => {
                let ts = chrono::DateTime::from_timestamp_millis(seq.metadata.batch_timestamp_ms)
                    .map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
                    .unwrap_or_default();
                let offs: Vec<String> = seq
                    .offsets
                    .iter()
                    .map(|o| o.as_ref().map_or("-".into(), |o| o.to_string()))
                    .collect();
                say!(
                    "batch {id:>6}  {state:<9}  {ts}  offsets {}",
                    offs.join(" ")
                );
                if let Some(n) = seq
                    .offsets
                    .first()
                    .cloned()
                    .flatten()
                    .and_then(|o| o.json().get("logOffset").and_then(|v| v.as_u64()))
                {
                    for f in source_files(&log, n).await {
                        say!("               file {f}");
                    }
                }
            }
            Err(e) => {
                say!("batch {id:>6}  {state:<9}  unreadable: {e}");
                problem.get_or_insert_with(|| e.to_string());
            }
        }
    }
    match problem {
        Some(p) => anyhow::bail!("{root}: the next start would refuse this checkpoint: {p}"),
        None => Ok(()),
    }
}

/// The files recorded for a file source log offset (plain entry, or the compact one).
async fn source_files(log: &Location, n: u64) -> Vec<String> {
    for name in [n.to_string(), format!("{n}.compact")] {
        if let Ok(Some(bytes)) = log.get(&name).await {
            return String::from_utf8_lossy(&bytes)
                .lines()
                .skip(1)
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v.get("batchId").and_then(|b| b.as_u64()) == Some(n))
                .filter_map(|v| v.get("path").and_then(|p| p.as_str()).map(str::to_string))
                .collect();
        }
    }
    Vec::new()
}
