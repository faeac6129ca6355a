//! The byte encoding of stateful operators' keys and values, which does not depend on the
//! Arrow version: per value, a NULL marker, then the value in a fixed layout for its type
//! family (little-endian integers and floats, length-prefixed bytes).

use datafusion::arrow::array::cast::AsArray;
use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, Float32Type, Float64Type, Int8Type,
    Int16Type, Int32Type, Int64Type, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use datafusion::scalar::ScalarValue;

/// The type family a key column's values are encoded as; `None`: not a key type.
pub(super) fn family(dt: &DataType) -> Option<String> {
    Some(match dt {
        DataType::Boolean => "boolean".into(),
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => "integer".into(),
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            "unsigned".into()
        }
        DataType::Float32 | DataType::Float64 => "float".into(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => "binary".into(),
        DataType::Date32 => "date".into(),
        DataType::Date64 => "date-ms".into(),
        DataType::Timestamp(unit, _) => format!(
            "timestamp-{}",
            match unit {
                TimeUnit::Second => "s",
                TimeUnit::Millisecond => "ms",
                TimeUnit::Microsecond => "us",
                TimeUnit::Nanosecond => "ns",
            }
        ),
        DataType::Decimal128(p, s) => format!("decimal({p},{s})"),
        _ => return None,
    })
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Floats as Spark compares them for grouping: -0.0 is 0.0 and every NaN is one NaN.
fn put_float(out: &mut Vec<u8>, v: f64) {
    let v = if v == 0.0 {
        0.0
    } else if v.is_nan() {
        f64::NAN
    } else {
        v
    };
    out.extend_from_slice(&v.to_bits().to_le_bytes());
}

/// Appends row `i` of `col` (a type [`family`] accepts) to `out`.
pub(super) fn encode_value(out: &mut Vec<u8>, col: &ArrayRef, i: usize) {
    if col.is_null(i) {
        out.push(0);
        return;
    }
    out.push(1);
    match col.data_type() {
        DataType::Boolean => out.push(u8::from(col.as_boolean().value(i))),
        DataType::Int8 => put_i64(out, col.as_primitive::<Int8Type>().value(i).into()),
        DataType::Int16 => put_i64(out, col.as_primitive::<Int16Type>().value(i).into()),
        DataType::Int32 => put_i64(out, col.as_primitive::<Int32Type>().value(i).into()),
        DataType::Int64 => put_i64(out, col.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => put_u64(out, col.as_primitive::<UInt8Type>().value(i).into()),
        DataType::UInt16 => put_u64(out, col.as_primitive::<UInt16Type>().value(i).into()),
        DataType::UInt32 => put_u64(out, col.as_primitive::<UInt32Type>().value(i).into()),
        DataType::UInt64 => put_u64(out, col.as_primitive::<UInt64Type>().value(i)),
        DataType::Float32 => put_float(out, col.as_primitive::<Float32Type>().value(i).into()),
        DataType::Float64 => put_float(out, col.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => put_bytes(out, col.as_string::<i32>().value(i).as_bytes()),
        DataType::LargeUtf8 => put_bytes(out, col.as_string::<i64>().value(i).as_bytes()),
        DataType::Utf8View => put_bytes(out, col.as_string_view().value(i).as_bytes()),
        DataType::Binary => put_bytes(out, col.as_binary::<i32>().value(i)),
        DataType::LargeBinary => put_bytes(out, col.as_binary::<i64>().value(i)),
        DataType::BinaryView => put_bytes(out, col.as_binary_view().value(i)),
        DataType::Date32 => put_i64(out, col.as_primitive::<Date32Type>().value(i).into()),
        DataType::Date64 => put_i64(out, col.as_primitive::<Date64Type>().value(i)),
        DataType::Timestamp(TimeUnit::Second, _) => {
            put_i64(out, col.as_primitive::<TimestampSecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Millisecond, _) => {
            put_i64(out, col.as_primitive::<TimestampMillisecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            put_i64(out, col.as_primitive::<TimestampMicrosecondType>().value(i))
        }
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            put_i64(out, col.as_primitive::<TimestampNanosecondType>().value(i))
        }
        DataType::Decimal128(_, _) => {
            out.extend_from_slice(&col.as_primitive::<Decimal128Type>().value(i).to_le_bytes())
        }
        // `family` refused every other type before any row is encoded.
        _ => {}
    }
}

/// Appends the non-NULL 64-bit integer `v` in the layout of [`encode_value`] (a window's
/// start in an aggregation's state key), without an array to read it from.
pub(super) fn encode_i64(out: &mut Vec<u8>, v: i64) {
    out.push(1);
    put_i64(out, v);
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` (of a type [`family`] accepts) in the layout of [`encode_value`].
pub(super) fn encode_scalar(out: &mut Vec<u8>, v: &ScalarValue) -> Result<(), String> {
    let array = v
        .to_array_of_size(1)
        .map_err(|e| format!("encoding {v}: {e}"))?;
    encode_value(out, &array, 0);
    Ok(())
}

/// Reads one value written by [`encode_value`] from `bytes` at `*at` as type `dt`, moving
/// `*at` past it; `Err` names what is wrong with the bytes.
pub(super) fn decode_value(
    bytes: &[u8],
    at: &mut usize,
    dt: &DataType,
) -> Result<ScalarValue, String> {
    let marker = take(bytes, at, 1)?[0];
    let null = match marker {
        0 => true,
        1 => false,
        m => return Err(format!("byte {m} at {} is not a NULL marker", *at - 1)),
    };
    if null {
        return ScalarValue::try_from(dt).map_err(|e| e.to_string());
    }
    let i64_at =
        |at: &mut usize| -> Result<i64, String> { Ok(i64::from_le_bytes(take8(bytes, at)?)) };
    Ok(match dt {
        DataType::Boolean => ScalarValue::Boolean(Some(take(bytes, at, 1)?[0] != 0)),
        DataType::Int8 => ScalarValue::Int8(Some(int(i64_at(at)?)?)),
        DataType::Int16 => ScalarValue::Int16(Some(int(i64_at(at)?)?)),
        DataType::Int32 => ScalarValue::Int32(Some(int(i64_at(at)?)?)),
        DataType::Int64 => ScalarValue::Int64(Some(i64_at(at)?)),
        DataType::UInt8 => ScalarValue::UInt8(Some(int(u64::from_le_bytes(take8(bytes, at)?))?)),
        DataType::UInt16 => ScalarValue::UInt16(Some(int(u64::from_le_bytes(take8(bytes, at)?))?)),
        DataType::UInt32 => ScalarValue::UInt32(Some(int(u64::from_le_bytes(take8(bytes, at)?))?)),
        DataType::UInt64 => ScalarValue::UInt64(Some(u64::from_le_bytes(take8(bytes, at)?))),
        DataType::Float32 => ScalarValue::Float32(Some(f64::from_bits(u64::from_le_bytes(take8(
            bytes, at,
        )?)) as f32)),
        DataType::Float64 => {
            ScalarValue::Float64(Some(f64::from_bits(u64::from_le_bytes(take8(bytes, at)?))))
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let len = u64::from_le_bytes(take8(bytes, at)?) as usize;
            let s = std::str::from_utf8(take(bytes, at, len)?)
                .map_err(|e| format!("a string value is not UTF-8: {e}"))?
                .to_string();
            match dt {
                DataType::Utf8 => ScalarValue::Utf8(Some(s)),
                DataType::LargeUtf8 => ScalarValue::LargeUtf8(Some(s)),
                _ => ScalarValue::Utf8View(Some(s)),
            }
        }
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            let len = u64::from_le_bytes(take8(bytes, at)?) as usize;
            let b = take(bytes, at, len)?.to_vec();
            match dt {
                DataType::Binary => ScalarValue::Binary(Some(b)),
                DataType::LargeBinary => ScalarValue::LargeBinary(Some(b)),
                _ => ScalarValue::BinaryView(Some(b)),
            }
        }
        DataType::Date32 => ScalarValue::Date32(Some(int(i64_at(at)?)?)),
        DataType::Date64 => ScalarValue::Date64(Some(i64_at(at)?)),
        DataType::Timestamp(unit, tz) => {
            let v = Some(i64_at(at)?);
            let tz = tz.clone();
            match unit {
                TimeUnit::Second => ScalarValue::TimestampSecond(v, tz),
                TimeUnit::Millisecond => ScalarValue::TimestampMillisecond(v, tz),
                TimeUnit::Microsecond => ScalarValue::TimestampMicrosecond(v, tz),
                TimeUnit::Nanosecond => ScalarValue::TimestampNanosecond(v, tz),
            }
        }
        DataType::Decimal128(p, s) => {
            let b: [u8; 16] = take(bytes, at, 16)?
                .try_into()
                .map_err(|_| "a decimal value is not 16 bytes".to_string())?;
            ScalarValue::Decimal128(Some(i128::from_le_bytes(b)), *p, *s)
        }
        other => return Err(format!("type {other} is not stored in state")),
    })
}

fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], String> {
    let end = at
        .checked_add(n)
        .filter(|e| *e <= bytes.len())
        .ok_or_else(|| format!("{} bytes end at {}, {n} more wanted", bytes.len(), *at))?;
    let out = &bytes[*at..end];
    *at = end;
    Ok(out)
}

fn take8(bytes: &[u8], at: &mut usize) -> Result<[u8; 8], String> {
    take(bytes, at, 8)?
        .try_into()
        .map_err(|_| "not 8 bytes".to_string())
}

fn int<T: TryFrom<V>, V: Copy + std::fmt::Display>(v: V) -> Result<T, String> {
    T::try_from(v).map_err(|_| format!("{v} does not fit the column's type"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, Int64Array, StringArray};
    use std::sync::Arc;

    fn key(cols: &[ArrayRef], row: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in cols {
            encode_value(&mut out, c, row);
        }
        out
    }

    #[test]
    fn values_decode_to_what_was_encoded() {
        let values = [
            ScalarValue::Int32(Some(-7)),
            ScalarValue::Int64(None),
            ScalarValue::UInt16(Some(9)),
            ScalarValue::Float64(Some(2.5)),
            ScalarValue::Utf8(Some("ü [1]".into())),
            ScalarValue::Boolean(Some(true)),
            ScalarValue::TimestampMicrosecond(Some(1_700_000_000_123_456), Some("UTC".into())),
            ScalarValue::Decimal128(Some(-12345), 10, 2),
            ScalarValue::Date32(Some(19000)),
        ];
        let mut out = Vec::new();
        for v in &values {
            encode_scalar(&mut out, v).unwrap();
        }
        let mut at = 0;
        for v in &values {
            assert_eq!(&decode_value(&out, &mut at, &v.data_type()).unwrap(), v);
        }
        assert_eq!(at, out.len());
        assert!(decode_value(&out[..3], &mut 0, &DataType::Int64).is_err());
        assert!(decode_value(&[1, 0, 1], &mut 0, &DataType::Int8).is_err());
    }

    #[test]
    fn keys_tell_nulls_strings_and_floats_apart_as_spark_groups_them() {
        let s: ArrayRef = Arc::new(StringArray::from(vec![
            Some("ab"),
            Some("a"),
            None,
            Some(""),
        ]));
        let t: ArrayRef = Arc::new(StringArray::from(vec![Some("c"), Some("bc"), None, None]));
        // ("ab","c") and ("a","bc") concatenate alike but are different keys.
        assert_ne!(
            key(&[s.clone(), t.clone()], 0),
            key(&[s.clone(), t.clone()], 1)
        );
        // NULL and the empty string differ.
        assert_ne!(
            key(std::slice::from_ref(&s), 2),
            key(std::slice::from_ref(&s), 3)
        );
        let f: ArrayRef = Arc::new(Float64Array::from(vec![0.0, -0.0, f64::NAN, -f64::NAN]));
        assert_eq!(
            key(std::slice::from_ref(&f), 0),
            key(std::slice::from_ref(&f), 1)
        );
        assert_eq!(
            key(std::slice::from_ref(&f), 2),
            key(std::slice::from_ref(&f), 3)
        );
        // The layout is fixed: an i64 key is its marker and 8 little-endian bytes.
        let i: ArrayRef = Arc::new(Int64Array::from(vec![Some(258), None]));
        assert_eq!(
            key(std::slice::from_ref(&i), 0),
            vec![1, 2, 1, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(key(&[i], 1), vec![0]);
        assert_eq!(family(&DataType::Int32).as_deref(), Some("integer"));
        assert_eq!(
            family(&DataType::Timestamp(TimeUnit::Microsecond, None)).as_deref(),
            Some("timestamp-us")
        );
        assert_eq!(family(&DataType::Null), None);
    }
}
