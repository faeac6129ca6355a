//! Decoding one input file into rows, on the blocking pool.

use bytes::Bytes;
use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::{FileEntry, FileFormat};
use crate::error::{Error, Result};
use crate::source::dead_letter;
use crate::source::decode::{self, BadRecordMode, Decoded};
use crate::storage::{FileMeta, Location, blocking};

/// What changed in a file since `e` recorded it (`None`: nothing the checks can see).
/// Size always; then the ETag on object stores, the modification time locally.
pub(super) fn change(e: &FileEntry, now: &FileMeta) -> Option<String> {
    if let Some(size) = e.size
        && size != now.size
    {
        return Some(format!(
            "was {size} bytes when taken and is {} bytes now",
            now.size
        ));
    }
    if e.etag.is_some() && now.e_tag.is_some() && e.etag != now.e_tag {
        return Some(format!(
            "was rewritten (ETag {} when taken, {} now)",
            e.etag.clone().unwrap_or_default(),
            now.e_tag.clone().unwrap_or_default()
        ));
    }
    if e.etag.is_none() && now.modified_ms != e.timestamp {
        return Some(format!(
            "was modified at {} ms after it was taken (recorded {} ms)",
            now.modified_ms, e.timestamp
        ));
    }
    None
}

/// Reads one recorded file: checks it is still what was recorded, reads it whole, and
/// decodes it on the blocking pool. Returns its rows and how many lines were malformed.
pub(super) async fn read_entry(
    dir: &Location,
    e: FileEntry,
    format: &FileFormat,
    schema: &SchemaRef,
    mode: BadRecordMode,
    dead: Option<&dead_letter::DeadLetter>,
) -> Result<(RecordBatch, u64)> {
    let name = e.name();
    let shown = dir.describe(&name);
    let changed = |change: String| Error::InputChanged {
        file: shown.clone(),
        batch_id: e.batch_id,
        change,
    };
    let Some(now) = dir.head(&name).await? else {
        return Err(changed("is gone".into()));
    };
    if let Some(c) = change(&e, &now) {
        return Err(changed(c));
    }
    let bytes = dir
        .get(&name)
        .await?
        .ok_or_else(|| changed("is gone".into()))?;
    if e.size.is_some_and(|s| s != bytes.len() as u64) {
        return Err(changed(format!(
            "changed while it was read ({} bytes read)",
            bytes.len()
        )));
    }
    let (format, schema) = (format.clone(), schema.clone());
    if let Some(dead) = dead {
        let (d, letters) = blocking(move || {
            let d = decode_file(bytes.clone(), &shown, &format, &schema, mode)?;
            let letters = dead_letter::json_file_letters(&bytes, &shown, &d.bad);
            Ok((d, letters))
        })
        .await?;
        dead_letter::write(dead, Some(&name), e.batch_id, &letters).await?;
        let n = d.malformed();
        return Ok((d.batch, n));
    }
    let d = blocking(move || decode_file(bytes, &shown, &format, &schema, mode)).await?;
    let n = d.malformed();
    Ok((d.batch, n))
}

/// Decodes `bytes` (the whole file `shown`) into rows of `schema`.
pub(super) fn decode_file(
    bytes: Bytes,
    shown: &str,
    format: &FileFormat,
    schema: &SchemaRef,
    mode: BadRecordMode,
) -> Result<Decoded> {
    let out_schema = decode::output_schema(schema, mode);
    if bytes.is_empty() {
        return Ok(Decoded::sound(RecordBatch::new_empty(out_schema)));
    }
    match format {
        FileFormat::Json => {
            let text = decode::strip_bom(&bytes);
            // One record per non-blank line.
            let (records, line_of) = decode::json_lines(text);
            decode::json_checked(schema, &records, text, mode)
                .map_err(|m| malformed(shown, line_of.get(m.index).copied().unwrap_or(0), m.reason))
        }
        FileFormat::Csv {
            has_header,
            delimiter,
        } => decode::csv(
            schema,
            decode::strip_bom(&bytes),
            *has_header,
            *delimiter,
            mode,
        )
        .map_err(|m| malformed(shown, m.index as u64 + 1, m.reason)),
        FileFormat::Parquet => {
            let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| {
                Error::MalformedInput {
                    file: shown.to_string(),
                    line: 0,
                    reason: format!("not a readable Parquet file: {e}"),
                }
            })?;
            let reader = builder.build().map_err(|e| Error::MalformedInput {
                file: shown.to_string(),
                line: 0,
                reason: e.to_string(),
            })?;
            let mut parts = Vec::new();
            for b in reader {
                let b = b.map_err(|e| Error::MalformedInput {
                    file: shown.to_string(),
                    line: 0,
                    reason: e.to_string(),
                })?;
                parts.push(conform(b, &out_schema, shown)?);
            }
            let batch =
                datafusion::arrow::compute::concat_batches(&out_schema, &parts).map_err(|e| {
                    Error::MalformedInput {
                        file: shown.to_string(),
                        line: 0,
                        reason: e.to_string(),
                    }
                })?;
            Ok(Decoded::sound(batch))
        }
    }
}

/// A Parquet file's rows in the source schema: columns by name, cast where the types
/// differ (a missing column is an error naming it). A cast must keep every value: one that
/// would truncate (4.7 into a bigint), overflow or turn a value into NULL ('abc' into a
/// bigint) is an error naming the file, the column and the first such row, not a changed
/// value.
fn conform(b: RecordBatch, schema: &SchemaRef, shown: &str) -> Result<RecordBatch> {
    let mut cols = Vec::with_capacity(schema.fields().len());
    for f in schema.fields() {
        let c = b
            .column_by_name(f.name())
            .ok_or_else(|| Error::MalformedInput {
                file: shown.to_string(),
                line: 0,
                reason: format!("the file has no column '{}'", f.name()),
            })?;
        let c = if c.data_type() == f.data_type() {
            c.clone()
        } else {
            lossless_cast(c, f.data_type()).map_err(|reason| {
                malformed(
                    shown,
                    0,
                    format!(
                        "column '{}' is {} in this file and {} in the source's schema: {reason}",
                        f.name(),
                        c.data_type(),
                        f.data_type()
                    ),
                )
            })?
        };
        cols.push(c);
    }
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| Error::MalformedInput {
        file: shown.to_string(),
        line: 0,
        reason: e.to_string(),
    })
}

/// `c` as `to`, only if every value survives: cast without turning failures into NULL,
/// then back, and compared with the original (NULL equal to NULL, NaN to NaN).
fn lossless_cast(c: &ArrayRef, to: &DataType) -> std::result::Result<ArrayRef, String> {
    use datafusion::arrow::compute::kernels::cmp::distinct;
    use datafusion::arrow::compute::{CastOptions, cast_with_options};
    let strict = CastOptions {
        safe: false,
        ..Default::default()
    };
    let out = cast_with_options(c, to, &strict).map_err(|e| e.to_string())?;
    let back = cast_with_options(&out, c.data_type(), &strict)
        .map_err(|e| format!("the values cannot be checked after the conversion: {e}"))?;
    let differs = distinct(c, &back)
        .map_err(|e| format!("the values cannot be checked after the conversion: {e}"))?;
    match differs.iter().position(|d| d == Some(true)) {
        None => Ok(out),
        Some(row) => {
            let shown = |a: &ArrayRef| {
                datafusion::arrow::util::display::array_value_to_string(a, row)
                    .unwrap_or_else(|_| "?".into())
            };
            Err(format!(
                "row {} holds {}, which would be read as {}",
                row + 1,
                shown(c),
                shown(&out)
            ))
        }
    }
}

fn malformed(file: &str, line: u64, reason: String) -> Error {
    Error::MalformedInput {
        file: file.to_string(),
        line,
        reason,
    }
}

/// The schema of a Parquet file's bytes.
pub(super) fn parquet_schema(bytes: Bytes, shown: &str) -> Result<SchemaRef> {
    ParquetRecordBatchReaderBuilder::try_new(bytes)
        .map(|b| b.schema().clone())
        .map_err(|e| Error::MalformedInput {
            file: shown.to_string(),
            line: 0,
            reason: format!("cannot read the Parquet schema: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{
        Float32Array, Float64Array, Int32Array, Int64Array, StringArray,
    };

    use super::*;

    #[test]
    fn a_parquet_column_of_another_type_is_converted_only_without_loss() {
        let ok = |c: ArrayRef, to: DataType| lossless_cast(&c, &to).unwrap();
        let refused = |c: ArrayRef, to: DataType| lossless_cast(&c, &to).unwrap_err();
        // Widening and exact conversions pass, NULLs and NaN included.
        let wide = ok(
            Arc::new(Int32Array::from(vec![Some(1), None, Some(i32::MIN)])),
            DataType::Int64,
        );
        assert_eq!(
            wide.as_ref(),
            &Int64Array::from(vec![Some(1), None, Some(i32::MIN as i64)])
                as &dyn datafusion::arrow::array::Array
        );
        ok(
            Arc::new(Float32Array::from(vec![Some(1.5), Some(f32::NAN), None])),
            DataType::Float64,
        );
        ok(
            Arc::new(Float64Array::from(vec![4.0, -1.0])),
            DataType::Int64,
        );
        ok(
            Arc::new(StringArray::from(vec![Some("3"), None])),
            DataType::Int64,
        );
        // What would change a value is refused, naming the row and both values.
        let e = refused(
            Arc::new(Float64Array::from(vec![4.0, 4.7])),
            DataType::Int64,
        );
        assert!(
            e.contains("row 2 holds 4.7, which would be read as 4"),
            "{e}"
        );
        let e = refused(Arc::new(Float64Array::from(vec![1e30])), DataType::Int64);
        assert!(
            e.contains("1000000000000000000000000000000")
                || e.contains("1e30")
                || e.contains("overflow")
                || e.contains("Can't cast"),
            "{e}"
        );
        refused(Arc::new(StringArray::from(vec!["abc"])), DataType::Int64);
        let e = refused(
            Arc::new(StringArray::from(vec!["7", "03"])),
            DataType::Int64,
        );
        assert!(e.contains("row 2 holds 03"), "{e}");
        refused(
            Arc::new(Int64Array::from(vec![1i64 << 40])),
            DataType::Int32,
        );
    }

    #[test]
    fn a_recorded_file_that_grew_shrank_or_was_rewritten_is_a_change() {
        let e = FileEntry {
            path: "file:///in/a.json".into(),
            timestamp: 1000,
            batch_id: 3,
            size: Some(10),
            etag: None,
        };
        let meta = |size, modified_ms, e_tag: Option<&str>| FileMeta {
            name: "a.json".into(),
            size,
            modified_ms,
            e_tag: e_tag.map(str::to_string),
        };
        assert_eq!(change(&e, &meta(10, 1000, None)), None);
        assert!(
            change(&e, &meta(11, 1000, None))
                .unwrap()
                .contains("is 11 bytes now")
        );
        assert!(
            change(&e, &meta(10, 2000, None))
                .unwrap()
                .contains("modified")
        );
        let s3 = FileEntry {
            etag: Some("\"a\"".into()),
            ..e.clone()
        };
        // On an object store the ETag decides, not the time.
        assert_eq!(change(&s3, &meta(10, 2000, Some("\"a\""))), None);
        assert!(
            change(&s3, &meta(10, 1000, Some("\"b\"")))
                .unwrap()
                .contains("rewritten")
        );
        // Spark's entries carry no size: only the time is checked.
        let spark = FileEntry { size: None, ..e };
        assert_eq!(change(&spark, &meta(99, 1000, None)), None);
    }
}
