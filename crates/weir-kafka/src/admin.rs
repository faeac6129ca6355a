//! Small admin helper for demos, benches and tests.

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

use crate::error::KafkaSourceError;

/// Creates `topic` with `partitions` partitions (replication 1) on `bootstrap`.
pub async fn create_topic(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
) -> Result<(), KafkaSourceError> {
    let kafka_err = |source| KafkaSourceError::Kafka {
        action: format!("creating topic {topic}"),
        source,
    };
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(kafka_err)?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .map_err(kafka_err)?;
    for r in results {
        r.map_err(|(_, code)| kafka_err(rdkafka::error::KafkaError::AdminOp(code)))?;
    }
    Ok(())
}
