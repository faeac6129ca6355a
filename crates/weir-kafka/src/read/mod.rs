//! Reading `[start, end)` of every partition into one Arrow batch.

use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::Consumer;

use crate::client::BaseConsumer;
use rdkafka::message::{BorrowedMessage, Headers, Message, Timestamp};
use rdkafka::{Offset, TopicPartitionList};
use weir_core::datafusion::arrow::array::{
    Array, ArrayRef, BinaryArray, BinaryBuilder, Int32Array, Int64Array, ListBuilder,
    StringBuilder, StructBuilder, TimestampMillisecondArray,
};
use weir_core::datafusion::arrow::datatypes::{
    DataType, Field, Fields, Schema, SchemaRef, TimeUnit,
};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::source::dead_letter::Letter;
use weir_core::source::decode;

use crate::PartitionOffsets;
use crate::client::watermarks;
use crate::error::KafkaSourceError;
use crate::marks::{Mark, Marks, compare};
use crate::offsets::check_loss;
use crate::options::{KafkaOptions, Tombstones, ValueFormat};
mod json;
use json::json_read;

fn header_fields() -> Fields {
    Fields::from(vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("value", DataType::Binary, true),
    ])
}

fn headers_type() -> DataType {
    DataType::List(Arc::new(Field::new(
        "item",
        DataType::Struct(header_fields()),
        true,
    )))
}

/// Spark's Kafka columns (with `headers`, an array of (key, value) structs, when
/// `include_headers` is on, as Spark's `includeHeaders`).
pub(crate) fn raw_schema(include_headers: bool) -> SchemaRef {
    let mut fields = vec![
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
    ];
    if include_headers {
        fields.push(Field::new("headers", headers_type(), true));
    }
    Arc::new(Schema::new(fields))
}

/// The schema of the batches for a value format (and `_deleted` last with
/// `tombstones = "delete"`).
pub(crate) fn output_schema(
    f: &ValueFormat,
    include_headers: bool,
    tombstones: Tombstones,
) -> SchemaRef {
    match f {
        ValueFormat::Raw => raw_schema(include_headers),
        ValueFormat::Json { schema, mode } => {
            crate::tombstone::schema(decode::output_schema(schema, *mode), tombstones)
        }
    }
}

/// What was read from one partition: values and keys back to back in Arrow builders (no
/// allocation per record), in offset order.
struct Part {
    topic: String,
    partition: i32,
    from: i64,
    to: i64,
    next: i64,
    /// A consumer position beyond `to` seen at the last empty poll, not yet trusted.
    beyond: Option<i64>,
    /// The mark of the record before `from`, which the read starts at to compare it.
    check: Option<Mark>,
    /// The mark of the range's last record, once read.
    last: Option<Mark>,
    offsets: Vec<i64>,
    timestamps: Vec<Option<i64>>,
    timestamp_types: Vec<i32>,
    keys: BinaryBuilder,
    values: BinaryBuilder,
    headers: Option<ListBuilder<StructBuilder>>,
}

impl Part {
    fn done(&self) -> bool {
        self.next >= self.to
    }

    /// Takes the consumer's position `at` (seen at an empty poll) as how far the partition
    /// got. A position beyond the range (control records skipped past its end) counts only
    /// when two empty polls in a row give it: a position left from the consumer's earlier
    /// assignment is reset within milliseconds and must not end the partition unread.
    fn advance_to(&mut self, at: i64) {
        if at <= self.to {
            self.next = self.next.max(at);
            self.beyond = None;
        } else if self.beyond == Some(at) {
            self.next = self.to;
        } else {
            self.beyond = Some(at);
        }
    }
}

/// The records of all partitions, ordered by (topic, partition, offset).
struct Records {
    /// The topic of each part, and the part each record came from.
    part_topics: Vec<String>,
    part_of: Vec<u32>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
    timestamps: Vec<Option<i64>>,
    timestamp_types: Vec<i32>,
    keys: BinaryArray,
    values: BinaryArray,
    headers: Vec<ArrayRef>,
}

impl Records {
    fn from_parts(parts: Vec<Part>) -> Records {
        let n: usize = parts.iter().map(|p| p.offsets.len()).sum();
        let bytes: usize = parts.iter().map(|p| p.values.values_slice().len()).sum();
        let mut r = Records {
            part_topics: Vec::with_capacity(parts.len()),
            part_of: Vec::with_capacity(n),
            partitions: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n),
            timestamps: Vec::with_capacity(n),
            timestamp_types: Vec::with_capacity(n),
            keys: BinaryArray::from(Vec::<Option<&[u8]>>::new()),
            values: BinaryArray::from(Vec::<Option<&[u8]>>::new()),
            headers: Vec::new(),
        };
        let mut keys = BinaryBuilder::new();
        let mut values = BinaryBuilder::with_capacity(n, bytes);
        for (index, mut p) in parts.into_iter().enumerate() {
            let k = p.keys.finish();
            let v = p.values.finish();
            if let Some(h) = p.headers.as_mut() {
                r.headers.push(Arc::new(h.finish()));
            }
            for i in 0..p.offsets.len() {
                keys.append_option(k.is_valid(i).then(|| k.value(i)));
                values.append_option(v.is_valid(i).then(|| v.value(i)));
            }
            r.part_of
                .extend(std::iter::repeat_n(index as u32, p.offsets.len()));
            r.part_topics.push(p.topic);
            r.partitions
                .extend(std::iter::repeat_n(p.partition, p.offsets.len()));
            r.offsets.append(&mut p.offsets);
            r.timestamps.append(&mut p.timestamps);
            r.timestamp_types.append(&mut p.timestamp_types);
        }
        r.keys = keys.finish();
        r.values = values.finish();
        r
    }

    fn len(&self) -> usize {
        self.offsets.len()
    }

    fn topic(&self, i: usize) -> &str {
        &self.part_topics[self.part_of[i] as usize]
    }
}

/// What a read gives: the rows, the tombstones dropped (`tombstones = "skip"`), and the
/// bad records that left the batch under DROPMALFORMED, for a dead letter (in offset order).
pub(crate) struct Read {
    pub batches: Vec<RecordBatch>,
    pub skipped: u64,
    pub letters: Vec<Letter>,
    /// The last record read in each partition (see [`crate::marks`]).
    pub marks: Vec<(String, i32, Mark)>,
}

/// Reads every partition's `[begin, end)` with the source's long-lived consumer `c`;
/// partitions missing from `begin` (added since) start at 0, with the data-loss check.
/// The batches hold the records in (topic, partition, offset) order. The consumer is unassigned
/// afterwards, whatever happened, so it fetches nothing between batches; records it had
/// prefetched past the range, and errors queued while nothing polled, are dropped at the start
/// of the next read. (Emptying the queue right after the read instead cost a 150,000-record
/// batch up to half its read time: the records fetched past its end came back one by one.)
/// A partition's record before `begin` with a mark in `marks` is read too, and compared.
pub(crate) fn read(
    c: &BaseConsumer,
    o: &KafkaOptions,
    begin: &PartitionOffsets,
    end: &PartitionOffsets,
    marks: &Marks,
) -> Result<Read, KafkaSourceError> {
    // Errors queued while nothing polled (a broker that restarted while the sinks wrote or
    // the query waited) are about connections since re-made, not about this read.
    drain(c);
    let read = read_assigned(c, o, begin, end, marks);
    let unassigned = c.unassign().map_err(|source| KafkaSourceError::Kafka {
        action: "unassigning the partitions read".into(),
        source,
    });
    let batch = read?;
    unassigned?;
    Ok(batch)
}

/// Polls the unassigned consumer until its queue is empty (at most [`DRAIN_MAX`] events),
/// dropping what it gives: records of a stopped assignment and stale errors.
fn drain(c: &BaseConsumer) {
    for _ in 0..DRAIN_MAX {
        match c.poll(std::time::Duration::ZERO) {
            None => return,
            Some(Err(e)) => tracing::debug!("Kafka: dropping a queued error between batches: {e}"),
            Some(Ok(_)) => {}
        }
    }
}

/// Events one drain takes at most: a bound, so a client that keeps failing cannot hold the
/// batch (the read that follows reports what is still wrong).
const DRAIN_MAX: usize = 100_000;

fn read_assigned(
    c: &BaseConsumer,
    o: &KafkaOptions,
    begin: &PartitionOffsets,
    end: &PartitionOffsets,
    marks: &Marks,
) -> Result<Read, KafkaSourceError> {
    let include_headers = o.include_headers;
    let raw = matches!(o.value_format, ValueFormat::Raw);
    let mut tpl = TopicPartitionList::new();
    // In (topic, partition) order: `end` is a sorted map of sorted maps.
    let mut parts: Vec<Part> = Vec::new();
    for (t, ps) in end {
        for (&p, &to) in ps {
            let (low, high) = watermarks(c, t, p)?;
            // A partition missing from `begin` was added since: it starts at 0, as in Spark.
            let b = begin.get(t).and_then(|m| m.get(&p)).copied().unwrap_or(0);
            let from = check_loss(o.fail_on_data_loss, t, p, b, low, high)?;
            if to > from {
                // The record before the range, when an earlier read left its mark: read
                // first and compared (a topic made again shows there).
                let check = marks.at(t, p, from - 1).filter(|_| from > low);
                let at = if check.is_some() { from - 1 } else { from };
                tpl.add_partition_offset(t, p, Offset::Offset(at))
                    .map_err(|source| KafkaSourceError::Kafka {
                        action: format!("assigning topic {t} partition {p} at {at}"),
                        source,
                    })?;
                let n = usize::try_from(to - from).unwrap_or(0);
                // JSON values go to chunks, not to these builders.
                let m = if raw { n } else { 0 };
                parts.push(Part {
                    topic: t.clone(),
                    partition: p,
                    from,
                    to,
                    next: from,
                    beyond: None,
                    check,
                    last: None,
                    offsets: Vec::with_capacity(n),
                    timestamps: Vec::with_capacity(m),
                    timestamp_types: Vec::with_capacity(m),
                    keys: BinaryBuilder::new(),
                    values: BinaryBuilder::with_capacity(m, m * 64),
                    headers: (raw && include_headers)
                        .then(|| ListBuilder::new(StructBuilder::from_fields(header_fields(), 0))),
                });
            }
        }
    }
    if !parts.is_empty() {
        c.assign(&tpl).map_err(|source| KafkaSourceError::Kafka {
            action: "assigning partitions".into(),
            source,
        })?;
    }
    match &o.value_format {
        ValueFormat::Raw => {
            poll(c, o, &mut parts, |_, part, m| part.append(m))?;
            let marks = last_marks(&parts);
            Ok(Read {
                batches: vec![raw_batch(&Records::from_parts(parts), include_headers)?],
                skipped: 0,
                letters: Vec::new(),
                marks,
            })
        }
        ValueFormat::Json { schema, mode } => {
            let mut read = json_read(c, o, &mut parts, schema, *mode)?;
            read.marks = last_marks(&parts);
            Ok(read)
        }
    }
}

/// The mark of each part's last record.
fn last_marks(parts: &[Part]) -> Vec<(String, i32, Mark)> {
    parts
        .iter()
        .filter_map(|p| p.last.map(|m| (p.topic.clone(), p.partition, m)))
        .collect()
}

impl Part {
    /// Keeps all of a record (the raw format).
    fn append(&mut self, m: &BorrowedMessage<'_>) {
        let (timestamp, timestamp_type) = match m.timestamp() {
            Timestamp::NotAvailable => (None, -1),
            Timestamp::CreateTime(t) => (Some(t), 0),
            Timestamp::LogAppendTime(t) => (Some(t), 1),
        };
        self.timestamps.push(timestamp);
        self.timestamp_types.push(timestamp_type);
        self.keys.append_option(m.key());
        self.values.append_option(m.payload());
        if let Some(hb) = self.headers.as_mut() {
            if let Some(hs) = m.headers() {
                let sb = hb.values();
                for h in hs.iter() {
                    if let Some(k) = sb.field_builder::<StringBuilder>(0) {
                        k.append_value(h.key);
                    }
                    if let Some(v) = sb.field_builder::<BinaryBuilder>(1) {
                        v.append_option(h.value);
                    }
                    sb.append(true);
                }
            }
            hb.append(true);
        }
    }
}

/// Polls the assigned consumer until every part reached its end, handing each record of a
/// range to `take` with the part's index (after its offset is pushed to the part).
fn poll(
    c: &BaseConsumer,
    o: &KafkaOptions,
    parts: &mut [Part],
    mut take: impl FnMut(usize, &mut Part, &BorrowedMessage<'_>),
) -> Result<(), KafkaSourceError> {
    let mut last_progress = Instant::now();
    let mut progressed = false;
    // A handful of partitions: asking each whether it is done costs less than the poll.
    while parts.iter().any(|p| !p.done()) {
        match c.poll(std::time::Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let Some((i, part)) = parts
                    .iter_mut()
                    .enumerate()
                    .find(|(_, p)| p.partition == m.partition() && p.topic == m.topic())
                else {
                    continue;
                };
                if part.done() {
                    continue;
                }
                // The record before the range, read to compare with its mark. When the
                // first record is later, the one before is gone (compacted, or a
                // transaction marker): nothing to compare.
                if let Some(want) = part.check.take()
                    && m.offset() < part.from
                {
                    if m.offset() == want.offset
                        && let Some(why) = compare(&want, &Mark::of(&m))
                    {
                        if o.fail_on_data_loss {
                            return Err(KafkaSourceError::DataLoss {
                                topic: part.topic.clone(),
                                partition: part.partition,
                                detail: why,
                            });
                        }
                        tracing::warn!(
                            "topic {} partition {}: {why}; reading on from {} (failOnDataLoss=false)",
                            part.topic,
                            part.partition,
                            part.from
                        );
                    }
                    continue;
                }
                if m.offset() >= part.to {
                    part.next = part.to;
                    continue;
                }
                // Offsets only grow within an assignment: an offset below the next one
                // expected can only be a record fetched for an earlier one.
                if m.offset() < part.next {
                    continue;
                }
                part.offsets.push(m.offset());
                take(i, part, &m);
                part.next = m.offset() + 1;
                if part.next == part.to {
                    part.last = Some(Mark::of(&m));
                }
                progressed = true;
            }
            Some(Err(source)) => {
                return Err(KafkaSourceError::Kafka {
                    action: "fetching records".into(),
                    source,
                });
            }
            None => {
                // The stall clock restarts at the first empty poll after progress (no
                // clock read per record).
                if progressed {
                    last_progress = Instant::now();
                    progressed = false;
                }
                // Control records (transaction markers) occupy offsets that are never
                // delivered: the consumer's position tells how far it really got.
                if let Ok(pos) = c.position() {
                    for e in pos.elements() {
                        if let Offset::Offset(at) = e.offset()
                            && let Some(part) = parts
                                .iter_mut()
                                .find(|p| p.partition == e.partition() && p.topic == e.topic())
                        {
                            part.advance_to(at);
                        }
                    }
                }
                if last_progress.elapsed() > o.fetch_timeout
                    && let Some(p) = parts.iter().find(|p| !p.done())
                {
                    return Err(KafkaSourceError::Stalled {
                        topic: p.topic.clone(),
                        partition: p.partition,
                        from: p.from,
                        to: p.to,
                        reached: p.next,
                        secs: o.fetch_timeout.as_secs(),
                    });
                }
            }
        }
    }
    Ok(())
}

fn raw_batch(r: &Records, include_headers: bool) -> Result<RecordBatch, KafkaSourceError> {
    let mut topic = StringBuilder::new();
    for i in 0..r.len() {
        topic.append_value(r.topic(i));
    }
    let ts = TimestampMillisecondArray::from(r.timestamps.clone()).with_timezone("UTC");
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(r.keys.clone()),
        Arc::new(r.values.clone()),
        Arc::new(topic.finish()),
        Arc::new(Int32Array::from(r.partitions.clone())),
        Arc::new(Int64Array::from(r.offsets.clone())),
        Arc::new(ts),
        Arc::new(Int32Array::from(r.timestamp_types.clone())),
    ];
    if include_headers {
        let parts: Vec<&dyn Array> = r.headers.iter().map(|a| a.as_ref()).collect();
        let headers = if parts.is_empty() {
            weir_core::datafusion::arrow::array::new_empty_array(&headers_type())
        } else {
            weir_core::datafusion::arrow::compute::concat(&parts).map_err(|e| {
                KafkaSourceError::Invalid {
                    what: "Kafka headers".into(),
                    reason: e.to_string(),
                }
            })?
        };
        cols.push(headers);
    }
    RecordBatch::try_new(raw_schema(include_headers), cols).map_err(|e| KafkaSourceError::Invalid {
        what: "Kafka batch".into(),
        reason: e.to_string(),
    })
}
