//! Offsets: what each batch reads.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use weir_core::checkpoint::file::{self as durable, WriteOutcome};
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::{Error, ReadLimit, Result, Source, SourceOffset};

use crate::error::KafkaSourceError;
use crate::options::{KafkaOptions, StartingOffsets, Subscribe};
use crate::{PartitionOffsets, read};

const META_TIMEOUT: Duration = Duration::from_secs(30);

/// A Kafka topic (or topics) as a replayable source. See the crate docs.
pub struct KafkaSource {
    opts: Arc<KafkaOptions>,
    schema: SchemaRef,
    log_dir: Mutex<Option<PathBuf>>,
    /// Per-partition lag after the last planned batch, for progress.
    behind: Mutex<BTreeMap<String, String>>,
    /// When the last batch was planned (or the source opened), for maxTriggerDelay.
    last_batch: Mutex<std::time::Instant>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Checks the options (a bad pattern is refused here).
    pub fn new(opts: KafkaOptions) -> Result<Self> {
        if let Subscribe::Pattern(p) = &opts.subscribe {
            regex::Regex::new(p).map_err(|e| Error::config("subscribePattern", e.to_string()))?;
        }
        if let Subscribe::Topics(t) = &opts.subscribe
            && t.is_empty()
        {
            return Err(Error::config("subscribe", "no topic given"));
        }
        let schema = read::output_schema(&opts.value_format);
        Ok(KafkaSource {
            opts: Arc::new(opts),
            schema,
            log_dir: Mutex::new(None),
            behind: Mutex::new(BTreeMap::new()),
            last_batch: Mutex::new(std::time::Instant::now()),
        })
    }

    fn err(&self, e: KafkaSourceError) -> Error {
        Error::Source {
            source_name: self.description(),
            reason: weir_core::sink::error_chain(&e),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&KafkaOptions) -> std::result::Result<T, KafkaSourceError> + Send + 'static,
    ) -> Result<T> {
        let opts = self.opts.clone();
        match tokio::task::spawn_blocking(move || f(&opts)).await {
            Ok(r) => r.map_err(|e| self.err(e)),
            Err(e) => Err(self.err(KafkaSourceError::Invalid {
                what: "Kafka task".into(),
                reason: e.to_string(),
            })),
        }
    }

    /// The first batch's start: recorded in `sources/0/0` once, then always read from there.
    async fn initial_offsets(&self) -> Result<PartitionOffsets> {
        let dir = self
            .log_dir
            .lock()
            .map_err(|_| self.err(invalid("state", "poisoned")))?
            .clone()
            .ok_or_else(|| self.err(invalid("state", "latest_offset called before open")))?;
        let path = dir.join("0");
        if path.exists() {
            let lines = durable::read_versioned(&path, 1, "Kafka initial offsets log")?;
            let line = lines.first().cloned().unwrap_or_default();
            let v: serde_json::Value = durable::parse_line(&path, 2, &line)?;
            return parse_offsets(&v).map_err(|e| self.err(e));
        }
        let starting = self.opts.starting_offsets.clone();
        let offsets = self
            .blocking(move |o| {
                let c = consumer(o)?;
                let mut out = PartitionOffsets::new();
                for (t, p) in partitions(&c, o)? {
                    let (low, high) = watermarks(&c, &t, p)?;
                    let at = match &starting {
                        StartingOffsets::Earliest => low,
                        StartingOffsets::Latest => high,
                        StartingOffsets::Explicit(m) => match m.get(&t).and_then(|ps| ps.get(&p)) {
                            Some(-2) | None => low,
                            Some(-1) => high,
                            Some(&o) => o,
                        },
                    };
                    out.entry(t).or_default().insert(p, at);
                }
                Ok(out)
            })
            .await?;
        let body = format!("v1\n{}", offsets_json(&offsets));
        if durable::write_new(&path, body.as_bytes())? == WriteOutcome::AlreadyExists {
            return Err(Error::CheckpointInUse { dir, path });
        }
        Ok(offsets)
    }

    async fn start_of(&self, start: Option<&SourceOffset>) -> Result<PartitionOffsets> {
        match start {
            Some(s) => parse_offsets(s.json()).map_err(|e| self.err(e)),
            None => self.initial_offsets().await,
        }
    }
}

fn invalid(what: &str, reason: &str) -> KafkaSourceError {
    KafkaSourceError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

/// A consumer that only ever reads assigned partitions at explicit offsets.
pub(crate) fn consumer(o: &KafkaOptions) -> std::result::Result<BaseConsumer, KafkaSourceError> {
    let mut cfg = ClientConfig::new();
    // librdkafka drops the connection on a fetch response above this (default 100 MB);
    // some Kafka-protocol brokers (noida-db among them) ignore fetch.max.bytes and answer a
    // 200,000-record read in one response. Overridable in `kafka.*`.
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
    cfg.create().map_err(|source| KafkaSourceError::Kafka {
        action: format!("connecting to {}", o.bootstrap_servers),
        source,
    })
}

pub(crate) fn partitions(
    c: &BaseConsumer,
    o: &KafkaOptions,
) -> std::result::Result<Vec<(String, i32)>, KafkaSourceError> {
    let md = c
        .fetch_metadata(None, META_TIMEOUT)
        .map_err(|source| KafkaSourceError::Kafka {
            action: "fetching topic metadata".into(),
            source,
        })?;
    let pattern = match &o.subscribe {
        Subscribe::Pattern(p) => {
            Some(regex::Regex::new(p).map_err(|e| invalid("subscribePattern", &e.to_string()))?)
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
        if wanted && t.error().is_none() {
            out.extend(
                t.partitions()
                    .iter()
                    .map(|p| (t.name().to_string(), p.id())),
            );
        }
    }
    out.sort();
    Ok(out)
}

pub(crate) fn watermarks(
    c: &BaseConsumer,
    topic: &str,
    p: i32,
) -> std::result::Result<(i64, i64), KafkaSourceError> {
    c.fetch_watermarks(topic, p, META_TIMEOUT)
        .map_err(|source| KafkaSourceError::Kafka {
            action: format!("fetching the offsets of topic {topic} partition {p}"),
            source,
        })
}

/// `{"t":{"0":1}}` into offsets.
pub(crate) fn parse_offsets(
    v: &serde_json::Value,
) -> std::result::Result<PartitionOffsets, KafkaSourceError> {
    let bad = || {
        invalid(
            "Kafka offset",
            &format!("{v} is not {{\"topic\":{{\"partition\":offset}}}}"),
        )
    };
    let mut out = PartitionOffsets::new();
    for (t, ps) in v.as_object().ok_or_else(bad)? {
        let m = out.entry(t.clone()).or_default();
        for (p, o) in ps.as_object().ok_or_else(bad)? {
            m.insert(p.parse().map_err(|_| bad())?, o.as_i64().ok_or_else(bad)?);
        }
    }
    Ok(out)
}

pub(crate) fn offsets_json(o: &PartitionOffsets) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (t, ps) in o {
        let inner: serde_json::Map<String, serde_json::Value> = ps
            .iter()
            .map(|(p, o)| (p.to_string(), serde_json::Value::from(*o)))
            .collect();
        m.insert(t.clone(), serde_json::Value::Object(inner));
    }
    serde_json::Value::Object(m)
}

/// Spark's rate limit: each partition gets its share of `limit` by backlog.
pub fn split_limit(
    backlog: &BTreeMap<(String, i32), i64>,
    limit: u64,
) -> BTreeMap<(String, i32), i64> {
    let total: i64 = backlog.values().sum();
    backlog
        .iter()
        .map(|(tp, &size)| {
            if total <= limit as i64 || total == 0 {
                return (tp.clone(), size);
            }
            let prorate = limit as f64 * (size as f64 / total as f64);
            let n = if prorate > 0.0 {
                prorate.floor()
            } else {
                prorate.ceil()
            } as i64;
            (tp.clone(), n.min(size))
        })
        .collect()
}

/// Checks `begin` against the partition's watermarks: data loss is an error, or (with
/// failOnDataLoss=false) a warning and a start at the earliest offset still there.
pub(crate) fn check_loss(
    fail: bool,
    topic: &str,
    p: i32,
    begin: i64,
    low: i64,
    high: i64,
) -> std::result::Result<i64, KafkaSourceError> {
    let detail = if begin < low {
        format!("offsets {begin}..{low} were deleted (earliest available is {low})")
    } else if begin > high {
        format!(
            "the recorded offset {begin} is beyond the latest {high}: the topic was recreated or truncated"
        )
    } else {
        return Ok(begin);
    };
    if fail {
        return Err(KafkaSourceError::DataLoss {
            topic: topic.into(),
            partition: p,
            detail,
        });
    }
    tracing::warn!(
        "topic {topic} partition {p}: {detail}; reading on from {low} (failOnDataLoss=false)"
    );
    Ok(low)
}

#[async_trait]
impl Source for KafkaSource {
    fn description(&self) -> String {
        match &self.opts.subscribe {
            Subscribe::Topics(t) => format!("KafkaV2[Subscribe[{}]]", t.join(",")),
            Subscribe::Pattern(p) => format!("KafkaV2[SubscribePattern[{p}]]"),
        }
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn open(&self, init: &weir_core::source::SourceInit) -> Result<()> {
        *self
            .log_dir
            .lock()
            .map_err(|_| self.err(invalid("state", "poisoned")))? = Some(init.log_dir.clone());
        Ok(())
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let begin = self.start_of(start).await?;
        let fail = self.opts.fail_on_data_loss;
        let (begins, highs) = self
            .blocking(move |o| {
                let c = consumer(o)?;
                let mut begins = BTreeMap::new();
                let mut highs = BTreeMap::new();
                let current = partitions(&c, o)?;
                for (t, ps) in &begin {
                    for p in ps.keys() {
                        if !current.contains(&(t.clone(), *p)) {
                            let e = KafkaSourceError::DataLoss {
                                topic: t.clone(),
                                partition: *p,
                                detail: "the partition is gone".into(),
                            };
                            if fail {
                                return Err(e);
                            }
                            tracing::warn!("{e}; dropping it (failOnDataLoss=false)");
                        }
                    }
                }
                for (t, p) in current {
                    let (low, high) = watermarks(&c, &t, p)?;
                    let b = match begin.get(&t).and_then(|ps| ps.get(&p)) {
                        Some(&b) => check_loss(fail, &t, p, b, low, high)?,
                        None => {
                            tracing::info!(
                                "topic {t}: new partition {p}, read from its earliest offset {low}"
                            );
                            low
                        }
                    };
                    begins.insert((t.clone(), p), b);
                    highs.insert((t, p), high);
                }
                Ok((begins, highs))
            })
            .await?;
        let backlog: BTreeMap<(String, i32), i64> = begins
            .iter()
            .map(|(tp, b)| (tp.clone(), (highs[tp] - b).max(0)))
            .collect();
        let take = match limit.max_rows {
            Some(l) => split_limit(&backlog, l),
            None => backlog.clone(),
        };
        let mut end = PartitionOffsets::new();
        let mut behind = Vec::new();
        for (tp, b) in &begins {
            let e = b + take.get(tp).copied().unwrap_or(0);
            behind.push(highs[tp] - e);
            end.entry(tp.0.clone()).or_default().insert(tp.1, e);
        }
        if let Ok(mut m) = self.behind.lock() {
            m.clear();
            if !behind.is_empty() {
                let n = behind.len() as f64;
                m.insert(
                    "minOffsetsBehindLatest".into(),
                    behind.iter().min().unwrap_or(&0).to_string(),
                );
                m.insert(
                    "maxOffsetsBehindLatest".into(),
                    behind.iter().max().unwrap_or(&0).to_string(),
                );
                m.insert(
                    "avgOffsetsBehindLatest".into(),
                    format!("{:.1}", behind.iter().sum::<i64>() as f64 / n),
                );
            }
        }
        let mut moved = take.values().any(|&n| n > 0);
        if let Some(min) = self.opts.min_offsets_per_trigger {
            let available: i64 = backlog.values().sum();
            let waited = self
                .last_batch
                .lock()
                .map(|t| t.elapsed())
                .unwrap_or_default();
            if moved && (available as u64) < min && waited < self.opts.max_trigger_delay {
                tracing::debug!(
                    "{available} new records < minOffsetsPerTrigger {min}; waiting (maxTriggerDelay {:?})",
                    self.opts.max_trigger_delay
                );
                moved = false;
            }
        }
        if moved && let Ok(mut t) = self.last_batch.lock() {
            *t = std::time::Instant::now();
        }
        let end = SourceOffset::new(offsets_json(&end));
        match start {
            Some(s) if !moved => Ok(Some(s.clone())),
            None if !moved => Ok(None),
            _ => Ok(Some(end)),
        }
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        let begin = self.start_of(start).await?;
        let end = parse_offsets(end.json()).map_err(|e| self.err(e))?;
        let batch = self.blocking(move |o| read::read(o, &begin, &end)).await?;
        ctx.read_batch(batch)
            .map_err(|e| Error::datafusion(format!("{}: holding the batch", self.description()), e))
    }

    fn metrics(&self) -> BTreeMap<String, String> {
        self.behind.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_limit_is_split_by_backlog_like_spark() {
        let backlog: BTreeMap<(String, i32), i64> = [
            (("t".to_string(), 0), 100),
            (("t".to_string(), 1), 300),
            (("t".to_string(), 2), 0),
        ]
        .into();
        let take = split_limit(&backlog, 100);
        assert_eq!(take.values().copied().collect::<Vec<_>>(), vec![25, 75, 0]);
        assert_eq!(
            split_limit(&backlog, 1000)
                .values()
                .copied()
                .collect::<Vec<_>>(),
            vec![100, 300, 0]
        );
    }

    #[test]
    fn offsets_round_trip_in_sparks_shape() {
        let v: serde_json::Value = serde_json::from_str(r#"{"orders":{"0":123,"1":456}}"#).unwrap();
        let o = parse_offsets(&v).unwrap();
        assert_eq!(offsets_json(&o), v);
        assert!(parse_offsets(&serde_json::json!({"orders": [1]})).is_err());
    }

    #[test]
    fn data_loss_fails_or_moves_on() {
        assert!(matches!(
            check_loss(true, "t", 0, 5, 10, 20),
            Err(KafkaSourceError::DataLoss { .. })
        ));
        assert_eq!(check_loss(false, "t", 0, 5, 10, 20).unwrap(), 10);
        assert_eq!(check_loss(true, "t", 0, 15, 10, 20).unwrap(), 15);
        assert!(
            check_loss(true, "t", 0, 25, 0, 3)
                .unwrap_err()
                .to_string()
                .contains("recreated")
        );
    }
}
