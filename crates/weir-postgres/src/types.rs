//! Arrow columns as PostgreSQL values for binary COPY and bind parameters.
//!
//! Every value is written exactly or the batch is refused before anything is written,
//! naming the column: [`prepare_columns`] checks the types and values of a whole batch
//! first (timestamps outside PostgreSQL's range, sub-microsecond timestamps, ...), so the
//! per-row encoding cannot fail or fall back to NULL.

use std::error::Error as StdError;

use bytes::{BufMut, BytesMut};
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use weir_core::datafusion::arrow::array::{Array, ArrayRef, AsArray};
use weir_core::datafusion::arrow::compute::cast;
use weir_core::datafusion::arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, Float32Type, Float64Type, Int8Type,
    Int16Type, Int32Type, Int64Type, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type, UInt32Type,
};

/// µs between 1970-01-01 and 2000-01-01 (PostgreSQL's epoch).
const PG_EPOCH_US: i64 = 946_684_800_000_000;
/// The earliest timestamp PostgreSQL stores (4714-11-24 BC), in µs since 1970.
const PG_MIN_TS_US: i64 = -211_813_488_000_000_000 + PG_EPOCH_US;
/// Days between 1970-01-01 and 2000-01-01.
const PG_EPOCH_DAYS: i32 = 10_957;

/// The PostgreSQL type for an Arrow type, and its SQL spelling; `None`: unsupported.
pub fn pg_type(dt: &DataType) -> Option<(Type, String)> {
    Some(match dt {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => (Type::TEXT, "text".into()),
        DataType::Int8 | DataType::Int16 | DataType::UInt8 => (Type::INT2, "smallint".into()),
        DataType::Int32 | DataType::UInt16 => (Type::INT4, "integer".into()),
        DataType::Int64 | DataType::UInt32 => (Type::INT8, "bigint".into()),
        DataType::Float32 => (Type::FLOAT4, "real".into()),
        DataType::Float64 => (Type::FLOAT8, "double precision".into()),
        DataType::Boolean => (Type::BOOL, "boolean".into()),
        DataType::Date32 | DataType::Date64 => (Type::DATE, "date".into()),
        DataType::Timestamp(_, Some(_)) => (Type::TIMESTAMPTZ, "timestamptz".into()),
        DataType::Timestamp(_, None) => (Type::TIMESTAMP, "timestamp".into()),
        // A negative scale means trailing zeros: numeric(p - s, 0) holds the value exactly.
        DataType::Decimal128(p, s) if *s < 0 => (
            Type::NUMERIC,
            format!("numeric({},0)", *p as i16 - *s as i16),
        ),
        DataType::Decimal128(p, s) => (Type::NUMERIC, format!("numeric({p},{s})")),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            (Type::BYTEA, "bytea".into())
        }
        DataType::Dictionary(_, v) => return pg_type(v),
        _ => return None,
    })
}

/// A column in a form [`cell`] reads: dictionaries decoded, views as plain arrays.
fn normalize(col: &ArrayRef) -> Result<ArrayRef, String> {
    let target = match col.data_type() {
        DataType::Dictionary(_, v) => Some(v.as_ref().clone()),
        DataType::Utf8View => Some(DataType::Utf8),
        DataType::BinaryView => Some(DataType::Binary),
        _ => None,
    };
    let col = match target {
        Some(t) => cast(col, &t).map_err(|e| e.to_string())?,
        None => col.clone(),
    };
    match col.data_type() {
        DataType::Utf8View => cast(&col, &DataType::Utf8).map_err(|e| e.to_string()),
        DataType::BinaryView => cast(&col, &DataType::Binary).map_err(|e| e.to_string()),
        _ => Ok(col),
    }
}

/// A timestamp column as µs since 1970, checking that every value fits PostgreSQL exactly.
fn timestamp_micros(col: &ArrayRef, unit: &TimeUnit) -> Result<Vec<Option<i64>>, String> {
    let mut out = Vec::with_capacity(col.len());
    for i in 0..col.len() {
        if col.is_null(i) {
            out.push(None);
            continue;
        }
        let us = match unit {
            TimeUnit::Second => col
                .as_primitive::<TimestampSecondType>()
                .value(i)
                .checked_mul(1_000_000),
            TimeUnit::Millisecond => col
                .as_primitive::<TimestampMillisecondType>()
                .value(i)
                .checked_mul(1000),
            TimeUnit::Microsecond => Some(col.as_primitive::<TimestampMicrosecondType>().value(i)),
            TimeUnit::Nanosecond => {
                let ns = col.as_primitive::<TimestampNanosecondType>().value(i);
                if ns % 1000 != 0 {
                    return Err(format!(
                        "row {i} has nanoseconds ({ns} ns since 1970); PostgreSQL keeps \
                         microseconds: truncate the column to microseconds in the query"
                    ));
                }
                Some(ns / 1000)
            }
        };
        match us {
            Some(us) if us >= PG_MIN_TS_US => out.push(Some(us)),
            _ => {
                return Err(format!(
                    "row {i} is outside PostgreSQL's timestamp range (4714 BC to 294276 AD)"
                ));
            }
        }
    }
    Ok(out)
}

/// A batch's columns, checked and ready for [`cell`].
#[derive(Debug)]
pub(crate) struct CopyRows {
    cols: Vec<Col>,
    rows: usize,
}

#[derive(Debug)]
enum Col {
    Plain(ArrayRef),
    /// µs since 1970, checked against PostgreSQL's range.
    Micros(Vec<Option<i64>>),
}

/// Checks and converts every column of a batch; the error names the column and the row.
pub(crate) fn prepare_columns(
    columns: &[ArrayRef],
    names: &[String],
) -> Result<CopyRows, (String, String)> {
    let rows = columns.first().map_or(0, |c| c.len());
    let mut cols = Vec::with_capacity(columns.len());
    for (c, name) in columns.iter().zip(names) {
        let c = normalize(c).map_err(|e| (name.clone(), e))?;
        cols.push(match c.data_type().clone() {
            DataType::Timestamp(unit, _) => {
                Col::Micros(timestamp_micros(&c, &unit).map_err(|e| (name.clone(), e))?)
            }
            dt if pg_type(&dt).is_some() => Col::Plain(c),
            dt => return Err((name.clone(), format!("type {dt} cannot be written"))),
        });
    }
    Ok(CopyRows { cols, rows })
}

impl CopyRows {
    /// The number of rows.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The cells of row `row`.
    pub(crate) fn row(&self, row: usize) -> Vec<Cell<'_>> {
        self.cols.iter().map(|c| cell(c, row)).collect()
    }

    /// Appends row `row` as a binary COPY tuple (field count, then each field's length and
    /// bytes) with `extra` after the batch's cells; `types` holds one type per field. The
    /// error gives the field's index and why.
    pub(crate) fn put_copy_row(
        &self,
        row: usize,
        types: &[Type],
        extra: &[Cell<'_>],
        out: &mut BytesMut,
    ) -> Result<(), (usize, String)> {
        let fields = self.cols.len() + extra.len();
        out.put_i16(i16::try_from(fields).map_err(|_| (0, "more than 32,767 columns".into()))?);
        let cells = self
            .cols
            .iter()
            .map(|c| cell(c, row))
            .chain(extra.iter().copied());
        for (i, (c, ty)) in cells.zip(types).enumerate() {
            let at = out.len();
            out.put_i32(0);
            match c.to_sql(ty, out).map_err(|e| (i, e.to_string()))? {
                IsNull::Yes => {
                    out.truncate(at);
                    out.put_i32(-1);
                }
                IsNull::No => {
                    let n = i32::try_from(out.len() - at - 4)
                        .map_err(|_| (i, "a value longer than 2 GiB".to_string()))?;
                    out[at..at + 4].copy_from_slice(&n.to_be_bytes());
                }
            }
        }
        Ok(())
    }
}

/// The start of binary COPY data: signature, flags, header extension length.
pub(crate) const COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
/// The end of binary COPY data: a field count of -1.
pub(crate) const COPY_TRAILER: &[u8] = &[0xff, 0xff];

/// One cell, ready for binary COPY or a bind parameter.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cell<'a> {
    Null,
    Text(&'a str),
    I16(i16),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    /// Days since 1970.
    Date(i32),
    /// µs since 1970 (timestamp and timestamptz are encoded alike).
    Ts(i64),
    Numeric {
        value: i128,
        scale: i8,
    },
    Bytes(&'a [u8]),
}

fn cell(c: &Col, row: usize) -> Cell<'_> {
    let col = match c {
        Col::Micros(v) => {
            return v.get(row).copied().flatten().map_or(Cell::Null, Cell::Ts);
        }
        Col::Plain(a) => a,
    };
    if col.is_null(row) {
        return Cell::Null;
    }
    // The type was checked by prepare_columns: every arm below matches its array.
    match col.data_type() {
        DataType::Utf8 => Cell::Text(col.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => Cell::Text(col.as_string::<i64>().value(row)),
        DataType::Int8 => Cell::I16(col.as_primitive::<Int8Type>().value(row).into()),
        DataType::Int16 => Cell::I16(col.as_primitive::<Int16Type>().value(row)),
        DataType::UInt8 => Cell::I16(col.as_primitive::<UInt8Type>().value(row).into()),
        DataType::Int32 => Cell::I32(col.as_primitive::<Int32Type>().value(row)),
        DataType::UInt16 => Cell::I32(col.as_primitive::<UInt16Type>().value(row).into()),
        DataType::Int64 => Cell::I64(col.as_primitive::<Int64Type>().value(row)),
        DataType::UInt32 => Cell::I64(col.as_primitive::<UInt32Type>().value(row).into()),
        DataType::Float32 => Cell::F32(col.as_primitive::<Float32Type>().value(row)),
        DataType::Float64 => Cell::F64(col.as_primitive::<Float64Type>().value(row)),
        DataType::Boolean => Cell::Bool(col.as_boolean().value(row)),
        DataType::Date32 => Cell::Date(col.as_primitive::<Date32Type>().value(row)),
        DataType::Date64 => {
            Cell::Date((col.as_primitive::<Date64Type>().value(row) / 86_400_000) as i32)
        }
        DataType::Decimal128(_, s) => Cell::Numeric {
            value: col.as_primitive::<Decimal128Type>().value(row),
            scale: *s,
        },
        DataType::Binary => Cell::Bytes(col.as_binary::<i32>().value(row)),
        DataType::LargeBinary => Cell::Bytes(col.as_binary::<i64>().value(row)),
        _ => Cell::Null,
    }
}

impl ToSql for Cell<'_> {
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
            Cell::Bytes(v) => v.to_sql(ty, out),
            Cell::Date(days) => {
                out.put_i32(days - PG_EPOCH_DAYS);
                Ok(IsNull::No)
            }
            Cell::Ts(us) => {
                out.put_i64(us - PG_EPOCH_US);
                Ok(IsNull::No)
            }
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
/// A negative `scale` means `value * 10^-scale` (written with scale 0, exactly).
pub(crate) fn write_numeric(value: i128, scale: i8, out: &mut BytesMut) {
    let negative = value < 0;
    let mut digits = value.unsigned_abs().to_string();
    let scale = if scale < 0 {
        if value != 0 {
            digits.push_str(&"0".repeat(scale.unsigned_abs() as usize));
        }
        0
    } else {
        scale as usize
    };
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

/// Whether a column's values are compared as text (with `COLLATE "C"`, byte order, like
/// Arrow's) in the upsert guard.
pub(crate) fn is_text(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    ) || matches!(dt, DataType::Dictionary(_, v) if is_text(v))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use weir_core::datafusion::arrow::array::{TimestampNanosecondArray, TimestampSecondArray};

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
        // 123 with scale -2 is 12300 -> [1, 2300], weight 1, dscale 0
        assert_eq!(enc(123, -2), vec![2, 1, 0, 0, 1, 2300]);
        assert_eq!(enc(-7, -3), vec![1, 0, 0x4000, 0, 7000]);
    }

    #[test]
    fn timestamps_outside_postgres_or_below_a_microsecond_are_refused_naming_the_column() {
        let names = vec!["t".to_string()];
        let ok: ArrayRef = Arc::new(TimestampNanosecondArray::from(vec![Some(1_000), None]));
        assert!(prepare_columns(&[ok], &names).is_ok());
        let ns: ArrayRef = Arc::new(TimestampNanosecondArray::from(vec![1_001]));
        let (col, why) = prepare_columns(&[ns], &names).err().unwrap();
        assert_eq!(col, "t");
        assert!(why.contains("nanoseconds"), "{why}");
        let old: ArrayRef = Arc::new(TimestampSecondArray::from(vec![-300_000_000_000]));
        let (_, why) = prepare_columns(&[old], &names).err().unwrap();
        assert!(
            why.contains("outside PostgreSQL's timestamp range"),
            "{why}"
        );
        let far: ArrayRef = Arc::new(TimestampSecondArray::from(vec![i64::MAX]));
        assert!(prepare_columns(&[far], &names).is_err());
    }
}
