//! Options with Spark's names.

use std::collections::BTreeMap;
use std::time::Duration;

use weir_core::datafusion::arrow::datatypes::SchemaRef;

use crate::PartitionOffsets;

/// `subscribe` or `subscribePattern`.
#[derive(Debug, Clone)]
pub enum Subscribe {
    Topics(Vec<String>),
    Pattern(String),
}

/// `startingOffsets`: where the first batch starts.
#[derive(Debug, Clone)]
pub enum StartingOffsets {
    Earliest,
    Latest,
    /// Per topic and partition; `-2` means earliest and `-1` latest, as in Spark.
    Explicit(PartitionOffsets),
}

/// What a malformed JSON value does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadRecordMode {
    /// Stop the query with an error naming topic, partition and offset.
    FailFast,
    /// Keep the row: columns null, the raw value in `_corrupt_record`.
    Permissive,
}

/// How values become columns.
#[derive(Debug, Clone)]
pub enum ValueFormat {
    /// Spark's columns: key, value (binary), topic, partition, offset, timestamp, timestampType.
    Raw,
    /// Each value is a JSON object parsed into `schema` (vectorized, with arrow-json).
    Json {
        schema: SchemaRef,
        mode: BadRecordMode,
    },
}

/// Settings of a [`crate::KafkaSource`].
#[derive(Clone)]
pub struct KafkaOptions {
    /// `kafka.bootstrap.servers`.
    pub bootstrap_servers: String,
    pub subscribe: Subscribe,
    pub starting_offsets: StartingOffsets,
    /// `failOnDataLoss` (default true).
    pub fail_on_data_loss: bool,
    /// Other `kafka.*` settings, passed to librdkafka as they are (security included).
    /// Never logged.
    pub kafka: BTreeMap<String, String>,
    pub value_format: ValueFormat,
    /// How long a read may wait for records it knows exist (default 60 s).
    pub fetch_timeout: Duration,
    /// `minOffsetsPerTrigger`: wait for at least this many new records in all partitions…
    pub min_offsets_per_trigger: Option<u64>,
    /// …but no longer than `maxTriggerDelay` (default 15 min) since the last batch.
    pub max_trigger_delay: Duration,
}

impl KafkaOptions {
    /// Reads `topics` from `bootstrap_servers`, earliest first, failing on data loss, raw rows.
    pub fn new(bootstrap_servers: impl Into<String>, topics: Vec<String>) -> Self {
        KafkaOptions {
            bootstrap_servers: bootstrap_servers.into(),
            subscribe: Subscribe::Topics(topics),
            starting_offsets: StartingOffsets::Earliest,
            fail_on_data_loss: true,
            kafka: BTreeMap::new(),
            value_format: ValueFormat::Raw,
            fetch_timeout: Duration::from_secs(60),
            min_offsets_per_trigger: None,
            max_trigger_delay: Duration::from_secs(15 * 60),
        }
    }
}

impl std::fmt::Debug for KafkaOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the kafka.* settings: they may hold passwords.
        f.debug_struct("KafkaOptions")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("subscribe", &self.subscribe)
            .field("fail_on_data_loss", &self.fail_on_data_loss)
            .finish_non_exhaustive()
    }
}
