//! Listings of local folders that grow by a file per batch, at a cost per new entry.
//!
//! A local folder cannot be listed "from a name on": `read_dir` returns every entry, so a
//! Delta table's `_delta_log`, which gains a commit file per batch and keeps them for 30 days
//! by default, made every listing (delta-rs lists it three times per batch) slower than the
//! last: 100,000 entries take some 50 ms to read. Here a folder is read once and then
//! followed with inotify: the names are kept sorted in memory and each listing first applies
//! the creations, deletions and renames the kernel queued since the last one.
//!
//! Why the kept names are exact: the watch is added before the folder is read, events are
//! queued by the kernel while the changing call runs (so before it returns to whoever made
//! it), and every event sets a name's presence absolutely (created: there; deleted or moved
//! away: not there). Applying, in order, all events queued since the watch to any state the
//! folder passed through after it gives the folder's present state. A queue overflow drops
//! every kept listing; a folder that is removed, moved, or no longer the one at its path (its
//! device and inode are checked on every listing) is forgotten and read afresh.
//!
//! Only folders on local file systems are followed (inotify does not see what another
//! machine writes to a network file system); anything else, or any inotify failure, makes
//! the caller read the folder as before.
//!
//! Memory stays bounded: after every [`TRIM_EVERY`] listings of a folder, names below the
//! lowest name any of those listings started after are let go (a later listing from below
//! them reads the folder again), so a Delta log keeps about the names since its last
//! checkpoint, not its whole history.

use std::collections::{BTreeSet, HashMap};
use std::mem::MaybeUninit;
use std::ops::Bound;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::io::Errno;

/// At most this many folders are followed at once (the least recently listed goes first).
const MAX_FOLDERS: usize = 64;
/// Listings of a folder between two trims of the names kept for it.
pub(super) const TRIM_EVERY: u32 = 1_000;

/// File-system magic numbers (`statfs.f_type`) of local file systems, whose every change
/// inotify reports: ext2/3/4, XFS, Btrfs, tmpfs, overlayfs, ZFS, F2FS, ramfs, bcachefs,
/// JFS, ReiserFS.
const LOCAL_FILE_SYSTEMS: [u32; 11] = [
    0xEF53,
    0x5846_5342,
    0x9123_683E,
    0x0102_1994,
    0x794C_7630,
    0x2FC1_2FC1,
    0xF2F5_2010,
    0x8584_58F6,
    0xCA45_1A4E,
    0x3153_464A,
    0x5265_4973,
];

/// Where a listing starts.
#[derive(Debug, Clone, Copy)]
pub(super) enum After<'a> {
    /// Every file.
    All,
    /// Files whose names sort after this.
    Name(&'a str),
}

/// The names of `dir`'s entries a listing starting at `after` must look at: its files that
/// sort after `after` and all its other entries (folders, links), whatever their names.
/// `None` when the folder is not followed: read it instead.
pub(super) fn names_after(dir: &Path, after: After<'_>) -> Option<Vec<String>> {
    let mut state = FOLLOWER.lock().ok()?;
    if matches!(*state, Follower::NotStarted) {
        // One attempt per process: where inotify is not available, every listing reads.
        *state = Follower::start();
    }
    let Follower::Running(f) = &mut *state else {
        return None;
    };
    match f.names_after(dir, after) {
        Ok(names) => names,
        Err(_) => {
            // The event queue could not be read: forget everything (closing the descriptor
            // removes the watches) and start again on the next listing.
            *state = Follower::NotStarted;
            None
        }
    }
}

static FOLLOWER: Mutex<Follower> = Mutex::new(Follower::NotStarted);

enum Follower {
    NotStarted,
    Unavailable,
    Running(Folders),
}

impl Follower {
    fn start() -> Follower {
        match inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC) {
            Ok(fd) => Follower::Running(Folders {
                fd,
                by_watch: HashMap::new(),
                buf: vec![MaybeUninit::uninit(); 64 * 1024],
                clock: 0,
            }),
            Err(_) => Follower::Unavailable,
        }
    }
}

struct Folders {
    fd: OwnedFd,
    by_watch: HashMap<i32, Folder>,
    buf: Vec<MaybeUninit<u8>>,
    clock: u64,
}

struct Folder {
    path: PathBuf,
    dev: u64,
    ino: u64,
    /// False until read, and after a queue overflow.
    valid: bool,
    /// Regular files (by the event or the listing that added them), from `floor` on.
    files: BTreeSet<String>,
    /// Everything else: folders, links, whatever a created entry turned out to be.
    others: BTreeSet<String>,
    /// Files sorting below this are not kept.
    floor: Option<String>,
    /// The lowest start of the listings since the last trim (`None`: one listed all).
    lowest: Option<String>,
    listings: u32,
    last_used: u64,
}

impl Folder {
    fn forget(&mut self) {
        self.valid = false;
        self.files.clear();
        self.others.clear();
        self.floor = None;
        self.lowest = None;
        self.listings = 0;
    }

    /// Reads the folder afresh. `None` if it cannot be kept (a name that is not UTF-8, which
    /// the caller's own read reports).
    fn read(&mut self) -> Option<()> {
        self.forget();
        for entry in std::fs::read_dir(&self.path).ok()? {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            if entry.file_type().ok()?.is_file() {
                self.files.insert(name);
            } else {
                self.others.insert(name);
            }
        }
        self.valid = true;
        Some(())
    }

    fn created(&mut self, name: &str, is_dir: bool) {
        let is_file = !is_dir
            && std::fs::symlink_metadata(self.path.join(name)).map_or(true, |m| m.is_file());
        if is_file {
            if self.floor.as_deref().is_none_or(|f| name >= f) {
                self.files.insert(name.to_string());
            }
        } else {
            self.others.insert(name.to_string());
        }
    }

    fn removed(&mut self, name: &str) {
        self.files.remove(name);
        self.others.remove(name);
    }

    /// Notes a listing's start; every `TRIM_EVERY` listings lets go of the names below the
    /// lowest start.
    fn note_listing(&mut self, after: After<'_>) {
        if self.listings == 0 {
            self.lowest = match after {
                After::All => None,
                After::Name(n) => Some(n.to_string()),
            };
        } else if let Some(low) = &self.lowest {
            match after {
                After::All => self.lowest = None,
                After::Name(n) if n < low.as_str() => self.lowest = Some(n.to_string()),
                After::Name(_) => {}
            }
        }
        self.listings += 1;
        if self.listings >= TRIM_EVERY {
            if let Some(low) = self.lowest.take() {
                self.files = self.files.split_off(low.as_str());
                self.floor = Some(low);
            }
            self.listings = 0;
        }
    }
}

impl Folders {
    fn names_after(&mut self, dir: &Path, after: After<'_>) -> Result<Option<Vec<String>>, Errno> {
        self.drain()?;
        let Ok(meta) = std::fs::metadata(dir) else {
            return Ok(None);
        };
        if !meta.is_dir() {
            return Ok(None);
        }
        self.clock += 1;
        let found = self
            .by_watch
            .iter()
            .find(|(_, f)| f.path == dir)
            .map(|(wd, f)| (*wd, f.dev == meta.dev() && f.ino == meta.ino()));
        let wd = match found {
            Some((wd, true)) => wd,
            Some((wd, false)) => {
                // Another folder now sits at this path.
                self.unwatch(wd);
                return Ok(self.watch(dir, &meta).and_then(|wd| self.list(wd, after)));
            }
            None => match self.watch(dir, &meta) {
                Some(wd) => wd,
                None => return Ok(None),
            },
        };
        Ok(self.list(wd, after))
    }

    fn list(&mut self, wd: i32, after: After<'_>) -> Option<Vec<String>> {
        let clock = self.clock;
        let f = self.by_watch.get_mut(&wd)?;
        f.last_used = clock;
        let below_floor = match (after, &f.floor) {
            (_, None) => false,
            (After::All, Some(_)) => true,
            (After::Name(n), Some(floor)) => n < floor.as_str(),
        };
        if (!f.valid || below_floor) && f.read().is_none() {
            f.forget();
            return None;
        }
        f.note_listing(after);
        let files = match after {
            After::All => f.files.range::<str, _>(..),
            After::Name(n) => f
                .files
                .range::<str, _>((Bound::Excluded(n), Bound::Unbounded)),
        };
        Some(files.chain(f.others.iter()).cloned().collect())
    }

    /// Starts following `dir`; `None` if it is not on a local file system or cannot be
    /// watched.
    fn watch(&mut self, dir: &Path, meta: &std::fs::Metadata) -> Option<i32> {
        let fs = rustix::fs::statfs(dir).ok()?;
        let kind = u32::try_from(fs.f_type & 0xFFFF_FFFF).ok()?;
        if !LOCAL_FILE_SYSTEMS.contains(&kind) {
            return None;
        }
        if self.by_watch.len() >= MAX_FOLDERS {
            let oldest = self
                .by_watch
                .iter()
                .min_by_key(|(_, f)| f.last_used)
                .map(|(wd, _)| *wd)?;
            self.unwatch(oldest);
        }
        let mask = WatchFlags::CREATE
            | WatchFlags::DELETE
            | WatchFlags::MOVED_FROM
            | WatchFlags::MOVED_TO
            | WatchFlags::DELETE_SELF
            | WatchFlags::MOVE_SELF
            | WatchFlags::ONLYDIR;
        let wd = inotify::add_watch(&self.fd, dir, mask).ok()?;
        // The same folder reached by another path (a bind mount) has the same watch: the
        // names kept are the same, so the newest path is kept with them.
        let folder = self.by_watch.entry(wd).or_insert_with(|| Folder {
            path: dir.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
            valid: false,
            files: BTreeSet::new(),
            others: BTreeSet::new(),
            floor: None,
            lowest: None,
            listings: 0,
            last_used: 0,
        });
        folder.path = dir.to_path_buf();
        Some(wd)
    }

    fn unwatch(&mut self, wd: i32) {
        if self.by_watch.remove(&wd).is_some() {
            // Fails only if the kernel already dropped the watch: nothing is left to do.
            let _ = inotify::remove_watch(&self.fd, wd);
        }
    }

    /// Applies every queued event.
    fn drain(&mut self) -> Result<(), Errno> {
        let mut gone = Vec::new();
        let mut reader = inotify::Reader::new(&self.fd, &mut self.buf);
        loop {
            let ev = match reader.next() {
                Ok(ev) => ev,
                Err(Errno::AGAIN) => break,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e),
            };
            let flags = ev.events();
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                self.by_watch.values_mut().for_each(Folder::forget);
                continue;
            }
            let Some(f) = self.by_watch.get_mut(&ev.wd()) else {
                continue;
            };
            if flags.intersects(
                ReadFlags::IGNORED
                    | ReadFlags::DELETE_SELF
                    | ReadFlags::MOVE_SELF
                    | ReadFlags::UNMOUNT,
            ) {
                gone.push(ev.wd());
                f.forget();
                continue;
            }
            if !f.valid {
                continue;
            }
            let Some(name) = ev.file_name().and_then(|n| n.to_str().ok()) else {
                // A name that is not UTF-8: read the folder again (and let that fail).
                f.forget();
                continue;
            };
            if flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
                f.created(name, flags.contains(ReadFlags::ISDIR));
            } else if flags.intersects(ReadFlags::DELETE | ReadFlags::MOVED_FROM) {
                f.removed(name);
            }
        }
        for wd in gone {
            self.unwatch(wd);
        }
        Ok(())
    }
}

/// How many folders are followed and how many names are kept for them (for tests).
#[cfg(test)]
pub(super) fn kept() -> (usize, usize) {
    match FOLLOWER.lock().as_deref() {
        Ok(Follower::Running(f)) => (
            f.by_watch.len(),
            f.by_watch
                .values()
                .map(|f| f.files.len() + f.others.len())
                .sum(),
        ),
        _ => (0, 0),
    }
}
