//! `--power-loss`: after each run, remove what a power cut at that moment could have lost.
//!
//! Before a run the work folder is listed; the run writes the journal of its durable steps
//! (`weir_core::storage::journal`); after it, every file or folder that is new or changed and
//! that the journal does not show as durable (entry fsynced in its folder, content fsynced) is
//! removed, as the disk would have dropped it. The next run then starts from what a machine
//! that lost power would hold.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};
use weir_core::storage::journal::Journal;

/// What a folder held: for each path, whether it is a folder, its size and its mtime.
#[derive(Debug, Default)]
pub(super) struct Snapshot(BTreeMap<PathBuf, (bool, u64, u128)>);

/// Lists `root` recursively, leaving out the top-level names in `skip`.
pub(super) fn snapshot(root: &Path, skip: &[&str]) -> Result<Snapshot> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
        };
        for e in entries {
            let e = e.with_context(|| format!("listing {}", dir.display()))?;
            let path = e.path();
            if dir == root && skip.iter().any(|s| e.file_name() == *s) {
                continue;
            }
            let m = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("looking at {}", path.display())),
            };
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            out.insert(path.clone(), (m.is_dir(), m.len(), mtime));
            if m.is_dir() {
                todo.push(path);
            }
        }
    }
    Ok(Snapshot(out))
}

/// Removes, under `root`, what the journal at `journal` does not show as durable among the
/// paths that are new or changed since `before`. Returns the paths removed.
pub(super) fn cut(
    root: &Path,
    skip: &[&str],
    before: &Snapshot,
    journal: &Path,
) -> Result<Vec<PathBuf>> {
    let text = match std::fs::read_to_string(journal) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", journal.display())),
    };
    let j = Journal::parse(&text);
    let after = snapshot(root, skip)?;
    let mut lost: Vec<PathBuf> = Vec::new();
    // BTreeMap order puts a folder before what it holds: once a folder is lost, so is
    // everything in it.
    for (path, (is_dir, size, mtime)) in &after.0 {
        if lost.iter().any(|l| path.starts_with(l)) {
            continue;
        }
        let old = before.0.get(path);
        let d = j.durability(path, old.is_some());
        let keep = match old {
            Some(&(was_dir, s, m))
                if was_dir == *is_dir && (*is_dir || (s, m) == (*size, *mtime)) =>
            {
                true
            }
            _ if *is_dir => d.name,
            _ => d.name && d.content,
        };
        if !keep {
            lost.push(path.clone());
        }
    }
    for l in &lost {
        let r = if l.is_dir() {
            std::fs::remove_dir_all(l)
        } else {
            std::fs::remove_file(l)
        };
        r.with_context(|| format!("removing {} (power cut)", l.display()))?;
    }
    Ok(lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_not_fsynced_is_removed_and_what_was_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(root.join("old"), "1").unwrap();
        std::fs::create_dir(root.join("runs")).unwrap();
        let before = snapshot(root, &["runs"]).unwrap();
        std::fs::create_dir(root.join("t")).unwrap();
        for n in ["a", "b"] {
            std::fs::write(root.join("t").join(n), n).unwrap();
        }
        std::fs::create_dir(root.join("gone")).unwrap();
        std::fs::write(root.join("gone/x"), "x").unwrap();
        std::fs::write(root.join("runs/log"), "kept: not looked at").unwrap();
        let p = |n: &Path| weir_core::storage::percent_encode(&n.to_string_lossy());
        let (t, a, b) = (root.join("t"), root.join("t/a"), root.join("t/b"));
        let journal = root.join("runs/journal");
        let text = format!(
            "N {t}\nD {r}\nN {a}\nS {a}\nN {b}\nD {t}\n",
            t = p(&t),
            r = p(root),
            a = p(&a),
            b = p(&b),
        );
        std::fs::write(&journal, text).unwrap();
        let lost = cut(root, &["runs"], &before, &journal).unwrap();
        let names: Vec<_> = lost
            .iter()
            .map(|l| l.strip_prefix(root).unwrap().display().to_string())
            .collect();
        // `gone` was never journaled but its parent was synced after: only its unsynced file goes.
        assert_eq!(names, vec!["gone/x", "t/b"]);
        assert!(root.join("t/a").exists() && root.join("old").exists());
        assert!(root.join("runs/log").exists());
    }
}
