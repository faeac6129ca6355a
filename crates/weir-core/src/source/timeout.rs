//! A time limit on a source's own calls (`[source] timeout = "2m"`): planning a batch
//! (listing files, asking the brokers for offsets), the reads a source makes before it
//! hands the rows over (the Kafka source in one process), opening and committing. A call
//! still running when the limit runs out is cancelled and the batch fails with
//! [`Error::SourceTimedOut`], an error that may pass: the query starts again from its
//! checkpoint after a pause (`engine::retry`), with the same range for a batch already
//! recorded. Rows a source reads lazily (files, read when the batch is written) are read
//! under the sinks' `timeout`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::prelude::{DataFrame, SessionContext};

use super::{ReadLimit, Source, SourceInit, SourceOffset};
use crate::error::{Error, Result};

/// `inner`, whose calls must end within `after`.
pub struct WithSourceTimeout {
    inner: Arc<dyn Source>,
    after: Duration,
}

impl WithSourceTimeout {
    pub fn new(inner: Arc<dyn Source>, after: Duration) -> Self {
        WithSourceTimeout { inner, after }
    }

    async fn limited<T>(
        &self,
        what: &'static str,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.after, work).await {
            Ok(result) => result,
            Err(_) => Err(Error::SourceTimedOut {
                source_name: self.inner.description(),
                what,
                after_ms: self.after.as_millis() as u64,
            }),
        }
    }
}

#[async_trait]
impl Source for WithSourceTimeout {
    fn description(&self) -> String {
        self.inner.description()
    }

    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }

    fn reads_on_workers(&self) -> bool {
        self.inner.reads_on_workers()
    }

    async fn open(&self, init: &SourceInit) -> Result<()> {
        self.limited("opening", self.inner.open(init)).await
    }

    async fn prepare_available_now(&self) -> Result<()> {
        self.limited(
            "finding what is available now",
            self.inner.prepare_available_now(),
        )
        .await
    }

    async fn reached_available_now(&self) -> Result<bool> {
        self.limited(
            "checking what is available now",
            self.inner.reached_available_now(),
        )
        .await
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        self.limited(
            "planning the next batch",
            self.inner.latest_offset(start, limit),
        )
        .await
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        self.limited("reading the batch", self.inner.read_range(ctx, start, end))
            .await
    }

    fn latest_seen(&self) -> Option<SourceOffset> {
        self.inner.latest_seen()
    }

    fn metrics(&self) -> std::collections::BTreeMap<String, String> {
        self.inner.metrics()
    }

    async fn before_commit(
        &self,
        batch_id: u64,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<()> {
        self.limited(
            "writing the batch's dead letter",
            self.inner.before_commit(batch_id, start, end),
        )
        .await
    }

    async fn commit(&self, end: &SourceOffset) -> Result<()> {
        self.limited("committing", self.inner.commit(end)).await
    }
}
