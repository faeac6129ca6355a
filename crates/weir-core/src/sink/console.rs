use async_trait::async_trait;
use datafusion::prelude::DataFrame;

use super::{BatchContext, ForeachBatch};
use crate::error::{BoxError, Error};

/// Prints each batch as Spark's console sink does: a header with the batch id, then up
/// to `num_rows` rows. For demos; it has no idempotency (a replay prints again).
#[derive(Debug, Clone)]
pub struct ConsoleSink {
    num_rows: usize,
}

impl Default for ConsoleSink {
    fn default() -> Self {
        ConsoleSink { num_rows: 20 }
    }
}

impl ConsoleSink {
    /// Prints at most `num_rows` rows a batch.
    pub fn new(num_rows: usize) -> Self {
        ConsoleSink { num_rows }
    }
}

#[async_trait]
impl ForeachBatch for ConsoleSink {
    async fn call(&self, batch: DataFrame, ctx: BatchContext) -> Result<(), BoxError> {
        let line = "-".repeat(43);
        println!("{line}\nBatch: {}\n{line}", ctx.batch_id);
        batch.show_limit(self.num_rows).await.map_err(|e| {
            Error::datafusion(
                format!("batch {}: printing to the console", ctx.batch_id),
                e,
            )
        })?;
        Ok(())
    }
}
