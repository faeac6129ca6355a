//! Arrow columns as PostgreSQL values for binary COPY.

use std::error::Error as StdError;

use bytes::{BufMut, BytesMut};
use chrono::{DateTime, NaiveDate, NaiveDateTime};
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use weir_core::datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BooleanArray, Date32Array, Decimal128Array,
    LargeBinaryArray, LargeStringArray, StringArray,
};
use weir_core::datafusion::arrow::datatypes::{
    DataType, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, TimeUnit,
    UInt8Type, UInt16Type, UInt32Type,
};

/// The PostgreSQL type for an Arrow type, and its SQL spelling; `None`: unsupported.
pub fn pg_type(dt: &DataType) -> Option<(Type, String)> {
    Some(match dt {
        DataType::Utf8 | DataType::LargeUtf8 => (Type::TEXT, "text".into()),
        DataType::Int8 | DataType::Int16 | DataType::UInt8 => (Type::INT2, "smallint".into()),
        DataType::Int32 | DataType::UInt16 => (Type::INT4, "integer".into()),
        DataType::Int64 | DataType::UInt32 => (Type::INT8, "bigint".into()),
        DataType::Float32 => (Type::FLOAT4, "real".into()),
        DataType::Float64 => (Type::FLOAT8, "double precision".into()),
        DataType::Boolean => (Type::BOOL, "boolean".into()),
        DataType::Date32 => (Type::DATE, "date".into()),
        DataType::Timestamp(_, Some(_)) => (Type::TIMESTAMPTZ, "timestamptz".into()),
        DataType::Timestamp(_, None) => (Type::TIMESTAMP, "timestamp".into()),
        DataType::Decimal128(p, s) => (Type::NUMERIC, format!("numeric({p},{s})")),
        DataType::Binary | DataType::LargeBinary => (Type::BYTEA, "bytea".into()),
        _ => return None,
    })
}

/// One cell, ready for `BinaryCopyInWriter`.
#[derive(Debug)]
pub enum Cell {
    Null,
    Text(String),
    I16(i16),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Date(NaiveDate),
    Ts(NaiveDateTime),
    TsTz(DateTime<chrono::Utc>),
    Numeric { value: i128, scale: i8 },
    Bytes(Vec<u8>),
}

/// The cell at `row` of `col`. The column's type was checked with [`pg_type`] first.
pub fn cell(col: &ArrayRef, row: usize) -> Cell {
    if col.is_null(row) {
        return Cell::Null;
    }
    match col.data_type() {
        DataType::Utf8 => col
            .as_any()
            .downcast_ref::<StringArray>()
            .map_or(Cell::Null, |a| Cell::Text(a.value(row).to_string())),
        DataType::LargeUtf8 => col
            .as_any()
            .downcast_ref::<LargeStringArray>()
            .map_or(Cell::Null, |a| Cell::Text(a.value(row).to_string())),
        DataType::Int8 => Cell::I16(col.as_primitive::<Int8Type>().value(row).into()),
        DataType::Int16 => Cell::I16(col.as_primitive::<Int16Type>().value(row)),
        DataType::UInt8 => Cell::I16(col.as_primitive::<UInt8Type>().value(row).into()),
        DataType::Int32 => Cell::I32(col.as_primitive::<Int32Type>().value(row)),
        DataType::UInt16 => Cell::I32(col.as_primitive::<UInt16Type>().value(row).into()),
        DataType::Int64 => Cell::I64(col.as_primitive::<Int64Type>().value(row)),
        DataType::UInt32 => Cell::I64(col.as_primitive::<UInt32Type>().value(row).into()),
        DataType::Float32 => Cell::F32(col.as_primitive::<Float32Type>().value(row)),
        DataType::Float64 => Cell::F64(col.as_primitive::<Float64Type>().value(row)),
        DataType::Boolean => col
            .as_any()
            .downcast_ref::<BooleanArray>()
            .map_or(Cell::Null, |a| Cell::Bool(a.value(row))),
        DataType::Date32 => col
            .as_any()
            .downcast_ref::<Date32Array>()
            .and_then(|a| a.value_as_date(row))
            .map_or(Cell::Null, Cell::Date),
        DataType::Timestamp(unit, tz) => {
            let micros = timestamp_micros(col, unit, row);
            match DateTime::from_timestamp_micros(micros) {
                Some(t) if tz.is_some() => Cell::TsTz(t),
                Some(t) => Cell::Ts(t.naive_utc()),
                None => Cell::Null,
            }
        }
        DataType::Decimal128(_, s) => {
            col.as_any()
                .downcast_ref::<Decimal128Array>()
                .map_or(Cell::Null, |a| Cell::Numeric {
                    value: a.value(row),
                    scale: *s,
                })
        }
        DataType::Binary => col
            .as_any()
            .downcast_ref::<BinaryArray>()
            .map_or(Cell::Null, |a| Cell::Bytes(a.value(row).to_vec())),
        DataType::LargeBinary => col
            .as_any()
            .downcast_ref::<LargeBinaryArray>()
            .map_or(Cell::Null, |a| Cell::Bytes(a.value(row).to_vec())),
        _ => Cell::Null,
    }
}

fn timestamp_micros(col: &ArrayRef, unit: &TimeUnit, row: usize) -> i64 {
    use weir_core::datafusion::arrow::datatypes::{
        TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
        TimestampSecondType,
    };
    match unit {
        TimeUnit::Second => col
            .as_primitive::<TimestampSecondType>()
            .value(row)
            .saturating_mul(1_000_000),
        TimeUnit::Millisecond => col
            .as_primitive::<TimestampMillisecondType>()
            .value(row)
            .saturating_mul(1000),
        TimeUnit::Microsecond => col.as_primitive::<TimestampMicrosecondType>().value(row),
        TimeUnit::Nanosecond => col.as_primitive::<TimestampNanosecondType>().value(row) / 1000,
    }
}

impl ToSql for Cell {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        match self {
            Cell::Null => Ok(IsNull::Yes),
            Cell::Text(v) => v.to_sql(ty, out),
            Cell::I16(v) => v.to_sql(ty, out),
            Cell::I32(v) => v.to_sql(ty, out),
            Cell::I64(v) => v.to_sql(ty, out),
            Cell::F32(v) => v.to_sql(ty, out),
            Cell::F64(v) => v.to_sql(ty, out),
            Cell::Bool(v) => v.to_sql(ty, out),
            Cell::Date(v) => v.to_sql(ty, out),
            Cell::Ts(v) => v.to_sql(ty, out),
            Cell::TsTz(v) => v.to_sql(ty, out),
            Cell::Bytes(v) => v.to_sql(ty, out),
            Cell::Numeric { value, scale } => {
                write_numeric(*value, *scale, out);
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// PostgreSQL's binary NUMERIC: ndigits, weight, sign, dscale, then base-10000 digits.
pub fn write_numeric(value: i128, scale: i8, out: &mut BytesMut) {
    let scale = scale.max(0) as usize;
    let negative = value < 0;
    let digits = value.unsigned_abs().to_string();
    let (int_part, frac_part) = if digits.len() > scale {
        let (i, f) = digits.split_at(digits.len() - scale);
        (i.to_string(), f.to_string())
    } else {
        (String::new(), format!("{digits:0>scale$}"))
    };
    let int_pad = (4 - int_part.len() % 4) % 4;
    let int_s = format!("{}{int_part}", "0".repeat(int_pad));
    let frac_pad = (4 - frac_part.len() % 4) % 4;
    let frac_s = format!("{frac_part}{}", "0".repeat(frac_pad));
    let group = |s: &str| -> Vec<i16> {
        s.as_bytes()
            .chunks(4)
            .map(|c| c.iter().fold(0i16, |acc, d| acc * 10 + i16::from(d - b'0')))
            .collect()
    };
    let int_groups = group(&int_s);
    let frac_groups = group(&frac_s);
    let mut weight = int_groups.len() as i16 - 1;
    let mut all: Vec<i16> = int_groups.into_iter().chain(frac_groups).collect();
    while all.first() == Some(&0) {
        all.remove(0);
        weight -= 1;
    }
    while all.last() == Some(&0) {
        all.pop();
    }
    if all.is_empty() {
        weight = 0;
    }
    out.put_i16(all.len() as i16);
    out.put_i16(weight);
    out.put_u16(if negative && !all.is_empty() {
        0x4000
    } else {
        0
    });
    out.put_u16(scale as u16);
    for d in all {
        out.put_i16(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: i128, s: i8) -> Vec<i16> {
        let mut b = BytesMut::new();
        write_numeric(v, s, &mut b);
        b.chunks(2)
            .map(|c| i16::from_be_bytes([c[0], c[1]]))
            .collect()
    }

    #[test]
    fn numeric_encoding_matches_postgres_binary_format() {
        // 12345.67 -> digits [1, 2345, 6700], weight 1, dscale 2
        assert_eq!(enc(1_234_567, 2), vec![3, 1, 0, 2, 1, 2345, 6700]);
        // -0.05 -> digits [500], weight -1
        assert_eq!(enc(-5, 2), vec![1, -1, 0x4000, 2, 500]);
        // 0 -> no digits
        assert_eq!(enc(0, 3), vec![0, 0, 0, 3]);
        // 10000 -> [1], weight 1
        assert_eq!(enc(10_000, 0), vec![1, 1, 0, 0, 1]);
    }
}
