//! Turning records (JSON values, CSV lines) into Arrow, with Spark's three modes for bad
//! records: `FAILFAST` (stop, naming the record), `PERMISSIVE` (keep the row with null
//! columns and the raw text in `_corrupt_record`), `DROPMALFORMED` (drop the row). The Kafka
//! source and the file source share this code.
//!
//! The fast path decodes everything at once (vectorized); only when that fails is each
//! record decoded on its own, to find the bad ones.

use std::sync::Arc;

use datafusion::arrow::array::StringArray;
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::json::ReaderBuilder;
use datafusion::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

/// The column PERMISSIVE adds for the raw text of a bad record.
pub const CORRUPT_RECORD: &str = "_corrupt_record";

/// What a malformed record does (Spark's `mode` option).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum BadRecordMode {
    /// Stop the query with an error naming the record (file and line, or topic, partition
    /// and offset). The default.
    #[default]
    #[serde(alias = "failfast", alias = "FailFast")]
    FailFast,
    /// Keep the row: columns null, the raw text in `_corrupt_record`; counted in progress.
    #[serde(alias = "permissive", alias = "Permissive")]
    Permissive,
    /// Drop the row; counted in progress.
    #[serde(alias = "dropmalformed", alias = "DropMalformed")]
    DropMalformed,
}

impl std::str::FromStr for BadRecordMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "FAILFAST" => Ok(BadRecordMode::FailFast),
            "PERMISSIVE" => Ok(BadRecordMode::Permissive),
            "DROPMALFORMED" => Ok(BadRecordMode::DropMalformed),
            _ => Err(format!(
                "'{s}' is not a mode: use FAILFAST, PERMISSIVE or DROPMALFORMED"
            )),
        }
    }
}

/// The schema rows come out with: every column nullable (a bad or partial record leaves
/// nulls), plus `_corrupt_record` in PERMISSIVE mode.
pub fn output_schema(schema: &SchemaRef, mode: BadRecordMode) -> SchemaRef {
    let mut fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(true))
        .collect();
    if mode == BadRecordMode::Permissive && schema.field_with_name(CORRUPT_RECORD).is_err() {
        fields.push(Field::new(CORRUPT_RECORD, DataType::Utf8, true));
    }
    Arc::new(Schema::new(fields))
}

fn parse_schema(schema: &SchemaRef) -> SchemaRef {
    Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .filter(|f| f.name() != CORRUPT_RECORD)
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect::<Vec<_>>(),
    ))
}

/// Rows decoded from a set of records.
#[derive(Debug)]
pub struct Decoded {
    pub batch: RecordBatch,
    /// The records that did not parse (kept or dropped, by the mode), in order: each
    /// one's index among the records, and why (a dead letter is made of them).
    pub bad: Vec<Malformed>,
}

impl Decoded {
    /// Rows that all parsed.
    pub fn sound(batch: RecordBatch) -> Self {
        Decoded {
            batch,
            bad: Vec::new(),
        }
    }

    /// How many records did not parse.
    pub fn malformed(&self) -> u64 {
        self.bad.len() as u64
    }
}

/// The first bad record in FAILFAST mode: its index among the records, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub index: usize,
    pub reason: String,
}

/// The non-blank lines of a JSON-lines file, each with its line number (1-based), CR
/// dropped.
pub(crate) fn json_lines(text: &[u8]) -> (Vec<Option<&[u8]>>, Vec<u64>) {
    let mut records = Vec::new();
    let mut line_of = Vec::new();
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', text).chain(std::iter::once(text.len()));
    for (i, end) in ends.enumerate() {
        // A CRLF file's lines without their CR (JSON reads it as blank space, but
        // PERMISSIVE keeps the line's text).
        let line = text[start..end]
            .strip_suffix(b"\r")
            .unwrap_or(&text[start..end]);
        start = end + 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        records.push(Some(line));
        line_of.push(i as u64 + 1);
    }
    (records, line_of)
}

/// Decodes `buf` (JSON values separated by whitespace, normally one per line) expecting
/// `rows` values (when known).
pub fn json_all(
    schema: &SchemaRef,
    buf: &[u8],
    rows: Option<usize>,
) -> Result<RecordBatch, String> {
    let schema = parse_schema(schema);
    let mut d = ReaderBuilder::new(schema.clone())
        .with_batch_size(rows.unwrap_or(8192).max(1))
        .build_decoder()
        .map_err(|e| e.to_string())?;
    let mut parts = Vec::new();
    let mut rest = buf;
    loop {
        let used = d.decode(rest).map_err(|e| e.to_string())?;
        rest = &rest[used..];
        if rest.is_empty() {
            break;
        }
        // The decoder stopped because its batch is full.
        if let Some(b) = d.flush().map_err(|e| e.to_string())? {
            parts.push(b);
        } else if used == 0 {
            return Err("the JSON decoder made no progress".into());
        }
    }
    if let Some(b) = d.flush().map_err(|e| e.to_string())? {
        parts.push(b);
    }
    let out = concat_batches(&schema, &parts).map_err(|e| e.to_string())?;
    if let Some(n) = rows
        && out.num_rows() != n
    {
        return Err(format!(
            "expected {n} JSON value(s), found {}",
            out.num_rows()
        ));
    }
    Ok(out)
}

/// Decodes JSON records (`None`: a null value, read as `{}`): in one pass when they are
/// flat and plain (see [`super::flat`]), else each checked strictly first (see
/// [`super::validate`]), `joined` (the same records one per line) decoded at once when
/// every record is sound. `mode` decides what a bad record does.
pub fn json_checked(
    schema: &SchemaRef,
    records: &[Option<&[u8]>],
    joined: &[u8],
    mode: BadRecordMode,
) -> Result<Decoded, Malformed> {
    if let Some(b) = super::flat_json::decode(&parse_schema(schema), records) {
        let batch =
            with_corrupt(b, schema, mode, None).map_err(|reason| Malformed { index: 0, reason })?;
        return Ok(Decoded::sound(batch));
    }
    json_strict(schema, records, joined, mode)
}

/// [`json_checked`] without the one-pass decoder: each record checked strictly, then all
/// decoded at once by arrow-json, or each on its own when one is bad.
pub(crate) fn json_strict(
    schema: &SchemaRef,
    records: &[Option<&[u8]>],
    joined: &[u8],
    mode: BadRecordMode,
) -> Result<Decoded, Malformed> {
    let parse = parse_schema(schema);
    let mut sound = true;
    for (index, r) in records.iter().enumerate() {
        if let Some(r) = r
            && let Err(reason) = super::validate::check_record(&parse, r)
        {
            if mode == BadRecordMode::FailFast {
                // A record before this one may pass the check and still fail the decoder
                // (`"two"` for a bigint): the first bad one in order is the one named.
                return match json_each(schema, &records[..=index], mode) {
                    Err(first) => Err(first),
                    Ok(_) => Err(Malformed { index, reason }),
                };
            }
            sound = false;
            break;
        }
    }
    if sound && let Ok(b) = json_all(schema, joined, Some(records.len())) {
        let batch =
            with_corrupt(b, schema, mode, None).map_err(|reason| Malformed { index: 0, reason })?;
        return Ok(Decoded::sound(batch));
    }
    json_each(schema, records, mode)
}

/// Decodes each record on its own (`None`: a null value, read as `{}`), checked strictly,
/// applying `mode` to the ones that fail. `schema` is the schema asked for (without
/// `_corrupt_record`).
pub fn json_each(
    schema: &SchemaRef,
    records: &[Option<&[u8]>],
    mode: BadRecordMode,
) -> Result<Decoded, Malformed> {
    let parse = parse_schema(schema);
    let mut parts = Vec::with_capacity(records.len());
    let mut corrupt: Vec<Option<String>> = Vec::with_capacity(records.len());
    let mut bad = Vec::new();
    let mut line = Vec::new();
    for (index, r) in records.iter().enumerate() {
        line.clear();
        line.extend(r.unwrap_or(b"{}").iter().filter(|&&b| b != b'\n'));
        line.push(b'\n');
        let decoded = super::validate::check_record(&parse, &line)
            .and_then(|()| json_all(&parse, &line, Some(1)));
        match decoded {
            Ok(b) => {
                parts.push(b);
                corrupt.push(None);
            }
            Err(reason) => match mode {
                BadRecordMode::FailFast => return Err(Malformed { index, reason }),
                BadRecordMode::DropMalformed => bad.push(Malformed { index, reason }),
                BadRecordMode::Permissive => {
                    parts.push(null_row(&parse).map_err(|reason| Malformed {
                        index,
                        reason: reason.clone(),
                    })?);
                    corrupt.push(Some(
                        String::from_utf8_lossy(r.unwrap_or_default()).into_owned(),
                    ));
                    bad.push(Malformed { index, reason });
                }
            },
        }
    }
    finish(&parse, &parts, schema, mode, corrupt, bad)
}

/// One row of nulls.
fn null_row(schema: &SchemaRef) -> Result<RecordBatch, String> {
    json_all(schema, b"{}\n", Some(1))
}

/// Adds the `_corrupt_record` column in PERMISSIVE mode (`None`: no bad record), where the
/// schema declares it or else last; in the other modes a declared one is all nulls.
pub fn with_corrupt(
    batch: RecordBatch,
    schema: &SchemaRef,
    mode: BadRecordMode,
    corrupt: Option<Vec<Option<String>>>,
) -> Result<RecordBatch, String> {
    if mode != BadRecordMode::Permissive && schema.index_of(CORRUPT_RECORD).is_err() {
        return Ok(batch);
    }
    let out = output_schema(schema, mode);
    let n = batch.num_rows();
    let mut cols = batch.columns().to_vec();
    let corrupt = match corrupt {
        Some(c) if mode == BadRecordMode::Permissive => c,
        _ => vec![None; n],
    };
    // The decoded columns are the schema's without this one, in the schema's order.
    let at = out.index_of(CORRUPT_RECORD).map_err(|e| e.to_string())?;
    cols.insert(at, Arc::new(StringArray::from(corrupt)));
    RecordBatch::try_new(out, cols).map_err(|e| e.to_string())
}

/// Refuses a declared `_corrupt_record` that is not a string: it holds a bad record's text.
pub fn check_corrupt_column(schema: &Schema) -> Result<(), String> {
    match schema.field_with_name(CORRUPT_RECORD) {
        Ok(f) if f.data_type() != &DataType::Utf8 => Err(format!(
            "`{CORRUPT_RECORD}` holds the text of a malformed record: declare it as string, \
             not {}",
            f.data_type()
        )),
        _ => Ok(()),
    }
}

/// Decodes CSV text: all at once, or line by line when that fails. `header` lines are
/// skipped. The line index in [`Malformed`] counts from the first line of `text`.
pub fn csv(
    schema: &SchemaRef,
    text: &[u8],
    header: bool,
    delimiter: u8,
    mode: BadRecordMode,
) -> Result<Decoded, Malformed> {
    use datafusion::arrow::csv::ReaderBuilder as CsvBuilder;
    let parse = parse_schema(schema);
    let all = |bytes: &[u8], header: bool| -> Result<RecordBatch, String> {
        let reader = CsvBuilder::new(parse.clone())
            .with_header(header)
            .with_delimiter(delimiter)
            .build(bytes)
            .map_err(|e| e.to_string())?;
        let parts = reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        concat_batches(&parse, &parts).map_err(|e| e.to_string())
    };
    if let Ok(b) = all(text, header) {
        let batch =
            with_corrupt(b, schema, mode, None).map_err(|reason| Malformed { index: 0, reason })?;
        return Ok(Decoded::sound(batch));
    }
    let mut parts = Vec::new();
    let mut corrupt = Vec::new();
    let mut bad = Vec::new();
    for (i, (line, record)) in csv_records(text, delimiter).into_iter().enumerate() {
        if (header && i == 0) || record.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // `index` counts lines from 0: the record starts on line `line` (1-based).
        let index = line.saturating_sub(1) as usize;
        match all(record, false) {
            Ok(b) if b.num_rows() == 1 => {
                parts.push(b);
                corrupt.push(None);
            }
            Ok(b) => {
                let reason = format!("a record gave {} rows", b.num_rows());
                if mode == BadRecordMode::FailFast {
                    return Err(Malformed { index, reason });
                }
                bad.push(Malformed { index, reason });
            }
            Err(reason) => match mode {
                BadRecordMode::FailFast => return Err(Malformed { index, reason }),
                BadRecordMode::DropMalformed => bad.push(Malformed { index, reason }),
                BadRecordMode::Permissive => {
                    parts.push(null_row(&parse).map_err(|reason| Malformed {
                        index,
                        reason: reason.clone(),
                    })?);
                    let text = String::from_utf8_lossy(record);
                    corrupt.push(Some(text.trim_end_matches(['\r', '\n']).to_string()));
                    bad.push(Malformed { index, reason });
                }
            },
        }
    }
    finish(&parse, &parts, schema, mode, corrupt, bad)
}

/// The records of CSV text as (line the record starts on, its bytes), quoted fields that
/// span lines kept whole.
fn csv_records(text: &[u8], delimiter: u8) -> Vec<(u64, &[u8])> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(delimiter)
        .from_reader(text);
    let mut rec = csv::ByteRecord::new();
    let mut starts: Vec<(u64, usize)> = Vec::new();
    loop {
        let pos = rdr.position().clone();
        match rdr.read_byte_record(&mut rec) {
            Ok(true) => {
                let (mut line, mut at) = (pos.line(), pos.byte() as usize);
                // After a CRLF record the reader stands on the LF, still on the line before.
                if at > 0 && text.get(at - 1) == Some(&b'\r') && text.get(at) == Some(&b'\n') {
                    line += 1;
                    at += 1;
                }
                starts.push((line, at));
            }
            Ok(false) | Err(_) => break,
        }
    }
    let mut out = Vec::with_capacity(starts.len());
    for (i, (line, start)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(text.len(), |n| n.1);
        out.push((*line, &text[(*start).min(end)..end.min(text.len())]));
    }
    out
}

/// The decoded parts as one batch in the output schema, with `_corrupt_record` when kept.
fn finish(
    parse: &SchemaRef,
    parts: &[RecordBatch],
    schema: &SchemaRef,
    mode: BadRecordMode,
    corrupt: Vec<Option<String>>,
    bad: Vec<Malformed>,
) -> Result<Decoded, Malformed> {
    let batch = concat_batches(parse, parts).map_err(|e| Malformed {
        index: 0,
        reason: e.to_string(),
    })?;
    let batch = with_corrupt(batch, schema, mode, Some(corrupt))
        .map_err(|reason| Malformed { index: 0, reason })?;
    Ok(Decoded { batch, bad })
}

/// Text without a UTF-8 byte order mark.
pub fn strip_bom(text: &[u8]) -> &[u8] {
    text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::Int64Type;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]))
    }

    #[test]
    fn json_records_follow_the_three_modes() {
        let recs: Vec<Option<&[u8]>> = vec![
            Some(br#"{"id":1,"name":"a"}"#),
            Some(br#"{"id":"x"}"#),
            None,
            Some(br#"{"id":3}"#),
        ];
        let err = json_each(&schema(), &recs, BadRecordMode::FailFast).unwrap_err();
        assert_eq!(err.index, 1);
        let d = json_each(&schema(), &recs, BadRecordMode::DropMalformed).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (3, 1));
        let d = json_each(&schema(), &recs, BadRecordMode::Permissive).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (4, 1));
        let corrupt = d.batch.column(2).as_string::<i32>();
        assert_eq!(corrupt.value(1), r#"{"id":"x"}"#);
        assert!(corrupt.is_null(0));
        let ids = d.batch.column(0).as_primitive::<Int64Type>();
        assert!(ids.is_null(1) && ids.is_null(2) && ids.value(3) == 3);
    }

    /// `_corrupt_record` declared before other columns gets the bad text, and the other
    /// columns their own values, on every path (one pass, all at once, record by record,
    /// CSV); in the other modes a declared one is there and null.
    #[test]
    fn a_declared_corrupt_record_column_is_filled_where_it_stands() {
        let declared = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new(CORRUPT_RECORD, DataType::Utf8, true),
            Field::new("name", DataType::Utf8, true),
        ]));
        let rows = |b: &RecordBatch| -> Vec<String> {
            (0..b.num_rows())
                .map(|r| {
                    (0..b.num_columns())
                        .map(|c| {
                            let col = b.column(c);
                            if col.is_null(r) {
                                "-".to_string()
                            } else if let Some(s) = col.as_string_opt::<i32>() {
                                s.value(r).to_string()
                            } else {
                                col.as_primitive::<Int64Type>().value(r).to_string()
                            }
                        })
                        .collect::<Vec<_>>()
                        .join("|")
                })
                .collect()
        };
        let good: Vec<Option<&[u8]>> = vec![Some(br#"{"id":1,"name":"a"}"#)];
        let joined = b"{\"id\":1,\"name\":\"a\"}\n";
        let mixed: Vec<Option<&[u8]>> = vec![Some(br#"{"id":1,"name":"a"}"#), Some(b"nope")];
        for mode in [
            BadRecordMode::Permissive,
            BadRecordMode::FailFast,
            BadRecordMode::DropMalformed,
        ] {
            for d in [
                json_checked(&declared, &good, joined, mode).unwrap(),
                json_strict(&declared, &good, joined, mode).unwrap(),
                json_each(&declared, &good, mode).unwrap(),
                csv(&declared, b"1,a\n", false, b',', mode).unwrap(),
            ] {
                assert_eq!(d.batch.schema(), output_schema(&declared, mode), "{mode:?}");
                assert_eq!(rows(&d.batch), ["1|-|a"], "{mode:?}");
            }
        }
        let d = json_each(&declared, &mixed, BadRecordMode::Permissive).unwrap();
        assert_eq!(rows(&d.batch), ["1|-|a", "-|nope|-"]);
        // With LF and CRLF line ends: the line ends stay out of the kept text.
        for text in [
            &b"1,a\n2,b,c,d\n3,c,x\n"[..],
            b"1,a\r\n2,b,c,d\r\n3,c,x\r\n",
        ] {
            let d = csv(&declared, text, false, b',', BadRecordMode::Permissive).unwrap();
            assert_eq!(rows(&d.batch), ["1|-|a", "-|2,b,c,d|-", "-|3,c,x|-"]);
        }
        // FAILFAST names the line of a CRLF file's bad record (index counts from 0).
        let m = csv(
            &declared,
            b"1,a\r\n2,b\r\n3,c,x,y\r\n",
            false,
            b',',
            BadRecordMode::FailFast,
        )
        .unwrap_err();
        assert_eq!(m.index, 2, "{}", m.reason);
        assert!(check_corrupt_column(&declared).is_ok());
        let wrong = Schema::new(vec![Field::new(CORRUPT_RECORD, DataType::Int64, true)]);
        let err = check_corrupt_column(&wrong).unwrap_err();
        assert!(err.contains("declare it as string"), "{err}");
    }

    /// FAILFAST names the first bad record in order, whichever check finds it.
    #[test]
    fn failfast_names_the_first_bad_record() {
        let recs: Vec<Option<&[u8]>> = vec![
            Some(br#"{"id":1}"#),
            Some(br#"{"id":"two"}"#),
            Some(br#"{"id":4.5}"#),
            Some(b"nope"),
        ];
        let joined = b"{\"id\":1}\n{\"id\":\"two\"}\n{\"id\":4.5}\nnope\n";
        for decoded in [
            json_checked(&schema(), &recs, joined, BadRecordMode::FailFast),
            json_strict(&schema(), &recs, joined, BadRecordMode::FailFast),
            json_each(&schema(), &recs, BadRecordMode::FailFast),
        ] {
            let m = decoded.unwrap_err();
            assert_eq!(m.index, 1, "{}", m.reason);
            assert!(m.reason.contains("two"), "{}", m.reason);
        }
    }

    #[test]
    fn json_all_reads_more_rows_than_one_decoder_batch() {
        let mut buf = Vec::new();
        for i in 0..20_000 {
            buf.extend_from_slice(format!("{{\"id\":{i}}}\n").as_bytes());
        }
        let b = json_all(&schema(), &buf, Some(20_000)).unwrap();
        assert_eq!(b.num_rows(), 20_000);
        assert!(json_all(&schema(), &buf, Some(3)).is_err());
    }

    #[test]
    fn csv_lines_follow_the_modes_and_name_the_line() {
        let text = b"id,name\n1,a\nx,b\n3,c\n";
        let err = csv(&schema(), text, true, b',', BadRecordMode::FailFast).unwrap_err();
        assert_eq!(err.index, 2);
        let d = csv(&schema(), text, true, b',', BadRecordMode::DropMalformed).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (2, 1));
        let d = csv(&schema(), text, true, b',', BadRecordMode::Permissive).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (3, 1));
        // A quoted field over three lines is one record; the bad one is on line 5.
        let text = b"id,name\n3,\"multi\nline\nmore\"\nbad,x\n";
        let err = csv(&schema(), text, true, b',', BadRecordMode::FailFast).unwrap_err();
        assert_eq!(err.index + 1, 5, "{err:?}");
        let d = csv(&schema(), text, true, b',', BadRecordMode::Permissive).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (2, 1));
        let d = csv(&schema(), text, true, b',', BadRecordMode::DropMalformed).unwrap();
        assert_eq!((d.batch.num_rows(), d.malformed()), (1, 1));
    }
}
