//! Reading `[start, end)` of every partition into one Arrow batch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::Consumer;
use rdkafka::message::{Message, Timestamp};
use rdkafka::{Offset, TopicPartitionList};
use weir_core::datafusion::arrow::array::{
    ArrayRef, BinaryBuilder, Int32Builder, Int64Builder, StringBuilder, TimestampMillisecondBuilder,
};
use weir_core::datafusion::arrow::compute::concat_batches;
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use weir_core::datafusion::arrow::json::ReaderBuilder;
use weir_core::datafusion::arrow::record_batch::RecordBatch;

use crate::PartitionOffsets;
use crate::error::KafkaSourceError;
use crate::options::{BadRecordMode, KafkaOptions, ValueFormat};
use crate::source::{check_loss, consumer, watermarks};

/// Spark's Kafka columns.
pub fn raw_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("key", DataType::Binary, true),
        Field::new("value", DataType::Binary, true),
        Field::new("topic", DataType::Utf8, false),
        Field::new("partition", DataType::Int32, false),
        Field::new("offset", DataType::Int64, false),
        Field::new(
            "timestamp",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            true,
        ),
        Field::new("timestampType", DataType::Int32, false),
    ]))
}

/// The schema of the batches for a value format.
pub fn output_schema(f: &ValueFormat) -> SchemaRef {
    match f {
        ValueFormat::Raw => raw_schema(),
        ValueFormat::Json { schema, mode } => {
            let mut fields: Vec<Field> = schema
                .fields()
                .iter()
                .map(|f| f.as_ref().clone().with_nullable(true))
                .collect();
            if *mode == BadRecordMode::Permissive {
                fields.push(Field::new("_corrupt_record", DataType::Utf8, true));
            }
            Arc::new(Schema::new(fields))
        }
    }
}

struct Record {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    timestamp: Option<i64>,
    timestamp_type: i32,
}

/// Reads every partition's `[begin, end)`; partitions missing from `begin` start at their
/// earliest offset. Records come out ordered by (topic, partition, offset).
pub fn read(
    o: &KafkaOptions,
    begin: &PartitionOffsets,
    end: &PartitionOffsets,
) -> Result<RecordBatch, KafkaSourceError> {
    let c = consumer(o)?;
    let mut tpl = TopicPartitionList::new();
    let mut ranges: BTreeMap<(String, i32), (i64, i64)> = BTreeMap::new();
    for (t, ps) in end {
        for (&p, &to) in ps {
            let (low, high) = watermarks(&c, t, p)?;
            let from = match begin.get(t).and_then(|m| m.get(&p)) {
                Some(&b) => check_loss(o.fail_on_data_loss, t, p, b, low, high)?,
                None => low,
            };
            if to > from {
                tpl.add_partition_offset(t, p, Offset::Offset(from))
                    .map_err(|source| KafkaSourceError::Kafka {
                        action: format!("assigning topic {t} partition {p} at {from}"),
                        source,
                    })?;
                ranges.insert((t.clone(), p), (from, to));
            }
        }
    }
    let mut records: Vec<Record> = Vec::new();
    if !ranges.is_empty() {
        c.assign(&tpl).map_err(|source| KafkaSourceError::Kafka {
            action: "assigning partitions".into(),
            source,
        })?;
        let mut next: BTreeMap<(String, i32), i64> =
            ranges.iter().map(|(k, v)| (k.clone(), v.0)).collect();
        let mut last_progress = Instant::now();
        while next.iter().any(|(k, &n)| n < ranges[k].1) {
            match c.poll(std::time::Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    let key = (m.topic().to_string(), m.partition());
                    let Some(&(_, to)) = ranges.get(&key) else {
                        continue;
                    };
                    if m.offset() >= to {
                        next.insert(key, to);
                        continue;
                    }
                    let (timestamp, timestamp_type) = match m.timestamp() {
                        Timestamp::NotAvailable => (None, -1),
                        Timestamp::CreateTime(t) => (Some(t), 0),
                        Timestamp::LogAppendTime(t) => (Some(t), 1),
                    };
                    records.push(Record {
                        topic: key.0.clone(),
                        partition: key.1,
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                        timestamp,
                        timestamp_type,
                    });
                    next.insert(key, m.offset() + 1);
                    last_progress = Instant::now();
                }
                Some(Err(source)) => {
                    return Err(KafkaSourceError::Kafka {
                        action: "fetching records".into(),
                        source,
                    });
                }
                None => {
                    // Control records (transaction markers) occupy offsets that are never
                    // delivered: the consumer's position tells how far it really got.
                    if let Ok(pos) = c.position() {
                        for e in pos.elements() {
                            if let Offset::Offset(p) = e.offset() {
                                let k = (e.topic().to_string(), e.partition());
                                if let Some(n) = next.get_mut(&k) {
                                    *n = (*n).max(p);
                                }
                            }
                        }
                    }
                    if last_progress.elapsed() > o.fetch_timeout {
                        let (k, n) = next
                            .iter()
                            .find(|(k, n)| **n < ranges[*k].1)
                            .map(|(k, n)| (k.clone(), *n))
                            .unwrap_or_default();
                        let (from, to) = ranges.get(&k).copied().unwrap_or_default();
                        return Err(KafkaSourceError::Stalled {
                            topic: k.0,
                            partition: k.1,
                            from,
                            to,
                            reached: n,
                            secs: o.fetch_timeout.as_secs(),
                        });
                    }
                }
            }
        }
    }
    records
        .sort_by(|a, b| (&a.topic, a.partition, a.offset).cmp(&(&b.topic, b.partition, b.offset)));
    match &o.value_format {
        ValueFormat::Raw => raw_batch(&records),
        ValueFormat::Json { schema, mode } => json_batch(&records, schema, *mode),
    }
}

fn raw_batch(records: &[Record]) -> Result<RecordBatch, KafkaSourceError> {
    let mut key = BinaryBuilder::new();
    let mut value = BinaryBuilder::new();
    let mut topic = StringBuilder::new();
    let mut partition = Int32Builder::new();
    let mut offset = Int64Builder::new();
    let mut ts = TimestampMillisecondBuilder::new().with_timezone("UTC");
    let mut ts_type = Int32Builder::new();
    for r in records {
        key.append_option(r.key.as_deref());
        value.append_option(r.value.as_deref());
        topic.append_value(&r.topic);
        partition.append_value(r.partition);
        offset.append_value(r.offset);
        ts.append_option(r.timestamp);
        ts_type.append_value(r.timestamp_type);
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(key.finish()),
        Arc::new(value.finish()),
        Arc::new(topic.finish()),
        Arc::new(partition.finish()),
        Arc::new(offset.finish()),
        Arc::new(ts.finish()),
        Arc::new(ts_type.finish()),
    ];
    RecordBatch::try_new(raw_schema(), cols).map_err(|e| KafkaSourceError::Invalid {
        what: "Kafka batch".into(),
        reason: e.to_string(),
    })
}

fn decode(schema: &SchemaRef, bytes: &[u8], rows: usize) -> Result<RecordBatch, String> {
    let mut d = ReaderBuilder::new(schema.clone())
        .with_batch_size(rows.max(1))
        .build_decoder()
        .map_err(|e| e.to_string())?;
    let used = d.decode(bytes).map_err(|e| e.to_string())?;
    if used != bytes.len() {
        return Err("trailing bytes after the JSON value".into());
    }
    if d.len() != rows {
        return Err(format!("expected {rows} JSON object(s), found {}", d.len()));
    }
    match d.flush().map_err(|e| e.to_string())? {
        Some(b) => Ok(b),
        None => Ok(RecordBatch::new_empty(schema.clone())),
    }
}

/// Parses all values at once (vectorized); only when that fails, value by value to find
/// the bad ones.
fn json_batch(
    records: &[Record],
    schema: &SchemaRef,
    mode: BadRecordMode,
) -> Result<RecordBatch, KafkaSourceError> {
    let out = output_schema(&ValueFormat::Json {
        schema: schema.clone(),
        mode,
    });
    let parse_schema = Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect::<Vec<_>>(),
    ));
    let line = |r: &Record| -> Vec<u8> {
        let mut v = r.value.clone().unwrap_or_else(|| b"{}".to_vec());
        v.retain(|&b| b != b'\n');
        v.push(b'\n');
        v
    };
    let all: Vec<u8> = records.iter().flat_map(line).collect();
    let invalid = |e: String| KafkaSourceError::Invalid {
        what: "JSON batch".into(),
        reason: e,
    };
    let with_corrupt =
        |b: RecordBatch, corrupt: Vec<Option<String>>| -> Result<RecordBatch, KafkaSourceError> {
            if mode == BadRecordMode::FailFast {
                return Ok(b);
            }
            let mut cols = b.columns().to_vec();
            cols.push(Arc::new(
                weir_core::datafusion::arrow::array::StringArray::from(corrupt),
            ));
            RecordBatch::try_new(out.clone(), cols).map_err(|e| invalid(e.to_string()))
        };
    if let Ok(b) = decode(&parse_schema, &all, records.len()) {
        return with_corrupt(b, vec![None; records.len()]);
    }
    let mut parts = Vec::with_capacity(records.len());
    let mut corrupt = Vec::with_capacity(records.len());
    for r in records {
        match decode(&parse_schema, &line(r), 1) {
            Ok(b) => {
                parts.push(b);
                corrupt.push(None);
            }
            Err(reason) if mode == BadRecordMode::FailFast => {
                return Err(KafkaSourceError::Malformed {
                    topic: r.topic.clone(),
                    partition: r.partition,
                    offset: r.offset,
                    reason,
                });
            }
            Err(_) => {
                parts.push(decode(&parse_schema, b"{}\n", 1).map_err(invalid)?);
                corrupt.push(Some(
                    String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned(),
                ));
            }
        }
    }
    let b = concat_batches(&parse_schema, &parts).map_err(|e| invalid(e.to_string()))?;
    with_corrupt(b, corrupt)
}
