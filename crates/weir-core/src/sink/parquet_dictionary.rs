//! Which columns of a Parquet part get a dictionary.
//!
//! The Parquet writer dictionary-encodes every column by default and falls back to plain
//! values once a column chunk's dictionary outgrows its page limit (1 MiB): on a column of
//! mostly distinct values (ids, timestamps, the keys a newest-per-key batch keeps) it builds
//! most of a dictionary, then throws it away, and where it keeps one the file is larger than
//! plain. Measured on the 200,000-row batches of `bench/spark_vs_weir.sh`, that was 14% of the
//! CPU of the whole run. So each part is sampled first, and the dictionary is turned off for
//! the columns whose values are mostly distinct or would overflow the page; columns of few
//! values (a status, a country) keep it.

use std::hash::BuildHasher;

use datafusion::arrow::array::{Array, ArrayData, AsArray};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::{HashMap, HashSet};
use datafusion::parquet::file::properties::{
    DEFAULT_DICTIONARY_PAGE_SIZE_LIMIT, DEFAULT_MAX_ROW_GROUP_ROW_COUNT, WriterPropertiesBuilder,
};
use datafusion::parquet::schema::types::ColumnPath;

/// Values looked at per column; the estimate's error at the thresholds is about 15% with it.
const SAMPLE: usize = 4096;

/// `props` with the dictionary turned off for the top-level columns of `batches` (one
/// part, in row groups of the writer's default size) where it would not pay: estimated
/// distinct values over half the non-null values, or a dictionary larger than the page
/// limit. Parts of at most [`SAMPLE`] rows keep the writer's default: too small for the
/// dictionary to matter.
pub(super) fn without_wasted_dictionaries(
    mut props: WriterPropertiesBuilder,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> WriterPropertiesBuilder {
    let rows = rows_of(batches);
    if rows <= SAMPLE {
        return props;
    }
    let group_rows = DEFAULT_MAX_ROW_GROUP_ROW_COUNT.min(rows);
    for (i, field) in schema.fields().iter().enumerate() {
        let columns: Vec<&dyn Array> = batches.iter().map(|b| b.column(i).as_ref()).collect();
        let Some(est) = estimate(&columns, rows) else {
            continue;
        };
        let per_group = est.distinct.min(group_rows as f64);
        if est.distinct > est.values / 2.0
            || per_group * est.width > DEFAULT_DICTIONARY_PAGE_SIZE_LIMIT as f64
        {
            props =
                props.set_column_dictionary_enabled(ColumnPath::from(field.name().as_str()), false);
        }
    }
    props
}

/// A column's estimated distinct values, non-null values and bytes per value.
#[derive(Debug)]
struct Estimate {
    distinct: f64,
    values: f64,
    width: f64,
}

/// Estimates the distinct values of one column (`columns`, one array per batch, `rows` in
/// all, more than [`SAMPLE`]) from the pairs of equal values among [`SAMPLE`] rows drawn at
/// random (the birthday count; random rather than evenly spaced, so a sorted column of
/// short runs is not taken for a distinct one). None for types the dictionary does not hold
/// as bytes (booleans, nested) and for columns of nulls.
fn estimate(columns: &[&dyn Array], rows: usize) -> Option<Estimate> {
    if !held_as_bytes(columns.first()?.data_type()) {
        return None;
    }
    let data: Vec<ArrayData> = columns.iter().map(|c| c.to_data()).collect();
    let starts: Vec<usize> = columns
        .iter()
        .scan(0, |start, c| {
            let s = *start;
            *start += c.len();
            Some(s)
        })
        .collect();
    let mut counts: HashMap<u64, u64> = HashMap::with_capacity(SAMPLE);
    let mut seen: HashSet<usize> = HashSet::with_capacity(SAMPLE);
    let hasher = counts.hasher().clone();
    let (mut tried, mut taken, mut bytes) = (0usize, 0usize, 0usize);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    // Bounded: a mostly-null column stops after 4 * SAMPLE draws.
    for _ in 0..4 * SAMPLE {
        if taken == SAMPLE {
            break;
        }
        x = splitmix(x);
        let i = (x % rows as u64) as usize;
        if !seen.insert(i) {
            continue;
        }
        tried += 1;
        let c = starts.partition_point(|&s| s <= i) - 1;
        let (column, row) = (columns[c], i - starts[c]);
        if column.is_null(row) {
            continue;
        }
        if let Some((hash, len)) = value_hash(column, &data[c], row, &hasher) {
            *counts.entry(hash).or_default() += 1;
            taken += 1;
            bytes += len;
        }
    }
    if taken < 2 {
        return None;
    }
    let values = rows as f64 * taken as f64 / tried as f64;
    // P(two rows hold the same value) = (rows/D - 1) / (rows - 1) for D equally common
    // values: solved for D with the sample's share of equal pairs.
    let pairs: f64 = counts.values().map(|&m| (m * (m - 1) / 2) as f64).sum();
    let all = (taken * (taken - 1) / 2) as f64;
    Some(Estimate {
        distinct: values / (1.0 + pairs / all * (values - 1.0).max(0.0)),
        values,
        width: bytes as f64 / taken as f64,
    })
}

fn held_as_bytes(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    ) || t.primitive_width().is_some()
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hash of value `row` of `column` (`data` its data) and its size in a dictionary page
/// (plain: the bytes, and a 4-byte length for byte arrays); None for types the dictionary
/// does not hold so.
fn value_hash(
    column: &dyn Array,
    data: &ArrayData,
    row: usize,
    hasher: &impl BuildHasher,
) -> Option<(u64, usize)> {
    let bytes = |b: &[u8], extra: usize| Some((hasher.hash_one(b), b.len() + extra));
    match column.data_type() {
        DataType::Utf8 => bytes(column.as_string::<i32>().value(row).as_bytes(), 4),
        DataType::LargeUtf8 => bytes(column.as_string::<i64>().value(row).as_bytes(), 4),
        DataType::Utf8View => bytes(column.as_string_view().value(row).as_bytes(), 4),
        DataType::Binary => bytes(column.as_binary::<i32>().value(row), 4),
        DataType::LargeBinary => bytes(column.as_binary::<i64>().value(row), 4),
        DataType::BinaryView => bytes(column.as_binary_view().value(row), 4),
        t => {
            let width = t.primitive_width()?;
            let values = data.buffers().first()?.as_slice();
            let from = (data.offset() + row) * width;
            bytes(values.get(from..from + width)?, 0)
        }
    }
}

/// The rows of `batches`.
pub(super) fn rows_of(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, Int64Array, StringArray};
    use datafusion::arrow::datatypes::{Field, Schema};
    use datafusion::parquet::file::properties::WriterProperties;
    use std::sync::Arc;

    fn dictionary(props: &WriterProperties, column: &str) -> bool {
        props.dictionary_enabled(&ColumnPath::from(column))
    }

    /// Ids lose the dictionary; a status of five values, a sorted column of short runs and
    /// one of long runs keep it, split over batches and with nulls; so do small parts.
    #[test]
    fn the_dictionary_stays_where_values_repeat() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("status", DataType::Utf8, true),
            Field::new("runs_of_4", DataType::Int64, false),
            Field::new("runs_of_1000", DataType::Int64, false),
            Field::new("flag", DataType::Boolean, false),
        ]));
        let batch = |from: usize, n: usize| {
            let rows = from..from + n;
            let cols: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from_iter(
                    rows.clone().map(|i| (i % 17 != 0).then_some(i as i64 * 7)),
                )),
                Arc::new(StringArray::from_iter(rows.clone().map(|i| {
                    (i % 9 != 0).then(|| ["new", "paid", "sent", "done", "void"][i % 5])
                }))),
                Arc::new(Int64Array::from_iter_values(
                    rows.clone().map(|i| (i / 4) as i64),
                )),
                Arc::new(Int64Array::from_iter_values(
                    rows.clone().map(|i| (i / 1000) as i64),
                )),
                Arc::new(datafusion::arrow::array::BooleanArray::from_iter(
                    rows.map(|i| Some(i % 2 == 0)),
                )),
            ];
            RecordBatch::try_new(schema.clone(), cols).unwrap()
        };
        for sizes in [
            vec![30_000],
            vec![70_000, 0, 130_000],
            vec![10],
            vec![4000, 96],
        ] {
            let mut from = 0;
            let batches: Vec<RecordBatch> = sizes
                .iter()
                .map(|&n| {
                    let b = batch(from, n);
                    from += n;
                    b
                })
                .collect();
            let props =
                without_wasted_dictionaries(WriterProperties::builder(), &schema, &batches).build();
            // Small parts keep the writer's default.
            assert_eq!(dictionary(&props, "id"), from <= SAMPLE, "{sizes:?}");
            assert!(dictionary(&props, "status"), "{sizes:?}");
            assert!(dictionary(&props, "flag"), "{sizes:?}");
            assert!(dictionary(&props, "runs_of_1000"), "{sizes:?}");
            // A quarter as many values as rows, sorted: an evenly spaced sample would see
            // every value once.
            assert!(dictionary(&props, "runs_of_4"), "{sizes:?}");
        }
        // Mostly distinct within a row group of 10,000 of 30,000 rows, and 10,000 values
        // of 200 bytes (2 MB) overflow the page.
        let wide: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..30_000).map(|i| format!("{:0200}", i % 10_000)),
        ));
        let schema = Arc::new(Schema::new(vec![Field::new("wide", DataType::Utf8, false)]));
        let b = RecordBatch::try_new(schema.clone(), vec![wide]).unwrap();
        let props = without_wasted_dictionaries(
            WriterProperties::builder(),
            &schema,
            std::slice::from_ref(&b),
        )
        .build();
        assert!(!dictionary(&props, "wide"));
        let short: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..30_000).map(|i| format!("{}", i % 10_000)),
        ));
        let b = RecordBatch::try_new(schema.clone(), vec![short]).unwrap();
        let props = without_wasted_dictionaries(WriterProperties::builder(), &schema, &[b]).build();
        assert!(dictionary(&props, "wide"));
    }

    /// The estimate is near the truth for uniform and skewed columns.
    #[test]
    fn the_estimate_is_close() {
        for (distinct, rows) in [
            (1_000usize, 200_000usize),
            (50_000, 200_000),
            (150_000, 200_000),
        ] {
            let a = Int64Array::from_iter_values((0..rows).map(|i| ((i * 7919) % distinct) as i64));
            let est = estimate(&[&a], rows).unwrap();
            let err = (est.distinct - distinct as f64).abs() / distinct as f64;
            assert!(err < 0.25, "{distinct}: {est:?}");
            assert_eq!(est.width, 8.0);
        }
        let all_null = Int64Array::from(vec![None::<i64>; 10_000]);
        assert!(estimate(&[&all_null], 10_000).is_none());
    }
}
