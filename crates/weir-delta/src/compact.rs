//! Compaction: OPTIMIZE between batches, so tiny batches do not leave a file each forever.
//!
//! A one-row batch makes one data file per commit. Left alone, a table written every second
//! holds 86,400 files a day and every snapshot, MERGE scan and checkpoint grows with them.
//! By default a Delta sink counts its small batches (under [`SMALL_BATCH_BYTES`] in memory)
//! and runs OPTIMIZE after [`AUTO_AFTER_SMALL_BATCHES`] of them; batches of ordinary size
//! never trigger it. `optimize-every = N` runs it after every N batches whatever their
//! size, and `0` turns compaction off.
//!
//! Exactly-once is untouched: OPTIMIZE rewrites files without changing rows, in its own
//! commit after the batch's commit (which carries the app transaction). A crash between the
//! two leaves the batch committed and the table uncompacted; the replay skips the write and
//! the next compaction picks the files up. A failed OPTIMIZE fails the batch like any write.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deltalake::DeltaTable;
use deltalake::parquet::basic::{Compression, ZstdLevel};
use deltalake::parquet::file::properties::WriterProperties;
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::storage::Location;

use crate::error::DeltaSinkError;
use crate::table::commit_properties;

/// Compaction writes files up to this size and leaves larger ones alone. Without a bound
/// (delta-rs takes the table's target file size, 100 MiB) the file earlier compactions made
/// stayed a candidate and every OPTIMIZE rewrote it with the new small files: after 100,000
/// ten-row batches each compaction read and wrote all 1,000,000 rows, and the cost and
/// memory of a compaction grew with the table. With it a compaction rewrites at most this
/// much (about the size that soak's table had reached, 3.6 MB for 1,000,000 rows); the table
/// gains a file per 4 MiB of data.
pub const COMPACT_TARGET_BYTES: u64 = 4 << 20;

/// Rows per row group in the files compaction writes. The Parquet writer holds the row group
/// it is filling in memory (arrow-rs closes one at 1,048,576 rows), and a compacted file of
/// ten-row batches holds about a million rows at [`COMPACT_TARGET_BYTES`]: the cap keeps what
/// one compaction buffers the same whatever the size of the file it rewrites.
pub const COMPACT_ROW_GROUP_ROWS: usize = 64 * 1024;

/// A batch smaller than this (Arrow memory size) counts as small.
pub const SMALL_BATCH_BYTES: usize = 8 << 20;
/// Small batches between automatic compactions.
pub const AUTO_AFTER_SMALL_BATCHES: u64 = 100;

/// How long a table a sink creates keeps the tombstones of replaced files in its checkpoints.
pub const DEFAULT_DELETED_FILE_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The table property that holds the tombstone retention.
pub const DELETED_FILE_RETENTION_PROPERTY: &str = "delta.deletedFileRetentionDuration";

/// `retention` as a Delta interval (`interval 86400 seconds`), which delta-rs and Spark read.
pub fn delta_interval(retention: Duration) -> String {
    let ms = retention.as_millis();
    if ms.is_multiple_of(1000) {
        format!("interval {} seconds", ms / 1000)
    } else {
        format!("interval {ms} milliseconds")
    }
}

/// When a sink compacts its table.
#[derive(Debug, Clone)]
pub(crate) struct Compaction {
    rule: Rule,
    /// Small batches written since the last compaction (automatic rule).
    small: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Auto,
    Every(u64),
    Off,
}

impl Default for Compaction {
    fn default() -> Self {
        Compaction {
            rule: Rule::Auto,
            small: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Compaction {
    /// After every `n` batches; `0`: never.
    pub(crate) fn every(n: u64) -> Self {
        Compaction {
            rule: if n == 0 { Rule::Off } else { Rule::Every(n) },
            ..Compaction::default()
        }
    }

    /// Whether to compact after batch `batch_id`, whose rows took `bytes` in memory.
    fn due(&self, batch_id: u64, bytes: usize) -> bool {
        match self.rule {
            Rule::Off => false,
            Rule::Every(n) => (batch_id + 1).is_multiple_of(n),
            Rule::Auto => {
                if bytes >= SMALL_BATCH_BYTES {
                    return false;
                }
                let n = self.small.fetch_add(1, Ordering::Relaxed) + 1;
                if n >= AUTO_AFTER_SMALL_BATCHES {
                    self.small.store(0, Ordering::Relaxed);
                    return true;
                }
                false
            }
        }
    }

    /// Runs OPTIMIZE after the batch's commit when it is due.
    pub(crate) async fn after_commit(
        &self,
        table: DeltaTable,
        bytes: usize,
        at: &Location,
        batch_id: u64,
    ) -> Result<DeltaTable, DeltaSinkError> {
        if !self.due(batch_id, bytes) {
            return Ok(table);
        }
        let (table, own) = crate::store::for_compaction(table);
        let mut optimize = table
            .optimize()
            .with_commit_properties(commit_properties())
            .with_writer_properties(compaction_writer_properties());
        if let Some(target) = NonZeroU64::new(COMPACT_TARGET_BYTES) {
            optimize = optimize.with_target_size(target);
        }
        let (table, metrics) = optimize.await.map_err(|source| DeltaSinkError::Delta {
            table: at.to_string(),
            batch_id,
            action: "compacting small files (optimize)",
            source,
        })?;
        tracing::info!(
            table = %at,
            "optimize after batch {batch_id}: {} files removed, {} added",
            metrics.num_files_removed,
            metrics.num_files_added
        );
        Ok(crate::store::with_log_store(table, own))
    }
}

/// What compaction writes with: delta-rs's own choice (ZSTD level 4) with row groups of at
/// most [`COMPACT_ROW_GROUP_ROWS`].
fn compaction_writer_properties() -> WriterProperties {
    let zstd = ZstdLevel::try_new(4).unwrap_or_default();
    WriterProperties::builder()
        .set_compression(Compression::ZSTD(zstd))
        .set_max_row_group_row_count(Some(COMPACT_ROW_GROUP_ROWS))
        .build()
}

/// The Arrow memory size of a batch's rows, which decides whether it counts as small.
pub(crate) fn batch_bytes(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::get_array_memory_size).sum()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use weir_core::datafusion::arrow::array::Int64Array;
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema};
    use weir_core::datafusion::arrow::record_batch::RecordBatch;

    use super::{
        AUTO_AFTER_SMALL_BATCHES, Compaction, DEFAULT_DELETED_FILE_RETENTION, SMALL_BATCH_BYTES,
        batch_bytes, delta_interval,
    };

    fn batch(rows: usize) -> usize {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let col = Int64Array::from_iter_values(0..rows as i64);
        batch_bytes(&[RecordBatch::try_new(schema, vec![Arc::new(col)]).unwrap()])
    }

    #[test]
    fn tiny_batches_compact_by_default_and_big_ones_never_do() {
        let c = Compaction::default();
        let due: Vec<u64> = (0..250).filter(|&id| c.due(id, batch(1))).collect();
        assert_eq!(
            due,
            vec![
                AUTO_AFTER_SMALL_BATCHES - 1,
                2 * AUTO_AFTER_SMALL_BATCHES - 1
            ]
        );
        let big = batch(SMALL_BATCH_BYTES / 8 + 1);
        let c = Compaction::default();
        assert!((0..300).all(|id| !c.due(id, big)));
    }

    #[test]
    fn an_explicit_period_counts_batches_and_zero_turns_it_off() {
        let c = Compaction::every(3);
        let due: Vec<u64> = (0..9).filter(|&id| c.due(id, batch(1))).collect();
        assert_eq!(due, vec![2, 5, 8]);
        let off = Compaction::every(0);
        assert!((0..300).all(|id| !off.due(id, batch(1))));
    }

    #[test]
    fn retentions_are_written_as_delta_intervals() {
        use std::time::Duration;
        assert_eq!(
            delta_interval(DEFAULT_DELETED_FILE_RETENTION),
            "interval 86400 seconds"
        );
        assert_eq!(delta_interval(Duration::ZERO), "interval 0 seconds");
        assert_eq!(
            delta_interval(Duration::from_millis(1500)),
            "interval 1500 milliseconds"
        );
    }
}
