//! Spark's `approx_count_distinct` as a HyperLogLog sketch per group: registers built from
//! a batch's rows, merged into the state by their maximum, estimated when a row is output.

use datafusion::arrow::record_batch::RecordBatch;

use super::super::keys::encode_value;

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
            value.clear();
            encode_value(&mut value, col, row);
            let h = hash64(&value);
            let idx = (h >> (64 - HLL_BITS)) as usize;
            let rank = ((h << HLL_BITS) | (1 << (HLL_BITS - 1))).leading_zeros() as u8 + 1;
            regs[n][idx] = regs[n][idx].max(rank);
        }
    }
    out
}

/// FNV-1a, then SplitMix64's finalizer: a hash that is the same on every platform and
/// release (the registers are kept in the checkpoint).
fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The HyperLogLog estimate of the registers, with linear counting for small counts.
pub(super) fn hll_estimate(regs: &[u8]) -> i64 {
    let m = regs.len() as f64;
    if regs.is_empty() {
        return 0;
    }
    let sum: f64 = regs.iter().map(|r| 2f64.powi(-i32::from(*r))).sum();
    let alpha = 0.7213 / (1.0 + 1.079 / m);
    let raw = alpha * m * m / sum;
    let zeros = regs.iter().filter(|r| **r == 0).count() as f64;
    let est = if raw <= 2.5 * m && zeros > 0.0 {
        m * (m / zeros).ln()
    } else {
        raw
    };
    est.round() as i64
}
