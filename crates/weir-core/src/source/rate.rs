//! The rate source: `rows_per_second` rows a second, `(timestamp, value)`, for load tests
//! and demos. Values are derived from the offset alone, so a replay returns the same rows:
//! row `i` has `value = i` and `timestamp = start + i / rows_per_second`. The start time is
//! part of the offset (`{"startMs":T,"rows":N}`).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use datafusion::arrow::array::{Int64Array, TimestampMillisecondArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::{DataFrame, SessionContext};

use super::{ReadLimit, Source, SourceOffset};
use crate::error::{Error, Result};

/// Generated rows; see the module docs.
pub struct RateSource {
    rows_per_second: u64,
    schema: SchemaRef,
    /// Rows that count as available for AvailableNow.
    available_now: Mutex<Option<u64>>,
    /// The start time when no offset is recorded yet (fixed by the first call).
    started: Mutex<Option<i64>>,
    clock: Arc<dyn Fn() -> i64 + Send + Sync>,
}

impl std::fmt::Debug for RateSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateSource")
            .field("rows_per_second", &self.rows_per_second)
            .finish()
    }
}

impl RateSource {
    /// `rows_per_second` must be at least 1.
    pub fn new(rows_per_second: u64) -> Result<Self> {
        Self::with_clock(
            rows_per_second,
            Arc::new(|| chrono::Utc::now().timestamp_millis()),
        )
    }

    /// With a clock in ms since the epoch, for tests.
    pub fn with_clock(
        rows_per_second: u64,
        clock: Arc<dyn Fn() -> i64 + Send + Sync>,
    ) -> Result<Self> {
        if rows_per_second == 0 {
            return Err(Error::config("rows-per-second", "must be at least 1"));
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "timestamp",
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                false,
            ),
            Field::new("value", DataType::Int64, false),
        ]));
        Ok(RateSource {
            rows_per_second,
            schema,
            available_now: Mutex::new(None),
            started: Mutex::new(None),
            clock,
        })
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::from_source(self.description(), reason.into())
    }

    fn parse(&self, o: &SourceOffset) -> Result<(i64, u64)> {
        let j = o.json();
        match (
            j.get("startMs").and_then(|v| v.as_i64()),
            j.get("rows").and_then(|v| v.as_u64()),
        ) {
            (Some(s), Some(r)) => Ok((s, r)),
            _ => Err(self.err(format!(
                "offset {o} is not a rate offset {{\"startMs\":T,\"rows\":N}}"
            ))),
        }
    }

    fn offset(start_ms: i64, rows: u64) -> SourceOffset {
        SourceOffset::new(serde_json::json!({ "startMs": start_ms, "rows": rows }))
    }
}

#[async_trait]
impl Source for RateSource {
    fn description(&self) -> String {
        format!("RateStream[rowsPerSecond={}]", self.rows_per_second)
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn prepare_available_now(&self) -> Result<()> {
        // Decided at the first latest_offset, once the start time is known.
        *self
            .available_now
            .lock()
            .map_err(|_| self.err("poisoned"))? = Some(u64::MAX);
        Ok(())
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let now = (self.clock)();
        let (start_ms, done) = match start {
            Some(s) => self.parse(s)?,
            None => (
                *self
                    .started
                    .lock()
                    .map_err(|_| self.err("poisoned"))?
                    .get_or_insert(now),
                0,
            ),
        };
        let elapsed = (now - start_ms).max(0) as u64;
        let mut available = elapsed.saturating_mul(self.rows_per_second) / 1000;
        {
            let mut cap = self
                .available_now
                .lock()
                .map_err(|_| self.err("poisoned"))?;
            if let Some(c) = cap.as_mut() {
                if *c == u64::MAX {
                    *c = available;
                }
                available = available.min(*c);
            }
        }
        let end = limit
            .max_rows
            .map_or(available, |m| available.min(done + m.max(1)));
        if end <= done {
            return Ok(start.cloned());
        }
        Ok(Some(Self::offset(start_ms, end)))
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        let (start_ms, to) = self.parse(end)?;
        let from = start.map(|s| self.parse(s)).transpose()?.map_or(0, |s| s.1);
        let values: Vec<i64> = (from..to).map(|v| v as i64).collect();
        let rps = self.rows_per_second as i64;
        let ts: Vec<i64> = values.iter().map(|v| start_ms + v * 1000 / rps).collect();
        let batch = RecordBatch::try_new(
            self.schema.clone(),
            vec![
                Arc::new(TimestampMillisecondArray::from(ts).with_timezone("UTC")),
                Arc::new(Int64Array::from(values)),
            ],
        )
        .map_err(|e| self.err(format!("building rows {from}..{to}: {e}")))?;
        ctx.read_batch(batch)
            .map_err(|e| Error::datafusion(self.description(), e))
    }
}
