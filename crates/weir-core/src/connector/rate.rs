//! The rate source in a pipeline file: `[source] type = "rate"`.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;

use super::{BuildEnv, Feed, FeedKind, SourceConnector, SourceHarness, SourceSpec};
use crate::error::{Error, Result};
use crate::source::{RateSource, ReadLimit, Source};

/// `[source] type = "rate"`: generated rows for load tests.
///
/// ```toml
/// [source]
/// type = "rate"
/// rows-per-second = 1000
/// max-offsets-per-trigger = 100
/// ```
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RateConfig {
    pub rows_per_second: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_offsets_per_trigger: Option<u64>,
}

#[async_trait]
impl SourceSpec for RateConfig {
    fn check(&self, _env: &BuildEnv) -> Result<()> {
        RateSource::new(self.rows_per_second).map(|_| ())
    }

    async fn build(&self, _env: &BuildEnv) -> Result<Arc<dyn Source>> {
        Ok(Arc::new(RateSource::new(self.rows_per_second)?))
    }

    fn schema(&self, _env: &BuildEnv) -> Result<Option<SchemaRef>> {
        Ok(Some(RateSource::new(self.rows_per_second)?.schema()))
    }

    fn read_limit(&self) -> Result<ReadLimit> {
        if self.max_offsets_per_trigger == Some(0) {
            return Err(Error::config(
                "source.max-offsets-per-trigger",
                "0 would never read a row: give at least 1",
            ));
        }
        Ok(ReadLimit {
            max_rows: self.max_offsets_per_trigger,
            ..ReadLimit::ALL
        })
    }
}

impl SourceHarness for RateConfig {
    fn feed_kind(&self) -> Option<FeedKind> {
        None
    }

    fn relocate(&mut self, _feed: &Feed, _batch_rows: u64) -> Result<()> {
        Err(Error::config(
            "source.type",
            "the rate source generates its rows; it cannot read a feed",
        ))
    }
}

impl SourceConnector for RateConfig {
    const KIND: &'static str = "rate";
}
