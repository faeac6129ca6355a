//! State files as Arrow IPC files: a `key` and a `value` binary column, one row per key.
//!
//! A delta's row with a NULL value removes its key. The IPC file format ends with a footer
//! and its magic bytes, so a file cut short is refused rather than read as fewer keys. The
//! schema's metadata names the kind and the version, checked against the file's name so a
//! file copied to the wrong name is refused too.

use std::io::Cursor;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::arrow::array::{Array, BinaryArray, BinaryBuilder};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::ipc::reader::FileReader;
use datafusion::arrow::ipc::writer::FileWriter;
use datafusion::arrow::record_batch::RecordBatch;

use super::files::Kind;

const KIND_KEY: &str = "weir.state.kind";
const VERSION_KEY: &str = "weir.state.version";

/// Rows per record batch in a file: a snapshot of millions of keys is written and read a
/// slice at a time.
const ROWS_PER_BATCH: usize = 64 * 1024;
/// Key and value bytes per record batch at most (a binary column's offsets are 32-bit).
const BYTES_PER_BATCH: usize = 64 << 20;

fn schema(kind: Kind, version: u64) -> Arc<Schema> {
    let meta = [
        (KIND_KEY.to_string(), kind.label().to_string()),
        (VERSION_KEY.to_string(), version.to_string()),
    ];
    Arc::new(
        Schema::new(vec![
            Field::new("key", DataType::Binary, false),
            Field::new("value", DataType::Binary, true),
        ])
        .with_metadata(meta.into_iter().collect()),
    )
}

/// Encodes `rows` (key, value; `None`: removed) as the file of `version`.
pub(super) fn encode<'a>(
    kind: Kind,
    version: u64,
    rows: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) -> Result<Bytes, String> {
    let schema = schema(kind, version);
    let mut out = Vec::new();
    let mut writer = FileWriter::try_new(&mut out, &schema).map_err(|e| e.to_string())?;
    let mut keys = BinaryBuilder::new();
    let mut values = BinaryBuilder::new();
    let flush = |keys: &mut BinaryBuilder,
                 values: &mut BinaryBuilder,
                 writer: &mut FileWriter<&mut Vec<u8>>|
     -> Result<(), String> {
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(keys.finish()), Arc::new(values.finish())],
        )
        .map_err(|e| e.to_string())?;
        writer.write(&batch).map_err(|e| e.to_string())
    };
    let (mut n, mut bytes) = (0, 0);
    for (k, v) in rows {
        keys.append_value(k);
        values.append_option(v);
        n += 1;
        bytes += k.len() + v.map_or(0, <[u8]>::len);
        if n == ROWS_PER_BATCH || bytes >= BYTES_PER_BATCH {
            flush(&mut keys, &mut values, &mut writer)?;
            (n, bytes) = (0, 0);
        }
    }
    if n > 0 {
        flush(&mut keys, &mut values, &mut writer)?;
    }
    writer.finish().map_err(|e| e.to_string())?;
    drop(writer);
    Ok(Bytes::from(out))
}

/// Decodes the file of `version`, calling `row` for each (key, value) in order. The reason
/// is returned for a file that is not a complete state file of that kind and version, or
/// whose keys are not in strictly ascending order (as every file is written: this catches
/// a repeated key and much damage inside a file).
pub(super) fn decode(
    bytes: Bytes,
    kind: Kind,
    version: u64,
    mut row: impl FnMut(&[u8], Option<&[u8]>),
) -> Result<(), String> {
    let reader = FileReader::try_new(Cursor::new(bytes), None)
        .map_err(|e| format!("not a complete Arrow IPC file ({e})"))?;
    let schema = reader.schema();
    let expected = self::schema(kind, version);
    if schema.fields() != expected.fields() {
        return Err(format!(
            "its columns are {:?}, not key and value (binary)",
            schema.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
        ));
    }
    let meta = schema.metadata();
    let found_kind = meta.get(KIND_KEY).map(String::as_str);
    let found_version = meta.get(VERSION_KEY).and_then(|v| v.parse::<u64>().ok());
    if found_kind != Some(kind.label()) || found_version != Some(version) {
        return Err(format!(
            "it holds {} of version {}, not the {} of version {version}",
            found_kind.unwrap_or("no state"),
            found_version.map_or("?".to_string(), |v| v.to_string()),
            kind.label()
        ));
    }
    let mut previous: Vec<u8> = Vec::new();
    let mut rows_read: u64 = 0;
    for batch in reader {
        let batch = batch.map_err(|e| format!("a record batch cannot be read ({e})"))?;
        let column = |i: usize| {
            batch
                .column(i)
                .as_any()
                .downcast_ref::<BinaryArray>()
                .ok_or_else(|| format!("column {i} is not binary"))
        };
        let (keys, values) = (column(0)?, column(1)?);
        if keys.null_count() > 0 {
            return Err("a key is NULL".into());
        }
        if kind == Kind::Snapshot && values.null_count() > 0 {
            return Err("a snapshot holds a removed key".into());
        }
        for i in 0..batch.num_rows() {
            let k = keys.value(i);
            if rows_read + (i as u64) > 0 && previous.as_slice() >= k {
                return Err(format!(
                    "its keys are not in ascending order (row {})",
                    rows_read + i as u64
                ));
            }
            let v = (!values.is_null(i)).then(|| values.value(i));
            row(k, v);
            previous.clear();
            previous.extend_from_slice(k);
        }
        rows_read += batch.num_rows() as u64;
    }
    Ok(())
}
