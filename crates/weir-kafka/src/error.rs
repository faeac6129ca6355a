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
        /// The broker's error is one that passes (a leader being elected, a broker
        /// starting): see [`KafkaSourceError::is_transient`].
        transient: bool,
    },

    /// A value could not be parsed in FAILFAST mode.
    #[error(
        "malformed record in topic {topic} partition {partition} at offset {offset}: {reason} \
         (FAILFAST; a record cannot be changed: to go on, run once with mode = \
         \"DROPMALFORMED\" on the source and trigger = \"once\", which replays only that \
         batch, without the record, and counts it; then set FAILFAST and the trigger back)"
    )]
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

impl KafkaSourceError {
    /// Whether running the batch again later may succeed: librdkafka's transport, timeout
    /// and broker-, leader- or coordinator-not-available errors, a metadata answer with such
    /// an error, and a read that stalled. Data loss, a malformed record, a missing topic or
    /// a refused setting are not. Decided by error code, never by text.
    pub fn is_transient(&self) -> bool {
        match self {
            KafkaSourceError::Kafka { source, .. } => {
                source.rdkafka_error_code().is_some_and(transient_code)
            }
            KafkaSourceError::Metadata { transient, .. } => *transient,
            KafkaSourceError::Stalled { .. } => true,
            _ => false,
        }
    }

    /// The error as the engine takes it: marked `Transient` when it may pass.
    pub fn boxed(self) -> weir_core::BoxError {
        if self.is_transient() {
            Box::new(weir_core::error::Transient::new(self))
        } else {
            Box::new(self)
        }
    }
}

/// The librdkafka and broker error codes that pass by themselves.
pub(crate) fn transient_code(code: rdkafka::types::RDKafkaErrorCode) -> bool {
    use rdkafka::types::RDKafkaErrorCode::*;
    matches!(
        code,
        BrokerTransportFailure
            | Resolve
            | AllBrokersDown
            | OperationTimedOut
            | LeaderNotAvailable
            | NotLeaderForPartition
            | RequestTimedOut
            | BrokerNotAvailable
            | ReplicaNotAvailable
            | NetworkException
            | CoordinatorLoadInProgress
            | CoordinatorNotAvailable
            | NotCoordinator
            | NotEnoughReplicas
            | NotEnoughReplicasAfterAppend
            | NotController
            | KafkaStorageError
            | FencedLeaderEpoch
            | UnknownLeaderEpoch
            | OffsetNotAvailable
            | PreferredLeaderNotAvailable
            | ThrottlingQuotaExceeded
    )
}

#[cfg(test)]
mod tests {
    use rdkafka::error::KafkaError;
    use rdkafka::types::RDKafkaErrorCode;

    use super::*;

    #[test]
    fn broker_and_network_errors_pass_and_the_rest_do_not() {
        let kafka = |code| KafkaSourceError::Kafka {
            action: "fetching".into(),
            source: KafkaError::MetadataFetch(code),
        };
        for (e, transient) in [
            (kafka(RDKafkaErrorCode::AllBrokersDown), true),
            (kafka(RDKafkaErrorCode::LeaderNotAvailable), true),
            (kafka(RDKafkaErrorCode::RequestTimedOut), true),
            (kafka(RDKafkaErrorCode::TopicAuthorizationFailed), false),
            (kafka(RDKafkaErrorCode::UnknownTopicOrPartition), false),
            (
                KafkaSourceError::DataLoss {
                    topic: "t".into(),
                    partition: 0,
                    detail: "gone".into(),
                },
                false,
            ),
        ] {
            assert_eq!(e.is_transient(), transient, "{e}");
            let boxed = e.boxed();
            assert_eq!(
                weir_core::error::is_transient(boxed.as_ref()),
                transient,
                "{boxed}"
            );
        }
    }
}
