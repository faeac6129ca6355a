//! Small admin helper for demos, benches and tests.

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;

use crate::error::KafkaSourceError;
use crate::options::KafkaOptions;

fn admin_client(bootstrap: &str) -> Result<AdminClient<DefaultClientContext>, KafkaError> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
}

/// Deletes `topic` from `bootstrap` (benches drop what they produced).
pub async fn delete_topic(bootstrap: &str, topic: &str) -> Result<(), KafkaSourceError> {
    let kafka_err = |source| KafkaSourceError::Kafka {
        action: format!("deleting topic {topic}"),
        source,
    };
    let results = admin_client(bootstrap)
        .map_err(kafka_err)?
        .delete_topics(&[topic], &AdminOptions::new())
        .await
        .map_err(kafka_err)?;
    for r in results {
        r.map_err(|(_, code)| kafka_err(KafkaError::AdminOp(code)))?;
    }
    Ok(())
}

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
    let results = admin_client(bootstrap)
        .map_err(kafka_err)?
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .map_err(kafka_err)?;
    for r in results {
        r.map_err(|(_, code)| kafka_err(KafkaError::AdminOp(code)))?;
    }
    Ok(())
}

/// The latest offset (high watermark) of every partition of `topic`.
pub async fn end_offsets(
    bootstrap: &str,
    topic: &str,
) -> Result<std::collections::BTreeMap<i32, i64>, KafkaSourceError> {
    let opts = KafkaOptions::new(bootstrap, [topic]);
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let c = crate::client::consumer(&opts)?;
        let mut out = std::collections::BTreeMap::new();
        for (t, p) in crate::client::partitions(&c, &opts)? {
            if t == topic {
                out.insert(p, crate::client::watermarks(&c, &t, p)?.1);
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| KafkaSourceError::Invalid {
        what: "Kafka task".into(),
        reason: e.to_string(),
    })?
}
