//! Steps 1-2 of a batch (see the loop's docs): its range under the read limit, recorded in
//! `offsets/N` before anything is read; a no-data batch when only the watermark moved; the
//! error of an available-now query that cannot finish.

use super::*;

impl Runner {
    /// The error of an available-now query that cannot finish: the source holds data that
    /// was there when the query started but offers no new offset.
    pub(super) fn unfinished(&self, batch_id: u64, start: &Option<SourceOffset>) -> Error {
        Error::Batch {
            query: self.shared.name.clone(),
            batch_id,
            stage: "draining the source (available-now)",
            source: Box::new(Error::from_source(
                self.spec.source.description(),
                format!(
                    "the source holds data that was there when the query \
                     started, but offered no new offset after {}: the query \
                     stops with an error rather than end with data unread",
                    start
                        .as_ref()
                        .map_or("the start".to_string(), |s| s.to_string())
                ),
            )),
        }
    }

    /// Records batch `id` as a no-data batch: the range of the batch before (nothing to
    /// read) with the watermark that moved since.
    pub(super) async fn plan_no_data(
        &self,
        id: u64,
        start: &SourceOffset,
        watermark_ms: i64,
        durations: &mut Durations,
    ) -> Result<Planned> {
        tracing::info!(query = %self.shared.name, batch = id, "no-data batch {id}: the watermark moved to {}", crate::engine::stateful::iso(watermark_ms));
        self.record(id, start.clone(), start.clone(), watermark_ms, durations)
            .await
    }

    /// Step 2: writes `offsets/N` for batch `id` ending at `end`.
    pub(super) async fn record(
        &self,
        id: u64,
        end: SourceOffset,
        latest: SourceOffset,
        watermark_ms: i64,
        durations: &mut Durations,
    ) -> Result<Planned> {
        let metadata = OffsetSeqMetadata {
            batch_watermark_ms: watermark_ms,
            batch_timestamp_ms: chrono::Utc::now().timestamp_millis(),
            conf: self.spec.conf.clone(),
        };
        let t = Instant::now();
        let seq = OffsetSeq {
            metadata: metadata.clone(),
            offsets: vec![Some(end.clone())],
        };
        self.shared.set_current_batch(id);
        self.spec.checkpoint.write_offsets(id, &seq).await?;
        durations.since(Phase::WalCommit, t);
        fault::hit(AFTER_OFFSETS_WRITE, id)?;
        Ok(Planned {
            id,
            latest: Some(latest),
            end,
            metadata,
            replay: false,
        })
    }

    /// The read limit of every batch under the query's trigger.
    pub(super) fn read_limit(&self) -> ReadLimit {
        match self.spec.trigger {
            Trigger::Once => ReadLimit::ALL,
            // Drain what is there, in batches of the max limits; never wait for more.
            Trigger::AvailableNow => ReadLimit {
                min_rows: None,
                ..self.spec.limit
            },
            _ => self.spec.limit,
        }
    }

    /// Steps 1-2: decides batch `id`'s range and records it. `None`: no new data.
    pub(super) async fn plan(
        &self,
        id: u64,
        start: Option<&SourceOffset>,
        watermark_ms: i64,
        durations: &mut Durations,
    ) -> Result<Option<Planned>> {
        let limit = self.read_limit();
        let t = Instant::now();
        let latest = self
            .spec
            .source
            .latest_offset(start, limit)
            .await
            .map_err(self.in_batch(id, "asking the source for new data"))?;
        durations.since(Phase::LatestOffset, t);
        let Some(end) = latest.filter(|l| Some(l) != start) else {
            return Ok(None);
        };
        let latest = self
            .spec
            .source
            .latest_seen()
            .unwrap_or_else(|| end.clone());
        self.record(id, end, latest, watermark_ms, durations)
            .await
            .map(Some)
    }
}
