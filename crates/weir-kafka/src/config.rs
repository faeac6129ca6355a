//! The Kafka source in a pipeline file.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use weir_core::connector::{
    BuildEnv, DurationText, Feed, FeedKind, SchemaText, SourceConnector, SourceHarness, SourceSpec,
    secret,
};
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::{Error, ReadLimit, Result, Source};

use crate::KafkaSource;
use crate::options::{
    BadRecordMode, KafkaOptions, StartingOffsets, Subscribe, Tombstones, ValueFormat,
};

/// How values become columns, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ValueFormatName {
    Raw,
    Json,
}

/// `[source] type = "kafka"`.
///
/// ```toml
/// [source]
/// type = "kafka"
/// bootstrap-servers = "localhost:9092"
/// subscribe = ["orders"]              # or subscribe-pattern = "orders-.*"
/// starting-offsets = "earliest"       # latest | '{"orders":{"0":42}}'
/// max-offsets-per-trigger = 200000
/// min-offsets-per-trigger = 50000     # with max-trigger-delay = "15m"
/// value-format = "json"               # raw (Spark's columns; include-headers = true adds headers)
/// schema = ["order_id bigint", "updated_at timestamp"]
/// mode = "FAILFAST"                   # PERMISSIVE | DROPMALFORMED
/// commit-to-group = "orders-weir"     # also commit each batch's end offsets there (for lag tools)
/// dead-letter = "dead/orders"         # bad records (with topic, partition, offset, error) go here
/// [source.kafka]                      # librdkafka settings; env:NAME reads a secret
/// "security.protocol" = "SASL_SSL"
/// "sasl.password" = "env:KAFKA_PASSWORD"
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct KafkaConfig {
    pub bootstrap_servers: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscribe: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscribe_pattern: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting_offsets: Option<StartingOffsets>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_offsets_per_trigger: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_on_data_loss: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_offsets_per_trigger: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_trigger_delay: Option<DurationText>,
    /// Passed to librdkafka as they are (`"security.protocol" = "SASL_SSL"`, ...); a value
    /// `env:NAME` is read from the environment. Never logged.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kafka: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_format: Option<ValueFormatName>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub include_headers: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaText>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<BadRecordMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_to_group: Option<String>,
    /// What a null value (a tombstone) becomes: "row" (default), "skip" or "delete".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tombstones: Option<Tombstones>,
    /// With tombstones = "delete": the column that gets the tombstone's Kafka timestamp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tombstone_timestamp: Option<String>,
    /// A folder for bad records (JSON values), written once per batch before its commit;
    /// sets mode to DROPMALFORMED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<String>,
}

impl KafkaConfig {
    /// The source's options, checked (secrets read from the environment).
    pub fn options(&self, env: &BuildEnv) -> Result<KafkaOptions> {
        let mut o = KafkaOptions::new(&self.bootstrap_servers, self.subscribe.clone());
        match (self.subscribe.is_empty(), &self.subscribe_pattern) {
            (true, Some(p)) => o.subscribe = Subscribe::Pattern(p.clone()),
            (false, None) => {}
            _ => {
                return Err(Error::config(
                    "source.subscribe",
                    "give either subscribe or subscribe-pattern",
                ));
            }
        }
        o.starting_offsets = self
            .starting_offsets
            .clone()
            .unwrap_or(StartingOffsets::Earliest);
        o.fail_on_data_loss = self.fail_on_data_loss.unwrap_or(true);
        o.include_headers = self.include_headers;
        if let Some(g) = &self.commit_to_group {
            if g.trim().is_empty() {
                return Err(Error::config("source.commit-to-group", "is empty"));
            }
            o.commit_to_group = Some(g.clone());
        }
        for (k, v) in &self.kafka {
            o.kafka
                .insert(k.clone(), secret(&format!("source.kafka.{k}"), v)?);
            if let Some(var) = v.strip_prefix("env:") {
                o.secret_env.insert(k.clone(), var.to_string());
            }
        }
        o.value_format = match self.value_format {
            None | Some(ValueFormatName::Raw) => {
                if self.schema.is_some() || self.mode.is_some() {
                    return Err(Error::config(
                        "source.schema",
                        "schema and mode apply to value-format = \"json\"",
                    ));
                }
                ValueFormat::Raw
            }
            Some(ValueFormatName::Json) => {
                let schema = self.schema.as_ref().ok_or_else(|| {
                    Error::config("source.schema", "required with value-format = \"json\"")
                })?;
                weir_core::source::decode::check_corrupt_column(&schema.schema())
                    .map_err(|r| Error::config("source.schema", r))?;
                if self.include_headers {
                    return Err(Error::config(
                        "source.include-headers",
                        "applies to value-format = \"raw\"",
                    ));
                }
                let mode = match (&self.dead_letter, self.mode) {
                    (Some(_), None) => BadRecordMode::DropMalformed,
                    (Some(_), Some(m)) if m != BadRecordMode::DropMalformed => {
                        return Err(Error::config(
                            "source.mode",
                            "with dead-letter, bad records go to the dead letter and leave the \
                             batch: leave mode unset (or DROPMALFORMED)",
                        ));
                    }
                    (_, m) => m.unwrap_or_default(),
                };
                ValueFormat::Json {
                    schema: schema.schema(),
                    mode,
                }
            }
        };
        if let Some(d) = &self.dead_letter {
            if matches!(o.value_format, ValueFormat::Raw) {
                return Err(Error::config(
                    "source.dead-letter",
                    "applies to value-format = \"json\" (raw rows are never bad)",
                ));
            }
            o.dead_letter = Some(env.location("source.dead-letter", d)?);
        }
        o.tombstones = self.tombstones.unwrap_or_default();
        o.tombstone_timestamp = self.tombstone_timestamp.clone();
        crate::tombstone::check(&o)?;
        Ok(o)
    }
}

#[async_trait]
impl SourceSpec for KafkaConfig {
    fn check(&self, env: &BuildEnv) -> Result<()> {
        self.read_limit()?;
        KafkaSource::new(self.options(env)?).map(|_| ())
    }

    async fn build(&self, env: &BuildEnv) -> Result<Arc<dyn Source>> {
        Ok(Arc::new(KafkaSource::new(self.options(env)?)?))
    }

    /// Asks the brokers for the subscribed topics' partitions (30 s at most).
    async fn probe(&self, env: &BuildEnv) -> Result<String> {
        let o = self.options(env)?;
        let what = format!("Kafka brokers {}", o.bootstrap_servers);
        let found = tokio::task::spawn_blocking(move || {
            let c = crate::client::consumer(&o)?;
            crate::client::partitions(&c, &o)
        })
        .await
        .map_err(|e| Error::Internal {
            what: format!("asking {what} for metadata: {e}"),
        })?
        .map_err(|e| Error::Unreachable {
            what: what.clone(),
            source: Box::new(e),
        })?;
        let mut topics: BTreeMap<&str, usize> = BTreeMap::new();
        for (t, _) in &found {
            *topics.entry(t).or_default() += 1;
        }
        let listed: Vec<String> = topics
            .iter()
            .map(|(t, n)| format!("{t} ({n} partition{})", if *n == 1 { "" } else { "s" }))
            .collect();
        Ok(format!("{what}: {}", listed.join(", ")))
    }

    fn schema(&self, env: &BuildEnv) -> Result<Option<SchemaRef>> {
        // Making the source connects to nothing (its consumer is made at first use).
        Ok(Some(KafkaSource::new(self.options(env)?)?.schema()))
    }

    fn read_limit(&self) -> Result<ReadLimit> {
        for (key, v) in [
            (
                "source.max-offsets-per-trigger",
                self.max_offsets_per_trigger,
            ),
            (
                "source.min-offsets-per-trigger",
                self.min_offsets_per_trigger,
            ),
        ] {
            if v == Some(0) {
                return Err(Error::config(
                    key,
                    "0 would never read a record: give at least 1",
                ));
            }
        }
        if self.max_trigger_delay.is_some() && self.min_offsets_per_trigger.is_none() {
            return Err(Error::config(
                "source.max-trigger-delay",
                "only used with min-offsets-per-trigger",
            ));
        }
        Ok(ReadLimit {
            max_rows: self.max_offsets_per_trigger,
            min_rows: self.min_offsets_per_trigger.map(|n| {
                (
                    n,
                    self.max_trigger_delay
                        .map_or(std::time::Duration::from_secs(15 * 60), |d| d.0),
                )
            }),
            ..ReadLimit::ALL
        })
    }
    fn dead_letter(&self, env: &BuildEnv) -> Option<weir_core::storage::Location> {
        let d = self.dead_letter.as_ref()?;
        env.location("source.dead-letter", d).ok()
    }

    /// Not with a dead letter: the workers' reads do not write one.
    fn reads_on_workers(&self) -> bool {
        self.dead_letter.is_none()
    }
}

impl SourceHarness for KafkaConfig {
    fn feed_kind(&self) -> Option<FeedKind> {
        Some(FeedKind::Kafka)
    }

    fn relocate(&mut self, feed: &Feed, batch_rows: u64) -> Result<()> {
        match feed {
            Feed::Kafka { brokers, topic } => {
                self.bootstrap_servers = brokers.clone();
                self.subscribe = vec![topic.clone()];
                self.subscribe_pattern = None;
                self.starting_offsets = Some(StartingOffsets::Earliest);
                self.max_offsets_per_trigger = Some(batch_rows);
                self.min_offsets_per_trigger = None;
                self.max_trigger_delay = None;
                Ok(())
            }
            Feed::Files { .. } => Err(Error::config(
                "source.type",
                "a Kafka source cannot read a folder of files",
            )),
        }
    }
}

impl SourceConnector for KafkaConfig {
    const KIND: &'static str = "kafka";
}
