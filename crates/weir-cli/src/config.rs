//! Pipelines from TOML. Unknown keys and bad values are refused, naming the key, before
//! anything runs. Relative paths are taken from the folder of the TOML file.
//!
//! ```toml
//! [query]
//! name = "orders"
//! checkpoint = "chk"
//! trigger = "available-now"          # once | 30s | 0 (as fast as possible)
//!
//! [source]
//! type = "files"
//! path = "in"
//! format = "json"                    # csv | parquet
//! schema = ["order_id bigint", "status string", "amount double", "updated_at timestamp"]
//! max-files-per-trigger = 1
//!
//! [transform]
//! sql = "SELECT * FROM batch WHERE amount > 0"
//!
//! [[sink]]
//! type = "parquet"
//! path = "out"
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use weir_core::engine::parse_duration;
use weir_core::{
    ConsoleSink, DataStreamWriter, FanOut, FileFormat, ForeachBatch, ParquetSink,
    StreamingDataFrame, Trigger, WeirSession,
};
use weir_delta::{DeltaAppend, DeltaMerge};
use weir_kafka::{
    BadRecordMode, KafkaOptions, KafkaSource, StartingOffsets, Subscribe, ValueFormat,
};
use weir_postgres::PostgresUpsert;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Pipeline {
    pub query: QueryConfig,
    pub source: SourceConfig,
    #[serde(default)]
    pub transform: Option<TransformConfig>,
    #[serde(rename = "sink")]
    pub sinks: Vec<SinkConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct QueryConfig {
    pub name: String,
    pub checkpoint: PathBuf,
    #[serde(default)]
    pub trigger: Option<String>,
    #[serde(default)]
    pub min_batches_to_retain: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SourceConfig {
    #[serde(rename_all = "kebab-case")]
    Files {
        path: PathBuf,
        format: Format,
        #[serde(default)]
        schema: Option<Vec<String>>,
        #[serde(default)]
        max_files_per_trigger: Option<usize>,
        #[serde(default)]
        latest_first: bool,
        #[serde(default)]
        max_file_age: Option<String>,
        #[serde(default)]
        csv_header: Option<bool>,
        #[serde(default)]
        csv_delimiter: Option<char>,
    },
    #[serde(rename_all = "kebab-case")]
    Kafka {
        bootstrap_servers: String,
        #[serde(default)]
        subscribe: Vec<String>,
        #[serde(default)]
        subscribe_pattern: Option<String>,
        /// `earliest`, `latest`, or per-partition JSON `{"orders":{"0":12}}`.
        #[serde(default)]
        starting_offsets: Option<String>,
        #[serde(default)]
        max_offsets_per_trigger: Option<u64>,
        #[serde(default)]
        fail_on_data_loss: Option<bool>,
        #[serde(default)]
        min_offsets_per_trigger: Option<u64>,
        #[serde(default)]
        max_trigger_delay: Option<String>,
        /// Passed to librdkafka as they are (`"security.protocol" = "SASL_SSL"`, ...);
        /// a value `env:NAME` is read from the environment.
        #[serde(default)]
        kafka: std::collections::BTreeMap<String, String>,
        /// `raw` (Spark's key/value/topic/... columns) or `json` (values parsed into `schema`).
        #[serde(default)]
        value_format: Option<String>,
        #[serde(default)]
        schema: Option<Vec<String>>,
        /// `FAILFAST` or `PERMISSIVE` for malformed JSON values.
        #[serde(default)]
        mode: Option<String>,
    },
    #[serde(rename_all = "kebab-case")]
    Rate {
        rows_per_second: u64,
        #[serde(default)]
        max_offsets_per_trigger: Option<u64>,
    },
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    Json,
    Csv,
    Parquet,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TransformConfig {
    pub sql: String,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SinkConfig {
    #[serde(rename_all = "kebab-case")]
    Parquet {
        path: PathBuf,
        #[serde(default)]
        target_rows_per_file: Option<usize>,
    },
    #[serde(rename_all = "kebab-case")]
    Console {
        #[serde(default)]
        num_rows: Option<usize>,
    },
    #[serde(rename_all = "kebab-case")]
    DeltaAppend {
        path: PathBuf,
        #[serde(default)]
        app_id: Option<String>,
        #[serde(default)]
        partition_by: Vec<String>,
        #[serde(default)]
        target_file_size: Option<u64>,
        #[serde(default)]
        optimize_every: Option<u64>,
    },
    #[serde(rename_all = "kebab-case")]
    DeltaMerge {
        path: PathBuf,
        keys: Vec<String>,
        ordering: String,
        #[serde(default)]
        app_id: Option<String>,
        #[serde(default)]
        dedupe: Option<bool>,
        #[serde(default)]
        update_condition: Option<String>,
        #[serde(default)]
        prune_by: Option<String>,
        #[serde(default)]
        partition_by: Vec<String>,
        #[serde(default)]
        optimize_every: Option<u64>,
    },
    #[serde(rename_all = "kebab-case")]
    PostgresUpsert {
        /// libpq form (`host=.. port=.. user=.. dbname=..`) or a `postgresql://` URL;
        /// `env:NAME` reads it from an environment variable (keeps passwords out of files).
        url: String,
        table: String,
        keys: Vec<String>,
        ordering: String,
        #[serde(default)]
        ledger: Option<String>,
        #[serde(default)]
        app_id: Option<String>,
        #[serde(default)]
        dedupe: Option<bool>,
        #[serde(default)]
        create_table: bool,
        #[serde(default)]
        staging_table: Option<String>,
    },
}

impl SinkConfig {
    /// A name for progress lines and errors.
    pub fn label(&self) -> String {
        match self {
            SinkConfig::Parquet { path, .. } => format!("parquet {}", path.display()),
            SinkConfig::Console { .. } => "console".into(),
            SinkConfig::DeltaAppend { path, .. } => format!("delta-append {}", path.display()),
            SinkConfig::DeltaMerge { path, .. } => format!("delta-merge {}", path.display()),
            SinkConfig::PostgresUpsert { table, .. } => format!("postgres-upsert {table}"),
        }
    }
}

impl Pipeline {
    /// Reads and checks a pipeline file; relative paths become relative to its folder.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut p: Pipeline =
            toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        p.resolve(base);
        p.check().with_context(|| format!("{}", path.display()))?;
        Ok(p)
    }

    fn resolve(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.query.checkpoint);
        if let SourceConfig::Files { path, .. } = &mut self.source {
            fix(path);
        }
        for s in &mut self.sinks {
            match s {
                SinkConfig::Parquet { path, .. }
                | SinkConfig::DeltaAppend { path, .. }
                | SinkConfig::DeltaMerge { path, .. } => fix(path),
                SinkConfig::Console { .. } | SinkConfig::PostgresUpsert { .. } => {}
            }
        }
    }

    /// Checks the values serde cannot: the trigger, durations, schema types, sinks.
    pub fn check(&self) -> Result<()> {
        self.trigger()?;
        if let SourceConfig::Kafka { .. } = &self.source {
            self.kafka_options()?;
        }
        if let SourceConfig::Files {
            schema,
            max_file_age,
            format,
            ..
        } = &self.source
        {
            if let Some(age) = max_file_age {
                parse_duration("source.max-file-age", age)?;
            }
            match schema {
                Some(s) => {
                    parse_schema(s)?;
                }
                None if !matches!(format, Format::Parquet) => {
                    bail!("invalid setting 'source.schema': required for json and csv files")
                }
                None => {}
            }
        }
        if self.sinks.is_empty() {
            bail!("invalid setting 'sink': at least one [[sink]] is required");
        }
        for (i, s) in self.sinks.iter().enumerate() {
            if let SinkConfig::DeltaMerge { keys, .. } | SinkConfig::PostgresUpsert { keys, .. } = s
                && keys.is_empty()
            {
                bail!("invalid setting 'sink[{i}].keys': a MERGE needs at least one key column");
            }
        }
        Ok(())
    }

    /// The trigger (default: available-now, which suits a command that should finish).
    pub fn trigger(&self) -> Result<Trigger> {
        match &self.query.trigger {
            None => Ok(Trigger::AvailableNow),
            Some(t) => t.parse::<Trigger>().map_err(|e| anyhow!("query.{e}")),
        }
    }

    /// The source with the transform applied.
    pub fn stream(&self, session: &WeirSession) -> Result<StreamingDataFrame> {
        let reader = session.read_stream();
        let frame = match &self.source {
            SourceConfig::Files {
                path,
                format,
                schema,
                max_files_per_trigger,
                latest_first,
                max_file_age,
                csv_header,
                csv_delimiter,
            } => {
                let mut r = reader.files(path).latest_first(*latest_first);
                r = r.format(match format {
                    Format::Json => FileFormat::Json,
                    Format::Parquet => FileFormat::Parquet,
                    Format::Csv => FileFormat::Csv {
                        has_header: csv_header.unwrap_or(true),
                        delimiter: csv_delimiter.map_or(b',', |c| c as u8),
                    },
                });
                if let Some(s) = schema {
                    r = r.schema(parse_schema(s)?);
                }
                if let Some(n) = max_files_per_trigger {
                    r = r.max_files_per_trigger(*n);
                }
                if let Some(a) = max_file_age {
                    r = r.max_file_age(parse_duration("source.max-file-age", a)?);
                }
                r.load()?
            }
            SourceConfig::Kafka {
                max_offsets_per_trigger,
                ..
            } => {
                let mut r = reader.source(Arc::new(KafkaSource::new(self.kafka_options()?)?));
                if let Some(n) = max_offsets_per_trigger {
                    r = r.max_offsets_per_trigger(*n);
                }
                r.load()?
            }
            SourceConfig::Rate {
                rows_per_second,
                max_offsets_per_trigger,
            } => {
                let mut r = reader.rate(*rows_per_second);
                if let Some(n) = max_offsets_per_trigger {
                    r = r.max_offsets_per_trigger(*n);
                }
                r.load()?
            }
        };
        Ok(match &self.transform {
            Some(t) => frame.sql(t.sql.clone()),
            None => frame,
        })
    }

    /// The whole query, ready for listeners and `start()`: the source with the transform,
    /// name, checkpoint, trigger, retention and the sinks in file order behind one FanOut.
    pub fn writer(&self, session: &WeirSession) -> Result<DataStreamWriter> {
        let mut writer = self
            .stream(session)?
            .write_stream()
            .query_name(&self.query.name)
            .checkpoint(&self.query.checkpoint)
            .trigger(self.trigger()?)
            .foreach_batch(FanOut::new(self.sinks()?));
        if let Some(n) = self.query.min_batches_to_retain {
            writer = writer.min_batches_to_retain(n);
        }
        Ok(writer)
    }

    /// The Kafka source's options, checked.
    pub fn kafka_options(&self) -> Result<KafkaOptions> {
        let SourceConfig::Kafka {
            bootstrap_servers,
            subscribe,
            subscribe_pattern,
            starting_offsets,
            fail_on_data_loss,
            min_offsets_per_trigger,
            max_trigger_delay,
            kafka,
            value_format,
            schema,
            mode,
            ..
        } = &self.source
        else {
            bail!("not a kafka source");
        };
        let mut o = KafkaOptions::new(bootstrap_servers, subscribe.clone());
        match (subscribe.is_empty(), subscribe_pattern) {
            (true, Some(p)) => o.subscribe = Subscribe::Pattern(p.clone()),
            (false, None) => {}
            _ => bail!(
                "invalid setting 'source.subscribe': give either subscribe or subscribe-pattern"
            ),
        }
        o.starting_offsets = match starting_offsets.as_deref() {
            None | Some("earliest") => StartingOffsets::Earliest,
            Some("latest") => StartingOffsets::Latest,
            Some(json) => {
                let v: serde_json::Value = serde_json::from_str(json)
                    .map_err(|e| anyhow!("invalid setting 'source.starting-offsets': {e}"))?;
                let mut m = weir_kafka::PartitionOffsets::new();
                for (t, ps) in v.as_object().into_iter().flatten() {
                    for (p, off) in ps.as_object().into_iter().flatten() {
                        let (Ok(p), Some(off)) = (p.parse::<i32>(), off.as_i64()) else {
                            bail!(
                                "invalid setting 'source.starting-offsets': {json} is not {{\"topic\":{{\"0\":offset}}}}"
                            );
                        };
                        m.entry(t.clone()).or_default().insert(p, off);
                    }
                }
                StartingOffsets::Explicit(m)
            }
        };
        o.fail_on_data_loss = fail_on_data_loss.unwrap_or(true);
        o.min_offsets_per_trigger = *min_offsets_per_trigger;
        if let Some(d) = max_trigger_delay {
            o.max_trigger_delay = parse_duration("source.max-trigger-delay", d)?;
        }
        for (k, v) in kafka {
            let v = match v.strip_prefix("env:") {
                Some(var) => std::env::var(var).map_err(|_| {
                    anyhow!(
                        "invalid setting 'source.kafka.{k}': environment variable {var} is not set"
                    )
                })?,
                None => v.clone(),
            };
            o.kafka.insert(k.clone(), v);
        }
        o.value_format = match value_format.as_deref() {
            None | Some("raw") => ValueFormat::Raw,
            Some("json") => {
                let cols = schema.as_ref().ok_or_else(|| {
                    anyhow!(
                        "invalid setting 'source.schema': required with value-format = \"json\""
                    )
                })?;
                let mode = match mode.as_deref().map(str::to_ascii_uppercase).as_deref() {
                    None | Some("FAILFAST") => BadRecordMode::FailFast,
                    Some("PERMISSIVE") => BadRecordMode::Permissive,
                    Some(m) => {
                        bail!("invalid setting 'source.mode': '{m}' (use FAILFAST or PERMISSIVE)")
                    }
                };
                ValueFormat::Json {
                    schema: parse_schema(cols)?,
                    mode,
                }
            }
            Some(f) => bail!("invalid setting 'source.value-format': '{f}' (use raw or json)"),
        };
        Ok(o)
    }

    /// The sinks, in the order the file lists them.
    pub fn sinks(&self) -> Result<Vec<(String, Arc<dyn ForeachBatch>)>> {
        self.sinks
            .iter()
            .map(|s| {
                let sink: Arc<dyn ForeachBatch> = match s {
                    SinkConfig::Parquet {
                        path,
                        target_rows_per_file,
                    } => {
                        let mut p = ParquetSink::new(path);
                        if let Some(n) = target_rows_per_file {
                            p = p.target_rows_per_file(*n);
                        }
                        Arc::new(p)
                    }
                    SinkConfig::Console { num_rows } => {
                        Arc::new(ConsoleSink::new(num_rows.unwrap_or(20)))
                    }
                    SinkConfig::DeltaAppend {
                        path,
                        app_id,
                        partition_by,
                        target_file_size,
                        optimize_every,
                    } => {
                        let mut d = DeltaAppend::new(path).partition_by(partition_by.clone());
                        if let Some(a) = app_id {
                            d = d.app_id(a);
                        }
                        if let Some(n) = target_file_size {
                            d = d.target_file_size(*n);
                        }
                        if let Some(n) = optimize_every {
                            d = d.optimize_every(*n);
                        }
                        Arc::new(d)
                    }
                    SinkConfig::DeltaMerge {
                        path,
                        keys,
                        ordering,
                        app_id,
                        dedupe,
                        update_condition,
                        prune_by,
                        partition_by,
                        optimize_every,
                    } => {
                        let mut d = DeltaMerge::new(path, keys.clone(), ordering)
                            .dedupe(dedupe.unwrap_or(true))
                            .partition_by(partition_by.clone());
                        if let Some(a) = app_id {
                            d = d.app_id(a);
                        }
                        if let Some(c) = update_condition {
                            d = d.update_condition(c);
                        }
                        if let Some(p) = prune_by {
                            d = d.prune_by(p);
                        }
                        if let Some(n) = optimize_every {
                            d = d.optimize_every(*n);
                        }
                        Arc::new(d)
                    }
                    SinkConfig::PostgresUpsert {
                        url,
                        table,
                        keys,
                        ordering,
                        ledger,
                        app_id,
                        dedupe,
                        create_table,
                        staging_table,
                    } => {
                        let url = match url.strip_prefix("env:") {
                            Some(var) => std::env::var(var).map_err(|_| {
                                anyhow!("invalid setting 'sink.url': environment variable {var} is not set")
                            })?,
                            None => url.clone(),
                        };
                        let mut p = PostgresUpsert::new(url, table, keys.clone(), ordering)
                            .dedupe(dedupe.unwrap_or(true))
                            .create_table(*create_table);
                        if let Some(l) = ledger {
                            p = p.ledger(l);
                        }
                        if let Some(a) = app_id {
                            p = p.app_id(a);
                        }
                        if let Some(s) = staging_table {
                            p = p.staging_table(s);
                        }
                        Arc::new(p)
                    }
                };
                Ok((s.label(), sink))
            })
            .collect()
    }
}

/// `["order_id bigint", "status string", ...]` into a schema. Columns are nullable.
pub fn parse_schema(cols: &[String]) -> Result<SchemaRef> {
    let mut fields = Vec::with_capacity(cols.len());
    for (i, c) in cols.iter().enumerate() {
        let mut parts = c.split_whitespace();
        let (Some(name), Some(ty), None) = (parts.next(), parts.next(), parts.next()) else {
            bail!("invalid setting 'source.schema[{i}]': '{c}' is not 'name type'");
        };
        let dt = match ty.to_ascii_lowercase().as_str() {
            "string" | "utf8" | "text" | "varchar" => DataType::Utf8,
            "bigint" | "long" | "int64" => DataType::Int64,
            "int" | "integer" | "int32" => DataType::Int32,
            "smallint" | "short" | "int16" => DataType::Int16,
            "double" | "float64" => DataType::Float64,
            "float" | "real" | "float32" => DataType::Float32,
            "boolean" | "bool" => DataType::Boolean,
            "date" => DataType::Date32,
            "timestamp" => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            "timestamp_ntz" => DataType::Timestamp(TimeUnit::Microsecond, None),
            "binary" => DataType::Binary,
            other => bail!(
                "invalid setting 'source.schema[{i}]': unknown type '{other}' (use string, bigint, int, \
                 smallint, double, float, boolean, date, timestamp, timestamp_ntz or binary)"
            ),
        };
        fields.push(Field::new(name, dt, true));
    }
    Ok(Arc::new(Schema::new(fields)))
}
