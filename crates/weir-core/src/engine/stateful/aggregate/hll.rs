//! Spark's `approx_count_distinct` as a HyperLogLog++ sketch per group: registers built
//! from a batch's rows, merged into the state by their maximum, estimated when a row is
//! output.
//!
//! [`Sketch::Spark`] is Spark's own HLL++ (`HyperLogLogPlusPlusHelper`): each value hashed
//! with XXH64 and seed 42 as Spark hashes its type (an 8-byte long for bigint and
//! timestamps, a 4-byte int for int, smaller ints, dates and booleans, the UTF-8 bytes of a
//! string, doubles with -0.0 as 0.0 and one NaN), 512 registers, and Spark's estimate
//! (linear counting below its threshold, else the raw estimate less the bias interpolated
//! from its table by the 6 nearest raw estimates). A query moved from Spark gets Spark's
//! numbers (a test holds PySpark 4.3.0's). [`Sketch::Legacy`] is what weir kept before
//! (FNV-1a and SplitMix64 over weir's key encoding, plain HLL): state written with it keeps
//! it, since registers of two hashes do not merge.

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::datatypes::{
    DataType, Date32Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
    TimeUnit, TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType,
};
use datafusion::arrow::record_batch::RecordBatch;

use super::super::keys::encode_value;
use super::hll_tables::{BIASES_P9, RAW_ESTIMATES_P9, THRESHOLD_P9};

/// How an operator's sketches hash and estimate: recorded as `_metadata/sketch` when its
/// state is first written (no such file: state written before, [`Sketch::Legacy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(in crate::engine::stateful) enum Sketch {
    Spark,
    Legacy,
}

/// `_metadata/sketch` of an aggregation whose state uses [`Sketch::Spark`].
pub(in crate::engine::stateful) const SPARK_SKETCH: &str = "spark-hll++ xxhash64 seed 42";

/// Where a state slot's value for a batch comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum SlotSource {
    /// This column of DataFusion's partial results (after the group columns).
    Partial(usize),
    /// A sketch of this column of the expanded batch.
    Sketch(usize),
}

/// HyperLogLog with 2^9 registers: Spark's default precision for `approx_count_distinct`
/// (relative standard deviation 0.05).
const HLL_BITS: u32 = 9;
pub(super) const HLL_REGISTERS: usize = 1 << HLL_BITS;

/// For each group of the expanded batch (its state key), the registers of each sketched
/// slot, in slot order.
pub(super) fn sketch_rows(
    batch: &RecordBatch,
    groups: usize,
    windowed: bool,
    sources: &[SlotSource],
    sketch: Sketch,
) -> std::collections::HashMap<Vec<u8>, Vec<Vec<u8>>> {
    let sketched: Vec<usize> = sources
        .iter()
        .filter_map(|s| match s {
            SlotSource::Sketch(c) => Some(*c),
            SlotSource::Partial(_) => None,
        })
        .collect();
    let mut out: std::collections::HashMap<Vec<u8>, Vec<Vec<u8>>> = Default::default();
    if sketched.is_empty() {
        return out;
    }
    let mut key = Vec::new();
    let mut value = Vec::new();
    for row in 0..batch.num_rows() {
        key.clear();
        if windowed {
            encode_value(&mut key, batch.column(groups), row);
        }
        for g in 0..groups {
            encode_value(&mut key, batch.column(g), row);
        }
        let regs = out
            .entry(key.clone())
            .or_insert_with(|| vec![vec![0; HLL_REGISTERS]; sketched.len()]);
        for (n, c) in sketched.iter().enumerate() {
            let col = batch.column(*c);
            if col.is_null(row) {
                continue;
            }
            let h = match sketch {
                Sketch::Spark => spark_hash(col, row, &mut value),
                Sketch::Legacy => {
                    value.clear();
                    encode_value(&mut value, col, row);
                    legacy_hash(&value)
                }
            };
            let idx = (h >> (64 - HLL_BITS)) as usize;
            let rank = ((h << HLL_BITS) | (1 << (HLL_BITS - 1))).leading_zeros() as u8 + 1;
            regs[n][idx] = regs[n][idx].max(rank);
        }
    }
    out
}

/// Spark's `XxHash64Function.hash(value, type, 42)` of row `row` of `col` (not NULL). A
/// type Spark has no counterpart for here (lists, structs, decimals) hashes weir's encoding
/// of the value (`scratch`), which Spark's numbers then do not match.
fn spark_hash(col: &ArrayRef, row: usize, scratch: &mut Vec<u8>) -> u64 {
    const SEED: u64 = 42;
    let int = |v: i32| xxh64(&v.to_le_bytes(), SEED);
    let long = |v: i64| xxh64(&v.to_le_bytes(), SEED);
    match col.data_type() {
        DataType::Int64 => long(col.as_primitive::<Int64Type>().value(row)),
        DataType::Int32 => int(col.as_primitive::<Int32Type>().value(row)),
        DataType::Int16 => int(i32::from(col.as_primitive::<Int16Type>().value(row))),
        DataType::Int8 => int(i32::from(col.as_primitive::<Int8Type>().value(row))),
        DataType::Boolean => int(i32::from(col.as_boolean().value(row))),
        DataType::Date32 => int(col.as_primitive::<Date32Type>().value(row)),
        DataType::Timestamp(unit, _) => long(match unit {
            TimeUnit::Microsecond => col.as_primitive::<TimestampMicrosecondType>().value(row),
            TimeUnit::Millisecond => col
                .as_primitive::<TimestampMillisecondType>()
                .value(row)
                .saturating_mul(1000),
            TimeUnit::Second => col
                .as_primitive::<TimestampSecondType>()
                .value(row)
                .saturating_mul(1_000_000),
            TimeUnit::Nanosecond => col
                .as_primitive::<TimestampNanosecondType>()
                .value(row)
                .div_euclid(1000),
        }),
        DataType::Float64 => {
            let d = col.as_primitive::<Float64Type>().value(row);
            // -0.0 is 0.0 (both compare equal to it), and every NaN is Java's one NaN.
            let bits = if d == 0.0 {
                0
            } else if d.is_nan() {
                0x7ff8_0000_0000_0000
            } else {
                d.to_bits() as i64
            };
            long(bits)
        }
        DataType::Float32 => {
            let f = col.as_primitive::<Float32Type>().value(row);
            let bits = if f == 0.0 {
                0
            } else if f.is_nan() {
                0x7fc0_0000
            } else {
                f.to_bits() as i32
            };
            int(bits)
        }
        DataType::Utf8 => xxh64(col.as_string::<i32>().value(row).as_bytes(), SEED),
        DataType::LargeUtf8 => xxh64(col.as_string::<i64>().value(row).as_bytes(), SEED),
        DataType::Utf8View => xxh64(col.as_string_view().value(row).as_bytes(), SEED),
        DataType::Binary => xxh64(col.as_binary::<i32>().value(row), SEED),
        DataType::LargeBinary => xxh64(col.as_binary::<i64>().value(row), SEED),
        _ => {
            scratch.clear();
            encode_value(scratch, col, row);
            xxh64(scratch, SEED)
        }
    }
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

fn round(acc: u64, lane: u64) -> u64 {
    acc.wrapping_add(lane.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn merge_round(acc: u64, v: u64) -> u64 {
    (acc ^ round(0, v)).wrapping_mul(P1).wrapping_add(P4)
}

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// XXH64 of `input` (Yann Collet's reference algorithm, which Spark's `XXH64` follows).
fn xxh64(input: &[u8], seed: u64) -> u64 {
    let mut rest = input;
    let mut h = if input.len() >= 32 {
        let mut v = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        while rest.len() >= 32 {
            for (i, acc) in v.iter_mut().enumerate() {
                *acc = round(*acc, word(&rest[i * 8..]));
            }
            rest = &rest[32..];
        }
        let mut h = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        for acc in v {
            h = merge_round(h, acc);
        }
        h
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(input.len() as u64);
    while rest.len() >= 8 {
        h = (h ^ round(0, word(rest)))
            .rotate_left(27)
            .wrapping_mul(P1)
            .wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        let mut w = [0u8; 4];
        w.copy_from_slice(&rest[..4]);
        h = (h ^ u64::from(u32::from_le_bytes(w)).wrapping_mul(P1))
            .rotate_left(23)
            .wrapping_mul(P2)
            .wrapping_add(P3);
        rest = &rest[4..];
    }
    for b in rest {
        h = (h ^ u64::from(*b).wrapping_mul(P5))
            .rotate_left(11)
            .wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// FNV-1a, then SplitMix64's finalizer: [`Sketch::Legacy`]'s hash.
fn legacy_hash(bytes: &[u8]) -> u64 {
    let mut h = crate::storage::fnv1a(bytes);
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The estimate of the registers `regs` (Spark's HLL++, or weir's earlier plain HLL).
pub(super) fn hll_estimate(regs: &[u8], sketch: Sketch) -> i64 {
    let m = regs.len() as f64;
    if regs.is_empty() {
        return 0;
    }
    let sum: f64 = regs.iter().map(|r| 2f64.powi(-i32::from(*r))).sum();
    let alpha = 0.7213 / (1.0 + 1.079 / m);
    let raw = alpha * m * m / sum;
    let zeros = regs.iter().filter(|r| **r == 0).count() as f64;
    let est = match sketch {
        Sketch::Legacy => {
            if raw <= 2.5 * m && zeros > 0.0 {
                m * (m / zeros).ln()
            } else {
                raw
            }
        }
        Sketch::Spark => {
            let corrected = || {
                if raw < 5.0 * m && regs.len() == HLL_REGISTERS {
                    raw - estimate_bias(raw)
                } else {
                    raw
                }
            };
            if zeros > 0.0 {
                let linear = m * (m / zeros).ln();
                if linear <= THRESHOLD_P9 || raw <= 2.5 * m {
                    linear
                } else {
                    corrected()
                }
            } else {
                corrected()
            }
        }
    };
    // Java's Math.round: half up.
    (est + 0.5).floor() as i64
}

/// Spark's `estimateBias`: the mean bias of the 6 raw estimates of its table nearest `e`.
fn estimate_bias(e: f64) -> f64 {
    const K: usize = 6;
    let n = RAW_ESTIMATES_P9.len();
    // Java's binarySearch: the index of `e`, or where it would go.
    let nearest = RAW_ESTIMATES_P9.partition_point(|x| *x < e);
    let distance = |i: usize| (e - RAW_ESTIMATES_P9[i]).powi(2);
    let mut low = (nearest + 1).saturating_sub(K);
    let mut high = (low + K).min(n);
    while high < n && distance(high) < distance(low) {
        low += 1;
        high += 1;
    }
    BIASES_P9[low..high].iter().sum::<f64>() / (high - low) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `approx_count_distinct` of `range(n)` as PySpark 4.3.0 gave it (`SELECT
    /// approx_count_distinct(id), ..(CAST(id AS INT)), ..(concat('order-', id)),
    /// ..(id / 4.0D), ..(timestamp_micros(id * 1000003)) FROM range(n)`).
    #[test]
    fn estimates_are_spark_s_for_each_type() {
        use std::sync::Arc;

        use datafusion::arrow::array::{
            Float64Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray,
        };
        let spark: [(i64, [i64; 5]); 11] = [
            (1, [1, 1, 1, 1, 1]),
            (3, [3, 3, 3, 3, 3]),
            (17, [17, 17, 17, 17, 17]),
            (100, [103, 99, 101, 94, 104]),
            (300, [296, 295, 300, 267, 316]),
            (710, [706, 706, 743, 629, 734]),
            (1000, [1026, 1026, 1004, 852, 997]),
            (2000, [1947, 2023, 1985, 1894, 2066]),
            (5000, [4671, 4956, 4978, 4682, 5079]),
            (20000, [19522, 18595, 20738, 17892, 19480]),
            (100000, [95546, 94954, 103482, 90759, 98613]),
        ];
        for (n, want) in spark {
            let columns: [ArrayRef; 5] = [
                Arc::new(Int64Array::from_iter_values(0..n)),
                Arc::new(Int32Array::from_iter_values((0..n).map(|i| i as i32))),
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("order-{i}")),
                )),
                Arc::new(Float64Array::from_iter_values(
                    (0..n).map(|i| i as f64 / 4.0),
                )),
                Arc::new(TimestampMicrosecondArray::from_iter_values(
                    (0..n).map(|i| i * 1_000_003),
                )),
            ];
            for (c, (col, want)) in columns.into_iter().zip(want).enumerate() {
                let b = RecordBatch::try_from_iter([("v", col)]).unwrap();
                let mut m = sketch_rows(&b, 0, false, &[SlotSource::Sketch(0)], Sketch::Spark);
                let regs = m.remove(&Vec::new()).unwrap().remove(0);
                assert_eq!(
                    hll_estimate(&regs, Sketch::Spark),
                    want,
                    "n = {n}, column {c}"
                );
            }
        }
    }

    /// The reference XXH64 vectors (the empty input, short ones, one past 32 bytes).
    #[test]
    fn xxh64_gives_the_reference_values() {
        assert_eq!(xxh64(b"", 0), 0xef46_db37_51d8_e999);
        assert_eq!(xxh64(b"a", 0), 0xd24e_c4f1_a98c_6e5b);
        assert_eq!(xxh64(b"abc", 0), 0x44bc_2cf5_ad77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition", 0),
            0xfbce_a83c_8a37_8bf1
        );
    }
}
