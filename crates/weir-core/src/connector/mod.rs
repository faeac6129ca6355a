//! How a connector (a source or sink type) describes itself, so that the CLI, `weir chaos`,
//! `weir bench` and the tests dispatch over connectors instead of knowing their insides.
//!
//! A connector crate provides, next to the source or sink itself, a serde config type
//! (`deny_unknown_fields`, kebab-case) that implements three traits:
//! - the production side, [`SinkSpec`] or [`SourceSpec`]: its kind and label, the checks
//!   of its settings, `build()`, the app id it uses for a query, what it ends up holding
//!   ([`SinkShape`]);
//! - the test-harness side, [`SinkHarness`] or [`SourceHarness`], which only `weir chaos`,
//!   `weir bench` and the tests use: the fault points a batch passes in it, how to point it
//!   at fresh places ([`Relocation`], [`Feed`]),
//!   and a [`SinkVerifier`] that reads back what it holds and checks its own bookkeeping
//!   (table versions, ledger rows) for a number of committed batches;
//! - [`SinkConnector`] or [`SourceConnector`]: the `type = "..."` it is written as.
//!
//! The configs of the connectors weir-core itself holds (files, rate, Parquet) live here,
//! above the sources and sinks they build, so `source` and `sink` never import `connector`.
//!
//! Adding a sink means one crate (one folder) with these, and one line in the `weir`
//! crate's registry (`weir::config`), which every pipeline file, `weir chaos`, `weir bench`
//! and the Python package read their `type = ...` tables through.

mod files;
mod parquet;
mod rate;
mod text;
mod verify;

use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::sink::ForeachBatch;
pub use crate::sink::QueryIdentity;
use crate::source::{ReadLimit, Source};
use crate::storage::{Location, StorageOptions};
pub use files::{CleanName, FilesConfig, FormatName};
pub use parquet::{ParquetConfig, ParquetReader};
pub use rate::RateConfig;
pub use text::{DurationText, RetryConfig, SchemaText, parse_schema};
pub use verify::{compare_append, compare_upsert, newest_per_key};

/// What a config is resolved against: the pipeline file's folder (relative paths) and
/// the object-store settings.
#[derive(Debug, Clone, Default)]
pub struct BuildEnv {
    /// Relative local paths are taken from here (the pipeline file's folder).
    pub base: Option<PathBuf>,
    pub storage: StorageOptions,
}

impl BuildEnv {
    /// A path or URL from a config key.
    pub fn location(&self, key: &str, text: &str) -> Result<Location> {
        Location::parse(key, text, self.base.as_deref(), &self.storage)
    }
}

/// A config value that may name an environment variable (`env:NAME`), so secrets stay out
/// of files. Errors name `key`; the value itself is never part of a message.
pub fn secret(key: &str, value: &str) -> Result<String> {
    match value.strip_prefix("env:") {
        Some(var) => std::env::var(var)
            .map_err(|_| Error::config(key, format!("environment variable {var} is not set"))),
        None => Ok(value.to_string()),
    }
}

/// What a sink ends up holding, which decides how its contents are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkShape {
    /// Every input row once (Delta append, Parquet).
    Append,
    /// The newest row per key, by `ordering` then the other columns (Delta MERGE,
    /// PostgreSQL upsert); see [`newest_per_key`].
    Upsert { keys: Vec<String>, ordering: String },
    /// Nothing that can be read back (the console).
    Unchecked,
}

/// Fresh places for a sink to write to (chaos and benchmarks point pipelines at them).
#[derive(Debug, Clone)]
pub struct Relocation {
    /// A new, empty folder for this sink's files.
    pub dir: Location,
    /// A PostgreSQL server for sinks that write one.
    pub postgres: Option<String>,
    /// A prefix for table names, unique to the run (`weir_chaos_`).
    pub prefix: String,
    /// The sink's index in its pipeline.
    pub index: usize,
}

/// What a sink found when its contents were checked.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Everything that is not as it must be.
    pub mismatches: Vec<String>,
    /// What was checked, for the report.
    pub notes: Vec<String>,
    /// Rows compared.
    pub rows: usize,
}

impl Verdict {
    /// Adds another verdict's findings.
    pub fn merge(&mut self, other: Verdict) {
        self.mismatches.extend(other.mismatches);
        self.notes.extend(other.notes);
        self.rows += other.rows;
    }
}

/// Reads back what a sink holds, and checks its own bookkeeping.
#[async_trait]
pub trait SinkVerifier: Send + Sync {
    /// Every row the sink holds, in `schema`'s columns and types.
    async fn rows(&self, schema: &SchemaRef) -> Result<Vec<RecordBatch>>;

    /// Checks what the sink records about batches: for `committed` batches (ids
    /// `0..committed`) of `query`, each recorded exactly once (one Delta version per batch
    /// and the app transaction at the last batch; one ledger row per batch and an empty
    /// staging table; ...).
    async fn check_bookkeeping(&self, query: &QueryIdentity, committed: u64) -> Result<Verdict>;

    /// Removes what a relocated sink wrote before (tables of an earlier chaos run), so a
    /// run starts empty. Folders are fresh already: the default does nothing.
    async fn reset(&self) -> Result<()> {
        Ok(())
    }
}

/// A sink config, as production uses it: what the sink is called, the checks of its
/// settings and the sink itself.
#[async_trait]
pub trait SinkSpec: Send + Sync + Debug {
    /// The name in progress, errors and reports: the kind and where it writes.
    fn label(&self, env: &BuildEnv) -> String;

    /// Checks the settings (before anything runs) and builds the sink.
    fn build(&self, env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>>;

    /// The app id the sink uses for `query`'s batches, if it records one.
    fn app_id(&self, query: &QueryIdentity) -> Option<String>;

    /// What the sink ends up holding (`weir check` holds an upsert's key and ordering
    /// columns against the batches' columns).
    fn shape(&self) -> SinkShape;

    /// The folder the sink writes, if it writes one: two sinks (or a sink and the source)
    /// must not share one.
    fn location(&self, _env: &BuildEnv) -> Option<Location> {
        None
    }

    /// Checks that where the sink writes can be reached, writing nothing (`weir check
    /// --connect`), and says what it found. By default its folder ([`Location::probe`]),
    /// which the label already names.
    async fn probe(&self, env: &BuildEnv) -> Result<String> {
        match self.location(env) {
            Some(at) => at.probe().await,
            None => Ok("nothing to reach".into()),
        }
    }
}

/// A sink config, as the test harness (`weir chaos`, `weir bench`, fault injection) uses
/// it: where a batch can be cut, what must be in the sink afterwards, and how to read it.
pub trait SinkHarness: SinkSpec {
    /// The fault points a batch passes in this sink, in order (see [`crate::fault`]).
    fn fault_points(&self) -> Vec<&'static str>;

    /// Points the sink at fresh places.
    fn relocate(&mut self, to: &Relocation) -> Result<()>;

    /// A reader of what the sink holds (`None`: the sink cannot be read back).
    fn verifier(&self, env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>>;
}

/// A sink kind for the registry: its config, read from a `[[sink]] type = KIND` table.
pub trait SinkConnector: SinkHarness + Serialize + DeserializeOwned + Clone + 'static {
    /// The `type = "..."` of its tables.
    const KIND: &'static str;
}

/// Where chaos and benchmarks feed input: a folder of JSON-lines files, or a Kafka topic.
#[derive(Debug, Clone)]
pub enum Feed {
    /// JSON-lines files appear in this folder.
    Files { dir: Location },
    /// Records are produced to this topic.
    Kafka { brokers: String, topic: String },
}

/// A source config, as production uses it: its checks, its schema and the source itself.
#[async_trait]
pub trait SourceSpec: Send + Sync + Debug {
    /// Checks the settings without reading anything (called before anything runs).
    fn check(&self, env: &BuildEnv) -> Result<()>;

    /// Builds the source (this may read, e.g. a Parquet schema).
    async fn build(&self, env: &BuildEnv) -> Result<Arc<dyn Source>>;

    /// The schema of the batches the built source will give, when the settings alone fix
    /// it, without reading anything. `None` when it comes from the data (Parquet files
    /// without a declared schema): `weir check` then cannot plan the transform.
    fn schema(&self, _env: &BuildEnv) -> Result<Option<SchemaRef>> {
        Ok(None)
    }

    /// The folder the source reads, if it reads one.
    fn location(&self, _env: &BuildEnv) -> Option<Location> {
        None
    }

    /// The folder the source writes its bad records to (`dead-letter`), if it has one: it
    /// must not share a folder with a sink, the source or the checkpoint.
    fn dead_letter(&self, _env: &BuildEnv) -> Option<Location> {
        None
    }

    /// Checks that what the source reads can be reached, reading as little as possible
    /// (`weir check --connect`), and says what it found. By default its folder
    /// ([`Location::probe`]).
    async fn probe(&self, env: &BuildEnv) -> Result<String> {
        match self.location(env) {
            Some(at) => Ok(format!("{at}: {}", at.probe().await?)),
            None => Ok("nothing to reach".into()),
        }
    }

    /// The read limits the config sets (max files / offsets per trigger, ...).
    fn read_limit(&self) -> Result<ReadLimit>;

    /// Whether the built source reads its ranges on a cluster's workers
    /// ([`Source::reads_on_workers`]): a pipeline with `[cluster]` refuses one that does not
    /// before anything runs.
    fn reads_on_workers(&self) -> bool {
        false
    }
}

/// The kinds of input chaos and benchmarks can feed a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedKind {
    Files,
    Kafka,
}

/// A source config, as the test harness uses it: what feed it can read, and pointing it
/// there.
pub trait SourceHarness: SourceSpec {
    /// The feed this kind of source reads (`None`: it generates its rows).
    fn feed_kind(&self) -> Option<FeedKind>;

    /// Reads `feed` instead, at most `batch_rows` rows or one file per batch. An error when
    /// this kind of source cannot read that kind of feed.
    fn relocate(&mut self, feed: &Feed, batch_rows: u64) -> Result<()>;
}

/// A source kind for the registry: its config, read from a `[source] type = KIND` table.
pub trait SourceConnector: SourceHarness + Serialize + DeserializeOwned + Clone + 'static {
    /// The `type = "..."` of its tables.
    const KIND: &'static str;
}

/// True when one folder is the other or inside it (by URL).
pub fn overlaps(a: &Location, b: &Location) -> bool {
    // Compared as folders: `out` and `out2` do not overlap, `out` and `out/x` do.
    let folder = |l: &Location| {
        let s = l.url().as_str();
        if s.ends_with('/') {
            s.to_string()
        } else {
            format!("{s}/")
        }
    };
    let (a, b) = (folder(a), folder(b));
    a.starts_with(&b) || b.starts_with(&a)
}

/// `path` relative to `base` unless it is absolute or a URL (for labels).
pub fn display_path(base: Option<&Path>, path: &str) -> String {
    if crate::storage::has_scheme(path) || Path::new(path).is_absolute() {
        return path.to_string();
    }
    match base {
        Some(b) => b.join(path).display().to_string(),
        None => path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::StorageOptions;

    #[test]
    fn folders_overlap_when_one_holds_the_other() {
        let o = StorageOptions::default();
        let at = |p: &str| Location::parse("path", p, None, &o).unwrap();
        assert!(overlaps(&at("/d/out"), &at("/d/out")));
        assert!(overlaps(&at("/d/out"), &at("/d/out/inner")));
        assert!(overlaps(&at("/d/out/inner"), &at("/d/out/")));
        assert!(!overlaps(&at("/d/out"), &at("/d/out2")));
        assert!(!overlaps(&at("s3://b/out"), &at("/d/out")));
        assert!(overlaps(&at("s3://b/out"), &at("s3://b/out/x")));
    }
}
