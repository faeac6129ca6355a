//! The file source: a folder of JSON-lines, CSV or Parquet files.
//!
//! New files are taken in order of modification time, then name (newest first with
//! `latest_first`), at most `max_files_per_trigger` a batch. The files each batch takes are
//! written to the source's own log, `<checkpoint>/sources/<i>/<logOffset>`, before the
//! offset `{"logOffset":N}` is handed to the engine, so a replay reads exactly the same
//! files even if more arrived or some were listed in another order. Every 10th log entry is
//! written as `<N>.compact` holding every entry so far, as Spark does, and older entries
//! are then deleted once the query's retention allows.
//!
//! Files whose names start with `.` or `_` are skipped (writers put temp files there).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::prelude::{
    CsvReadOptions, DataFrame, JsonReadOptions, ParquetReadOptions, SessionContext,
};
use serde::{Deserialize, Serialize};

use super::{ReadLimit, Source, SourceInit, SourceOffset};
use crate::checkpoint::file::{self as durable, WriteOutcome};
use crate::error::{Error, Result};

const COMPACT_INTERVAL: u64 = 10;

/// The format of the files in the folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileFormat {
    /// One JSON object per line. ISO-8601 strings parse into timestamp columns.
    Json,
    /// Delimited text, with or without a header line.
    Csv { has_header: bool, delimiter: u8 },
    /// Parquet; the schema may be read from the first file.
    Parquet,
}

impl FileFormat {
    /// CSV with a header line and commas.
    pub const CSV: FileFormat = FileFormat::Csv {
        has_header: true,
        delimiter: b',',
    };
}

/// Settings of a [`FileSource`]; Spark's option names in brackets.
#[derive(Debug, Clone)]
pub struct FileSourceOptions {
    /// The folder to watch (`path`).
    pub path: PathBuf,
    pub format: FileFormat,
    /// The schema; required for JSON and CSV, read from the first file for Parquet.
    pub schema: Option<SchemaRef>,
    /// Newest files first (`latestFirst`), for catching up on the recent past first.
    pub latest_first: bool,
    /// Files older than this relative to the newest file seen are ignored (`maxFileAge`).
    pub max_file_age: Option<Duration>,
}

/// One file taken by a batch: a line of `sources/<i>/N`, in Spark's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    /// `file:///abs/path`.
    pub path: String,
    /// Modification time in ms since the epoch.
    pub timestamp: i64,
    /// The log offset (batch) that took the file.
    pub batch_id: u64,
}

#[derive(Debug, Default)]
struct State {
    log_dir: Option<PathBuf>,
    retain: u64,
    /// Entries by log offset.
    entries: BTreeMap<u64, Vec<FileEntry>>,
    seen: HashSet<String>,
    newest_timestamp: i64,
    /// For AvailableNow: the files present when the query started.
    available_now: Option<HashSet<String>>,
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
    pub fn new(opts: FileSourceOptions) -> Result<Self> {
        let schema = match (&opts.schema, &opts.format) {
            (Some(s), _) => s.clone(),
            (None, FileFormat::Parquet) => parquet_schema(&opts.path)?,
            (None, _) => {
                return Err(Error::config(
                    "schema",
                    format!(
                        "the file source on {} needs a schema for {:?} files; give one with .schema(..)",
                        opts.path.display(),
                        opts.format
                    ),
                ));
            }
        };
        Ok(FileSource {
            opts,
            schema,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| self.err("internal state poisoned by an earlier panic"))
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Source {
            source_name: self.description(),
            reason: reason.into(),
        }
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

    /// The files in the folder now, with their modification times, in the order to take them.
    fn list(&self) -> Result<Vec<(String, i64, PathBuf)>> {
        let dir = &self.opts.path;
        let entries = match fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("listing input folder", dir, e)),
        };
        let mut files = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("listing input folder", dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if durable::is_hidden(&name) {
                continue;
            }
            let meta = match entry.metadata() {
                Ok(m) if m.is_file() => m,
                Ok(_) => continue,
                // Deleted between listing and stat: not ours to take.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("reading metadata of", entry.path(), e)),
            };
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_millis() as i64);
            let path = fs::canonicalize(entry.path())
                .map_err(|e| Error::io("resolving", entry.path(), e))?;
            files.push((file_uri(&path), mtime, path));
        }
        files.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
        if self.opts.latest_first {
            files.reverse();
        }
        Ok(files)
    }

    fn entry_path(log_dir: &Path, id: u64) -> PathBuf {
        if (id + 1).is_multiple_of(COMPACT_INTERVAL) {
            log_dir.join(format!("{id}.compact"))
        } else {
            log_dir.join(id.to_string())
        }
    }
}

#[async_trait]
impl Source for FileSource {
    fn description(&self) -> String {
        format!("FileStreamSource[{}]", file_uri(&self.opts.path))
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn open(&self, init: &SourceInit) -> Result<()> {
        let entries = read_log(&init.log_dir)?;
        let mut st = self.lock()?;
        st.seen = entries.values().flatten().map(|e| e.path.clone()).collect();
        st.newest_timestamp = entries
            .values()
            .flatten()
            .map(|e| e.timestamp)
            .max()
            .unwrap_or(0);
        st.entries = entries;
        st.log_dir = Some(init.log_dir.clone());
        st.retain = init.retain_batches.max(2);
        Ok(())
    }

    async fn prepare_available_now(&self) -> Result<()> {
        let files = self.list()?;
        self.lock()?.available_now = Some(files.into_iter().map(|f| f.0).collect());
        Ok(())
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let start_id = start.map(|s| self.log_offset(s)).transpose()?;
        let next_id = start_id.map_or(0, |s| s + 1);
        {
            let st = self.lock()?;
            // An attempt that crashed after writing its file list but before offsets/N:
            // hand out exactly that entry again.
            if st.entries.contains_key(&next_id) {
                return Ok(Some(log_offset(next_id)));
            }
        }
        let listed = self.list()?;
        let mut st = self.lock()?;
        let Some(log_dir) = st.log_dir.clone() else {
            return Err(self.err("latest_offset called before open"));
        };
        let newest = listed
            .iter()
            .map(|f| f.1)
            .max()
            .unwrap_or(0)
            .max(st.newest_timestamp);
        let oldest_allowed = self
            .opts
            .max_file_age
            .map_or(i64::MIN, |age| newest - age.as_millis() as i64);
        let mut take: Vec<FileEntry> = listed
            .into_iter()
            .filter(|(uri, mtime, _)| {
                !st.seen.contains(uri)
                    && *mtime >= oldest_allowed
                    && st.available_now.as_ref().is_none_or(|a| a.contains(uri))
            })
            .map(|(path, timestamp, _)| FileEntry {
                path,
                timestamp,
                batch_id: next_id,
            })
            .collect();
        if let Some(max) = limit.max_files {
            take.truncate(max.max(1));
        }
        if take.is_empty() {
            return Ok(start.cloned());
        }
        let path = Self::entry_path(&log_dir, next_id);
        let mut lines: Vec<&FileEntry> = Vec::new();
        if path.extension().is_some_and(|e| e == "compact") {
            lines.extend(st.entries.values().flatten());
        }
        lines.extend(take.iter());
        let mut body = String::from("v1");
        for e in lines {
            body.push('\n');
            body.push_str(&serde_json::to_string(e).map_err(|e| self.err(e.to_string()))?);
        }
        if durable::write_new(&path, body.as_bytes())? == WriteOutcome::AlreadyExists {
            return Err(Error::CheckpointInUse { dir: log_dir, path });
        }
        for e in &take {
            st.seen.insert(e.path.clone());
            st.newest_timestamp = st.newest_timestamp.max(e.timestamp);
        }
        st.entries.insert(next_id, take);
        Ok(Some(log_offset(next_id)))
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
        let mut paths = Vec::new();
        {
            let st = self.lock()?;
            for id in from..=to {
                let files = st.entries.get(&id).ok_or_else(|| {
                    self.err(format!(
                        "the file list of logOffset {id} is missing from {}",
                        st.log_dir.as_deref().unwrap_or(Path::new("?")).display()
                    ))
                })?;
                for f in files {
                    let local = f
                        .path
                        .strip_prefix("file://")
                        .unwrap_or(&f.path)
                        .to_string();
                    if !Path::new(&local).is_file() {
                        return Err(self.err(format!(
                            "{local}, taken by logOffset {id}, is gone: files must stay in place \
                             until their batch is committed"
                        )));
                    }
                    paths.push(local);
                }
            }
        }
        let what = || format!("{}: reading logOffset {from}..={to}", self.description());
        if paths.is_empty() {
            let empty =
                datafusion::arrow::record_batch::RecordBatch::new_empty(self.schema.clone());
            return ctx
                .read_batch(empty)
                .map_err(|e| Error::datafusion(what(), e));
        }
        let schema: &Schema = &self.schema;
        let df = match &self.opts.format {
            FileFormat::Json => {
                ctx.read_json(
                    paths,
                    JsonReadOptions::default().schema(schema).file_extension(""),
                )
                .await
            }
            FileFormat::Csv {
                has_header,
                delimiter,
            } => {
                let o = CsvReadOptions::new()
                    .schema(schema)
                    .has_header(*has_header)
                    .delimiter(*delimiter)
                    .file_extension("");
                ctx.read_csv(paths, o).await
            }
            FileFormat::Parquet => {
                ctx.read_parquet(
                    paths,
                    ParquetReadOptions::default()
                        .schema(schema)
                        .file_extension(""),
                )
                .await
            }
        };
        df.map_err(|e| Error::datafusion(what(), e))
    }

    async fn commit(&self, end: &SourceOffset) -> Result<()> {
        let end_id = self.log_offset(end)?;
        let mut st = self.lock()?;
        let Some(log_dir) = st.log_dir.clone() else {
            return Ok(());
        };
        // Keep the newest compact file and every entry of the retained batches after it.
        let floor = (end_id + 1).saturating_sub(st.retain);
        let Some(compact) = (0..=end_id)
            .rev()
            .find(|id| (id + 1).is_multiple_of(COMPACT_INTERVAL))
        else {
            return Ok(());
        };
        let keep_from = floor.min(compact);
        for id in 0..keep_from {
            let p = Self::entry_path(&log_dir, id);
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("removing old source log entry", &p, e)),
            }
        }
        if let Some(age) = self.opts.max_file_age {
            let oldest = st.newest_timestamp - age.as_millis() as i64;
            st.entries
                .retain(|&id, files| id >= floor || files.iter().any(|f| f.timestamp >= oldest));
        }
        Ok(())
    }
}

fn log_offset(id: u64) -> SourceOffset {
    SourceOffset::new(serde_json::json!({ "logOffset": id }))
}

/// `file:///abs/path` for a local path.
pub fn file_uri(path: &Path) -> String {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    format!("file://{}", abs.display())
}

/// Reads a file source log: the newest `N.compact`, then every plain entry after it.
fn read_log(dir: &Path) -> Result<BTreeMap<u64, Vec<FileEntry>>> {
    let mut plain = Vec::new();
    let mut compacts = Vec::new();
    let listing = match fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(Error::io("listing", dir, e)),
    };
    for entry in listing {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if durable::is_hidden(&name) {
            continue;
        }
        let (id, compact) = match name.strip_suffix(".compact") {
            Some(n) => (n.parse::<u64>(), true),
            None => (name.parse::<u64>(), false),
        };
        let id = id.map_err(|_| Error::CorruptLog {
            path: entry.path(),
            reason: "Unexpected file in a file source log".into(),
        })?;
        if compact {
            compacts.push(id)
        } else {
            plain.push(id)
        }
    }
    let base = compacts.iter().copied().max();
    let mut out: BTreeMap<u64, Vec<FileEntry>> = BTreeMap::new();
    let mut ids: Vec<(u64, PathBuf)> = Vec::new();
    if let Some(c) = base {
        ids.push((c, dir.join(format!("{c}.compact"))));
    }
    plain.sort_unstable();
    ids.extend(
        plain
            .into_iter()
            .filter(|&id| base.is_none_or(|c| id > c))
            .map(|id| (id, dir.join(id.to_string()))),
    );
    for (_, path) in &ids {
        let lines = durable::read_versioned(path, 1, "file source log")?;
        for (i, line) in lines
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let e: FileEntry = durable::parse_line(path, i + 2, line)?;
            out.entry(e.batch_id).or_default().push(e);
        }
    }
    // Plain entries after the compact one must follow each other.
    let after: Vec<u64> = ids
        .iter()
        .skip(usize::from(base.is_some()))
        .map(|(id, _)| *id)
        .collect();
    let first = base.map_or(after.first().copied().unwrap_or(0), |c| c + 1);
    for (expect, id) in (first..).zip(after) {
        if id != expect {
            return Err(Error::CorruptLog {
                path: dir.join(expect.to_string()),
                reason: "Missing entry in the file source log".into(),
            });
        }
    }
    Ok(out)
}

fn parquet_schema(dir: &Path) -> Result<SchemaRef> {
    use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| Error::io("listing input folder", dir, e))?
        .filter_map(|e| e.ok())
        .filter(|e| !durable::is_hidden(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let first = files.first().ok_or_else(|| {
        Error::config(
            "schema",
            format!(
                "{} has no Parquet file to read the schema from yet; give the schema explicitly",
                dir.display()
            ),
        )
    })?;
    let f = fs::File::open(first).map_err(|e| Error::io("opening", first, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(f).map_err(|e| Error::Source {
        source_name: file_uri(first),
        reason: format!("cannot read the Parquet schema: {e}"),
    })?;
    Ok(builder.schema().clone())
}
