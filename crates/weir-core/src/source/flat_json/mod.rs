//! A one-pass decoder for the common case: each record a flat JSON object, read into
//! columns of plain types (integers, floats, text, booleans, dates, timestamps).
//!
//! The checked path ([`super::validate`], then arrow-json) reads every record twice and
//! spent 57% of a file batch's CPU doing it. This decoder checks the syntax and the value
//! types and builds the columns in the same pass. It accepts only what the checked path
//! accepts, and gives the same values: anything it is not sure of (a column type it does
//! not handle, an escaped key, a string in a number column, a repeated key, a number out of
//! range, deep nesting, a syntax error) makes it give up on the whole set with `None`, and
//! the caller decodes with the checked path, which finds and names the bad record.

mod scan;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use chrono::{TimeZone, Utc};
use datafusion::arrow::array::timezone::Tz;
use datafusion::arrow::array::{
    ArrayRef, BooleanArray, Date32Array, Float32Array, Float64Array, Int8Array, Int16Array,
    Int32Array, Int64Array, StringBuilder, TimestampMicrosecondArray, TimestampMillisecondArray,
    TimestampNanosecondArray, TimestampSecondArray, UInt8Array, UInt16Array, UInt32Array,
    UInt64Array,
};
use datafusion::arrow::compute::kernels::cast_utils::{Parser, string_to_datetime};
use datafusion::arrow::datatypes::{DataType, Date32Type, SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;

use scan::{in_range, integer, literal, number, same_key, skip, string, string_end, ws};

/// Deeper values than this (in columns the schema does not name) go to the checked path,
/// which has its own limit.
const MAX_DEPTH: usize = 64;

/// Decodes `records` (`None`: a null value, read as `{}`) into `schema` (every field
/// nullable, no `_corrupt_record`); `None` when the checked path must decide.
pub fn decode(schema: &SchemaRef, records: &[Option<&[u8]>]) -> Option<RecordBatch> {
    let mut cols = schema
        .fields()
        .iter()
        .map(|f| Column::new(f.data_type(), records.len()))
        .collect::<Option<Vec<_>>>()?;
    let names: Vec<&[u8]> = schema
        .fields()
        .iter()
        .map(|f| f.name().as_bytes())
        .collect();
    // The row each column last got a value in (+1), to find repeated keys.
    let mut filled = vec![0usize; cols.len()];
    for (row, r) in records.iter().enumerate() {
        let stamp = row + 1;
        if let Some(r) = r {
            let text = std::str::from_utf8(r).ok()?;
            record(text, &names, &mut cols, &mut filled, stamp)?;
        }
        for (c, f) in cols.iter_mut().zip(&filled) {
            if *f != stamp {
                c.push_null();
            }
        }
    }
    let arrays = cols.into_iter().map(Column::finish).collect::<Vec<_>>();
    RecordBatch::try_new(schema.clone(), arrays).ok()
}

/// Reads one record into the columns; `None` at anything the checked path must judge.
fn record(
    text: &str,
    names: &[&[u8]],
    cols: &mut [Column],
    filled: &mut [usize],
    stamp: usize,
) -> Option<()> {
    let b = text.as_bytes();
    let mut i = ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(b, i + 1);
    // Records usually repeat one key order: try the column after the last one first.
    let mut next = 0;
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            if b.get(i) != Some(&b'"') {
                return None;
            }
            let (end, escaped) = string_end(b, i + 1)?;
            if escaped {
                return None;
            }
            let key = &b[i + 1..end];
            i = ws(b, end + 1);
            if b.get(i) != Some(&b':') {
                return None;
            }
            i = ws(b, i + 1);
            let col = if names.get(next).is_some_and(|n| same_key(n, key)) {
                Some(next)
            } else {
                names.iter().position(|n| same_key(n, key))
            };
            match col {
                Some(c) => {
                    if filled[c] == stamp {
                        return None;
                    }
                    filled[c] = stamp;
                    i = cols[c].value(text, i)?;
                    next = c + 1;
                }
                None => i = skip(b, i, 0)?,
            }
            i = ws(b, i);
            match b.get(i) {
                Some(b',') => i = ws(b, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    (ws(b, i) == b.len()).then_some(())
}

/// The values of one column, and what JSON they take.
enum Column {
    Signed(DataType, Vec<Option<i64>>),
    Unsigned(DataType, Vec<Option<u64>>),
    F32(Vec<Option<f32>>),
    F64(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
    Text(StringBuilder),
    Date32(Vec<Option<i32>>),
    /// Unit, zone as the schema names it, and the zone parsed (`None`: UTC, as arrow-json).
    Timestamp(TimeUnit, Option<Arc<str>>, Option<Tz>, Vec<Option<i64>>),
}

impl Column {
    fn new(dt: &DataType, rows: usize) -> Option<Column> {
        Some(match dt {
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                Column::Signed(dt.clone(), Vec::with_capacity(rows))
            }
            DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
                Column::Unsigned(dt.clone(), Vec::with_capacity(rows))
            }
            DataType::Float32 => Column::F32(Vec::with_capacity(rows)),
            DataType::Float64 => Column::F64(Vec::with_capacity(rows)),
            DataType::Boolean => Column::Bool(Vec::with_capacity(rows)),
            DataType::Utf8 => Column::Text(StringBuilder::with_capacity(rows, rows * 16)),
            DataType::Date32 => Column::Date32(Vec::with_capacity(rows)),
            DataType::Timestamp(unit, tz) => {
                let parsed = match tz {
                    Some(tz) => Some(tz.parse::<Tz>().ok()?),
                    None => None,
                };
                Column::Timestamp(*unit, tz.clone(), parsed, Vec::with_capacity(rows))
            }
            _ => return None,
        })
    }

    fn push_null(&mut self) {
        match self {
            Column::Signed(_, v) | Column::Timestamp(_, _, _, v) => v.push(None),
            Column::Unsigned(_, v) => v.push(None),
            Column::F32(v) => v.push(None),
            Column::F64(v) => v.push(None),
            Column::Bool(v) => v.push(None),
            Column::Text(v) => v.append_null(),
            Column::Date32(v) => v.push(None),
        }
    }

    /// Reads the value at `i` into the column; the position after it.
    fn value(&mut self, text: &str, i: usize) -> Option<usize> {
        let b = text.as_bytes();
        if b.get(i) == Some(&b'n') {
            let end = literal(b, i, b"null")?;
            self.push_null();
            return Some(end);
        }
        match self {
            Column::Text(v) => {
                if b.get(i) != Some(&b'"') {
                    return None;
                }
                let (s, end) = string(text, i)?;
                v.append_value(s);
                Some(end)
            }
            Column::Date32(v) => {
                if b.get(i) != Some(&b'"') {
                    return None;
                }
                let (s, end) = string(text, i)?;
                v.push(Some(Date32Type::parse(&s)?));
                Some(end)
            }
            Column::Timestamp(unit, _, tz, v) => {
                if b.get(i) != Some(&b'"') {
                    return None;
                }
                let (s, end) = string(text, i)?;
                let t = match tz {
                    Some(tz) => instant(tz, &s, *unit)?,
                    None => instant(&Utc, &s, *unit)?,
                };
                v.push(Some(t));
                Some(end)
            }
            Column::Bool(v) => {
                let (value, end) = match b.get(i)? {
                    b't' => (true, literal(b, i, b"true")?),
                    b'f' => (false, literal(b, i, b"false")?),
                    _ => return None,
                };
                v.push(Some(value));
                Some(end)
            }
            Column::Signed(dt, v) => {
                let (end, token) = integer(text, i)?;
                let x = token.parse::<i64>().ok()?;
                let fits = match dt {
                    DataType::Int8 => i8::try_from(x).is_ok(),
                    DataType::Int16 => i16::try_from(x).is_ok(),
                    DataType::Int32 => i32::try_from(x).is_ok(),
                    _ => true,
                };
                if !fits {
                    return None;
                }
                v.push(Some(x));
                Some(end)
            }
            Column::Unsigned(dt, v) => {
                let (end, token) = integer(text, i)?;
                let x = token.parse::<u64>().ok()?;
                let fits = match dt {
                    DataType::UInt8 => u8::try_from(x).is_ok(),
                    DataType::UInt16 => u16::try_from(x).is_ok(),
                    DataType::UInt32 => u32::try_from(x).is_ok(),
                    _ => true,
                };
                if !fits {
                    return None;
                }
                v.push(Some(x));
                Some(end)
            }
            Column::F32(v) => {
                let (end, token) = number(text, i)?;
                in_range(token)?;
                let x = token.parse::<f32>().ok().filter(|x| x.is_finite())?;
                v.push(Some(x));
                Some(end)
            }
            Column::F64(v) => {
                let (end, token) = number(text, i)?;
                v.push(Some(in_range(token)?));
                Some(end)
            }
        }
    }

    fn finish(self) -> ArrayRef {
        fn narrow<T: TryFrom<i64>>(v: Vec<Option<i64>>) -> impl Iterator<Item = Option<T>> {
            v.into_iter().map(|x| x.and_then(|x| T::try_from(x).ok()))
        }
        fn narrow_u<T: TryFrom<u64>>(v: Vec<Option<u64>>) -> impl Iterator<Item = Option<T>> {
            v.into_iter().map(|x| x.and_then(|x| T::try_from(x).ok()))
        }
        match self {
            Column::Signed(DataType::Int8, v) => Arc::new(narrow::<i8>(v).collect::<Int8Array>()),
            Column::Signed(DataType::Int16, v) => {
                Arc::new(narrow::<i16>(v).collect::<Int16Array>())
            }
            Column::Signed(DataType::Int32, v) => {
                Arc::new(narrow::<i32>(v).collect::<Int32Array>())
            }
            Column::Signed(_, v) => Arc::new(Int64Array::from(v)),
            Column::Unsigned(DataType::UInt8, v) => {
                Arc::new(narrow_u::<u8>(v).collect::<UInt8Array>())
            }
            Column::Unsigned(DataType::UInt16, v) => {
                Arc::new(narrow_u::<u16>(v).collect::<UInt16Array>())
            }
            Column::Unsigned(DataType::UInt32, v) => {
                Arc::new(narrow_u::<u32>(v).collect::<UInt32Array>())
            }
            Column::Unsigned(_, v) => Arc::new(UInt64Array::from(v)),
            Column::F32(v) => Arc::new(Float32Array::from(v)),
            Column::F64(v) => Arc::new(Float64Array::from(v)),
            Column::Bool(v) => Arc::new(BooleanArray::from(v)),
            Column::Text(mut v) => Arc::new(v.finish()),
            Column::Date32(v) => Arc::new(Date32Array::from(v)),
            Column::Timestamp(unit, tz, _, v) => match unit {
                TimeUnit::Second => Arc::new(TimestampSecondArray::from(v).with_timezone_opt(tz)),
                TimeUnit::Millisecond => {
                    Arc::new(TimestampMillisecondArray::from(v).with_timezone_opt(tz))
                }
                TimeUnit::Microsecond => {
                    Arc::new(TimestampMicrosecondArray::from(v).with_timezone_opt(tz))
                }
                TimeUnit::Nanosecond => {
                    Arc::new(TimestampNanosecondArray::from(v).with_timezone_opt(tz))
                }
            },
        }
    }
}

/// A timestamp string as arrow-json reads it: in `tz` when it has no offset, counted in
/// `unit` since the epoch.
fn instant<T: TimeZone>(tz: &T, s: &str, unit: TimeUnit) -> Option<i64> {
    match utc_instant(s.as_bytes()) {
        Some(t) => in_unit(&t, unit),
        None => arrow_instant(tz, s, unit),
    }
}

/// [`instant`] by arrow's parser alone.
fn arrow_instant<T: TimeZone>(tz: &T, s: &str, unit: TimeUnit) -> Option<i64> {
    in_unit(&string_to_datetime(tz, s).ok()?, unit)
}

/// `t` counted in `unit` since the epoch (`None` when the unit cannot hold it).
fn in_unit<T: TimeZone>(t: &chrono::DateTime<T>, unit: TimeUnit) -> Option<i64> {
    match unit {
        TimeUnit::Second => Some(t.timestamp()),
        TimeUnit::Millisecond => Some(t.timestamp_millis()),
        TimeUnit::Microsecond => Some(t.timestamp_micros()),
        TimeUnit::Nanosecond => t.timestamp_nanos_opt(),
    }
}

/// The common form `YYYY-MM-DDTHH:MM:SS[.f]Z` (`T` or a space, 1 to 9 fraction digits, a
/// valid date and time) without arrow's general parser, which took about 4% of the CPU of a
/// JSON batch with one such column; `None` for any other text, which then goes to arrow.
fn utc_instant(b: &[u8]) -> Option<chrono::DateTime<Utc>> {
    fn num(b: &[u8]) -> Option<u32> {
        let mut n = 0u32;
        for &c in b {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                return None;
            }
            n = n * 10 + u32::from(d);
        }
        Some(n)
    }
    if b.len() < 20
        || b.last() != Some(&b'Z')
        || b[4] != b'-'
        || b[7] != b'-'
        || (b[10] != b'T' && b[10] != b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let nanos = match &b[19..b.len() - 1] {
        [] => 0,
        [b'.', digits @ ..] if (1..=9).contains(&digits.len()) => {
            num(digits)? * 10u32.pow(9 - digits.len() as u32)
        }
        _ => return None,
    };
    let date = chrono::NaiveDate::from_ymd_opt(
        i32::try_from(num(&b[0..4])?).ok()?,
        num(&b[5..7])?,
        num(&b[8..10])?,
    )?;
    let (hour, minute, second) = (num(&b[11..13])?, num(&b[14..16])?, num(&b[17..19])?);
    // chrono reads a second of 60 as a leap second; arrow decides those.
    if second > 59 {
        return None;
    }
    Some(
        date.and_hms_nano_opt(hour, minute, second, nanos)?
            .and_utc(),
    )
}
