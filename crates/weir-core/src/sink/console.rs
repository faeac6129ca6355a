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

/// `[[sink]] type = "console"`: prints each batch (no idempotency; a demo sink).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ConsoleConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_rows: Option<usize>,
}

impl crate::connector::SinkSpec for ConsoleConfig {
    fn kind(&self) -> &'static str {
        "console"
    }

    fn label(&self, _env: &crate::connector::BuildEnv) -> String {
        "console".into()
    }

    fn build(
        &self,
        _env: &crate::connector::BuildEnv,
    ) -> crate::Result<std::sync::Arc<dyn ForeachBatch>> {
        Ok(std::sync::Arc::new(ConsoleSink::new(
            self.num_rows.unwrap_or(20),
        )))
    }

    fn fault_points(&self) -> Vec<&'static str> {
        Vec::new()
    }

    fn shape(&self) -> crate::connector::SinkShape {
        crate::connector::SinkShape::Unchecked
    }

    fn app_id(&self, _query: &crate::sink::QueryIdentity) -> Option<String> {
        None
    }

    fn relocate(&mut self, _to: &crate::connector::Relocation) -> crate::Result<()> {
        Ok(())
    }

    fn verifier(
        &self,
        _env: &crate::connector::BuildEnv,
    ) -> crate::Result<Option<Box<dyn crate::connector::SinkVerifier>>> {
        Ok(None)
    }
}
