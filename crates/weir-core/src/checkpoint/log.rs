//! Durable files: written whole or not at all, and never overwritten.
//!
//! A file is written to a hidden temp name in the same folder, fsynced, hard-linked to
//! its final name (which fails if that name exists: no silent overwrite), the temp name
//! removed and the folder fsynced. A reader therefore sees either no file or the whole
//! file; a crash can only leave a hidden temp file behind, which readers ignore.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// What `write_new` found.
#[derive(Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The file is now durable under its final name.
    Written,
    /// A file with that name was already there; nothing was changed.
    AlreadyExists,
}

/// Writes `bytes` to `path` atomically and durably, unless `path` already exists.
pub fn write_new(path: &Path, bytes: &[u8]) -> Result<WriteOutcome> {
    let dir = parent(path)?;
    fs::create_dir_all(dir).map_err(|e| Error::io("creating folder", dir, e))?;
    let tmp = temp_name(path)?;
    let result = write_temp(&tmp, bytes).and_then(|()| match fs::hard_link(&tmp, path) {
        Ok(()) => Ok(WriteOutcome::Written),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(WriteOutcome::AlreadyExists),
        Err(e) => Err(Error::io("linking into place", path, e)),
    });
    // The temp name is ours alone; failing to remove it leaves a hidden file readers skip.
    let _ = fs::remove_file(&tmp);
    let outcome = result?;
    if outcome == WriteOutcome::Written {
        sync_dir(dir)?;
    }
    Ok(outcome)
}

/// Writes `bytes` to `path` atomically, replacing a file of that name if there is one.
/// For outputs that a replay writes again with the same content (the Parquet sink).
pub fn write_replace(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent(path)?;
    fs::create_dir_all(dir).map_err(|e| Error::io("creating folder", dir, e))?;
    let tmp = temp_name(path)?;
    write_temp(&tmp, bytes)?;
    fs::rename(&tmp, path).map_err(|e| Error::io("renaming into place", path, e))?;
    sync_dir(dir)
}

/// Fsyncs a folder so that the names created or removed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("syncing folder", dir, e))
}

/// The hidden temp name beside `path` that a write goes through.
pub fn temp_name(path: &Path) -> Result<PathBuf> {
    let dir = parent(path)?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::config("path", format!("{} has no file name", path.display())))?;
    Ok(dir.join(format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple())))
}

fn write_temp(tmp: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(|e| Error::io("creating", tmp, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io("writing", tmp, e))
}

fn parent(path: &Path) -> Result<&Path> {
    path.parent()
        .ok_or_else(|| Error::config("path", format!("{} has no parent folder", path.display())))
}

/// A name that readers of a log folder skip: temp files, `.crc` files, `_` files.
pub fn is_hidden(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

/// Reads a `v1` log file: the version line, then the remaining lines.
///
/// Errors name the file and say what is wrong, in Spark's words where Spark has some.
/// `log` names the log in the message for an empty file ("offset commit log", ...).
pub fn read_versioned(path: &Path, max_version: u32, log: &str) -> Result<Vec<String>> {
    let bytes = fs::read(path).map_err(|e| Error::io("reading", path, e))?;
    let corrupt = |reason: String| Error::CorruptLog {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() {
        return Err(corrupt(format!("Incomplete log file in the {log}")));
    }
    let text =
        String::from_utf8(bytes).map_err(|_| corrupt("The file is not UTF-8 text".into()))?;
    let mut lines = text.split('\n');
    let first = lines.next().unwrap_or_default();
    let version = first
        .strip_prefix('v')
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or_else(|| {
            corrupt(format!(
                "Log file was malformed: failed to read correct log version from {first:.40?}"
            ))
        })?;
    if version == 0 || version > max_version {
        return Err(corrupt(format!(
            "UnsupportedLogVersion: maximum supported log version is v{max_version}, but \
             encountered v{version}. The log file was produced by a newer version of weir \
             and cannot be read by this version. Please upgrade."
        )));
    }
    Ok(lines.map(str::to_owned).collect())
}

/// Parses line `index` (1-based, counting the version line) of a log file as JSON.
pub fn parse_line<T: serde::de::DeserializeOwned>(
    path: &Path,
    index: usize,
    line: &str,
) -> Result<T> {
    serde_json::from_str(line).map_err(|e| Error::CorruptLog {
        path: path.to_path_buf(),
        reason: format!("Line {index} is not valid: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_new_refuses_to_overwrite_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("0");
        assert_eq!(write_new(&p, b"v1\na").unwrap(), WriteOutcome::Written);
        assert_eq!(
            write_new(&p, b"v1\nb").unwrap(),
            WriteOutcome::AlreadyExists
        );
        assert_eq!(fs::read(&p).unwrap(), b"v1\na");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("0")]);
    }

    #[test]
    fn read_versioned_names_the_file_and_the_fault() {
        let dir = tempfile::tempdir().unwrap();
        let cases: &[(&[u8], &str)] = &[
            (b"", "Incomplete log file"),
            (b"garbage", "failed to read correct log version"),
            (b"v9\n{}", "encountered v9"),
            (b"\xff\xfe", "not UTF-8"),
        ];
        for (i, (bytes, want)) in cases.iter().enumerate() {
            let p = dir.path().join(i.to_string());
            fs::write(&p, bytes).unwrap();
            let err = read_versioned(&p, 1, "offset log").unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
            assert!(err.contains(&p.display().to_string()), "{err}");
        }
    }
}
