//! JSON values: polled into chunks, each chunk decoded (on a second thread while the poll
//! goes on), bad-record modes and tombstones applied, bad records kept for a dead letter.

use crate::client::BaseConsumer;
use rdkafka::message::{BorrowedMessage, Message};
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::source::dead_letter::{Letter, Position};
use weir_core::source::decode;

use super::{Part, Read, poll};
use crate::error::KafkaSourceError;
use crate::options::{BadRecordMode, KafkaOptions, Tombstones};
use crate::tombstone::{self, Tomb};

/// JSON values parsed at a time: a chunk full while the poll goes on is parsed by a second
/// thread meanwhile, so the parse (as long as the poll on this machine) hides behind it.
const CHUNK: usize = 16_384;

/// Up to [`CHUNK`] consecutive values of one part, one per line as the decoder reads them.
struct Chunk {
    /// The part, and the index in it of the chunk's first record.
    part: usize,
    first: usize,
    /// Each value and a newline (a null value as `{}`; newlines inside a value, which can
    /// only be JSON whitespace, dropped).
    lines: Vec<u8>,
    /// Where each value's line ends (before its newline) in `lines`.
    ends: Vec<usize>,
    /// Records whose value is null, and values as they came that had a newline.
    nulls: Vec<usize>,
    raw: Vec<(usize, Vec<u8>)>,
    /// The null values' keys and timestamps (with `tombstones = "delete"` or `"skip"`).
    tombs: Vec<Tomb>,
}

impl Chunk {
    /// A chunk of part `part` from its record `first`, sized for at most `left` records.
    fn new(part: usize, first: usize, left: usize) -> Chunk {
        let n = left.min(CHUNK);
        Chunk {
            part,
            first,
            lines: Vec::with_capacity(n * 64),
            ends: Vec::with_capacity(n),
            nulls: Vec::new(),
            raw: Vec::new(),
            tombs: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn push(&mut self, m: &BorrowedMessage<'_>, tombstones: Tombstones) {
        self.push_record(m.payload(), m.key(), m.timestamp().to_millis(), tombstones);
    }

    /// A record's value, key and Kafka timestamp (ms).
    fn push_record(
        &mut self,
        v: Option<&[u8]>,
        key: Option<&[u8]>,
        timestamp: Option<i64>,
        tombstones: Tombstones,
    ) {
        if v.is_none() && tombstones != Tombstones::Row {
            self.tombs.push(Tomb {
                index: self.ends.len(),
                key: key.map(<[u8]>::to_vec),
                timestamp,
            });
        }
        match v {
            None => {
                self.nulls.push(self.ends.len());
                self.lines.extend_from_slice(b"{}");
            }
            Some(v) if v.contains(&b'\n') => {
                self.raw.push((self.ends.len(), v.to_vec()));
                self.lines.extend(v.iter().filter(|&&b| b != b'\n'));
            }
            Some(v) => self.lines.extend_from_slice(v),
        }
        self.ends.push(self.lines.len());
        self.lines.push(b'\n');
    }

    /// The values as the decoder checks them: `None` for a null value.
    fn records(&self) -> Vec<Option<&[u8]>> {
        let mut nulls = self.nulls.iter().peekable();
        let mut raw = self.raw.iter().peekable();
        let mut start = 0;
        let mut out = Vec::with_capacity(self.len());
        for (i, &end) in self.ends.iter().enumerate() {
            let line = &self.lines[start..end];
            start = end + 1;
            if nulls.next_if(|&&n| n == i).is_some() {
                out.push(None);
            } else if let Some((_, v)) = raw.next_if(|(n, _)| *n == i) {
                out.push(Some(v.as_slice()));
            } else {
                out.push(Some(line));
            }
        }
        out
    }

    fn parse(&self, schema: &SchemaRef, mode: BadRecordMode, o: &KafkaOptions) -> Parsed {
        let records = self.records();
        let keys = tombstone::check_keys(&self.tombs, schema, o);
        let decoded = decode::json_checked(schema, &records, &self.lines, mode).map_err(|m| {
            // FAILFAST names the first bad record in offset order, a tombstone's key
            // included.
            match keys.iter().filter_map(|k| k.as_ref().err()).next() {
                Some(k) if k.index < m.index => k.clone(),
                _ => m,
            }
        });
        // DROPMALFORMED took the bad values out: which ones (for the dead letter), and
        // where each tombstone's row is now.
        let mut bad = Vec::new();
        let mut tombs = std::borrow::Cow::Borrowed(&self.tombs);
        if let Ok(d) = &decoded
            && !d.bad.is_empty()
            && mode == BadRecordMode::DropMalformed
        {
            bad.extend(d.bad.iter().map(|m| Bad {
                index: m.index,
                record: String::from_utf8_lossy(records[m.index].unwrap_or_default()).into_owned(),
                error: m.reason.clone(),
            }));
            // A tombstone's value (`{}`) is never bad, so it only moves up.
            tombs = std::borrow::Cow::Owned(
                self.tombs
                    .iter()
                    .map(|t| Tomb {
                        index: t.index - bad.partition_point(|b| b.index < t.index),
                        ..t.clone()
                    })
                    .collect(),
            );
        }
        if mode == BadRecordMode::DropMalformed {
            for (t, k) in self.tombs.iter().zip(&keys) {
                if let Err(m) = k {
                    bad.push(Bad {
                        index: t.index,
                        record: String::from_utf8_lossy(t.key.as_deref().unwrap_or_default())
                            .into_owned(),
                        error: m.reason.clone(),
                    });
                }
            }
            bad.sort_by_key(|b| b.index);
        }
        let batch = decoded.and_then(|d| tombstone::apply(d.batch, &tombs, &keys, o, mode));
        let (batch, skipped) = match batch {
            Ok((b, n)) => (Ok(b), n),
            Err(m) => (Err(m), 0),
        };
        Parsed {
            part: self.part,
            first: self.first,
            batch,
            skipped,
            bad,
        }
    }
}

/// A record of a chunk that left the batch under DROPMALFORMED: its index in the chunk, the
/// record (or the tombstone's key) as text, and why.
struct Bad {
    index: usize,
    record: String,
    error: String,
}

struct Parsed {
    part: usize,
    first: usize,
    batch: Result<RecordBatch, decode::Malformed>,
    /// Tombstones dropped (`tombstones = "skip"`).
    skipped: u64,
    bad: Vec<Bad>,
}

/// Polls the parts, parsing full chunks on a second thread as they fill and the rest on this
/// one after the poll; the batches come out in (topic, partition, offset) order.
pub(super) fn json_read(
    c: &BaseConsumer,
    o: &KafkaOptions,
    parts: &mut [Part],
    schema: &SchemaRef,
    mode: BadRecordMode,
) -> Result<Read, KafkaSourceError> {
    let left = |p: &Part, first: usize| {
        usize::try_from(p.to - p.from)
            .unwrap_or(0)
            .saturating_sub(first)
    };
    let mut open: Vec<Chunk> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| Chunk::new(i, 0, left(p, 0)))
        .collect();
    let mut parsed = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<Chunk>();
        let parser = s.spawn(move || {
            let mut done = Vec::new();
            // FAILFAST names the first bad record in (partition, offset) order, and chunks
            // come in the order they filled: after a failure only the chunks that sort
            // after it need no parse.
            let mut failed: Option<(usize, usize)> = None;
            for chunk in rx {
                if failed.is_some_and(|f| (chunk.part, chunk.first) > f) {
                    continue;
                }
                let p = chunk.parse(schema, mode, o);
                if p.batch.is_err() {
                    let at = (p.part, p.first);
                    failed = Some(failed.map_or(at, |f| f.min(at)));
                }
                done.push(p);
            }
            done
        });
        let polled = poll(c, o, parts, |i, part, m| {
            let chunk = &mut open[i];
            chunk.push(m, o.tombstones);
            if chunk.len() >= CHUNK {
                let first = part.offsets.len();
                let full = std::mem::replace(chunk, Chunk::new(i, first, left(part, first)));
                // A send fails only when the parser thread is gone (a panic, which its join
                // reports).
                let _ = tx.send(full);
            }
        });
        drop(tx);
        let mut mine: Vec<Parsed> = match &polled {
            Ok(()) => open
                .iter()
                .filter(|c| !c.ends.is_empty())
                .map(|c| c.parse(schema, mode, o))
                .collect(),
            Err(_) => Vec::new(),
        };
        let theirs = parser.join().map_err(|_| KafkaSourceError::Invalid {
            what: "JSON parser thread".into(),
            reason: "panicked".into(),
        });
        polled?;
        mine.extend(theirs?);
        Ok::<_, KafkaSourceError>(mine)
    })?;
    parsed.sort_by_key(|p| (p.part, p.first));
    let mut batches = Vec::with_capacity(parsed.len());
    let mut skipped = 0;
    let mut letters = Vec::new();
    for p in parsed {
        skipped += p.skipped;
        let part = &parts[p.part];
        letters.extend(p.bad.into_iter().map(|b| Letter {
            at: Position::Offset {
                topic: part.topic.clone(),
                partition: part.partition,
                offset: part.offsets[p.first + b.index],
            },
            record: b.record,
            error: b.error,
        }));
        match p.batch {
            Ok(b) => batches.push(b),
            Err(m) => {
                return Err(KafkaSourceError::Malformed {
                    topic: part.topic.clone(),
                    partition: part.partition,
                    offset: part.offsets[p.first + m.index],
                    reason: m.reason,
                });
            }
        }
    }
    // Kept as parsed (a DataFrame promises no row order, and slices one batch anyway).
    if batches.is_empty() {
        batches.push(RecordBatch::new_empty(tombstone::schema(
            decode::output_schema(schema, mode),
            o.tombstones,
        )));
    }
    Ok(Read {
        batches,
        skipped,
        letters,
        marks: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use weir_core::datafusion::arrow::array::{Array, AsArray};
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};

    use super::*;

    /// DROPMALFORMED takes bad values out before the tombstones are applied: a tombstone
    /// after a bad value still deletes its own key, and each bad record (a value, a key
    /// that is no JSON object) is kept once with its index and error, in order.
    #[test]
    fn bad_values_before_a_tombstone_leave_it_deleting_its_own_key() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("order_id", DataType::Int64, true),
            Field::new("status", DataType::Utf8, true),
        ]));
        let mut o = KafkaOptions::new("127.0.0.1:1", ["t"]);
        o.tombstones = Tombstones::Delete;
        o.value_format = crate::options::ValueFormat::Json {
            schema: schema.clone(),
            mode: BadRecordMode::DropMalformed,
        };
        let mut c = Chunk::new(0, 0, 8);
        for (v, k) in [
            (Some(&b"{\"order_id\":1,\"status\":\"a\"}"[..]), None),
            (Some(b"{\"order_id\":"), None),
            (Some(b"{\"order_id\":\"7.25\"}"), None),
            (None, Some(&b"{\"order_id\":9}"[..])),
            (None, Some(b"not json")),
            (Some(b"{\"order_id\":2,\"status\":\"b\"}"), None),
        ] {
            c.push_record(v, k, Some(5), Tombstones::Delete);
        }
        let p = c.parse(&schema, BadRecordMode::DropMalformed, &o);
        let batch = p.batch.unwrap();
        let ids = batch.column(0).as_primitive::<Int64Type>();
        let deleted = batch.column(2).as_boolean();
        let got: Vec<(i64, bool)> = (0..batch.num_rows())
            .map(|i| (ids.value(i), deleted.value(i)))
            .collect();
        assert_eq!(got, [(1, false), (9, true), (2, false)]);
        let bad: Vec<(usize, &str)> = p.bad.iter().map(|b| (b.index, b.record.as_str())).collect();
        assert_eq!(
            bad,
            [
                (1, "{\"order_id\":"),
                (2, "{\"order_id\":\"7.25\"}"),
                (4, "not json")
            ]
        );
        assert!(p.bad.iter().all(|b| !b.error.is_empty()));
        assert!(!batch.column(1).is_null(0));
    }
}
