//! librdkafka clients: a consumer that only reads assigned partitions at explicit offsets,
//! topic metadata, watermarks. Every call here blocks: the source runs them on tokio's
//! blocking pool.

use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer as RdBaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::PartitionOffsets;

use crate::error::KafkaSourceError;
use crate::options::{KafkaOptions, Subscribe};

/// The source's consumers: librdkafka's repeated lines held back (see [`crate::quiet`]).
pub(crate) type BaseConsumer = RdBaseConsumer<crate::quiet::Quiet>;

const META_TIMEOUT: Duration = Duration::from_secs(30);

/// A client kept in `slot` across batches: made by `make` on first use, reused by `use_it`,
/// and dropped when a call fails, so the next call starts from a fresh connection instead
/// of a client left in an unknown state. Blocks: call it on the blocking pool.
pub(crate) fn with_client<C, T>(
    slot: &Mutex<Option<C>>,
    make: impl FnOnce() -> Result<C, KafkaSourceError>,
    use_it: impl FnOnce(&C) -> Result<T, KafkaSourceError>,
) -> Result<T, KafkaSourceError> {
    let mut slot = slot.lock().map_err(|_| KafkaSourceError::Invalid {
        what: "Kafka client".into(),
        reason: "poisoned by an earlier panic".into(),
    })?;
    let client = match slot.take() {
        Some(c) => c,
        None => make()?,
    };
    let out = use_it(&client)?;
    *slot = Some(client);
    Ok(out)
}

/// librdkafka's refusal of a setting echoes its value, which may be a secret
/// (`sasl.password`, an `env:` value): the error names the setting and why, not the value.
fn unshown(action: String, source: KafkaError) -> KafkaSourceError {
    match source {
        KafkaError::ClientConfig(_, desc, key, value) => {
            let desc = if value.is_empty() {
                desc
            } else {
                desc.replace(&value, "***")
            };
            KafkaSourceError::Invalid {
                what: format!("setting kafka.{key} ({action})"),
                reason: format!(
                    "librdkafka refused its value (not shown: it may be a secret): {desc}"
                ),
            }
        }
        other => KafkaSourceError::Kafka {
            action,
            source: other,
        },
    }
}

/// A consumer that only ever reads assigned partitions at explicit offsets.
pub(crate) fn consumer(o: &KafkaOptions) -> Result<BaseConsumer, KafkaSourceError> {
    let mut cfg = ClientConfig::new();
    // librdkafka drops the connection on a fetch response above this (default 100 MB);
    // some Kafka-protocol brokers ignore fetch.max.bytes and answer a 200,000-record read
    // in one response. Overridable in `kafka.*`.
    cfg.set("receive.message.max.bytes", "2147483647");
    for (k, v) in &o.kafka {
        cfg.set(k, v);
    }
    cfg.set("bootstrap.servers", &o.bootstrap_servers)
        // assign() still wants a group id; nothing is committed to it.
        .set(
            "group.id",
            format!("weir-{}", uuid::Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "error");
    cfg.create_with_context(crate::quiet::Quiet)
        .map_err(|source| unshown(format!("connecting to {}", o.bootstrap_servers), source))
}

/// A client of consumer group `group` that only commits offsets (it never subscribes, so
/// it never joins the group or takes partitions from its members).
pub(crate) fn group_committer(
    o: &KafkaOptions,
    group: &str,
) -> Result<BaseConsumer, KafkaSourceError> {
    let mut cfg = ClientConfig::new();
    for (k, v) in &o.kafka {
        cfg.set(k, v);
    }
    cfg.set("bootstrap.servers", &o.bootstrap_servers)
        .set("group.id", group)
        .set("enable.auto.commit", "false");
    cfg.create_with_context(crate::quiet::Quiet)
        .map_err(|source| {
            unshown(
                format!("connecting to {} for group {group}", o.bootstrap_servers),
                source,
            )
        })
}

/// Commits `offsets` (the next offset to read, per partition) to the client's group.
pub(crate) fn commit_offsets(
    c: &BaseConsumer,
    group: &str,
    offsets: &PartitionOffsets,
) -> Result<(), KafkaSourceError> {
    let mut tpl = TopicPartitionList::new();
    for (topic, parts) in offsets {
        for (p, o) in parts {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*o))
                .map_err(|source| KafkaSourceError::Kafka {
                    action: format!("committing offsets to group {group}"),
                    source,
                })?;
        }
    }
    c.commit(&tpl, CommitMode::Sync)
        .map_err(|source| KafkaSourceError::Kafka {
            action: format!("committing the batch's end offsets to consumer group {group}"),
            source,
        })
}

/// The partitions of the subscribed topics. A topic or partition whose metadata comes back
/// with an error is an error (the batch fails and runs again), never a partition that
/// vanished: that would read it again from its start when the metadata recovers.
pub(crate) fn partitions(
    c: &BaseConsumer,
    o: &KafkaOptions,
) -> Result<Vec<(String, i32)>, KafkaSourceError> {
    let md = c
        .fetch_metadata(None, META_TIMEOUT)
        .map_err(|source| KafkaSourceError::Kafka {
            action: "fetching topic metadata".into(),
            source,
        })?;
    let pattern = match &o.subscribe {
        Subscribe::Pattern(p) => {
            Some(regex::Regex::new(p).map_err(|e| KafkaSourceError::Invalid {
                what: "subscribePattern".into(),
                reason: e.to_string(),
            })?)
        }
        Subscribe::Topics(_) => None,
    };
    let mut out = Vec::new();
    for t in md.topics() {
        let wanted = match (&o.subscribe, &pattern) {
            (Subscribe::Topics(ts), _) => ts.iter().any(|x| x == t.name()),
            (_, Some(re)) => re.is_match(t.name()),
            _ => false,
        };
        if !wanted {
            continue;
        }
        if let Some(e) = t.error() {
            return Err(KafkaSourceError::Metadata {
                topic: t.name().to_string(),
                partition: None,
                detail: format!("{e:?}"),
                transient: crate::error::transient_code(e.into()),
            });
        }
        for p in t.partitions() {
            if let Some(e) = p.error() {
                return Err(KafkaSourceError::Metadata {
                    topic: t.name().to_string(),
                    partition: Some(p.id()),
                    detail: format!("{e:?}"),
                    transient: crate::error::transient_code(e.into()),
                });
            }
            out.push((t.name().to_string(), p.id()));
        }
    }
    if let Subscribe::Topics(ts) = &o.subscribe {
        for t in ts {
            if !out.iter().any(|(n, _)| n == t) {
                return Err(KafkaSourceError::Metadata {
                    topic: t.clone(),
                    partition: None,
                    detail: "the broker does not list the topic".into(),
                    transient: false,
                });
            }
        }
    }
    out.sort();
    Ok(out)
}

/// (earliest, latest) offsets of a partition.
pub(crate) fn watermarks(
    c: &BaseConsumer,
    topic: &str,
    p: i32,
) -> Result<(i64, i64), KafkaSourceError> {
    c.fetch_watermarks(topic, p, META_TIMEOUT)
        .map_err(|source| KafkaSourceError::Kafka {
            action: format!("fetching the offsets of topic {topic} partition {p}"),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_setting_is_named_without_its_value() {
        let mut o = KafkaOptions::new("127.0.0.1:1", ["t"]);
        o.kafka
            .insert("fetch.min.bytes".into(), "notnum-SecretABC".into());
        let e = consumer(&o).err().unwrap().to_string();
        assert!(e.contains("kafka.fetch.min.bytes"), "{e}");
        assert!(!e.contains("SecretABC"), "{e}");
    }
}
