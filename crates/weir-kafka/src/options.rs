//! Options with Spark's names, parsed once.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use weir_core::datafusion::arrow::datatypes::SchemaRef;
pub use weir_core::source::BadRecordMode;

use crate::PartitionOffsets;

/// `subscribe` or `subscribePattern`.
#[derive(Debug, Clone)]
pub enum Subscribe {
    Topics(Vec<String>),
    Pattern(String),
}

/// `startingOffsets`: where the first batch starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartingOffsets {
    Earliest,
    Latest,
    /// Per topic and partition; `-2` means earliest and `-1` latest, as in Spark.
    Explicit(PartitionOffsets),
}

impl std::str::FromStr for StartingOffsets {
    type Err = String;

    /// `earliest`, `latest`, or Spark's JSON `{"orders":{"0":42,"1":-2}}`. Anything else
    /// is refused (a bare number, a topic without partitions, an offset below -2).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "earliest" => return Ok(StartingOffsets::Earliest),
            "latest" => return Ok(StartingOffsets::Latest),
            _ => {}
        }
        let shape = || {
            format!(
                "'{s}' is not earliest, latest or {{\"topic\":{{\"partition\":offset}}}} \
                 (offset -2 = earliest, -1 = latest)"
            )
        };
        let v: serde_json::Value = serde_json::from_str(s).map_err(|_| shape())?;
        let topics = v.as_object().ok_or_else(shape)?;
        if topics.is_empty() {
            return Err(shape());
        }
        let mut out = PartitionOffsets::new();
        for (t, ps) in topics {
            let ps = ps.as_object().ok_or_else(shape)?;
            if ps.is_empty() {
                return Err(format!("topic '{t}' in '{s}' lists no partition"));
            }
            for (p, o) in ps {
                let p: i32 = p
                    .parse()
                    .ok()
                    .filter(|p| *p >= 0)
                    .ok_or_else(|| format!("'{p}' in '{s}' is not a partition number"))?;
                let o = o
                    .as_i64()
                    .filter(|o| *o >= -2)
                    .ok_or_else(|| format!("'{o}' in '{s}' is not an offset (-2, -1 or >= 0)"))?;
                out.entry(t.clone()).or_default().insert(p, o);
            }
        }
        Ok(StartingOffsets::Explicit(out))
    }
}

impl<'de> Deserialize<'de> for StartingOffsets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(|e| {
            serde::de::Error::custom(format!("invalid setting 'starting-offsets': {e}"))
        })
    }
}

impl Serialize for StartingOffsets {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StartingOffsets::Earliest => s.serialize_str("earliest"),
            StartingOffsets::Latest => s.serialize_str("latest"),
            StartingOffsets::Explicit(m) => {
                s.serialize_str(&crate::offsets::to_json(m).to_string())
            }
        }
    }
}

/// How values become columns.
#[derive(Debug, Clone)]
pub enum ValueFormat {
    /// Spark's columns: key, value (binary), topic, partition, offset, timestamp,
    /// timestampType, headers.
    Raw,
    /// Each value is a JSON object parsed into `schema` (vectorized, with arrow-json).
    Json {
        schema: SchemaRef,
        mode: BadRecordMode,
    },
}

/// What a record whose value is null (a tombstone) becomes, with JSON values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tombstones {
    /// A row of NULLs, as Spark's `from_json` gives (the default).
    #[default]
    Row,
    /// Dropped; counted in the progress (`sources[].metrics.tombstonesSkipped`).
    Skip,
    /// A delete of its key: the row takes its columns from the record's key (a JSON
    /// object, e.g. `{"order_id": 7}`) and has `_deleted` true; every other row has
    /// `_deleted` false. The Delta MERGE and PostgreSQL upsert sinks delete the key.
    Delete,
}

/// Settings of a [`crate::KafkaSource`]. `minOffsetsPerTrigger` and `maxOffsetsPerTrigger`
/// are read limits, set on the stream reader.
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
    /// The `kafka.*` settings that were given as `env:NAME`, by key: a scan sent to a
    /// cluster's workers carries the reference, not the secret.
    pub secret_env: BTreeMap<String, String>,
    pub value_format: ValueFormat,
    /// `includeHeaders`: a `headers` column (array of key/value structs) in the raw format.
    pub include_headers: bool,
    /// How long a read may wait for records it knows exist (default 60 s).
    pub fetch_timeout: Duration,
    /// After each batch is committed, its end offsets are committed to this consumer group
    /// too, so that the lag tools people already run can see the query. Never read back:
    /// the checkpoint stays the truth.
    pub commit_to_group: Option<String>,
    /// What a null value becomes (JSON values only).
    pub tombstones: Tombstones,
    /// With [`Tombstones::Delete`]: the column that gets the tombstone's Kafka timestamp,
    /// so the delete is ordered like any other change (name the sinks' ordering column).
    pub tombstone_timestamp: Option<String>,
    /// Where bad records go (`dead-letter`, JSON values under DROPMALFORMED): each with its
    /// topic, partition, offset, error and batch id, one Parquet file per batch, written
    /// once before the batch's commit. Not on a cluster (the workers' reads write none).
    pub dead_letter: Option<weir_core::storage::Location>,
}

impl KafkaOptions {
    /// Reads `topics` from `bootstrap_servers`, earliest first, failing on data loss, raw rows.
    pub fn new(
        bootstrap_servers: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        KafkaOptions {
            bootstrap_servers: bootstrap_servers.into(),
            subscribe: Subscribe::Topics(topics.into_iter().map(Into::into).collect()),
            starting_offsets: StartingOffsets::Earliest,
            fail_on_data_loss: true,
            kafka: BTreeMap::new(),
            secret_env: BTreeMap::new(),
            value_format: ValueFormat::Raw,
            include_headers: false,
            fetch_timeout: Duration::from_secs(60),
            commit_to_group: None,
            tombstones: Tombstones::Row,
            tombstone_timestamp: None,
            dead_letter: None,
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
            .field("kafka", &self.kafka.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starting_offsets_are_parsed_strictly() {
        assert_eq!("earliest".parse(), Ok(StartingOffsets::Earliest));
        assert_eq!("latest".parse(), Ok(StartingOffsets::Latest));
        let StartingOffsets::Explicit(m) = r#"{"orders":{"0":42,"1":-2}}"#.parse().unwrap() else {
            panic!()
        };
        assert_eq!(m["orders"][&0], 42);
        for bad in [
            "5",
            r#"{"orders": 3}"#,
            "{}",
            r#"{"o":{}}"#,
            r#"{"o":{"x":1}}"#,
            r#"{"o":{"0":-3}}"#,
            "earliest-ish",
        ] {
            assert!(bad.parse::<StartingOffsets>().is_err(), "{bad}");
        }
    }
}
