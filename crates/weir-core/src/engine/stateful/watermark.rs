//! Event-time watermarks, as Spark's `withWatermark` computes them.
//!
//! The step notes the event times of the rows passing it (min, max, average, ignoring
//! NULLs). After a batch the watermark for the next one is `max(watermark, max event time -
//! delay)`: it only moves forward, and the first batch has 0. Batch N runs with the
//! watermark recorded in `offsets/N` (`batchWatermarkMs`); `commits/N` records the next one
//! (`nextBatchWatermarkMs`), so a replay sees the watermark its first attempt saw and a
//! restart continues from the committed one. As in Spark since 3.4, stateful operators
//! drop as late the rows at or below the watermark of the batch before (`event time <=
//! previous batch's watermark`), and evict (or, in append mode, emit) by the batch's own.

use std::collections::BTreeMap;

use datafusion::arrow::array::cast::AsArray;
use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Schema, TimeUnit, TimestampMicrosecondType};
use datafusion::arrow::record_batch::RecordBatch;

use datafusion::prelude::{DataFrame, SessionContext};

use crate::error::{Error, Result};

/// The setting errors name (the pipeline file's spelling; `with_watermark` in the API).
pub(crate) const KEY: &str = "transform.with-watermark";

/// The watermark a batch runs with, for the stateful operators after the step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct EventTime {
    /// The event-time column (a timestamp).
    pub column: String,
    pub delay_ms: i64,
    /// The batch's watermark (`batchWatermarkMs`): what state is evicted by.
    pub watermark_ms: i64,
    /// The watermark of the batch before (0 for the first): what rows are late by.
    pub late_ms: i64,
}

impl EventTime {
    /// Whether the batch's watermark passed `micros` (Spark's eviction rule: at or below).
    pub(crate) fn passed(&self, micros: i64) -> bool {
        micros <= self.watermark_ms.saturating_mul(1000)
    }

    /// Whether a row at `micros` (or a window ending there) is late: at or below the
    /// previous batch's watermark.
    pub(crate) fn late(&self, micros: i64) -> bool {
        micros <= self.late_ms.saturating_mul(1000)
    }

    /// The event-time column's index in `schema`, or `None` if a transform dropped it.
    pub(crate) fn index_in(&self, schema: &Schema) -> Result<Option<usize>> {
        let Ok(i) = schema.index_of(&self.column) else {
            return Ok(None);
        };
        check_type(&self.column, schema.field(i).data_type())?;
        Ok(Some(i))
    }
}

/// Refuses an event-time column that is not a timestamp.
pub(crate) fn check_type(column: &str, dt: &DataType) -> Result<()> {
    if matches!(dt, DataType::Timestamp(_, _)) {
        return Ok(());
    }
    Err(Error::config(
        KEY,
        format!(
            "column `{column}` has type {dt}; an event-time column must be a timestamp \
             (CAST it in a SQL transform before the watermark)"
        ),
    ))
}

/// The column's values in microseconds since the epoch (NULLs stay NULL).
pub(crate) fn micros(col: &ArrayRef) -> Result<Vec<Option<i64>>> {
    let tz = match col.data_type() {
        DataType::Timestamp(_, tz) => tz.clone(),
        other => return Err(Error::config(KEY, format!("{other} is not a timestamp"))),
    };
    let us = cast(col, &DataType::Timestamp(TimeUnit::Microsecond, tz))
        .map_err(|e| Error::config(KEY, format!("reading event times: {e}")))?;
    let us = us.as_primitive::<TimestampMicrosecondType>();
    Ok((0..us.len())
        .map(|i| (!us.is_null(i)).then(|| us.value(i)))
        .collect())
}

/// The watermark step: the batch's event times in `column`, and the batch, read once
/// (the steps after it read the same rows).
pub(crate) async fn observe(
    ctx: &SessionContext,
    df: DataFrame,
    column: &str,
) -> Result<(DataFrame, EventTimeStats)> {
    let schema = df.schema().inner().clone();
    let i = column_index(&schema, column)?;
    let parts = super::collect_partitions(df, "the watermark").await?;
    let mut stats = EventTimeStats::default();
    for p in &parts {
        stats.observe(p, i)?;
    }
    Ok((super::frame(ctx, schema, parts, KEY)?, stats))
}

/// The index of the watermark's column `column` in `schema`, checked to be a timestamp.
pub(crate) fn column_index(schema: &Schema, column: &str) -> Result<usize> {
    let i = schema.index_of(column).map_err(|_| {
        Error::config(
            KEY,
            format!("no column `{column}` in the batch at the watermark"),
        )
    })?;
    check_type(column, schema.field(i).data_type())?;
    Ok(i)
}

/// The event times of one batch, in ms (Spark's `EventTimeStats`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct EventTimeStats {
    min: i64,
    max: i64,
    sum: i128,
    count: u64,
}

impl EventTimeStats {
    /// Adds the non-NULL values of column `index` of `batches`.
    pub(crate) fn observe(&mut self, batches: &[RecordBatch], index: usize) -> Result<()> {
        for b in batches {
            for us in micros(b.column(index))?.into_iter().flatten() {
                let ms = us.div_euclid(1000);
                if self.count == 0 {
                    self.min = ms;
                    self.max = ms;
                } else {
                    self.min = self.min.min(ms);
                    self.max = self.max.max(ms);
                }
                self.sum += i128::from(ms);
                self.count += 1;
            }
        }
        Ok(())
    }

    /// Adds what `other` saw (the event times of another task of the same batch).
    pub(crate) fn merge(&mut self, other: &EventTimeStats) {
        if other.count == 0 {
            return;
        }
        if self.count == 0 {
            *self = other.clone();
            return;
        }
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
        self.count += other.count;
    }

    /// The watermark after a batch that ran with `current` and saw these event times.
    pub(crate) fn next_watermark(&self, current: i64, delay_ms: i64) -> i64 {
        if self.count == 0 {
            return current;
        }
        current.max(self.max.saturating_sub(delay_ms))
    }

    /// Spark's `eventTime` progress entry for a batch that ran with `watermark_ms`.
    pub(crate) fn progress(&self, watermark_ms: i64) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert("watermark".to_string(), iso(watermark_ms));
        if self.count > 0 {
            m.insert("min".to_string(), iso(self.min));
            m.insert("max".to_string(), iso(self.max));
            m.insert(
                "avg".to_string(),
                iso((self.sum / i128::from(self.count)) as i64),
            );
        }
        m
    }
}

/// `ms` since the epoch as Spark prints event times: ISO-8601 UTC with milliseconds.
pub(crate) fn iso(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
        .unwrap_or_else(|| ms.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::TimestampNanosecondArray;
    use datafusion::arrow::datatypes::Field;
    use std::sync::Arc;

    #[test]
    fn the_watermark_is_max_event_time_minus_delay_and_never_goes_back() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Nanosecond, None),
            true,
        )]));
        let col =
            TimestampNanosecondArray::from(vec![Some(5_000_000_000), None, Some(1_500_999_999)]);
        let batch = RecordBatch::try_new(schema, vec![Arc::new(col)]).unwrap();
        let mut s = EventTimeStats::default();
        s.observe(&[batch], 0).unwrap();
        assert_eq!(s.next_watermark(0, 1000), 4000);
        assert_eq!(s.next_watermark(4500, 1000), 4500);
        let p = s.progress(4000);
        assert_eq!(p["watermark"], "1970-01-01T00:00:04.000Z");
        assert_eq!(p["min"], "1970-01-01T00:00:01.500Z");
        assert_eq!(p["max"], "1970-01-01T00:00:05.000Z");
        assert_eq!(p["avg"], "1970-01-01T00:00:03.250Z");
        assert_eq!(EventTimeStats::default().next_watermark(7, 1), 7);
        let e = EventTime {
            column: "ts".into(),
            delay_ms: 0,
            watermark_ms: 4,
            late_ms: 2,
        };
        assert!(e.passed(4000) && !e.passed(4001));
        assert!(e.late(2000) && !e.late(2001));
        assert!(
            check_type("n", &DataType::Int64)
                .unwrap_err()
                .to_string()
                .contains("`n`")
        );
    }
}
