//! Streaming deduplication (`drop_duplicates`, `drop_duplicates_within_watermark`): see
//! the parent module. The rules a row and a key go by ([`pass_new`], [`evict_passed`],
//! [`kept_value`]) are shared by the run on this process's cores and the run on the
//! workers ([`super::on_workers`]).

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, BooleanArray};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::{DataFrame, SessionContext};

use super::keys::encode_value;
use super::watermark::{self, EventTime};
use super::{
    OperatorMetrics, OperatorState, PARALLEL_ROWS, collect_in_order, columns_json, frame,
    key_columns, key_families,
};
use crate::error::{Error, Result};
use crate::state::{StateStore, partition_of};

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum DedupeMode {
    /// `drop_duplicates`: state keyed by the keys (evicted by the watermark only if the
    /// event-time column is a key).
    Plain,
    /// `drop_duplicates_within_watermark`: each key until event time + delay.
    WithinWatermark,
}

impl DedupeMode {
    pub(crate) fn key(self) -> &'static str {
        match self {
            DedupeMode::Plain => "transform.drop-duplicates",
            DedupeMode::WithinWatermark => "transform.drop-duplicates-within-watermark",
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            DedupeMode::Plain => "dedupe",
            DedupeMode::WithinWatermark => "dedupeWithinWatermark",
        }
    }
}

/// One `drop_duplicates` or `drop_duplicates_within_watermark` of a query.
pub(crate) struct Dedupe {
    pub(super) op: OperatorState,
    pub(super) keys: Vec<String>,
    pub(super) mode: DedupeMode,
    pub(super) metrics: OperatorMetrics,
    /// What the workers did in this batch, when it ran there ([`super::on_workers`]):
    /// its partitions are committed already.
    pub(super) on_workers: Option<super::Ran>,
}

/// What a batch's rows are deduplicated by, checked against the batch's schema.
pub(super) struct Rules {
    /// The key columns' indexes.
    pub(super) columns: Vec<usize>,
    /// The event time and its column's index, when the batch has it.
    pub(super) event: Option<(EventTime, usize)>,
    /// Whether a key keeps a time (its event time, or when it expires).
    pub(super) keep_time: bool,
    pub(super) mode: DedupeMode,
}

impl Rules {
    /// How long a key of `drop_duplicates_within_watermark` is kept after its event time.
    fn delay_us(&self) -> i64 {
        self.event
            .as_ref()
            .map_or(0, |(e, _)| e.delay_ms.saturating_mul(1000))
    }

    /// What a new key keeps for a row at event time `time`: nothing, its event time, or the
    /// time it expires.
    pub(super) fn kept_value(&self, time: Option<i64>) -> Vec<u8> {
        match (self.keep_time, self.mode, time) {
            (false, _, _) | (true, DedupeMode::Plain, None) => Vec::new(),
            (true, DedupeMode::Plain, Some(t)) => t.to_le_bytes().to_vec(),
            // Spark reads a NULL event time as 0 here.
            (true, DedupeMode::WithinWatermark, t) => t
                .unwrap_or(0)
                .saturating_add(self.delay_us())
                .to_le_bytes()
                .to_vec(),
        }
    }

    /// Whether the rows are late by the watermark and keys evicted by it.
    pub(super) fn evicts(&self) -> Option<&EventTime> {
        match (&self.event, self.keep_time) {
            (Some((e, _)), true) => Some(e),
            _ => None,
        }
    }
}

/// The rows among `rows` (in the order they are to be judged) whose keys (`key_of`) are
/// not in `store`, each put there with [`Rules::kept_value`] of its time (`time_of`): the
/// first row of each new key.
pub(super) fn pass_new<'k>(
    store: &mut StateStore,
    rows: &[u32],
    key_of: impl Fn(usize) -> &'k [u8],
    value_of: impl Fn(usize) -> Vec<u8>,
) -> Vec<u32> {
    let mut new = Vec::new();
    for &row in rows {
        let key = key_of(row as usize);
        if store.get(key).is_none() {
            store.put(key.to_vec(), value_of(row as usize));
            new.push(row);
        }
    }
    new
}

/// Removes from `store` the keys whose kept time the batch's watermark `e` passed (keys
/// kept without a time stay); how many.
pub(super) fn evict_passed(store: &mut StateStore, e: &EventTime) -> u64 {
    let gone: Vec<Vec<u8>> = store
        .iter()
        .filter(|(_, v)| <[u8; 8]>::try_from(*v).is_ok_and(|b| e.passed(i64::from_le_bytes(b))))
        .map(|(k, _)| k.to_vec())
        .collect();
    let n = gone.len() as u64;
    for k in gone {
        store.remove(k);
    }
    n
}

/// Each row's key encoded (`keys[ends[r-1]..ends[r]]`).
pub(super) struct EncodedKeys {
    keys: Vec<u8>,
    ends: Vec<usize>,
}

impl EncodedKeys {
    pub(super) fn key(&self, row: usize) -> &[u8] {
        &self.keys[row.checked_sub(1).map_or(0, |r| self.ends[r])..self.ends[row]]
    }
}

/// A batch's rows as a deduplication sees them ([`encode_keys`]).
pub(super) struct Encoded {
    pub(super) keys: EncodedKeys,
    /// The rows not late of each partition, in batch order.
    pub(super) by_part: Vec<Vec<u32>>,
    /// Each row's event time in microseconds, when the batch has one.
    pub(super) times: Option<Vec<Option<i64>>>,
}

impl Encoded {
    /// The event time of row `row`.
    pub(super) fn time_of(&self, row: usize) -> Option<i64> {
        self.times.as_ref().and_then(|t| t[row])
    }
}

/// Encodes the keys of `batch`'s rows by `rules`, giving each row not late its partition
/// of `parts`; counts late rows in `dropped_late`.
pub(super) fn encode_keys(
    batch: &RecordBatch,
    rules: &Rules,
    parts: u32,
    dropped_late: &mut u64,
) -> Result<Encoded> {
    let rows = batch.num_rows();
    let cols: Vec<&ArrayRef> = rules.columns.iter().map(|i| batch.column(*i)).collect();
    let times = match &rules.event {
        Some((_, i)) => Some(watermark::micros(batch.column(*i))?),
        None => None,
    };
    let mut keys = Vec::new();
    let mut ends = Vec::with_capacity(rows);
    let mut by_part: Vec<Vec<u32>> = vec![Vec::new(); parts as usize];
    for row in 0..rows {
        if let (Some((e, _)), Some(t)) = (&rules.event, times.as_ref().and_then(|t| t[row]))
            && e.late(t)
        {
            *dropped_late += 1;
            ends.push(keys.len());
            continue;
        }
        let start = keys.len();
        for c in &cols {
            encode_value(&mut keys, c, row);
        }
        ends.push(keys.len());
        by_part[partition_of(&keys[start..], parts)].push(row as u32);
    }
    Ok(Encoded {
        keys: EncodedKeys { keys, ends },
        by_part,
        times,
    })
}

impl Dedupe {
    pub(super) fn new(op: OperatorState, keys: Vec<String>, mode: DedupeMode) -> Self {
        Dedupe {
            op,
            keys,
            mode,
            metrics: OperatorMetrics::new(mode.name()),
            on_workers: None,
        }
    }

    /// The rules for a batch of `schema`, its state's metadata checked (and version
    /// `batch_id` loaded here unless `on_workers`).
    pub(super) async fn rules(
        &mut self,
        schema: &datafusion::arrow::datatypes::Schema,
        batch_id: u64,
        event: Option<&EventTime>,
        on_workers: bool,
    ) -> Result<Rules> {
        let key = self.mode.key();
        let columns = key_columns(schema, &self.keys, key)?;
        let families = key_families(schema, &columns, key)?;
        let keys_json = || serde_json::Value::from(columns_json(&self.keys, &families)).to_string();
        self.op
            .prepare(
                batch_id,
                self.mode.name(),
                "keys",
                keys_json,
                key,
                !on_workers,
            )
            .await?;
        let event = match event {
            Some(e) => e.index_in(schema)?.map(|i| (e.clone(), i)),
            None => None,
        };
        if self.mode == DedupeMode::WithinWatermark && event.is_none() {
            return Err(Error::config(
                key,
                "drop_duplicates_within_watermark needs a watermark: put with_watermark \
                 (`transform.with-watermark`) before it, on a column that reaches it",
            ));
        }
        // The event time is kept with a key if it can evict it.
        let keep_time = match (self.mode, &event) {
            (DedupeMode::WithinWatermark, _) => true,
            (DedupeMode::Plain, Some((_, i))) => columns.contains(i),
            (DedupeMode::Plain, None) => false,
        };
        Ok(Rules {
            columns,
            event,
            keep_time,
            mode: self.mode,
        })
    }

    /// The rows of `df` whose keys were not seen before (batch `batch_id`).
    pub(super) async fn apply(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<DataFrame> {
        let key = self.mode.key();
        let schema = Arc::new(df.schema().as_arrow().clone());
        let rules = self.rules(&schema, batch_id, event, false).await?;
        let batches = collect_in_order(df, batch_id, key).await?;
        let started = Instant::now();
        self.metrics = OperatorMetrics::new(self.mode.name());
        self.on_workers = None;
        let parts = self.op.store.partitions();
        let mut kept = Vec::with_capacity(batches.len());
        for batch in batches {
            let rows = batch.num_rows();
            let enc = encode_keys(&batch, &rules, parts, &mut self.metrics.dropped_late)?;
            // A row passes if its key is new: the first of its key in the partition's rows,
            // which are in batch order, and not in the state.
            let new_rows = self.op.store.each_part(rows >= PARALLEL_ROWS, |p, store| {
                pass_new(
                    store,
                    &enc.by_part[p],
                    |r| enc.keys.key(r),
                    |r| rules.kept_value(enc.time_of(r)),
                )
            });
            let mut mask = vec![false; rows];
            for row in new_rows.into_iter().flatten() {
                mask[row as usize] = true;
                self.metrics.updated += 1;
            }
            let filtered = filter_record_batch(&batch, &BooleanArray::from(mask))
                .map_err(|e| Error::datafusion(key, e.into()))?;
            if filtered.num_rows() > 0 {
                kept.push(filtered);
            }
        }
        self.metrics.update_ms = started.elapsed().as_millis() as u64;
        if let Some(e) = rules.evicts() {
            // Evict what the batch's watermark passed, each partition by itself.
            let started = Instant::now();
            let many = self.op.store.len() >= PARALLEL_ROWS;
            let removed = self
                .op
                .store
                .each_part(many, |_, store| evict_passed(store, e));
            self.metrics.removed = removed.into_iter().sum();
            self.metrics.remove_ms = started.elapsed().as_millis() as u64;
        }
        frame(ctx, schema, vec![kept], key)
    }
}
