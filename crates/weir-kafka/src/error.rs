/// Errors of the Kafka source; each names the topic and partition where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaSourceError {
    /// librdkafka failed (connecting, metadata, watermarks, fetching).
    #[error("{action}: {source}")]
    Kafka {
        action: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },

    /// Offsets that the batch needs are gone (retention, a deleted topic or partition).
    #[error(
        "data loss: topic {topic} partition {partition}: {detail}. Some data may have been lost because \
         it is not available in Kafka any more. If you want the query to carry on, set failOnDataLoss (fail-on-data-loss in a pipeline file) to false"
    )]
    DataLoss {
        topic: String,
        partition: i32,
        detail: String,
    },

    /// The broker answered topic metadata with an error: the batch is not planned on it.
    #[error("topic {topic}{}: metadata error: {detail}; the batch fails rather than treat the partitions as gone", partition.map(|p| format!(" partition {p}")).unwrap_or_default())]
    Metadata {
        topic: String,
        partition: Option<i32>,
        detail: String,
    },

    /// A value could not be parsed in FAILFAST mode.
    #[error("malformed record in topic {topic} partition {partition} at offset {offset}: {reason}")]
    Malformed {
        topic: String,
        partition: i32,
        offset: i64,
        reason: String,
    },

    /// Reading a range did not finish: the broker stopped delivering before `end`.
    #[error(
        "topic {topic} partition {partition}: read up to {reached} of [{from}, {to}) and no more records came for {secs} s"
    )]
    Stalled {
        topic: String,
        partition: i32,
        from: i64,
        to: i64,
        reached: i64,
        secs: u64,
    },

    /// An offset or option is not in the expected shape.
    #[error("invalid {what}: {reason}")]
    Invalid { what: String, reason: String },
}
