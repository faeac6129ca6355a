//! The dead letter of the files source (`dead-letter = "folder"`): the malformed lines of a
//! batch's file, each with the file, its line number, the error and the batch id, as one
//! Parquet file per (batch, input file), `part-<batch>-<hash of the file's name>.parquet`.
//!
//! Written while the batch reads its files, so before `commits/N`; written once: the name
//! is fixed by the batch and the file, the write is put-if-absent (a temp file and a link
//! locally, `If-None-Match: *` on object stores), and a replay of the batch, which reads the
//! same bytes (the source refuses a file that changed), finds the file there and leaves it.
//! A kill during the write leaves no partial file under the name.

use std::sync::Arc;

use bytes::Bytes;
use datafusion::arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::ArrowWriter;

use crate::error::{Error, Result};
use crate::source::decode::{self, BadRecordMode};
use crate::storage::Location;

/// The dead letter's columns (the Kafka ones, `topic`, `partition` and `offset`, are NULL
/// for files).
pub(super) fn schema() -> SchemaRef {
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

/// The malformed lines of the JSON-lines file `bytes` (shown as `shown`), as dead-letter
/// rows of batch `batch_id`; `None` when every line is sound.
pub(super) fn letters(
    bytes: &Bytes,
    shown: &str,
    schema_asked: &SchemaRef,
    batch_id: u64,
) -> Result<Option<RecordBatch>> {
    let (records, line_of) = decode::json_lines(decode::strip_bom(bytes));
    let (mut lines, mut texts, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for (r, line) in records.iter().zip(&line_of) {
        if let Err(m) = decode::json_each(schema_asked, &[*r], BadRecordMode::FailFast) {
            lines.push(*line as i64);
            texts.push(String::from_utf8_lossy(r.unwrap_or_default()).into_owned());
            errors.push(m.reason);
        }
    }
    if lines.is_empty() {
        return Ok(None);
    }
    let n = lines.len();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(vec![batch_id as i64; n])),
        Arc::new(StringArray::from(vec![Some(shown); n])),
        Arc::new(Int64Array::from(lines)),
        Arc::new(StringArray::from(vec![None::<&str>; n])),
        Arc::new(Int32Array::from(vec![None; n])),
        Arc::new(Int64Array::from(vec![None; n])),
        Arc::new(StringArray::from(texts)),
        Arc::new(StringArray::from(errors)),
    ];
    RecordBatch::try_new(schema(), columns)
        .map(Some)
        .map_err(|e| Error::Internal {
            what: format!("the dead letter of {shown}: {e}"),
        })
}

/// Writes `rows` (the dead letter of input file `name` in batch `batch_id`) into `dead`,
/// unless a run of the batch before did.
pub(super) async fn write(
    dead: &Location,
    name: &str,
    batch_id: u64,
    rows: RecordBatch,
) -> Result<()> {
    let file = format!(
        "part-{batch_id:05}-{:016x}.parquet",
        crate::storage::fnv1a(name.as_bytes())
    );
    let what = || dead.describe(&file);
    let mut out = Vec::new();
    let mut w =
        ArrowWriter::try_new(&mut out, rows.schema(), None).map_err(|e| Error::Internal {
            what: format!("encoding the dead letter {}: {e}", what()),
        })?;
    w.write(&rows)
        .and_then(|()| w.close().map(|_| ()))
        .map_err(|e| Error::Internal {
            what: format!("encoding the dead letter {}: {e}", what()),
        })?;
    dead.create_dir().await?;
    // Already there: an earlier run of this batch wrote the same lines.
    dead.put_new(&file, Bytes::from(out)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bad_lines_of_a_file_become_dead_letter_rows_with_their_line_and_error() {
        let asked = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("x", DataType::Float64, true),
        ]));
        let bytes = Bytes::from_static(
            b"{\"id\":1,\"x\":1.5}\n\n{\"id\":\"two\"}\n{\"id\":3,\"x\":\"7.25\"}\n{\"id\":4\n",
        );
        let rows = letters(&bytes, "in/a.json", &asked, 7).unwrap().unwrap();
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
        assert!(
            letters(&Bytes::from_static(b"{\"id\":1}\n"), "a", &asked, 7)
                .unwrap()
                .is_none()
        );
    }
}
