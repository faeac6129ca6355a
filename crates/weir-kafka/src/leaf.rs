//! The Kafka source's read on a cluster's workers. On a session whose plans run on a
//! cluster, `read_range` does not fetch the batch's records into the driver: it returns a
//! plan over [`KafkaRangeExec`], the batch's offset ranges from `offsets/N` as plain data
//! ([`KafkaScan`]). The distributed planner gives each task a share of the partitions
//! ([`KafkaScan::split`]); the task reads its ranges straight from the brokers with the same
//! reader as the single-process path (explicit offsets, the data-loss check, transaction
//! markers skipped, the same JSON decoder and bad-record modes), so a replay reads the same
//! records wherever it runs.
//!
//! A `kafka.*` setting given as `env:NAME` travels as that reference and is read from the
//! worker's own environment: secrets are not sent in plans.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use weir_core::connector::secret;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::common::{DataFusionError, Result as DfResult, project_schema};
use weir_core::datafusion::execution::{SendableRecordBatchStream, TaskContext};
use weir_core::datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use weir_core::datafusion::physical_plan::stream::RecordBatchReceiverStreamBuilder;
use weir_core::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties,
};
use weir_core::source::BadRecordMode;
use weir_core::source::leaf::{ScanKind, WorkerScan, balance, leaf_properties, stream_share};

use crate::marks::Marks;
use crate::options::{KafkaOptions, ValueFormat};
use crate::{PartitionOffsets, client, read};

/// One partition's records of a batch: `[from, to)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KafkaRange {
    pub topic: String,
    pub partition: i32,
    pub from: i64,
    pub to: i64,
}

impl KafkaRange {
    fn records(&self) -> u64 {
        u64::try_from(self.to - self.from).unwrap_or(0)
    }
}

impl fmt::Display for KafkaRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} partition {} offsets [{}, {})",
            self.topic, self.partition, self.from, self.to
        )
    }
}

/// What one scan of Kafka ranges reads: plain data, sent to the workers with the plan.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct KafkaScan {
    /// `kafka.bootstrap.servers`.
    pub bootstrap_servers: String,
    /// The `kafka.*` settings; one given as `env:NAME` stays that reference (read where the
    /// scan runs). Never shown.
    #[serde(default)]
    pub kafka: BTreeMap<String, String>,
    pub fail_on_data_loss: bool,
    pub include_headers: bool,
    pub fetch_timeout_ms: u64,
    /// `None`: Spark's raw columns; `Some(mode)`: JSON values decoded with the scan's schema.
    pub json: Option<BadRecordMode>,
    /// The ranges in shares: one share until the planner gives each task its own
    /// ([`KafkaScan::split`]). A scan reads every share it holds.
    pub shares: Vec<Vec<KafkaRange>>,
    /// Partitions per task: a task reads its ranges on this many consumers at once.
    pub partitions: usize,
    /// The columns read, by index into the output schema (`None`: all).
    #[serde(default)]
    pub projection: Option<Vec<usize>>,
    /// What a null JSON value becomes, and the column a delete's timestamp goes to.
    #[serde(default)]
    pub tombstones: crate::options::Tombstones,
    #[serde(default)]
    pub tombstone_timestamp: Option<String>,
    /// The marks of the records before the ranges, as the driver knew them when the plan
    /// was sent: each task checks its ranges' first records against them (a recreated
    /// topic, see [`crate::marks`]).
    #[serde(default)]
    pub(crate) marks: Marks,
}

impl fmt::Debug for KafkaScan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the kafka.* values: they may hold passwords.
        f.debug_struct("KafkaScan")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("kafka", &self.kafka.keys().collect::<Vec<_>>())
            .field("shares", &self.shares)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl KafkaScan {
    /// The scan of `[begin, end)` for `o`: every partition of `end` with its recorded
    /// begin (one missing from `begin` was added since and starts at 0, as in Spark), as
    /// the single-process read takes them. Empty ranges are kept: the reader's data-loss
    /// check decides where a partition really starts (with `failOnDataLoss = false` a
    /// recreated topic's end may lie below the recorded begin, and its records are read).
    pub(crate) fn new(o: &KafkaOptions, begin: &PartitionOffsets, end: &PartitionOffsets) -> Self {
        let mut ranges = Vec::new();
        for (t, ps) in end {
            for (&p, &to) in ps {
                let from = begin.get(t).and_then(|m| m.get(&p)).copied().unwrap_or(0);
                ranges.push(KafkaRange {
                    topic: t.clone(),
                    partition: p,
                    from,
                    to,
                });
            }
        }
        let kafka = o
            .kafka
            .iter()
            .map(|(k, v)| match o.secret_env.get(k) {
                Some(var) => (k.clone(), format!("env:{var}")),
                None => (k.clone(), v.clone()),
            })
            .collect();
        KafkaScan {
            bootstrap_servers: o.bootstrap_servers.clone(),
            kafka,
            fail_on_data_loss: o.fail_on_data_loss,
            include_headers: o.include_headers,
            fetch_timeout_ms: u64::try_from(o.fetch_timeout.as_millis()).unwrap_or(u64::MAX),
            json: match &o.value_format {
                ValueFormat::Raw => None,
                ValueFormat::Json { mode, .. } => Some(*mode),
            },
            shares: vec![ranges],
            partitions: weir_core::cores().max(2),
            projection: None,
            tombstones: o.tombstones,
            tombstone_timestamp: o.tombstone_timestamp.clone(),
            marks: Marks::default(),
        }
    }

    /// Every range, in (topic, partition) order.
    pub fn ranges(&self) -> impl Iterator<Item = &KafkaRange> {
        self.shares.iter().flatten()
    }

    /// The same ranges in `tasks` shares of about equal records (largest first onto the
    /// lightest share; ties keep the order), each share in (topic, partition) order.
    pub fn split(&self, tasks: usize) -> KafkaScan {
        let ranges: Vec<KafkaRange> = self.ranges().cloned().collect();
        KafkaScan {
            shares: balance(&ranges, KafkaRange::records, tasks),
            ..self.clone()
        }
    }

    /// The options a reader of this scan needs, secrets read from this process's
    /// environment. `schema` is the JSON values' schema (unused for raw rows).
    fn options(&self, schema: &SchemaRef) -> Result<KafkaOptions, weir_core::Error> {
        let mut topics: Vec<String> = self.ranges().map(|r| r.topic.clone()).collect();
        topics.sort();
        topics.dedup();
        let mut o = KafkaOptions::new(&self.bootstrap_servers, topics);
        for (k, v) in &self.kafka {
            o.kafka
                .insert(k.clone(), secret(&format!("source.kafka.{k}"), v)?);
        }
        o.fail_on_data_loss = self.fail_on_data_loss;
        o.include_headers = self.include_headers;
        o.fetch_timeout = Duration::from_millis(self.fetch_timeout_ms);
        o.tombstones = self.tombstones;
        o.tombstone_timestamp = self.tombstone_timestamp.clone();
        o.value_format = match self.json {
            None => ValueFormat::Raw,
            Some(mode) => ValueFormat::Json {
                schema: schema.clone(),
                mode,
            },
        };
        Ok(o)
    }

    fn output_schema(&self, schema: &SchemaRef) -> SchemaRef {
        match self.json {
            None => read::raw_schema(self.include_headers),
            Some(mode) => crate::tombstone::schema(
                weir_core::source::decode::output_schema(schema, mode),
                self.tombstones,
            ),
        }
    }
}

/// The Kafka source's scan on the wire.
pub const KAFKA_RANGES: ScanKind = ScanKind {
    kind: "weir.KafkaRanges.v1",
    find: |node| {
        node.downcast_ref::<KafkaRangeExec>()
            .map(|e| e as &dyn WorkerScan)
    },
    decode: |schema, body| {
        let scan: KafkaScan = serde_json::from_str(body).map_err(|e| {
            DataFusionError::Internal(format!("decoding a scan of Kafka ranges: {e}"))
        })?;
        Ok(Arc::new(KafkaRangeExec::try_new(scan, schema)?))
    },
};

/// A scan of the Kafka ranges one batch recorded, read by the task that runs it.
#[derive(Debug)]
pub struct KafkaRangeExec {
    scan: KafkaScan,
    /// The driver's marks, read when the plan is sent (a plan made while the batch before
    /// still ran gets that batch's marks too); `None` on a worker.
    live_marks: Option<Arc<Mutex<Marks>>>,
    /// The JSON values' schema (the raw columns for raw rows).
    decode_schema: SchemaRef,
    metrics: ExecutionPlanMetricsSet,
    props: Arc<PlanProperties>,
}

impl KafkaRangeExec {
    /// The scan `scan`, JSON values decoded with `decode_schema`.
    pub fn try_new(scan: KafkaScan, decode_schema: SchemaRef) -> DfResult<Self> {
        let full = scan.output_schema(&decode_schema);
        let projected = project_schema(&full, scan.projection.as_ref())?;
        let props = leaf_properties(projected, scan.partitions);
        Ok(KafkaRangeExec {
            scan,
            live_marks: None,
            decode_schema,
            metrics: ExecutionPlanMetricsSet::new(),
            props,
        })
    }

    /// What the scan reads.
    pub fn scan(&self) -> &KafkaScan {
        &self.scan
    }

    /// The scan with the driver's marks `marks`, sent with the plan as they are then.
    pub(crate) fn with_live_marks(mut self, marks: Arc<Mutex<Marks>>) -> Self {
        self.live_marks = Some(marks);
        self
    }

    /// The marks the ranges are checked against: the driver's as they are now, or on a
    /// worker those the plan brought.
    fn marks(&self) -> DfResult<Marks> {
        match &self.live_marks {
            Some(live) => {
                let marks = live
                    .lock()
                    .map_err(|_| DataFusionError::Internal("the Kafka marks' lock".into()))?;
                Ok(marks.only(self.scan.ranges().map(|r| (r.topic.as_str(), r.partition))))
            }
            None => Ok(self.scan.marks.clone()),
        }
    }

    /// `scan` read the way this one is (the same decode schema and live marks).
    fn like_this(&self, scan: KafkaScan) -> DfResult<Arc<dyn ExecutionPlan>> {
        let mut exec = KafkaRangeExec::try_new(scan, self.decode_schema.clone())?;
        exec.live_marks = self.live_marks.clone();
        Ok(Arc::new(exec))
    }
}

impl WorkerScan for KafkaRangeExec {
    fn kind(&self) -> &'static str {
        KAFKA_RANGES.kind
    }

    fn encode(&self) -> DfResult<(SchemaRef, String)> {
        let scan = KafkaScan {
            marks: self.marks()?,
            ..self.scan.clone()
        };
        let body = serde_json::to_string(&scan).map_err(|e| {
            DataFusionError::Internal(format!("encoding a scan of Kafka ranges: {e}"))
        })?;
        Ok((self.decode_schema.clone(), body))
    }

    /// One task per partition with records.
    fn tasks_wanted(&self) -> usize {
        self.scan
            .ranges()
            .filter(|r| r.records() > 0)
            .count()
            .max(1)
    }

    fn with_projection(&self, projection: Option<Vec<usize>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.like_this(KafkaScan {
            projection,
            ..self.scan.clone()
        })
    }

    fn per_task(&self, tasks: usize) -> DfResult<Vec<Arc<dyn ExecutionPlan>>> {
        self.scan
            .split(tasks)
            .shares
            .into_iter()
            .map(|share| {
                self.like_this(KafkaScan {
                    shares: vec![share],
                    ..self.scan.clone()
                })
            })
            .collect()
    }
}

impl DisplayAs for KafkaRangeExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let sizes: Vec<String> = self
            .scan
            .shares
            .iter()
            .map(|s| s.len().to_string())
            .collect();
        write!(
            f,
            "KafkaRangeExec: bootstrap={}, partitions per task=[{}]",
            self.scan.bootstrap_servers,
            sizes.join(", ")
        )
    }
}

impl ExecutionPlan for KafkaRangeExec {
    weir_core::leaf_plan_methods!("KafkaRangeExec");

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        // A task's variant holds its own share (see `per_task`); its ranges are spread
        // over the partitions, each read by a consumer of its own.
        let mine = stream_share(self.scan.ranges(), self.scan.partitions, partition);
        let rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let out = self.schema();
        let mut builder = RecordBatchReceiverStreamBuilder::new(out, 2);
        if mine.is_empty() {
            return Ok(builder.build());
        }
        let what = {
            let names: Vec<String> = mine.iter().map(ToString::to_string).collect();
            format!("reading Kafka {}", names.join(", "))
        };
        let opts = self.scan.options(&self.decode_schema).map_err(|e| {
            DataFusionError::Context(
                what.clone(),
                Box::new(DataFusionError::External(Box::new(e))),
            )
        })?;
        let projection = self.scan.projection.clone();
        // Run in the driver (a one-task stage), the driver's marks as they are now.
        let marks = self.marks()?;
        let tx = builder.tx();
        builder.spawn_blocking(move || {
            // A malformed value is the topic's: the batch is not run again on other
            // workers (it would fail the same way).
            let failed = |e| {
                let e = match e {
                    e @ crate::error::KafkaSourceError::Malformed { .. } => {
                        weir_core::sink::task_data_error(e)
                    }
                    e => DataFusionError::External(e.boxed()),
                };
                DataFusionError::Context(what.clone(), Box::new(e))
            };
            let consumer = client::consumer(&opts).map_err(failed)?;
            // One range at a time: a range's records are sent before the next is fetched,
            // so a task holds one partition's share in memory, and a plan that stopped
            // reading (cancelled, or failed elsewhere) stops the task at the next range.
            for r in &mine {
                let begin: PartitionOffsets =
                    [(r.topic.clone(), [(r.partition, r.from)].into())].into();
                let end: PartitionOffsets =
                    [(r.topic.clone(), [(r.partition, r.to)].into())].into();
                let read::Read { batches, .. } =
                    read::read(&consumer, &opts, &begin, &end, &marks).map_err(failed)?;
                for batch in batches {
                    let batch = match &projection {
                        Some(p) => batch.project(p)?,
                        None => batch,
                    };
                    rows.add(batch.num_rows());
                    if tx.blocking_send(Ok(batch)).is_err() {
                        return Ok(());
                    }
                }
            }
            Ok(())
        });
        Ok(builder.build())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(topic: &str, partition: i32, from: i64, to: i64) -> KafkaRange {
        KafkaRange {
            topic: topic.into(),
            partition,
            from,
            to,
        }
    }

    fn shares(s: &KafkaScan) -> Vec<Vec<(String, i32)>> {
        s.shares
            .iter()
            .map(|sh| sh.iter().map(|r| (r.topic.clone(), r.partition)).collect())
            .collect()
    }

    #[test]
    fn the_scan_takes_every_range_once_and_keeps_secrets_as_references() {
        let mut o = KafkaOptions::new("b:9092", ["o"]);
        o.kafka.insert("sasl.password".into(), "s3cret".into());
        o.kafka
            .insert("security.protocol".into(), "SASL_SSL".into());
        o.secret_env
            .insert("sasl.password".into(), "KAFKA_PASSWORD".into());
        let begin: PartitionOffsets = [("o".to_string(), [(0, 5), (1, 9)].into())].into();
        // Partition 1 has nothing new (kept: the reader's data-loss check still looks at
        // it); partition 2 was added since (starts at 0).
        let end: PartitionOffsets = [("o".to_string(), [(0, 8), (1, 9), (2, 4)].into())].into();
        let scan = KafkaScan::new(&o, &begin, &end);
        assert_eq!(
            scan.shares,
            vec![vec![
                range("o", 0, 5, 8),
                range("o", 1, 9, 9),
                range("o", 2, 0, 4)
            ]]
        );
        let exec = KafkaRangeExec::try_new(scan.clone(), read::raw_schema(false)).unwrap();
        assert_eq!(
            exec.tasks_wanted(),
            2,
            "one task per partition with records"
        );
        assert_eq!(scan.kafka["sasl.password"], "env:KAFKA_PASSWORD");
        assert_eq!(scan.kafka["security.protocol"], "SASL_SSL");
        let json = serde_json::to_string(&scan).unwrap();
        assert!(!json.contains("s3cret"), "{json}");
        assert!(!format!("{scan:?}").contains("SASL_SSL"));
        // On a worker without the variable the read says which setting wants it.
        let e = scan
            .options(&read::raw_schema(false))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("source.kafka.sasl.password"), "{e}");
    }

    #[test]
    fn split_balances_records() {
        let scan = KafkaScan {
            bootstrap_servers: "b:9092".into(),
            kafka: BTreeMap::new(),
            fail_on_data_loss: true,
            include_headers: false,
            fetch_timeout_ms: 1000,
            json: None,
            shares: vec![vec![
                range("a", 0, 0, 10),
                range("a", 1, 0, 100),
                range("a", 2, 0, 10),
                range("b", 0, 0, 50),
                range("b", 1, 0, 40),
            ]],
            partitions: 2,
            projection: None,
            tombstones: Default::default(),
            tombstone_timestamp: None,
            marks: Marks::default(),
        };
        // Largest first onto the lightest share: a1 | b0 | b1, then a0 onto b1 (40) and
        // a2 onto the first at 50.
        assert_eq!(
            shares(&scan.split(3)),
            vec![
                vec![("a".into(), 1)],
                vec![("a".into(), 2), ("b".into(), 0)],
                vec![("a".into(), 0), ("b".into(), 1)],
            ]
        );
        let many = scan.split(8);
        assert_eq!(many.shares.len(), 8);
        assert_eq!(many.ranges().count(), 5);
        assert_eq!(scan.split(1).shares, scan.shares);
    }
}
