//! The file source: a folder of JSON-lines, CSV or Parquet files, local or on an object
//! store.
//!
//! New files are taken in order of modification time, then name (newest first with
//! `latest_first`), at most `max_files_per_trigger` a batch. The files each batch takes,
//! with their size (and ETag on object stores), are written to the source's own log,
//! `<checkpoint>/sources/<i>/<logOffset>`, before the offset `{"logOffset":N}` is handed to
//! the engine, so a replay reads exactly the same files even if more arrived. Every read
//! checks each file against what was recorded: a file that changed or vanished stops the
//! query with an error naming it and the batch, instead of reading other data.
//!
//! Names are taken literally (`a[1].json`, spaces, `%`, unicode): no glob patterns. A name is
//! taken once: a file written again under a name already taken is not read again (files are
//! taken as immutable, as Spark does), and a followed folder does not offer such a name again
//! even after `max_file_age` forgets it.
//! Files whose names start with `.` or `_` are skipped (writers put temp files there).
//!
//! Per batch the work does not grow with history: a listing is kept as a queue of files
//! not yet taken and the folder is listed again only when the queue is empty; only new
//! names are looked at (`stat`/`HEAD`). A local folder is followed with inotify after its
//! first listing (on local file systems), so a later listing costs the files created since,
//! not every file the folder holds; elsewhere each listing reads the whole folder. What the
//! source remembers, the files already taken, is bounded by `max_file_age` (files older than
//! that, relative to the newest file taken, are forgotten and ignored, as Spark's `maxFileAge`;
//! a backlog is read whole, oldest first) and by `clean_source` (files of
//! committed batches are deleted or archived, then forgotten, as Spark's `cleanSource`).
//! Without either it grows by one entry per file taken.
//!
//! Every 10th log entry is written as `<N>.compact` holding the entries still needed: the
//! remembered files and the batches within retention.

mod leaf;
mod log;
mod options;
mod read;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::{DataFrame, SessionContext};
use futures::{StreamExt, TryStreamExt};

use super::decode::{BadRecordMode, output_schema};
use super::{ReadLimit, Source, SourceInit, SourceOffset};
use crate::error::{Error, Result};
use crate::logfile::retention::{Purge, log_keep_from, purge};
use crate::storage::{FileMeta, ListingCursor, Location, blocking, is_hidden};
pub use leaf::{FilesScan, RECORDED_FILES, RecordedFilesExec};
pub use log::FileEntry;
use log::{COMPACT_INTERVAL, entry_name};
pub use options::{CleanSource, FileFormat, FileSourceOptions};

#[derive(Debug, Default)]
struct State {
    log: Option<Location>,
    /// The checkpoint's query id (names the dead letter's files).
    query_id: uuid::Uuid,
    retain: u64,
    /// Entries of the batches still needed for reading (replay) and compaction.
    entries: BTreeMap<u64, Vec<FileEntry>>,
    /// Files taken and not yet forgotten, by name: only what deduplication, `max_file_age`,
    /// `clean_source` and the compact log entry need, since a folder that only grows keeps
    /// one of these per file for the life of the query.
    seen: HashMap<String, Seen>,
    newest_timestamp: i64,
    /// Listed, not yet taken, in the order to take them.
    queue: VecDeque<FileMeta>,
    /// Where the last listing of a followed local folder left off.
    listing: Option<ListingCursor>,
    /// For AvailableNow: the names present when the query started, not yet taken.
    available_now: Option<HashSet<String>>,
    /// Rows that failed to parse in the last read (PERMISSIVE / DROPMALFORMED).
    malformed: u64,
    /// Committed batches whose files are cleaned (clean_source) up to here.
    cleaned_through: Option<u64>,
    /// Log entries below this are deleted (`None`: not known yet in this run).
    log_purged_below: Option<u64>,
}

/// What the source remembers of a file it took.
#[derive(Debug, Clone, Copy)]
struct Seen {
    timestamp: i64,
    batch_id: u64,
}

impl From<&FileEntry> for Seen {
    fn from(e: &FileEntry) -> Self {
        Seen {
            timestamp: e.timestamp,
            batch_id: e.batch_id,
        }
    }
}

/// A folder of files as a replayable source. See the module docs.
#[derive(Debug)]
pub struct FileSource {
    opts: FileSourceOptions,
    schema: SchemaRef,
    state: Mutex<State>,
}

impl FileSource {
    /// Checks the options; for Parquet without a schema reads it from the oldest file.
    pub async fn new(opts: FileSourceOptions) -> Result<Self> {
        if opts.latest_first && opts.max_file_age.is_some() {
            tracing::warn!(
                "{}: max_file_age is not applied with latest_first (as Spark), so no file of a \
                 backlog is dropped after a restart",
                opts.path.url_string()
            );
        }
        let base = match (&opts.schema, &opts.format) {
            (Some(s), _) => s.clone(),
            (None, FileFormat::Parquet) => Self::parquet_schema(&opts.path).await?,
            (None, _) => {
                return Err(Error::config(
                    "schema",
                    format!(
                        "the file source on {} needs a schema for {:?} files; give one with .schema(..)",
                        opts.path, opts.format
                    ),
                ));
            }
        };
        opts.check_modes("")?;
        let schema = output_schema(&base, opts.mode);
        Ok(FileSource {
            opts: FileSourceOptions {
                schema: Some(base),
                ..opts
            },
            schema,
            state: Mutex::new(State::default()),
        })
    }

    async fn parquet_schema(dir: &Location) -> Result<SchemaRef> {
        let mut files: Vec<FileMeta> = dir
            .list()
            .await?
            .into_iter()
            .filter(|f| !is_hidden(&f.name) && f.size > 0)
            .collect();
        files.sort_by(|a, b| (a.modified_ms, &a.name).cmp(&(b.modified_ms, &b.name)));
        let Some(first) = files.first() else {
            return Err(Error::config(
                "schema",
                format!(
                    "{dir} has no Parquet file to read the schema from yet; give the schema explicitly"
                ),
            ));
        };
        let shown = dir.describe(&first.name);
        let bytes = dir.get(&first.name).await?.unwrap_or_default();
        blocking(move || read::parquet_schema(bytes, &shown)).await
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| self.err("internal state poisoned by an earlier panic"))
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::from_source(self.description(), reason.into())
    }

    fn log_offset(&self, o: &SourceOffset) -> Result<u64> {
        o.json()
            .get("logOffset")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| {
                self.err(format!(
                    "offset {o} is not a file source offset {{\"logOffset\":N}}"
                ))
            })
    }

    /// The oldest modification time still taken, given the newest file taken. With
    /// `latest_first` there is no such bound (Spark's rule, SPARK-19813): the newest file is
    /// taken first, so every older one of a backlog would fall out of the age after a restart.
    fn oldest_allowed(&self, newest: i64) -> i64 {
        if self.opts.latest_first {
            return i64::MIN;
        }
        self.opts.max_file_age.map_or(i64::MIN, |age| {
            newest.saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX))
        })
    }

    fn entry_for(&self, f: &FileMeta, batch_id: u64) -> FileEntry {
        FileEntry {
            path: self.opts.path.file_url_encoded(&f.name),
            timestamp: f.modified_ms,
            batch_id,
            size: Some(f.size),
            etag: f.e_tag.clone(),
        }
    }

    /// Lists the folder again and queues the files not taken yet, in the order to take them.
    async fn refill(&self) -> Result<()> {
        let dir = &self.opts.path;
        // Whether a listed name is new: checked against the state in place (copying every
        // name seen, once per listing, cost time and memory that grew with the query's age).
        let unknown = |names: Vec<String>| -> Result<(Vec<String>, i64)> {
            let st = self.lock()?;
            let queued: HashSet<&str> = st.queue.iter().map(|f| f.name.as_str()).collect();
            let fresh = names
                .into_iter()
                .filter(|n| {
                    !is_hidden(n) && !st.seen.contains_key(n) && !queued.contains(n.as_str())
                })
                .collect();
            Ok((fresh, st.newest_timestamp))
        };
        // Locally a listing gives names only (after the first, only the names created since,
        // when the folder can be followed): stat just the new ones.
        let (metas, newest, cursor) = if dir.is_local() {
            // The cursor moves on once the names it covers are queued (see `latest_offset`
            // for what an error does).
            let mut cursor = self.lock()?.listing.take();
            let listed = dir.list_new_names(&mut cursor).await?;
            let (names, newest) = unknown(listed)?;
            let mut out = Vec::with_capacity(names.len());
            for n in names {
                if let Some(m) = dir.head(&n).await? {
                    out.push(m);
                }
            }
            (out, newest, cursor)
        } else {
            let mut listed: HashMap<String, FileMeta> = dir
                .list()
                .await?
                .into_iter()
                .map(|f| (f.name.clone(), f))
                .collect();
            let (names, newest) = unknown(listed.keys().cloned().collect())?;
            let out: Vec<FileMeta> = names.iter().filter_map(|n| listed.remove(n)).collect();
            (out, newest, None)
        };
        // Age counts from the newest file taken, not the newest listed (Spark's rule): a
        // backlog that spans more than max_file_age is still read whole, oldest first, and
        // only files older than what was already taken, by more than the age, are ignored.
        let oldest = self.oldest_allowed(newest);
        let mut fresh: Vec<FileMeta> = metas
            .into_iter()
            .filter(|m| m.modified_ms >= oldest)
            .collect();
        fresh.sort_by(|a, b| (a.modified_ms, &a.name).cmp(&(b.modified_ms, &b.name)));
        if self.opts.latest_first {
            fresh.reverse();
        }
        let mut st = self.lock()?;
        st.queue.extend(fresh);
        st.listing = cursor;
        Ok(())
    }

    /// The offset of the next batch: its files taken from the queue and recorded.
    async fn next_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let start_id = start.map(|s| self.log_offset(s)).transpose()?;
        let next_id = start_id.map_or(0, |s| s + 1);
        let log = {
            let st = self.lock()?;
            // An attempt that crashed after writing its file list but before offsets/N:
            // hand out exactly that entry again.
            if st.entries.contains_key(&next_id) {
                return Ok(Some(log_offset(next_id)));
            }
            st.log
                .clone()
                .ok_or_else(|| self.err("latest_offset called before open"))?
        };
        if self.lock()?.queue.is_empty() {
            self.refill().await?;
        }
        let max = limit.max_files.unwrap_or(usize::MAX).max(1);
        let mut take: Vec<FileEntry> = Vec::new();
        while take.len() < max {
            let candidate = {
                let mut st = self.lock()?;
                let Some(f) = st.queue.pop_front() else { break };
                if st.seen.contains_key(&f.name)
                    || st
                        .available_now
                        .as_ref()
                        .is_some_and(|a| !a.contains(&f.name))
                {
                    continue;
                }
                f
            };
            // Look again now: the size and time recorded are what the read will check.
            let Some(now) = self.opts.path.head(&candidate.name).await? else {
                continue;
            };
            take.push(self.entry_for(&now, next_id));
        }
        if take.is_empty() {
            return Ok(start.cloned());
        }
        self.record(&log, next_id, &take).await?;
        let mut st = self.lock()?;
        for e in &take {
            let name = e.name();
            if let Some(a) = st.available_now.as_mut() {
                a.remove(&name);
            }
            st.newest_timestamp = st.newest_timestamp.max(e.timestamp);
            st.seen.insert(name, Seen::from(e));
        }
        st.entries.insert(next_id, take);
        Ok(Some(log_offset(next_id)))
    }

    /// Writes the log entry of `id` taking `take`, compacting every 10th: a compact entry
    /// holds every file still remembered (path, time and batch, as Spark records them) and
    /// the full entries of the batches still retained for a replay.
    async fn record(&self, log: &Location, id: u64, take: &[FileEntry]) -> Result<()> {
        if !entry_name(id).ends_with(".compact") {
            let refs: Vec<&FileEntry> = take.iter().collect();
            return log::write(log, id, &refs).await;
        }
        let (older, retained) = {
            let st = self.lock()?;
            let floor = (id + 1).saturating_sub(st.retain);
            let mut older: Vec<(&String, &Seen)> =
                st.seen.iter().filter(|(_, s)| s.batch_id < floor).collect();
            older.sort_unstable_by_key(|(n, s)| (s.batch_id, *n));
            let older: Vec<FileEntry> = older
                .into_iter()
                .map(|(n, s)| FileEntry {
                    path: self.opts.path.file_url_encoded(n),
                    timestamp: s.timestamp,
                    batch_id: s.batch_id,
                    size: None,
                    etag: None,
                })
                .collect();
            let retained: Vec<FileEntry> = st
                .entries
                .range(floor..)
                .flat_map(|(_, es)| es.iter().cloned())
                .collect();
            (older, retained)
        };
        let refs: Vec<&FileEntry> = older.iter().chain(&retained).chain(take).collect();
        log::write(log, id, &refs).await
    }

    /// Deletes or archives the files of committed batches up to `end_id`, then forgets them.
    async fn clean(&self, end_id: u64) -> Result<()> {
        let archive = match &self.opts.clean_source {
            CleanSource::Off => return Ok(()),
            CleanSource::Delete => None,
            CleanSource::Archive(to) => Some(to.clone()),
        };
        let doomed: Vec<String> = {
            let st = self.lock()?;
            if st.cleaned_through.is_some_and(|c| c >= end_id) {
                return Ok(());
            }
            st.seen
                .iter()
                .filter(|(_, s)| s.batch_id <= end_id)
                .map(|(n, _)| n.clone())
                .collect()
        };
        let dir = &self.opts.path;
        for name in &doomed {
            if let Some(to) = &archive
                && let Some(bytes) = dir.get(name).await?
            {
                to.put(name, bytes).await?;
            }
        }
        dir.delete_many(doomed.clone()).await?;
        let mut st = self.lock()?;
        for n in &doomed {
            st.seen.remove(n);
        }
        st.cleaned_through = Some(end_id);
        Ok(())
    }
}

#[async_trait]
impl Source for FileSource {
    fn description(&self) -> String {
        format!("FileStreamSource[{}]", self.opts.path.url_string())
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn reads_on_workers(&self) -> bool {
        // The workers' reads do not write a dead letter.
        self.opts.dead_letter.is_none()
    }

    async fn open(&self, init: &SourceInit) -> Result<()> {
        // A local folder that is not there is a mistake (a typo, a volume not mounted), not
        // an empty stream: Spark refuses it too ("Path does not exist"). An object store
        // has no folders to be missing.
        if let Some(path) = self.opts.path.local_path()
            && !path.is_dir()
        {
            return Err(Error::config(
                "source.path",
                format!(
                    "Path does not exist: {} is not a folder; a local source folder must be \
                     there when the query starts (create it, empty if need be)",
                    path.display()
                ),
            ));
        }
        let entries = log::read(&init.log).await?;
        let newest = entries
            .values()
            .flatten()
            .map(|e| e.timestamp)
            .max()
            .unwrap_or(0);
        let oldest = self.oldest_allowed(newest);
        let mut st = self.lock()?;
        st.seen = entries
            .values()
            .flatten()
            .filter(|e| e.timestamp >= oldest)
            .map(|e| (e.name(), Seen::from(e)))
            .collect();
        st.newest_timestamp = newest;
        st.entries = entries;
        st.log = Some(init.log.clone());
        st.query_id = init.query_id;
        st.retain = init.retain_batches.max(2);
        st.queue.clear();
        // What was queued is gone: the next listing must give every file again.
        st.listing = None;
        Ok(())
    }

    async fn prepare_available_now(&self) -> Result<()> {
        let names: HashSet<String> = self
            .opts
            .path
            .list_names()
            .await?
            .into_iter()
            .filter(|n| !is_hidden(n))
            .collect();
        let mut st = self.lock()?;
        let names = names
            .into_iter()
            .filter(|n| !st.seen.contains_key(n))
            .collect();
        st.available_now = Some(names);
        Ok(())
    }

    async fn reached_available_now(&self) -> Result<bool> {
        // Files present at start that vanished or fell out of max_file_age are not data to
        // read: only those still in the folder and still allowed count.
        let left: Vec<String> = {
            let st = self.lock()?;
            match &st.available_now {
                Some(a) => a.iter().cloned().collect(),
                None => return Ok(true),
            }
        };
        let newest = self.lock()?.newest_timestamp;
        let oldest = self.oldest_allowed(newest);
        for n in left {
            if let Some(m) = self.opts.path.head(&n).await?
                && m.modified_ms >= oldest
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let next = self.next_offset(start, limit).await;
        if next.is_err() {
            // Files listed but not taken may have left the queue: list everything again.
            let mut st = self.lock()?;
            st.queue.clear();
            st.listing = None;
        }
        next
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        let from = start
            .map(|s| self.log_offset(s))
            .transpose()?
            .map_or(0, |s| s + 1);
        let to = self.log_offset(end)?;
        let mut files = Vec::new();
        {
            let st = self.lock()?;
            for id in from..=to {
                let entries = st.entries.get(&id).ok_or_else(|| {
                    self.err(format!(
                        "the file list of logOffset {id} is missing from {}",
                        st.log.as_ref().map(ToString::to_string).unwrap_or_default()
                    ))
                })?;
                files.extend(entries.iter().cloned());
            }
        }
        let dir = self.opts.path.clone();
        let format = self.opts.format.clone();
        let base = self
            .opts
            .schema
            .clone()
            .unwrap_or_else(|| self.schema.clone());
        let mode = self.opts.mode;
        let dead = match &self.opts.dead_letter {
            Some(dir) => Some(crate::source::dead_letter::DeadLetter {
                dir: dir.clone(),
                query_id: self.lock()?.query_id,
            }),
            None => None,
        };
        if super::leaf::scans_on_cluster(ctx) {
            // Read where the plan runs: the workers, each its share of the files.
            let scan = FilesScan {
                dir: dir.url().to_string(),
                storage: dir.options().as_map().clone(),
                format,
                mode,
                shares: vec![files],
                partitions: crate::cores().max(2),
                projection: None,
            };
            let planning = |e| {
                Error::datafusion(
                    format!("{}: planning logOffset {from}..={to}", self.description()),
                    e,
                )
            };
            let exec = RecordedFilesExec::in_dir(scan, base, dir).map_err(planning)?;
            let table = super::leaf::ScanTable::new(std::sync::Arc::new(exec));
            return ctx.read_table(std::sync::Arc::new(table)).map_err(|e| {
                Error::datafusion(
                    format!("{}: planning logOffset {from}..={to}", self.description()),
                    e,
                )
            });
        }
        // Two files per core: one is read (listing check, get) while one is decoded, so
        // the cores do not wait on the store at the start of a range.
        let parallel = 2 * crate::cores().max(2);
        let decoded: Vec<(RecordBatch, u64)> = futures::stream::iter(files)
            .map(|e| read::read_entry(&dir, e, &format, &base, mode, dead.as_ref()))
            .buffered(parallel)
            .try_collect()
            .await?;
        let malformed = decoded.iter().map(|d| d.1).sum();
        self.lock()?.malformed = malformed;
        let batches: Vec<RecordBatch> = decoded
            .into_iter()
            .map(|d| d.0)
            .filter(|b| b.num_rows() > 0)
            .collect();
        let what = || format!("{}: holding logOffset {from}..={to}", self.description());
        if batches.is_empty() {
            return ctx
                .read_batch(RecordBatch::new_empty(self.schema.clone()))
                .map_err(|e| Error::datafusion(what(), e));
        }
        ctx.read_batches(batches)
            .map_err(|e| Error::datafusion(what(), e))
    }

    fn metrics(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        if let Ok(st) = self.state.lock() {
            if self.opts.mode != BadRecordMode::FailFast {
                m.insert("numMalformedRecords".into(), st.malformed.to_string());
            }
            m.insert("numFilesQueued".into(), st.queue.len().to_string());
        }
        m
    }

    async fn commit(&self, end: &SourceOffset) -> Result<()> {
        let end_id = self.log_offset(end)?;
        self.clean(end_id).await?;
        let (log, doomed, keep_from) = {
            let mut st = self.lock()?;
            let Some(log) = st.log.clone() else {
                return Ok(());
            };
            let floor = (end_id + 1).saturating_sub(st.retain);
            // Forget what max_file_age lets go of, and entries out of retention.
            let oldest = self.oldest_allowed(st.newest_timestamp);
            st.seen.retain(|_, e| e.timestamp >= oldest);
            st.entries.retain(|&id, _| id >= floor);
            // Keep the newest compact file and every plain entry after it (and those of
            // retained batches); what fell below that since the last commit goes.
            let Some(keep_from) = log_keep_from(end_id, st.retain, COMPACT_INTERVAL) else {
                return Ok(());
            };
            let plan = purge(st.log_purged_below, keep_from);
            st.log_purged_below = Some(keep_from);
            let doomed = match plan {
                Purge::Nothing => Some(Vec::new()),
                Purge::Range(r) => Some(r.map(entry_name).collect()),
                Purge::ListBelow(_) => None,
            };
            (log, doomed, keep_from)
        };
        let doomed = match doomed {
            Some(d) => d,
            None => log
                .list_names()
                .await?
                .into_iter()
                .filter(|n| {
                    n.trim_end_matches(".compact")
                        .parse::<u64>()
                        .is_ok_and(|id| id < keep_from)
                })
                .collect(),
        };
        log.delete_many(doomed).await
    }
}

/// The files a file source's log records, by log offset (batch): the newest compact entry
/// and every plain entry after it. For tools that check what a query read.
pub async fn taken_files(log: &Location) -> Result<BTreeMap<u64, Vec<FileEntry>>> {
    log::read(log).await
}

fn log_offset(id: u64) -> SourceOffset {
    SourceOffset::new(serde_json::json!({ "logOffset": id }))
}
