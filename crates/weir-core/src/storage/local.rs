//! Durable local file operations. Every function here blocks: call them through
//! [`super::blocking`].

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::UNIX_EPOCH;

use bytes::Bytes;

use super::{FileMeta, WriteOutcome, journal};
use crate::error::{Error, Result};

/// Folders known to be durable in their parent (created by an earlier run, or created and
/// fsynced by this process): a new folder's own entry is fsynced once, not on every write.
fn durable_dirs() -> &'static Mutex<HashSet<PathBuf>> {
    static DIRS: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    DIRS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// `a/./b/../c` -> `a/c`, without touching the disk (the folder may not exist yet).
pub(super) fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Creates `dir` and any missing parents; each folder created is fsynced in its parent, so
/// the whole chain survives a power cut.
pub(super) fn create_dir_durable(dir: &Path) -> Result<()> {
    // Made durable by this process before, and still there: a long-lived process (a
    // cluster's worker) sees folders deleted and made again under the same name (a
    // checkpoint started afresh), which it must make again.
    if durable_dirs()
        .lock()
        .map(|s| s.contains(dir))
        .unwrap_or(false)
        && fs::metadata(dir).is_ok_and(|m| m.is_dir())
    {
        return Ok(());
    }
    // Find the missing ancestors, top down.
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(d) = cur {
        match fs::metadata(d) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(Error::io(
                    "creating folder (a file of that name exists)",
                    d,
                    std::io::Error::from(ErrorKind::AlreadyExists),
                ));
            }
            Err(e) if e.kind() == ErrorKind::NotFound => missing.push(d.to_path_buf()),
            Err(e) => return Err(Error::io("looking at", d, e)),
        }
        cur = d.parent();
    }
    for d in missing.iter().rev() {
        journal::note('N', d);
        match fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating folder", d, e)),
        }
        if let Some(parent) = d.parent() {
            sync_dir(parent)?;
        }
    }
    if let Ok(mut s) = durable_dirs().lock() {
        s.insert(dir.to_path_buf());
    }
    Ok(())
}

/// The topmost folder of `dir`'s chain that does not exist yet (`dir` itself when only it is
/// missing); `None` when `dir` exists.
pub(super) fn topmost_missing(dir: &Path) -> Result<Option<PathBuf>> {
    let mut top = None;
    let mut cur = Some(dir);
    while let Some(d) = cur {
        match fs::metadata(d) {
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::NotFound => top = Some(d.to_path_buf()),
            Err(e) => return Err(Error::io("looking at", d, e)),
        }
        cur = d.parent();
    }
    Ok(top)
}

/// Removes the folder `dir` and everything in it (a missing folder is not an error), and
/// forgets that folders under it were made durable.
pub(super) fn remove_tree(dir: &Path) -> Result<()> {
    if let Ok(mut s) = durable_dirs().lock() {
        s.retain(|d| !d.starts_with(dir));
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("removing folder", dir, e)),
    }
    match dir.parent() {
        Some(p) => sync_dir(p),
        None => Ok(()),
    }
}

/// Removes the empty folders under `dir`, deepest first (folders that hold a file stay, and
/// so does `dir`).
pub(super) fn remove_empty_folders_under(dir: &Path) -> Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut removed = false;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let path = entry.path();
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        remove_empty_folders_under(&path)?;
        match fs::remove_dir(&path) {
            Ok(()) => {
                removed = true;
                if let Ok(mut s) = durable_dirs().lock() {
                    s.retain(|d| !d.starts_with(&path));
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty) => {}
            Err(e) => return Err(Error::io("removing folder", &path, e)),
        }
    }
    if removed { sync_dir(dir) } else { Ok(()) }
}

fn parent(path: &Path) -> Result<&Path> {
    path.parent()
        .ok_or_else(|| Error::config("path", format!("{} has no parent folder", path.display())))
}

/// The hidden temp name beside `path` that a write goes through.
pub(super) fn temp_name(path: &Path) -> Result<PathBuf> {
    let dir = parent(path)?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::config("path", format!("{} has no file name", path.display())))?;
    Ok(dir.join(super::names::temp_name(name)))
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

/// Writes `bytes` to `path` atomically and durably, unless `path` already exists.
pub(super) fn write_new(path: &Path, bytes: &[u8]) -> Result<WriteOutcome> {
    let tmp = prepare_new(path, bytes)?;
    finish_new(&tmp, path)
}

/// The first half of [`write_new`]: `bytes` durable under a hidden temp name beside `path`
/// (returned), which nothing reads.
pub(super) fn prepare_new(path: &Path, bytes: &[u8]) -> Result<PathBuf> {
    create_dir_durable(parent(path)?)?;
    let tmp = temp_name(path)?;
    if let Err(e) = write_temp(&tmp, bytes) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(tmp)
}

/// The second half of [`write_new`]: links the prepared `tmp` to `path` unless `path`
/// exists, removes `tmp`, and fsyncs the folder.
pub(super) fn finish_new(tmp: &Path, path: &Path) -> Result<WriteOutcome> {
    let result = match link_noted(tmp, path) {
        Ok(()) => Ok(WriteOutcome::Written),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(WriteOutcome::AlreadyExists),
        Err(e) => Err(Error::io("linking into place", path, e)),
    };
    // The temp name is ours alone; failing to remove it leaves a hidden file readers skip.
    let _ = fs::remove_file(tmp);
    let outcome = result?;
    if outcome == WriteOutcome::Written {
        sync_dir(parent(path)?)?;
    }
    Ok(outcome)
}

/// Writes `bytes` to `path` atomically and durably, replacing a file of that name.
pub(super) fn write_replace(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent(path)?;
    create_dir_durable(dir)?;
    let tmp = temp_name(path)?;
    if let Err(e) = write_temp(&tmp, bytes) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    journal::note('N', path);
    fs::rename(&tmp, path).map_err(|e| Error::io("renaming into place", path, e))?;
    // The content was fsynced under the temp name: the same inode.
    journal::note('S', path);
    sync_dir(dir)
}

/// Moves the durable file `from` to `to` (replacing a file of that name), then fsyncs the
/// folders of both names.
pub(super) fn rename_durable(from: &Path, to: &Path) -> Result<()> {
    let (from_dir, to_dir) = (parent(from)?, parent(to)?);
    create_dir_durable(to_dir)?;
    journal::note('N', to);
    fs::rename(from, to).map_err(|e| Error::io("moving into place", from, e))?;
    // The content was fsynced under the old name: the same inode.
    journal::note('S', to);
    sync_dir(to_dir)?;
    if from_dir != to_dir {
        sync_dir(from_dir)?;
    }
    Ok(())
}

/// Hard-links the fsynced temp file `tmp` to `path` (which must not exist).
fn link_noted(tmp: &Path, path: &Path) -> std::io::Result<()> {
    journal::note('N', path);
    fs::hard_link(tmp, path)?;
    // The content was fsynced under the temp name: the same inode.
    journal::note('S', path);
    Ok(())
}

/// Fsyncs a folder so that the names created or removed in it are durable.
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("syncing folder", dir, e))?;
    journal::note('D', dir);
    Ok(())
}

/// Fsyncs a file's contents.
pub(super) fn sync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("syncing", path, e))?;
    journal::note('S', path);
    Ok(())
}

pub(super) fn read(path: &Path) -> Result<Option<Bytes>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(Bytes::from(b))),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("reading", path, e)),
    }
}

fn meta_of(name: String, m: &fs::Metadata) -> FileMeta {
    FileMeta {
        name,
        size: m.len(),
        modified_ms: m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as i64),
        e_tag: None,
    }
}

pub(super) fn head(path: &Path, name: String) -> Result<Option<FileMeta>> {
    match fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(Some(meta_of(name, &m))),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("reading metadata of", path, e)),
    }
}

pub(super) fn list_names(dir: &Path) -> Result<Vec<String>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        // Sub-folders are not files of this folder; the entry type is free on most file
        // systems (no stat).
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match entry.file_name().into_string() {
            Ok(n) => out.push(n),
            Err(raw) => {
                return Err(Error::io(
                    "listing (a file name is not UTF-8)",
                    dir.join(raw),
                    std::io::Error::from(ErrorKind::InvalidData),
                ));
            }
        }
    }
    Ok(out)
}

pub(super) fn list(dir: &Path) -> Result<Vec<FileMeta>> {
    let mut out = Vec::new();
    for name in list_names(dir)? {
        let path = dir.join(&name);
        match fs::metadata(&path) {
            Ok(m) if m.is_file() => out.push(meta_of(name, &m)),
            Ok(_) => {}
            // Deleted between listing and stat: not there any more.
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("reading metadata of", path, e)),
        }
    }
    Ok(out)
}

pub(super) fn remove_no_sync(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("removing", path, e)),
    }
}

pub(super) fn remove(path: &Path) -> Result<()> {
    remove_no_sync(path)?;
    sync_dir(parent(path)?)
}

/// Fsyncs `path` and its folder, and the folder's ancestors up to one already known to be
/// durable (for writes made by others, e.g. delta-rs, through [`super::DurableLocalStore`]).
pub(super) fn make_durable(path: &Path) -> Result<()> {
    sync_file(path)?;
    let mut dir = parent(path)?;
    sync_dir(dir)?;
    loop {
        let known = durable_dirs()
            .lock()
            .map(|s| s.contains(dir))
            .unwrap_or(false);
        let Some(up) = dir.parent() else { break };
        if known {
            break;
        }
        // `dir` may be new: its own entry lives in `up`.
        sync_dir(up)?;
        if let Ok(mut s) = durable_dirs().lock() {
            s.insert(dir.to_path_buf());
        }
        dir = up;
    }
    Ok(())
}
