//! `weir checkpoint show DIR`.

use std::path::Path;

use anyhow::Result;
use weir_core::checkpoint::{Checkpoint, StartPoint};

pub fn show(dir: &Path) -> Result<()> {
    if !dir.join("metadata").exists() {
        anyhow::bail!(
            "{} is not a checkpoint: it has no metadata file",
            dir.display()
        );
    }
    let cp = Checkpoint::open(dir)?;
    let (offsets, commits) = cp.batch_ids()?;
    println!("checkpoint {}", dir.display());
    println!("query id   {}", cp.query_id());
    match (offsets.first(), offsets.last()) {
        (Some(a), Some(b)) => println!(
            "batches    {a}..={b} in the offset log, {} committed",
            commits.len()
        ),
        _ => println!("batches    none yet"),
    }
    match cp.recover() {
        Ok(StartPoint::Fresh) => println!("next start fresh: batch 0"),
        Ok(StartPoint::Next { batch_id, .. }) => println!("next start new batch {batch_id}"),
        Ok(StartPoint::Replay { batch_id, .. }) => {
            println!("pending    batch {batch_id} is not committed: the next start runs it again")
        }
        Err(e) => println!("problem    {e}"),
    }
    for id in &offsets {
        let state = if commits.contains(id) {
            "committed"
        } else {
            "PENDING"
        };
        match cp.read_offsets(*id) {
            Ok(seq) => {
                let ts = chrono::DateTime::from_timestamp_millis(seq.metadata.batch_timestamp_ms)
                    .map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string())
                    .unwrap_or_default();
                let offs: Vec<String> = seq
                    .offsets
                    .iter()
                    .map(|o| o.as_ref().map_or("-".into(), |o| o.to_string()))
                    .collect();
                println!(
                    "batch {id:>6}  {state:<9}  {ts}  offsets {}",
                    offs.join(" ")
                );
                if let Some(log) = seq
                    .offsets
                    .first()
                    .cloned()
                    .flatten()
                    .and_then(|o| o.json().get("logOffset").and_then(|v| v.as_u64()))
                {
                    for f in source_files(dir, log) {
                        println!("               file {f}");
                    }
                }
            }
            Err(e) => println!("batch {id:>6}  {state:<9}  unreadable: {e}"),
        }
    }
    Ok(())
}

/// The files recorded for a file source log offset (plain entry, or the compact one).
fn source_files(dir: &Path, log: u64) -> Vec<String> {
    let base = dir.join("sources").join("0");
    let candidates = [
        base.join(log.to_string()),
        base.join(format!("{log}.compact")),
    ];
    for p in candidates {
        if let Ok(text) = std::fs::read_to_string(&p) {
            return text
                .lines()
                .skip(1)
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v.get("batchId").and_then(|b| b.as_u64()) == Some(log))
                .filter_map(|v| v.get("path").and_then(|p| p.as_str()).map(str::to_string))
                .collect();
        }
    }
    Vec::new()
}
