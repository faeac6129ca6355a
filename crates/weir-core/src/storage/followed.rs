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
//! every watch and kept listing; a folder that is removed, moved, or no longer the one at its path (its
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
//!
//! A folder whose new files arrive under any name (a file source's input) is listed with
//! [`created_since`]: the first listing reads every entry and gives a [`Cursor`], the next
//! ones only the entries created or moved in since the cursor, from a journal of creations
//! the folder keeps once such a listing asked for it. No other name of such a folder is
//! kept. The journal is emptied by each listing and dropped past [`MAX_JOURNAL`] entries; a
//! cursor that does not match it (another reader, a dropped journal, a replaced folder) gets
//! every entry again, never fewer. A queue overflow drops every watch: the listing that
//! meets it reads the folder itself and the next one starts following afresh.

use std::collections::{BTreeSet, HashMap};
use std::mem::MaybeUninit;
use std::ops::Bound;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Creations a folder keeps for [`created_since`] between two listings; past this the journal
/// is dropped and the next listing gives every entry.
pub(super) const MAX_JOURNAL: usize = 10_000;

/// Numbers every emptying of a journal, across folders, so that no cursor matches a journal
/// that lost entries since the cursor was handed out.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// Where a reader of a folder's new entries stands: the journal generation its listing
/// started (see [`GENERATIONS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor(u64);

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
    with_folders(|f| f.names_after(dir, after))
}

/// The names of `dir`'s entries other than folders created (or moved in) since `cursor`, or
/// of all of them when the cursor is `None` or no longer matches, with the cursor for the
/// next listing. `None` when the folder is not followed: read it instead.
pub(super) fn created_since(dir: &Path, cursor: Option<Cursor>) -> Option<(Vec<String>, Cursor)> {
    with_folders(|f| f.created_since(dir, cursor))
}

/// Runs `list` on the followed folders, starting the follower if need be.
fn with_folders<T>(list: impl FnOnce(&mut Folders) -> Result<Option<T>, Errno>) -> Option<T> {
    let mut state = FOLLOWER.lock().ok()?;
    if matches!(*state, Follower::NotStarted) {
        // One attempt per process: where inotify is not available, every listing reads.
        *state = Follower::start();
    }
    let Follower::Running(f) = &mut *state else {
        return None;
    };
    match list(f) {
        Ok(listed) => listed,
        Err(_) => {
            // The event queue overflowed or could not be read: forget everything (closing
            // the descriptor removes the watches) and start again on the next listing.
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
    /// Entries other than folders created since the last [`created_since`] listing; `None`
    /// until one asks.
    journal: Option<Vec<String>>,
    /// Renewed whenever the journal is emptied (taken, dropped, or the folder forgotten).
    generation: u64,
}

fn next_generation() -> u64 {
    GENERATIONS.fetch_add(1, Ordering::Relaxed)
}

impl Folder {
    /// Drops the names kept for [`names_after`]; the journal goes on.
    fn forget_names(&mut self) {
        self.valid = false;
        self.files.clear();
        self.others.clear();
        self.floor = None;
        self.lowest = None;
        self.listings = 0;
    }

    /// Drops everything known of the folder: after this no cursor matches it.
    fn forget(&mut self) {
        self.forget_names();
        if let Some(j) = &mut self.journal {
            j.clear();
        }
        self.generation = next_generation();
    }

    /// Reads the folder afresh. `None` if it cannot be kept (a name that is not UTF-8, which
    /// the caller's own read reports).
    fn read(&mut self) -> Option<()> {
        self.forget_names();
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
        if !is_dir && let Some(j) = &mut self.journal {
            if j.len() >= MAX_JOURNAL {
                // Nobody listed for a long while: the next listing gives everything.
                j.clear();
                self.generation = next_generation();
            }
            j.push(name.to_string());
        }
        if !self.valid {
            return;
        }
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

/// The names of the folder's entries other than sub-folders; `None` if it cannot be read or
/// a name is not UTF-8 (the caller's own read reports it).
fn read_names(dir: &Path) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        if entry.file_type().ok()?.is_dir() {
            continue;
        }
        out.push(entry.file_name().into_string().ok()?);
    }
    Some(out)
}

impl Folders {
    fn names_after(&mut self, dir: &Path, after: After<'_>) -> Result<Option<Vec<String>>, Errno> {
        self.drain()?;
        Ok(self.followed(dir).and_then(|wd| self.list(wd, after)))
    }

    /// The watch of `dir`, started if need be; `None` if it cannot be followed.
    fn followed(&mut self, dir: &Path) -> Option<i32> {
        let meta = std::fs::metadata(dir).ok()?;
        if !meta.is_dir() {
            return None;
        }
        self.clock += 1;
        let found = self
            .by_watch
            .iter()
            .find(|(_, f)| f.path == dir)
            .map(|(wd, f)| (*wd, f.dev == meta.dev() && f.ino == meta.ino()));
        match found {
            Some((wd, true)) => Some(wd),
            Some((wd, false)) => {
                // Another folder now sits at this path.
                self.unwatch(wd);
                self.watch(dir, &meta)
            }
            None => self.watch(dir, &meta),
        }
    }

    fn created_since(
        &mut self,
        dir: &Path,
        cursor: Option<Cursor>,
    ) -> Result<Option<(Vec<String>, Cursor)>, Errno> {
        self.drain()?;
        let Some(wd) = self.followed(dir) else {
            return Ok(None);
        };
        let clock = self.clock;
        let Some(f) = self.by_watch.get_mut(&wd) else {
            return Ok(None);
        };
        f.last_used = clock;
        let journal = f.journal.get_or_insert_with(Vec::new);
        let since = Cursor(f.generation);
        // The journal is emptied here either way: only this reader's next cursor matches it.
        f.generation = next_generation();
        let names = if cursor == Some(since) {
            // A name created twice since (replaced, or deleted and written again) once.
            let mut names = std::mem::take(journal);
            names.sort_unstable();
            names.dedup();
            names
        } else {
            // Everything, read now: the watch is older than this read, so whatever changes
            // from here on reaches the journal. The names are not kept (an input folder may
            // hold millions), unless listings from a name keep them anyway.
            journal.clear();
            if f.valid && f.floor.is_none() {
                f.note_listing(After::All);
                f.files.iter().chain(f.others.iter()).cloned().collect()
            } else {
                match read_names(&f.path) {
                    Some(names) => names,
                    None => {
                        f.forget();
                        return Ok(None);
                    }
                }
            }
        };
        Ok(Some((names, Cursor(f.generation))))
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
            journal: None,
            generation: next_generation(),
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
                // Events were lost, a folder's removal among them perhaps (its watch would
                // then be dead while a new folder sits at the same path, maybe on the same
                // inode): start again with no watches at all.
                return Err(Errno::OVERFLOW);
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
            if !f.valid && f.journal.is_none() {
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

/// How many names are kept for `dir` besides its journal (for tests).
#[cfg(test)]
pub(super) fn kept_for(dir: &Path) -> Option<usize> {
    match FOLLOWER.lock().as_deref() {
        Ok(Follower::Running(f)) => f
            .by_watch
            .values()
            .find(|f| f.path == dir)
            .map(|f| f.files.len() + f.others.len()),
        _ => None,
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::{Cursor, created_since};

    /// What `list_names` gives: every entry but folders.
    fn present(dir: &Path) -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| !e.file_type().unwrap().is_dir())
            .map(|e| e.file_name().into_string().unwrap())
            .collect()
    }

    fn since(dir: &Path, cursor: Option<Cursor>) -> (BTreeSet<String>, Cursor) {
        let (names, next) = created_since(dir, cursor).expect("a temp folder is followed");
        (names.into_iter().collect(), next)
    }

    /// After the first listing only new entries come back, and a reader that takes every
    /// listing has been given every file the folder holds, whatever happened to it.
    #[test]
    fn listings_since_a_cursor_give_the_new_entries_and_never_miss_one() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in [raw] é");
        std::fs::create_dir(&input).unwrap();
        for n in ["a[1].json", "space 1.json", "ü (copy).json"] {
            std::fs::write(input.join(n), n).unwrap();
        }
        std::fs::create_dir(input.join("sub")).unwrap();
        let (first, c1) = since(&input, None);
        assert_eq!(
            first,
            present(&input),
            "the first listing gives everything but folders"
        );
        let (nothing, c2) = since(&input, Some(c1));
        assert!(nothing.is_empty(), "{nothing:?}");
        assert_eq!(
            super::kept_for(&input),
            Some(0),
            "an input folder's names are not kept"
        );

        std::fs::write(input.join("b[2].json"), "b").unwrap();
        std::fs::write(dir.path().join("outside.json"), "o").unwrap();
        std::fs::rename(dir.path().join("outside.json"), input.join("moved in.json")).unwrap();
        std::os::unix::fs::symlink(input.join("a[1].json"), input.join("link.json")).unwrap();
        std::fs::create_dir(input.join("sub2")).unwrap();
        std::fs::remove_file(input.join("space 1.json")).unwrap();
        std::fs::write(input.join("gone.json"), "g").unwrap();
        std::fs::remove_file(input.join("gone.json")).unwrap();
        let (new, c3) = since(&input, Some(c2));
        let want: BTreeSet<String> = ["b[2].json", "moved in.json", "link.json", "gone.json"]
            .map(String::from)
            .into();
        assert_eq!(new, want, "creations, moves in and links; no folders");

        // A stale cursor, or another reader's listing in between, gives everything again.
        let (all, _) = since(&input, Some(c1));
        assert!(all.is_superset(&present(&input)), "{all:?}");
        std::fs::write(input.join("c.json"), "c").unwrap();
        let (_, other) = since(&input, None);
        let (all, c4) = since(&input, Some(c3));
        assert!(all.is_superset(&present(&input)), "{all:?}");
        assert_ne!(Some(other), None);

        // Random changes: what a reader was given always covers what is there.
        let mut handed: BTreeSet<String> = all;
        let mut cursor = c4;
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for step in 0..600u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let name = format!("f {} [{}].json", x % 97, step % 3);
            match x % 5 {
                0 | 1 => std::fs::write(input.join(&name), "x").unwrap(),
                2 => {
                    let _ = std::fs::remove_file(input.join(&name));
                }
                3 => {
                    std::fs::write(dir.path().join("tmp"), "t").unwrap();
                    std::fs::rename(dir.path().join("tmp"), input.join(&name)).unwrap();
                }
                _ => {
                    if input.join(&name).exists() {
                        std::fs::rename(input.join(&name), dir.path().join("away")).unwrap();
                    }
                }
            }
            // Deleted and created again: given again, as a new file.
            if x.is_multiple_of(7) {
                let again = format!("f {} [{}].json", (x >> 8) % 97, step % 3);
                if handed.contains(&again) && input.join(&again).exists() {
                    std::fs::remove_file(input.join(&again)).unwrap();
                    handed.remove(&again);
                    std::fs::write(input.join(&again), "again").unwrap();
                }
            }
            if step.is_multiple_of(4) {
                let (new, next) = since(&input, Some(cursor));
                handed.extend(new);
                cursor = next;
                let missed: Vec<_> = present(&input).difference(&handed).cloned().collect();
                assert!(missed.is_empty(), "step {step}: never given {missed:?}");
            }
        }
        // The folder replaced by another at the same path: everything, afresh.
        std::fs::rename(&input, dir.path().join("old")).unwrap();
        std::fs::create_dir(&input).unwrap();
        std::fs::write(input.join("fresh.json"), "f").unwrap();
        let (all, c5) = since(&input, Some(cursor));
        assert_eq!(all, present(&input));
        // A name that is not UTF-8 cannot be handed out: the caller reads, and reports it.
        use std::os::unix::ffi::OsStrExt;
        let bad = input.join(std::ffi::OsStr::from_bytes(b"bad \xff.json"));
        std::fs::write(&bad, "b").unwrap();
        assert!(created_since(&input, Some(c5)).is_none());
        assert!(created_since(&input, None).is_none());
        std::fs::remove_file(&bad).unwrap();
        let (all, _) = since(&input, None);
        assert_eq!(all, present(&input));
    }

    /// More changes than the kernel queues between two listings (here a folder emptied and
    /// made again, which may reuse its inode): the follower starts afresh, and files created
    /// after are still given.
    #[test]
    fn after_a_queue_overflow_a_remade_folder_is_still_followed() {
        let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in");
        std::fs::create_dir(&input).unwrap();
        let (_, cursor) = since(&input, None);
        for i in 0..limit + 100 {
            std::fs::write(input.join(format!("{i}.json")), "").unwrap();
        }
        std::fs::remove_dir_all(&input).unwrap();
        std::fs::create_dir(&input).unwrap();
        std::fs::write(input.join("first.json"), "f").unwrap();
        // The listing that meets the overflow lets the caller read; any other gives all.
        let mut cursor = match created_since(&input, Some(cursor)) {
            None => None,
            Some((names, next)) => {
                assert!(names.contains(&"first.json".to_string()), "{names:?}");
                Some(next)
            }
        };
        if cursor.is_none() {
            let (all, next) = since(&input, None);
            assert_eq!(all, present(&input));
            cursor = Some(next);
        }
        std::fs::write(input.join("after.json"), "a").unwrap();
        let (new, _) = since(&input, cursor);
        assert!(new.contains("after.json"), "{new:?}");
    }
}
