//! Dead letters (`dead-letter = "folder"` on a source): the records a batch could not
//! decode, each with where it was (file and line, or topic, partition and offset), the
//! error and the batch id, as Parquet files in a folder of their own.
//!
//! Written before `commits/N` and written once: a file's name is fixed by the query, the
//! batch and what it covers (`part-<batch>-<query id>-<hash of the input file's
//! name>.parquet` for files, `part-<batch>-<query id>-kafka.parquet` for Kafka; the query
//! id keeps two queries sharing a folder, or a new checkpoint, from taking each other's
//! names), the write is put-if-absent (a temp file and a
//! link locally, `If-None-Match: *` on object stores), and a replay of the batch, which
//! reads the same records (same range, same rows), finds the file there and leaves it. A
//! kill during the write leaves no partial file under the name.
//!
//! When: the files source writes while the batch reads its files (the batch's file list is
//! in the source's own log before the read, so a replay reads the same files). The Kafka
//! source writes from [`crate::source::Source::before_commit`]: its next batch is read
//! ahead before `offsets/N+1` fixes that batch's range, so a letter written at read time
//! could belong to a range that a restart plans differently.

use std::sync::Arc;

use bytes::Bytes;
use datafusion::arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::ArrowWriter;

use crate::error::{Error, Result};
use crate::source::decode::{self, Malformed};
use crate::storage::Location;

/// One record that could not be decoded: where it was, the record as text, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Letter {
    pub at: Position,
    pub record: String,
    pub error: String,
}

/// Where a dead letter's record was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Position {
    /// A file (as shown in errors) and the record's line (1-based).
    Line { file: String, line: u64 },
    /// A Kafka record.
    Offset {
        topic: String,
        partition: i32,
        offset: i64,
    },
}

/// The dead letter's columns: `file` and `line` are NULL for Kafka records, `topic`,
/// `partition` and `offset` for lines of files.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("batch_id", DataType::Int64, false),
        Field::new("file", DataType::Utf8, true),
        Field::new("line", DataType::Int64, true),
        Field::new("topic", DataType::Utf8, true),
        Field::new("partition", DataType::Int32, true),
        Field::new("offset", DataType::Int64, true),
        Field::new("record", DataType::Utf8, false),
        Field::new("error", DataType::Utf8, false),
    ]))
}

/// `letters` as rows of batch `batch_id`.
pub fn rows(batch_id: u64, letters: &[Letter]) -> Result<RecordBatch> {
    let n = letters.len();
    let (mut file, mut line) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut topic, mut partition, mut offset) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for l in letters {
        match &l.at {
            Position::Line { file: f, line: n } => {
                file.push(Some(f.as_str()));
                line.push(Some(*n as i64));
                topic.push(None);
                partition.push(None);
                offset.push(None);
            }
            Position::Offset {
                topic: t,
                partition: p,
                offset: o,
            } => {
                file.push(None);
                line.push(None);
                topic.push(Some(t.as_str()));
                partition.push(Some(*p));
                offset.push(Some(*o));
            }
        }
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(vec![batch_id as i64; n])),
        Arc::new(StringArray::from(file)),
        Arc::new(Int64Array::from(line)),
        Arc::new(StringArray::from(topic)),
        Arc::new(Int32Array::from(partition)),
        Arc::new(Int64Array::from(offset)),
        Arc::new(StringArray::from_iter_values(
            letters.iter().map(|l| &l.record),
        )),
        Arc::new(StringArray::from_iter_values(
            letters.iter().map(|l| &l.error),
        )),
    ];
    RecordBatch::try_new(schema(), columns).map_err(|e| Error::Internal {
        what: format!("the dead letter of batch {batch_id}: {e}"),
    })
}

/// The dead letters of the JSON-lines file `bytes` (shown as `shown`) whose records `bad`
/// did not decode (the decoder's [`decode::Decoded::bad`]): each with its line number, its
/// text and the error.
pub(crate) fn json_file_letters(bytes: &Bytes, shown: &str, bad: &[Malformed]) -> Vec<Letter> {
    if bad.is_empty() {
        return Vec::new();
    }
    let (records, line_of) = decode::json_lines(decode::strip_bom(bytes));
    bad.iter()
        .map(|m| Letter {
            at: Position::Line {
                file: shown.to_string(),
                line: line_of.get(m.index).copied().unwrap_or(0),
            },
            record: records
                .get(m.index)
                .copied()
                .flatten()
                .map(|r| String::from_utf8_lossy(r).into_owned())
                .unwrap_or_default(),
            error: m.reason.clone(),
        })
        .collect()
}

/// Where a query's dead letter goes: the folder, and the query whose files they are.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub dir: Location,
    pub query_id: uuid::Uuid,
}

/// The name of the dead letter's file for batch `batch_id` of query `query_id` covering
/// `what` (an input file's name; `None`: the batch's whole read).
fn file_name(query_id: uuid::Uuid, batch_id: u64, what: Option<&str>) -> String {
    let query = query_id.simple();
    match what {
        Some(name) => format!(
            "part-{batch_id:05}-{query}-{:016x}.parquet",
            crate::storage::fnv1a(name.as_bytes())
        ),
        None => format!("part-{batch_id:05}-{query}-kafka.parquet"),
    }
}

/// Writes `letters` (the dead letter of batch `batch_id` for `what`: an input file's name,
/// or `None` for the batch's whole read) into `to`, unless a run of the batch before did.
/// Nothing is written for no letters.
pub async fn write(
    to: &DeadLetter,
    what: Option<&str>,
    batch_id: u64,
    letters: &[Letter],
) -> Result<()> {
    if letters.is_empty() {
        return Ok(());
    }
    let dead = &to.dir;
    let rows = rows(batch_id, letters)?;
    let file = file_name(to.query_id, batch_id, what);
    let shown = || dead.describe(&file);
    let mut out = Vec::new();
    let mut w =
        ArrowWriter::try_new(&mut out, rows.schema(), None).map_err(|e| Error::Internal {
            what: format!("encoding the dead letter {}: {e}", shown()),
        })?;
    w.write(&rows)
        .and_then(|()| w.close().map(|_| ()))
        .map_err(|e| Error::Internal {
            what: format!("encoding the dead letter {}: {e}", shown()),
        })?;
    dead.create_dir().await?;
    // Already there: an earlier run of this batch wrote the same records.
    dead.put_new(&file, Bytes::from(out)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::decode::BadRecordMode;

    /// What the decoder finds bad in the JSON-lines file `bytes`.
    fn bad_of(bytes: &Bytes, asked: &SchemaRef) -> Vec<Malformed> {
        let text = decode::strip_bom(bytes);
        let (records, _) = decode::json_lines(text);
        decode::json_checked(asked, &records, text, BadRecordMode::DropMalformed)
            .unwrap()
            .bad
    }

    #[test]
    fn the_bad_lines_of_a_file_become_dead_letter_rows_with_their_line_and_error() {
        let asked = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
        ]));
        let bytes = Bytes::from_static(
            b"{\"id\":1,\"x\":1.5}\n\n{\"id\":\"two\"}\n{\"id\":3,\"x\":\"7.25\"}\n{\"id\":4\n",
        );
        let letters = json_file_letters(&bytes, "in/a.json", &bad_of(&bytes, &asked));
        let rows = rows(7, &letters).unwrap();
        assert_eq!(rows.num_rows(), 3);
        let lines = rows
            .column(2)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(lines.values(), &[3, 4, 5]);
        let text = rows
            .column(6)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        assert_eq!(text.value(2), "{\"id\":4");
        assert!(rows.column(3).is_null(0) && rows.column(5).is_null(2));
        let sound = Bytes::from_static(b"{\"id\":1}\n");
        assert!(json_file_letters(&sound, "a", &bad_of(&sound, &asked)).is_empty());
    }

    #[test]
    fn file_names_are_the_querys_the_batchs_and_the_input_files() {
        let (q1, q2) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let a = file_name(q1, 3, Some("in/a.json"));
        assert_eq!(a, file_name(q1, 3, Some("in/a.json")), "a replay's name");
        for other in [
            file_name(q2, 3, Some("in/a.json")),
            file_name(q1, 4, Some("in/a.json")),
            file_name(q1, 3, Some("in/b.json")),
            file_name(q1, 3, None),
        ] {
            assert_ne!(a, other);
        }
        assert!(
            a.starts_with("part-00003-") && a.ends_with(".parquet"),
            "{a}"
        );
    }

    #[test]
    fn a_kafka_letter_has_its_offset_and_no_file() {
        let rows = rows(
            3,
            &[Letter {
                at: Position::Offset {
                    topic: "orders [eu]".into(),
                    partition: 2,
                    offset: 41,
                },
                record: "{\"id\":".into(),
                error: "EOF".into(),
            }],
        )
        .unwrap();
        assert!(rows.column(1).is_null(0) && rows.column(2).is_null(0));
        let offsets = rows
            .column(5)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(offsets.value(0), 41);
        let batch = rows
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(batch.value(0), 3);
    }
}
