//! A record of the steps that make local files durable, for power-cut tests.
//!
//! When the environment variable `WEIR_POWER_JOURNAL` names a file, every local write made
//! through [`super::Location`] or [`super::DurableLocalStore`] appends a line to it:
//!
//! ```text
//! N <path>   a name is about to be created or replaced (its content is not yet durable)
//! S <path>   the file's content has been fsynced
//! D <path>   the folder has been fsynced: the names created in it so far are durable
//! ```
//!
//! `N` is written before the step and `S`/`D` after it returns, so a process killed at any
//! moment leaves a journal that never claims more durability than the disk had. `weir chaos
//! --power-loss` reads it after each run and removes what a power cut could have lost:
//! every new or changed file or folder that the journal does not show as durable (files that
//! bypassed the journal count as not durable, which is how a sink that never fsyncs is
//! caught). When the variable is unset the cost is one load of an initialised `OnceLock`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The environment variable that turns the journal on.
pub const JOURNAL_VAR: &str = "WEIR_POWER_JOURNAL";

fn journal() -> Option<&'static Mutex<File>> {
    static J: OnceLock<Option<Mutex<File>>> = OnceLock::new();
    J.get_or_init(|| {
        let path = std::env::var_os(JOURNAL_VAR)?;
        // A test hook: if the journal cannot be opened, the run must not pass for one that
        // was checked.
        match OpenOptions::new().create(true).append(true).open(&path) {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                eprintln!("weir: cannot open {JOURNAL_VAR} {path:?}: {e}");
                std::process::abort();
            }
        }
    })
    .as_ref()
}

/// Appends one step (`N`, `S` or `D`) for `path`, when the journal is on.
pub(super) fn note(step: char, path: &Path) {
    let Some(j) = journal() else { return };
    let line = format!(
        "{step} {}\n",
        super::percent_encode(&path.to_string_lossy())
    );
    let ok = j
        .lock()
        .map(|mut f| f.write_all(line.as_bytes()).is_ok())
        .unwrap_or(false);
    if !ok {
        eprintln!("weir: cannot append to {JOURNAL_VAR}");
        std::process::abort();
    }
}

/// What a journal says about one path.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Durability {
    /// The path's entry is durable in its folder.
    pub name: bool,
    /// The path's content is durable.
    pub content: bool,
}

/// A journal read back.
#[derive(Debug, Default)]
pub struct Journal {
    steps: Vec<(char, PathBuf)>,
}

impl Journal {
    /// Reads the journal's text (lines it cannot read are ignored: a line cut by a kill).
    pub fn parse(text: &str) -> Journal {
        let steps = text
            .lines()
            .filter_map(|l| {
                let (s, p) = l.split_once(' ')?;
                let s = s.chars().next()?;
                Some((s, PathBuf::from(super::percent_decode(p))))
            })
            .collect();
        Journal { steps }
    }

    /// Whether `path`'s entry and content were durable when the journal ended. `existed`:
    /// the path was there before the journal began (its entry was durable then).
    pub fn durability(&self, path: &Path, existed: bool) -> Durability {
        let parent = path.parent();
        let created = self
            .steps
            .iter()
            .rposition(|(s, p)| *s == 'N' && p == path)
            .map(|i| i + 1);
        let later = &self.steps[created.unwrap_or(0)..];
        let content = later.iter().any(|(s, p)| *s == 'S' && p == path);
        let name = (existed && created.is_none())
            || later
                .iter()
                .any(|(s, p)| *s == 'D' && Some(p.as_path()) == parent);
        Durability { name, content }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_durable_only_after_its_folder_is_synced_and_content_after_its_sync() {
        let j =
            Journal::parse("D /t\nN /t/a\nS /t/a\nN /t/b\nS /t/b\nD /t\nN /t/c\nS /t/c\nN /t/b\n");
        let d = |p: &str, existed| j.durability(Path::new(p), existed);
        let both = |name, content| Durability { name, content };
        assert_eq!(d("/t/a", false), both(true, true));
        // Replaced after the last folder sync, and its new content never synced.
        assert_eq!(d("/t/b", true), both(false, false));
        // Content synced, name not.
        assert_eq!(d("/t/c", false), both(false, true));
        // Never journaled: its content is not durable.
        assert_eq!(d("/t/x", false), both(true, false));
        assert_eq!(d("/u/x", false), both(false, false));
        // Names with newlines and spaces survive the encoding.
        let odd = "/t/a b\nc";
        let enc = crate::storage::percent_encode(odd);
        let j = Journal::parse(&format!("N {enc}\nS {enc}\n"));
        assert_eq!(j.durability(Path::new(odd), true), both(false, true));
    }
}
