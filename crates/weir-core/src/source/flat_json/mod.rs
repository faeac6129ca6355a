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

/// `a == b` for short byte strings (column names) without a call to `memcmp`, which cost
/// more than the compare itself: 2.4% of a JSON batch's CPU went to that call.
#[inline]
fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let word = |s: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        u64::from_ne_bytes(w)
    };
    let (wa, wb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (wa.remainder(), wb.remainder());
    wa.zip(wb).all(|(x, y)| word(x) == word(y)) && ra.iter().zip(rb).all(|(x, y)| x == y)
}

/// The first position at or after `i` that is not JSON whitespace.
fn ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The closing quote of the string whose text starts at `i`, and whether it has escapes
/// (checked to be valid). `None` for a raw control character, a bad escape, a lone
/// surrogate or no closing quote.
fn string_end(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let mut escaped = false;
    loop {
        match *b.get(i)? {
            b'"' => return Some((i, escaped)),
            b'\\' => {
                escaped = true;
                i = escape(b, i + 1)?.1;
            }
            c if c < 0x20 => return None,
            _ => i += 1,
        }
    }
}

/// The character of the escape whose letter is at `i`, and the position after it.
fn escape(b: &[u8], i: usize) -> Option<(char, usize)> {
    let c = match *b.get(i)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hi = hex4(b, i + 1)?;
            if (0xD800..0xDC00).contains(&hi) {
                // A high surrogate must be followed by an escaped low one.
                if b.get(i + 5) != Some(&b'\\') || b.get(i + 6) != Some(&b'u') {
                    return None;
                }
                let lo = hex4(b, i + 7)?;
                if !(0xDC00..0xE000).contains(&lo) {
                    return None;
                }
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return Some((char::from_u32(c)?, i + 11));
            }
            return Some((char::from_u32(hi)?, i + 5));
        }
        _ => return None,
    };
    Some((c, i + 1))
}

fn hex4(b: &[u8], i: usize) -> Option<u32> {
    let digits = std::str::from_utf8(b.get(i..i + 4)?).ok()?;
    if !digits.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

/// The text of the string whose opening quote is at `i` (escapes resolved), and the
/// position after its closing quote.
fn string(text: &str, i: usize) -> Option<(std::borrow::Cow<'_, str>, usize)> {
    let b = text.as_bytes();
    let (end, escaped) = string_end(b, i + 1)?;
    let raw = text.get(i + 1..end)?;
    if !escaped {
        return Some((raw.into(), end + 1));
    }
    let mut out = String::with_capacity(raw.len());
    let mut j = i + 1;
    while j < end {
        let run = b[j..end]
            .iter()
            .position(|&c| c == b'\\')
            .map_or(end, |p| j + p);
        out.push_str(text.get(j..run)?);
        if run == end {
            break;
        }
        let (c, after) = escape(b, run + 1)?;
        out.push(c);
        j = after;
    }
    Some((out.into(), end + 1))
}

/// The end of the number starting at `i` (strict JSON grammar), and whether it is an
/// integer (no fraction, no exponent).
fn number_end(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let digits = |b: &[u8], mut i: usize| {
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i = digits(b, i)?,
        _ => return None,
    }
    let mut integer = true;
    if b.get(i) == Some(&b'.') {
        integer = false;
        i = digits(b, i + 1)?;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        integer = false;
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        i = digits(b, i)?;
    }
    Some((i, integer))
}

/// A number serde_json (the checked path's parser) reads without "number out of range":
/// one that is finite as an `f64`.
fn in_range(token: &str) -> Option<f64> {
    token
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && v.abs() < 1.7e308)
}

/// Skips the value at `i` (of a key the schema does not name), checking its syntax.
fn skip(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    if depth > MAX_DEPTH {
        return None;
    }
    match *b.get(i)? {
        b'"' => Some(string_end(b, i + 1)?.0 + 1),
        b'{' | b'[' => {
            let (close, object) = if b[i] == b'{' {
                (b'}', true)
            } else {
                (b']', false)
            };
            let mut j = ws(b, i + 1);
            if b.get(j) == Some(&close) {
                return Some(j + 1);
            }
            loop {
                if object {
                    if b.get(j) != Some(&b'"') {
                        return None;
                    }
                    j = ws(b, string_end(b, j + 1)?.0 + 1);
                    if b.get(j) != Some(&b':') {
                        return None;
                    }
                    j = ws(b, j + 1);
                }
                j = ws(b, skip(b, j, depth + 1)?);
                match b.get(j) {
                    Some(b',') => j = ws(b, j + 1),
                    Some(c) if *c == close => return Some(j + 1),
                    _ => return None,
                }
            }
        }
        b't' => literal(b, i, b"true"),
        b'f' => literal(b, i, b"false"),
        b'n' => literal(b, i, b"null"),
        _ => {
            let (end, integer) = number_end(b, i)?;
            let token = std::str::from_utf8(&b[i..end]).ok()?;
            if !(integer && token.len() <= 18) {
                in_range(token)?;
            }
            Some(end)
        }
    }
}

fn literal(b: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    (b.get(i..i + word.len()) == Some(word)).then_some(i + word.len())
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

/// The number token at `i` and the position after it.
fn number(text: &str, i: usize) -> Option<(usize, &str)> {
    let (end, _) = number_end(text.as_bytes(), i)?;
    Some((end, text.get(i..end)?))
}

/// The integer token at `i` (a fraction or an exponent: `None`, the checked path refuses
/// or judges it; so does `-0`, which serde_json reads as a float) and the position after
/// it.
fn integer(text: &str, i: usize) -> Option<(usize, &str)> {
    let (end, integer) = number_end(text.as_bytes(), i)?;
    let token = text.get(i..end)?;
    (integer && token != "-0").then_some((end, token))
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

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;
    use crate::source::decode::{BadRecordMode, json_strict};

    #[test]
    fn same_key_is_byte_equality() {
        let words: Vec<&[u8]> = vec![
            b"",
            b"a",
            b"ab",
            b"order_id",
            b"order_ie",
            b"order_id2",
            b"prder_id2",
            b"updated_at",
            b"updated_au",
            b"\xc3\xbc_twelve_bytes_",
            b"0123456789abcdef",
            b"0123456789abcdeg",
        ];
        for a in &words {
            for b in &words {
                assert_eq!(same_key(a, b), a == b, "{a:?} {b:?}");
            }
        }
    }

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("small", DataType::Int8, true),
            Field::new("u", DataType::UInt32, true),
            Field::new("x", DataType::Float64, true),
            Field::new("f", DataType::Float32, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("ok", DataType::Boolean, true),
            Field::new("d", DataType::Date32, true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
            Field::new("ms", DataType::Timestamp(TimeUnit::Millisecond, None), true),
            Field::new(
                "ns",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("+02:00".into())),
                true,
            ),
        ]))
    }

    /// A small deterministic generator (xorshift), so a failure names its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
            from[self.below(from.len())]
        }
    }

    const NUMBERS: &[&str] = &[
        "0",
        "-0",
        "7",
        "-128",
        "127",
        "128",
        "-129",
        "255",
        "4294967295",
        "4294967296",
        "-1",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775808",
        "99999999999999999999",
        "1.5",
        "-2.25",
        "1e3",
        "1E-2",
        "2.5e+10",
        "0.1",
        "3.4e38",
        "3.5e38",
        "1e308",
        "1.7976931348623157e308",
        "1e309",
        "1e400",
        "-1e400",
        "01",
        "-",
        "1.",
        ".5",
        "1e",
        "+1",
        "0x10",
        "1.5.2",
        "--1",
        "123456789012345678901234567890",
    ];
    const STRINGS: &[&str] = &[
        r#""""#,
        r#""a""#,
        r#""héllo ü [1] {x}""#,
        r#""tab\tand\nnewline""#,
        r#""quote\" slash\/ back\\""#,
        r#""\u00e9\u0041""#,
        r#""\ud83d\ude00 smile""#,
        r#""lone \ud800 x""#,
        r#""low \udc00""#,
        r#""bad \x escape""#,
        r#""bad \u12 short""#,
        "\"raw\tcontrol\"",
        r#""unterminated"#,
        r#""2026-01-05""#,
        r#""2026-13-40""#,
        r#""2026-01-05T10:20:30Z""#,
        r#""2026-01-05T10:20:30.123456789+05:30""#,
        r#""2026-01-05 10:20:30""#,
        r#""2026-01-05T10:20:30.5""#,
        r#""not a date""#,
        r#""12""#,
        r#""1.5""#,
        r#""true""#,
        r#""🦀""#,
    ];
    const OTHERS: &[&str] = &[
        "true",
        "false",
        "null",
        "nul",
        "tru",
        "True",
        "NULL",
        "[]",
        "[1,2,3]",
        "{}",
        r#"{"a":{"b":[1,{"c":null}]}}"#,
        "[1,]",
        r#"{"a":1,}"#,
        "[[[[[]]]]]",
        r#"{"a" 1}"#,
    ];
    const KEYS: &[&str] = &[
        "id",
        "small",
        "u",
        "x",
        "f",
        "name",
        "ok",
        "d",
        "at",
        "ms",
        "ns",
        "extra",
        "ID",
        "na\\u006de",
        "",
    ];

    fn value(rng: &mut Rng, key: &str, good: bool) -> String {
        let good_value = match key {
            "id" | "small" | "u" => Some(rng.pick(&["0", "1", "42", "-3", "100"]).to_string()),
            "x" | "f" => Some(rng.pick(&["1.5", "-0.25", "3", "1e2", "0.1"]).to_string()),
            "name" => Some(
                rng.pick(&[r#""a""#, r#""ü x""#, r#""q\"z""#, r#""""#])
                    .to_string(),
            ),
            "ok" => Some(rng.pick(&["true", "false"]).to_string()),
            "d" => Some(r#""2026-02-03""#.to_string()),
            "at" | "ms" | "ns" => Some(
                rng.pick(&[
                    r#""2026-01-05T10:20:30Z""#,
                    r#""2026-01-05T10:20:30.123456+01:00""#,
                    r#""2026-01-05 10:20:30""#,
                ])
                .to_string(),
            ),
            _ => None,
        };
        if good
            && rng.below(8) > 0
            && let Some(v) = good_value
        {
            return v;
        }
        if good && rng.below(4) == 0 {
            return "null".into();
        }
        match rng.below(3) {
            0 => rng.pick(NUMBERS).into(),
            1 => rng.pick(STRINGS).into(),
            _ => rng.pick(OTHERS).into(),
        }
    }

    fn space(rng: &mut Rng) -> &'static str {
        rng.pick(&["", "", "", " ", "\t", "  ", "\r", "\n"])
    }

    fn record(rng: &mut Rng, good: bool) -> String {
        if !good && rng.below(10) == 0 {
            return rng
                .pick(&[
                    "",
                    "null",
                    "[1]",
                    "{",
                    "{}{}",
                    r#"{"id":1}x"#,
                    "\"s\"",
                    "{} {}",
                ])
                .into();
        }
        let mut keys: Vec<&str> = Vec::new();
        for _ in 0..rng.below(8) {
            let k = if good {
                rng.pick(&KEYS[..12])
            } else {
                rng.pick(KEYS)
            };
            if !good || !keys.contains(&k) {
                keys.push(k);
            }
        }
        let mut s = format!("{}{{", space(rng));
        for (n, k) in keys.iter().enumerate() {
            if n > 0 {
                s.push(',');
            }
            let v = value(rng, k, good);
            s.push_str(&format!(
                "{}\"{k}\"{}:{}{v}{}",
                space(rng),
                space(rng),
                space(rng),
                space(rng)
            ));
        }
        s.push('}');
        s.push_str(space(rng));
        if !good && rng.below(20) == 0 {
            let mut cut = rng.below(s.len() + 1);
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
        }
        s
    }

    /// Whatever the one-pass decoder accepts, the checked path accepts too, with the same
    /// rows; and it accepts most plain records (else it would be no faster).
    #[test]
    fn the_one_pass_decoder_agrees_with_the_checked_path() {
        let schema = schema();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut fast, mut strict_ok, mut good_fast, mut good_total) = (0, 0, 0, 0);
        for round in 0..6000 {
            let good = round % 2 == 0;
            let n = 1 + rng.below(4);
            let texts: Vec<String> = (0..n).map(|_| record(&mut rng, good)).collect();
            let mut records: Vec<Option<&[u8]>> =
                texts.iter().map(|t| Some(t.as_bytes())).collect();
            if rng.below(10) == 0 {
                records.push(None);
            }
            let joined: Vec<u8> = records
                .iter()
                .flat_map(|r| {
                    let r = r.unwrap_or(b"{}");
                    r.iter().copied().filter(|&c| c != b'\n').chain([b'\n'])
                })
                .collect();
            let strict = json_strict(&schema, &records, &joined, BadRecordMode::FailFast);
            let one_pass = decode(&schema, &records);
            if let Ok(d) = &strict {
                strict_ok += 1;
                assert_eq!(d.malformed, 0);
            }
            if good && strict.is_ok() {
                good_total += 1;
            }
            if let Some(b) = one_pass {
                fast += 1;
                if good {
                    good_fast += 1;
                }
                match &strict {
                    Ok(d) => assert_eq!(d.batch, b, "round {round}: {texts:?}"),
                    Err(e) => panic!(
                        "round {round}: accepted what the checked path refuses ({e:?}): {texts:?}"
                    ),
                }
            }
        }
        assert!(fast > 1000 && strict_ok > fast, "{fast} {strict_ok}");
        assert!(
            good_fast * 10 >= good_total * 8,
            "{good_fast} of {good_total}"
        );
    }

    #[test]
    fn plain_records_decode_in_one_pass_with_escapes_nulls_and_unknown_keys() {
        let schema = schema();
        let texts = [
            r#"{"id":1,"name":"a\"b\u00e9\ud83d\ude00","x":1e2,"ok":true,"at":"2026-01-05T10:20:30Z"}"#,
            r#" { "extra" : {"deep":[1,{"z":null}],"s":"\\"} , "id" : -7 , "name" : null } "#,
            r#"{}"#,
        ];
        let mut records: Vec<Option<&[u8]>> = texts.iter().map(|t| Some(t.as_bytes())).collect();
        records.push(None);
        let b = decode(&schema, &records).unwrap();
        assert_eq!(b.num_rows(), 4);
        let joined = texts.join("\n") + "\n{}\n";
        let strict = json_strict(
            &schema,
            &records,
            joined.as_bytes(),
            BadRecordMode::FailFast,
        )
        .unwrap();
        assert_eq!(strict.batch, b);
        for bad in [
            r#"{"id":1.5}"#,
            r#"{"id":1,"id":2}"#,
            r#"{"id":"1"}"#,
            r#"{"na\u006de":"x"}"#,
            r#"{"id":1}{"id":2}"#,
            r#"{"extra":1e400}"#,
            r#"{"id":1,}"#,
        ] {
            assert!(decode(&schema, &[Some(bad.as_bytes())]).is_none(), "{bad}");
        }
        let nested = Arc::new(Schema::new(vec![Field::new(
            "l",
            DataType::List(Arc::new(Field::new("item", DataType::Int64, true))),
            true,
        )]));
        assert!(decode(&nested, &[Some(br#"{"l":[1]}"#)]).is_none());
    }

    /// The fast path for `...Z` timestamps gives what arrow's parser gives, in every unit,
    /// on valid and invalid dates, times, fractions and near-misses of the form.
    #[test]
    fn utc_timestamps_parse_as_arrow_parses_them() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let tz: Tz = "+02:00".parse().unwrap();
        let units = [
            TimeUnit::Second,
            TimeUnit::Millisecond,
            TimeUnit::Microsecond,
            TimeUnit::Nanosecond,
        ];
        let mut fast = 0;
        for case in 0..200_000 {
            let year = [
                0, 1, 1600, 1677, 1900, 1969, 1970, 2000, 2024, 2100, 2262, 2263, 9999,
            ][next(13) as usize]
                + if case % 3 == 0 { next(400) as u32 } else { 0 };
            let mut text = format!(
                "{:04}-{:02}-{:02}{}{:02}:{:02}:{:02}",
                year.min(9999),
                next(14),
                next(33),
                [" ", "T", "t", "_"][next(4) as usize],
                next(26),
                next(62),
                next(62)
            );
            match next(6) {
                0 => {}
                1 => text.push('.'),
                _ => {
                    text.push('.');
                    for _ in 0..1 + next(11) {
                        text.push(char::from(b'0' + next(10) as u8));
                    }
                }
            }
            text.push_str(["Z", "Z", "Z", "z", "+00:00", "", "Z ", "ZZ"][next(8) as usize]);
            if next(50) == 0 {
                let at = next(text.len() as u64) as usize;
                text.replace_range(at..at + 1, "x");
            }
            for unit in units {
                if utc_instant(text.as_bytes()).is_some() {
                    fast += 1;
                }
                let arrow = arrow_instant(&Utc, &text, unit);
                assert_eq!(instant(&Utc, &text, unit), arrow, "{text} {unit:?}");
                if text.ends_with('Z') {
                    assert_eq!(
                        instant(&tz, &text, unit),
                        arrow,
                        "{text} {unit:?} in +02:00"
                    );
                }
            }
        }
        assert!(fast > 50_000, "only {fast} cases took the fast path");
    }
}
