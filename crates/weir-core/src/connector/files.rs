//! The file source in a pipeline file: `[source] type = "files"`.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{
    BuildEnv, DurationText, Feed, FeedKind, SchemaText, SourceConnector, SourceHarness, SourceSpec,
};
use crate::error::{Error, Result};
use crate::source::decode::output_schema;
use crate::source::file::{CleanSource, FileFormat, FileSource, FileSourceOptions};
use crate::source::{BadRecordMode, ReadLimit, Source};

/// The file format names of a pipeline file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FormatName {
    Json,
    Csv,
    Parquet,
}

/// What happens to the files of committed batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CleanName {
    Off,
    Delete,
    Archive,
}

/// `[source] type = "files"`.
///
/// ```toml
/// [source]
/// type = "files"
/// path = "in"                      # a folder, or s3://bucket/prefix, az://..., gs://...
/// format = "json"                  # csv (with csv-header = true | false) | parquet
/// schema = ["order_id bigint", "status string", "updated_at timestamp"]
/// max-files-per-trigger = 20
/// mode = "PERMISSIVE"              # FAILFAST (default) | DROPMALFORMED
/// max-file-age = "7d"
/// clean-source = "delete"          # off (default) | archive (with source-archive-dir)
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FilesConfig {
    pub path: String,
    pub format: FormatName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaText>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_files_per_trigger: Option<usize>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub latest_first: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_file_age: Option<DurationText>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csv_header: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csv_delimiter: Option<char>,
    /// FAILFAST (default), PERMISSIVE or DROPMALFORMED, for malformed JSON and CSV lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<BadRecordMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clean_source: Option<CleanName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_archive_dir: Option<String>,
    /// A folder for malformed lines (JSON), written once per batch and file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<String>,
}

impl FilesConfig {
    fn format(&self) -> Result<FileFormat> {
        if self.format != FormatName::Csv {
            for (key, set) in [
                ("source.csv-header", self.csv_header.is_some()),
                ("source.csv-delimiter", self.csv_delimiter.is_some()),
            ] {
                if set {
                    return Err(Error::config(key, "applies to format = \"csv\""));
                }
            }
        }
        Ok(match self.format {
            FormatName::Json => FileFormat::Json,
            FormatName::Parquet => FileFormat::Parquet,
            FormatName::Csv => FileFormat::Csv {
                // No default: a wrong guess either drops each file's first row or reads a
                // header as a row (Spark assumes no header, many exports have one).
                has_header: self.csv_header.ok_or_else(|| {
                    Error::config(
                        "source.csv-header",
                        "required with format = \"csv\": true when each file's first line \
                         names the columns, false when it is a row (Spark's default)",
                    )
                })?,
                delimiter: match self.csv_delimiter {
                    None => b',',
                    Some(c @ ('"' | '\n' | '\r')) => {
                        return Err(Error::config(
                            "source.csv-delimiter",
                            format!("{c:?} quotes or ends records; it cannot part fields"),
                        ));
                    }
                    Some(c) if c.is_ascii() => c as u8,
                    Some(c) => {
                        return Err(Error::config(
                            "source.csv-delimiter",
                            format!("'{c}' is not a single-byte (ASCII) character"),
                        ));
                    }
                },
            },
        })
    }

    /// The options, checked.
    pub fn options(&self, env: &BuildEnv) -> Result<FileSourceOptions> {
        if self.schema.is_none() && self.format != FormatName::Parquet {
            return Err(Error::config(
                "source.schema",
                "required for json and csv files",
            ));
        }
        let mut o =
            FileSourceOptions::new(env.location("source.path", &self.path)?, self.format()?);
        o.schema = self.schema.as_ref().map(SchemaText::schema);
        o.latest_first = self.latest_first;
        o.max_file_age = self.max_file_age.map(|d| d.0);
        o.mode = self.mode.unwrap_or_default();
        if let Some(d) = &self.dead_letter {
            o.dead_letter = Some(env.location("source.dead-letter", d)?);
            if self.mode.is_none() {
                o.mode = BadRecordMode::DropMalformed;
            }
        }
        o.check_modes("source.")?;
        o.clean_source = match (self.clean_source, &self.source_archive_dir) {
            (None | Some(CleanName::Off), None) => CleanSource::Off,
            (Some(CleanName::Delete), None) => CleanSource::Delete,
            (Some(CleanName::Archive), Some(d)) => {
                CleanSource::Archive(env.location("source.source-archive-dir", d)?)
            }
            (Some(CleanName::Archive), None) => {
                return Err(Error::config(
                    "source.source-archive-dir",
                    "clean-source = \"archive\" needs the folder to move files to",
                ));
            }
            (_, Some(_)) => {
                return Err(Error::config(
                    "source.source-archive-dir",
                    "only used with clean-source = \"archive\"",
                ));
            }
        };
        Ok(o)
    }
}

#[async_trait]
impl SourceSpec for FilesConfig {
    fn check(&self, env: &BuildEnv) -> Result<()> {
        self.options(env).map(|_| ())
    }

    fn location(&self, env: &BuildEnv) -> Option<crate::storage::Location> {
        env.location("source.path", &self.path).ok()
    }

    fn dead_letter(&self, env: &BuildEnv) -> Option<crate::storage::Location> {
        let d = self.dead_letter.as_ref()?;
        env.location("source.dead-letter", d).ok()
    }

    /// The folder must be there, as `weir run` requires of a local one.
    async fn probe(&self, env: &BuildEnv) -> Result<String> {
        let at = env.location("source.path", &self.path)?;
        if let Some(p) = at.local_path()
            && !p.is_dir()
        {
            return Err(Error::config(
                "source.path",
                format!(
                    "{} is not a folder (Path does not exist): weir run refuses it",
                    p.display()
                ),
            ));
        }
        Ok(format!("{at}: {}", at.probe().await?))
    }

    fn schema(&self, env: &BuildEnv) -> Result<Option<datafusion::arrow::datatypes::SchemaRef>> {
        let o = self.options(env)?;
        Ok(o.schema.as_ref().map(|s| output_schema(s, o.mode)))
    }

    async fn build(&self, env: &BuildEnv) -> Result<Arc<dyn Source>> {
        Ok(Arc::new(FileSource::new(self.options(env)?).await?))
    }

    fn read_limit(&self) -> Result<ReadLimit> {
        if self.max_files_per_trigger == Some(0) {
            return Err(Error::config(
                "source.max-files-per-trigger",
                "0 would never take a file: give at least 1",
            ));
        }
        Ok(ReadLimit {
            max_files: self.max_files_per_trigger,
            ..ReadLimit::ALL
        })
    }
    /// Not with a dead letter yet: the workers' reads do not write one.
    fn reads_on_workers(&self) -> bool {
        self.dead_letter.is_none()
    }
}

impl SourceHarness for FilesConfig {
    fn feed_kind(&self) -> Option<FeedKind> {
        Some(FeedKind::Files)
    }

    fn relocate(&mut self, feed: &Feed, _batch_rows: u64) -> Result<()> {
        match feed {
            Feed::Files { dir } => {
                self.path = dir.url_string();
                self.format = FormatName::Json;
                self.csv_header = None;
                self.csv_delimiter = None;
                self.max_files_per_trigger = Some(1);
                Ok(())
            }
            Feed::Kafka { .. } => Err(Error::config(
                "source.type",
                "a files source cannot read a Kafka feed",
            )),
        }
    }
}

impl SourceConnector for FilesConfig {
    const KIND: &'static str = "files";
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv_config() -> FilesConfig {
        serde_json::from_str(
            r#"{"path": "in", "format": "csv", "csv-header": true, "csv-delimiter": ";",
                "schema": ["id bigint"]}"#,
        )
        .unwrap()
    }

    /// A CSV source pointed at chaos's JSON feed keeps no CSV settings (they would be
    /// refused on JSON).
    #[test]
    fn a_relocated_csv_source_reads_json_without_csv_settings() {
        let env = BuildEnv::default();
        let mut c = csv_config();
        assert!(c.options(&env).is_ok());
        let dir = crate::storage::Location::local(std::path::Path::new("/tmp/feed"));
        c.relocate(&Feed::Files { dir }, 10).unwrap();
        assert!(c.options(&env).is_ok(), "{:?}", c.options(&env).err());
        assert_eq!(c.format, FormatName::Json);
    }

    /// Parquet with a bad-record mode is refused where `weir check` sees it.
    #[test]
    fn parquet_takes_no_bad_record_mode() {
        let c: FilesConfig = serde_json::from_str(
            r#"{"path": "in", "format": "parquet", "mode": "PERMISSIVE", "schema": ["id bigint"]}"#,
        )
        .unwrap();
        let err = c.options(&BuildEnv::default()).err().unwrap().to_string();
        assert!(err.contains("source.mode"), "{err}");
    }

    /// A dead letter drops the bad lines from the batch: another mode, another format or
    /// a folder inside the source's is refused, naming the key.
    #[test]
    fn a_dead_letter_is_refused_where_it_cannot_work() {
        let refused = |json: &str, key: &str| {
            let c: FilesConfig = serde_json::from_str(json).unwrap();
            let err = c.options(&BuildEnv::default()).err().unwrap().to_string();
            assert!(err.contains(key), "{json}: {err}");
        };
        refused(
            r#"{"path": "in", "format": "json", "schema": ["id bigint"], "dead-letter": "dead", "mode": "PERMISSIVE"}"#,
            "source.mode",
        );
        refused(
            r#"{"path": "in", "format": "csv", "csv-header": false, "schema": ["id bigint"], "dead-letter": "dead"}"#,
            "source.dead-letter",
        );
        refused(
            r#"{"path": "in", "format": "json", "schema": ["id bigint"], "dead-letter": "in/dead"}"#,
            "source.dead-letter",
        );
        let ok: FilesConfig = serde_json::from_str(
            r#"{"path": "in", "format": "json", "schema": ["id bigint"], "dead-letter": "dead"}"#,
        )
        .unwrap();
        let o = ok.options(&BuildEnv::default()).unwrap();
        assert_eq!(o.mode, BadRecordMode::DropMalformed);
        assert!(!ok.reads_on_workers());
    }
}
