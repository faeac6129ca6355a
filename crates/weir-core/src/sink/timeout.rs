//! A time limit on a sink's writes (`[[sink]] timeout = "2m"`): a write still running when
//! it runs out is cancelled and the batch fails with [`Error::TimedOut`], an error that may
//! pass, so the query runs the batch again after a pause (`engine::retry`) instead of
//! hanging on a frozen server for good.
//!
//! Cancelling drops the write's future at its current `.await`. What a sink's writes promise
//! holds through that drop as through a crash at the same point: a PostgreSQL transaction
//! that was not committed rolls back; a COMMIT that was sent and may land later is found in
//! the ledger by the run again, which then skips the batch; a Delta version that was not
//! written is not made (and one whose write lands late is found by its app transaction).
//! So the run again writes each row once, as after a kill.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::prelude::DataFrame;

use super::{BatchContext, ForeachBatch, PlanRunner, QueryIdentity};
use crate::error::{BoxError, Error};

/// `inner`, whose calls must end within `after`.
pub struct WithTimeout {
    inner: Arc<dyn ForeachBatch>,
    /// The sink's name, for the error.
    name: String,
    after: Duration,
}

impl WithTimeout {
    pub fn new(inner: Arc<dyn ForeachBatch>, name: impl Into<String>, after: Duration) -> Self {
        WithTimeout {
            inner,
            name: name.into(),
            after,
        }
    }

    async fn limited(
        &self,
        what: &'static str,
        batch_id: u64,
        work: impl Future<Output = Result<(), BoxError>>,
    ) -> Result<(), BoxError> {
        match tokio::time::timeout(self.after, work).await {
            Ok(result) => result,
            Err(_) => Err(Box::new(Error::TimedOut {
                sink: self.name.clone(),
                batch_id,
                what,
                after_ms: self.after.as_millis() as u64,
            })),
        }
    }
}

#[async_trait]
impl ForeachBatch for WithTimeout {
    async fn open(&self, query: &QueryIdentity) -> Result<(), BoxError> {
        self.limited("opening", 0, self.inner.open(query)).await
    }

    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let id = ctx.batch_id;
        self.limited("writing the batch", id, self.inner.call(batch, ctx))
            .await
    }

    async fn stage(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let id = ctx.batch_id;
        self.limited("staging the batch", id, self.inner.stage(batch, ctx))
            .await
    }

    async fn discard(&self, ctx: BatchContext) {
        self.inner.discard(ctx).await
    }

    fn writes_on_workers(&self) -> bool {
        self.inner.writes_on_workers()
    }

    async fn write_on_workers(
        &self,
        batch: DataFrame,
        ctx: BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), BoxError> {
        let id = ctx.batch_id;
        let work = self.inner.write_on_workers(batch, ctx, run);
        self.limited("writing the batch on the workers", id, work)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::is_transient;

    /// A write that never ends is cancelled at the limit with an error that may pass and
    /// names the sink and batch; one that ends in time is passed through, errors included.
    #[tokio::test]
    async fn a_write_past_its_limit_is_cancelled_with_an_error_that_may_pass() {
        let ctx = datafusion::prelude::SessionContext::new();
        let df = ctx.read_empty().unwrap();
        let batch = |id| BatchContext::on_session(uuid::Uuid::nil(), "q", id, ctx.clone());
        let hangs: Arc<dyn ForeachBatch> = Arc::new(|_df: DataFrame, _c: BatchContext| async {
            std::future::pending::<()>().await;
            Ok::<(), BoxError>(())
        });
        let s = WithTimeout::new(hangs, "pg", Duration::from_millis(50));
        let started = std::time::Instant::now();
        let e = s.call(df.clone(), batch(7)).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(is_transient(e.as_ref()), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("sink pg: batch 7") && text.contains("50 ms"),
            "{text}"
        );

        let fails: Arc<dyn ForeachBatch> = Arc::new(|_df: DataFrame, _c: BatchContext| async {
            Err::<(), BoxError>("a value the table refuses".into())
        });
        let s = WithTimeout::new(fails, "pg", Duration::from_secs(5));
        let e = s.call(df.clone(), batch(8)).await.unwrap_err();
        assert_eq!(e.to_string(), "a value the table refuses");
        assert!(!is_transient(e.as_ref()));

        let ok: Arc<dyn ForeachBatch> =
            Arc::new(|_df: DataFrame, _c: BatchContext| async { Ok::<(), BoxError>(()) });
        let s = WithTimeout::new(ok, "pg", Duration::from_secs(5));
        s.call(df, batch(9)).await.unwrap();
    }
}
