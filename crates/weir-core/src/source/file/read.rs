//! Decoding one input file into rows, on the blocking pool.

use bytes::Bytes;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::FileFormat;
use crate::error::{Error, Result};
use crate::source::decode::{self, BadRecordMode, Decoded};

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
        return Ok(Decoded {
            batch: RecordBatch::new_empty(out_schema),
            malformed: 0,
        });
    }
    match format {
        FileFormat::Json => {
            if let Ok(b) = decode::json_all(schema, &bytes, None) {
                let batch = decode::with_corrupt(b, schema, mode, None)
                    .map_err(|reason| malformed(shown, 0, reason))?;
                return Ok(Decoded {
                    batch,
                    malformed: 0,
                });
            }
            // Find the bad lines: one record per non-blank line.
            let mut records = Vec::new();
            let mut line_of = Vec::new();
            for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                records.push(Some(line));
                line_of.push(i as u64 + 1);
            }
            decode::json_each(schema, &records, mode)
                .map_err(|m| malformed(shown, line_of.get(m.index).copied().unwrap_or(0), m.reason))
        }
        FileFormat::Csv {
            has_header,
            delimiter,
        } => decode::csv(schema, &bytes, *has_header, *delimiter, mode)
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
            Ok(Decoded {
                batch,
                malformed: 0,
            })
        }
    }
}

/// A Parquet file's rows in the source schema: columns by name, cast where the types
/// differ (a missing column is an error naming it).
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
            datafusion::arrow::compute::cast(c, f.data_type()).map_err(|e| {
                Error::MalformedInput {
                    file: shown.to_string(),
                    line: 0,
                    reason: format!("column '{}': {e}", f.name()),
                }
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
