//! # weir-kafka
//!
//! A Kafka source for weir with Spark's semantics and option names. Each batch reads
//! exactly `[start, end)` of every partition by assigning partitions at explicit offsets
//! (no consumer-group state decides what is read), so a replay returns the same records in
//! the same order. Offsets are stored in Spark's shape `{"orders":{"0":123,"1":456}}`, the
//! next offset to read per partition. The first batch's starting offsets are recorded in
//! `<checkpoint>/sources/0/0` before it runs, as Spark does, so a replay of batch 0 does not
//! depend on where `earliest` or `latest` has moved since.
//!
//! A topic deleted and made again is told from the one read by the records themselves
//! (see `marks`): the read of a batch starts one record early and compares that record with
//! what an earlier batch read there.
//!
//! On a cluster (`[cluster]`) each batch's ranges are read on the workers, each task its
//! share of the partitions straight from the brokers (`KafkaRangeExec`).
//!
//! librdkafka is built by its own `./configure` with OpenSSL (TLS, SASL PLAIN, SCRAM,
//! OAUTHBEARER) and every codec (gzip, snappy, lz4, zstd); `kafka.*` settings pass through.

mod admin;
mod client;
mod config;
mod error;
mod leaf;
mod marks;
mod offsets;
mod options;
mod quiet;
mod read;
mod source;
mod tombstone;

pub use admin::{create_topic, delete_topic, end_offsets};
pub use config::{KafkaConfig, ValueFormatName};
pub use error::KafkaSourceError;
pub use leaf::{KAFKA_RANGES, KafkaRange, KafkaRangeExec, KafkaScan};
pub use offsets::{check_loss, split_limit};
pub use options::{
    BadRecordMode, KafkaOptions, StartingOffsets, Subscribe, Tombstones, ValueFormat,
};
pub use source::KafkaSource;

/// rdkafka, re-exported for producers and admin calls in tests and tools.
pub use rdkafka;

/// Offsets per topic and partition: the next offset to read.
pub type PartitionOffsets =
    std::collections::BTreeMap<String, std::collections::BTreeMap<i32, i64>>;
