//! # weir-console
//!
//! `[[sink]] type = "console"`: prints each batch, as Spark's console sink does. A demo
//! sink with no idempotency (a replay prints again), and the smallest complete connector:
//! the sink, its config with the production ([`SinkSpec`]) and harness ([`SinkHarness`])
//! sides, and its [`SinkConnector`] kind. The `weir` crate's registry lists it in one line.

use std::sync::Arc;

use async_trait::async_trait;
use weir_core::connector::{
    BuildEnv, QueryIdentity, Relocation, SinkConnector, SinkHarness, SinkShape, SinkSpec,
    SinkVerifier,
};
use weir_core::datafusion::prelude::DataFrame;
use weir_core::{BatchContext, BoxError, Error, ForeachBatch, Result};

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

impl SinkSpec for ConsoleConfig {
    fn label(&self, _env: &BuildEnv) -> String {
        "console".into()
    }

    fn build(&self, _env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>> {
        Ok(Arc::new(ConsoleSink::new(self.num_rows.unwrap_or(20))))
    }

    fn app_id(&self, _query: &QueryIdentity) -> Option<String> {
        None
    }

    fn shape(&self) -> SinkShape {
        SinkShape::Unchecked
    }
}

impl SinkHarness for ConsoleConfig {
    fn fault_points(&self) -> Vec<&'static str> {
        Vec::new()
    }

    fn relocate(&mut self, _to: &Relocation) -> Result<()> {
        Ok(())
    }

    fn verifier(&self, _env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>> {
        Ok(None)
    }
}

impl SinkConnector for ConsoleConfig {
    const KIND: &'static str = "console";
}
