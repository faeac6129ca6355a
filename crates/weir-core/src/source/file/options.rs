//! The file source's settings: the format, what happens to files after their batch, and
//! the checks that need no file.

use std::time::Duration;

use datafusion::arrow::datatypes::SchemaRef;

use crate::error::{Error, Result};
use crate::source::decode::{BadRecordMode, check_corrupt_column};
use crate::storage::Location;

/// The format of the files in the folder.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// What happens to the files of a committed batch (Spark's `cleanSource`).
#[derive(Debug, Clone, Default)]
pub enum CleanSource {
    /// Leave them (default).
    #[default]
    Off,
    /// Delete them once their batch is committed.
    Delete,
    /// Move them into this folder once their batch is committed.
    Archive(Location),
}

/// Settings of a [`FileSource`](super::FileSource); Spark's option names in brackets.
#[derive(Debug, Clone)]
pub struct FileSourceOptions {
    /// The folder to watch (`path`).
    pub path: Location,
    pub format: FileFormat,
    /// The schema; required for JSON and CSV, read from the first file for Parquet.
    pub schema: Option<SchemaRef>,
    /// Newest files first (`latestFirst`), for catching up on the recent past first.
    pub latest_first: bool,
    /// Files older than this relative to the newest file taken are ignored and forgotten
    /// (`maxFileAge`): before the first batch every file counts. Not applied with
    /// `latest_first`.
    pub max_file_age: Option<Duration>,
    /// What a malformed line does (`mode`; JSON and CSV only).
    pub mode: BadRecordMode,
    /// What happens to files once their batch is committed (`cleanSource`).
    pub clean_source: CleanSource,
    /// Where malformed lines go (`dead-letter`, JSON only): each with its file, line,
    /// error and batch id, one Parquet file per batch and input file, written once. The
    /// lines are dropped from the batch.
    pub dead_letter: Option<Location>,
}

impl FileSourceOptions {
    /// JSON files in `path`, everything else at its default.
    pub fn new(path: Location, format: FileFormat) -> Self {
        FileSourceOptions {
            path,
            format,
            schema: None,
            latest_first: false,
            max_file_age: None,
            mode: BadRecordMode::FailFast,
            clean_source: CleanSource::Off,
            dead_letter: None,
        }
    }

    /// The checks that need no file: a bad-record mode only for lines (JSON, CSV), and a
    /// declared `_corrupt_record` a string. `prefix` goes before the setting's name
    /// (`source.` in a pipeline file).
    pub(crate) fn check_modes(&self, prefix: &str) -> Result<()> {
        if self.format == FileFormat::Parquet {
            if self.mode != BadRecordMode::FailFast {
                return Err(Error::config(
                    format!("{prefix}mode"),
                    "PERMISSIVE and DROPMALFORMED apply to JSON and CSV lines, not to Parquet files",
                ));
            }
        } else if let Some(s) = &self.schema {
            check_corrupt_column(s).map_err(|r| Error::config(format!("{prefix}schema"), r))?;
        }
        if let Some(dead) = &self.dead_letter {
            if self.format != FileFormat::Json {
                return Err(Error::config(
                    format!("{prefix}dead-letter"),
                    "applies to JSON lines (format = \"json\") for now",
                ));
            }
            if self.mode != BadRecordMode::DropMalformed {
                return Err(Error::config(
                    format!("{prefix}mode"),
                    "with dead-letter, malformed lines go to the dead letter and leave the \
                     batch: leave mode unset (or DROPMALFORMED)",
                ));
            }
            let folder = |l: &Location| {
                let u = l.url().as_str().trim_end_matches('/').to_string();
                format!("{u}/")
            };
            let (d, p) = (folder(dead), folder(&self.path));
            if d.starts_with(&p) || p.starts_with(&d) {
                return Err(Error::config(
                    format!("{prefix}dead-letter"),
                    format!(
                        "{dead} is in the folder the source reads ({}), or holds it",
                        self.path
                    ),
                ));
            }
        }
        Ok(())
    }
}
