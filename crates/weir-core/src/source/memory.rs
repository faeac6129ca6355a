//! An in-memory source for tests and examples: append record batches, read them back
//! by offset. Offsets count appended batches: `{"batches":N}` means "the first N".

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::prelude::{DataFrame, SessionContext};

use super::{ReadLimit, Source, SourceOffset};
use crate::error::{Error, Result};

/// Batches appended by the program. Cloning shares the same data.
#[derive(Debug, Clone)]
pub struct MemorySource {
    schema: SchemaRef,
    batches: Arc<Mutex<Vec<RecordBatch>>>,
    available_now: Arc<Mutex<Option<usize>>>,
}

impl MemorySource {
    /// An empty source of `schema`.
    pub fn new(schema: SchemaRef) -> Self {
        MemorySource {
            schema,
            batches: Arc::default(),
            available_now: Arc::default(),
        }
    }

    /// Appends a batch; it is seen by the next trigger. Its schema must be the source's.
    pub fn add(&self, batch: RecordBatch) -> Result<()> {
        if batch.schema().fields() != self.schema.fields() {
            return Err(self.err(format!(
                "batch schema {:?} differs from the source schema {:?}",
                batch.schema(),
                self.schema
            )));
        }
        self.lock()?.push(batch);
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<RecordBatch>>> {
        self.batches
            .lock()
            .map_err(|_| self.err("poisoned by an earlier panic"))
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::from_source("MemoryStream", reason.into())
    }

    fn count(&self, o: Option<&SourceOffset>) -> Result<usize> {
        match o {
            None => Ok(0),
            Some(o) => o
                .json()
                .get("batches")
                .and_then(|v| v.as_u64())
                .map(|n| n as usize)
                .ok_or_else(|| {
                    self.err(format!(
                        "offset {o} is not a memory offset {{\"batches\":N}}"
                    ))
                }),
        }
    }
}

#[async_trait]
impl Source for MemorySource {
    fn description(&self) -> String {
        "MemoryStream".into()
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn prepare_available_now(&self) -> Result<()> {
        let n = self.lock()?.len();
        *self
            .available_now
            .lock()
            .map_err(|_| self.err("poisoned"))? = Some(n);
        Ok(())
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let from = self.count(start)?;
        let batches = self.lock()?;
        let cap = self
            .available_now
            .lock()
            .map_err(|_| self.err("poisoned"))?
            .unwrap_or(batches.len());
        let mut end = from;
        let mut rows = 0u64;
        while end < cap.min(batches.len()) {
            if end > from
                && limit
                    .max_rows
                    .is_some_and(|m| rows + batches[end].num_rows() as u64 > m)
            {
                break;
            }
            rows += batches[end].num_rows() as u64;
            end += 1;
        }
        if end == from {
            return Ok(start.cloned());
        }
        Ok(Some(SourceOffset::new(
            serde_json::json!({ "batches": end }),
        )))
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        let (from, to) = (self.count(start)?, self.count(Some(end))?);
        let batches = self.lock()?;
        let part = batches
            .get(from..to)
            .ok_or_else(|| {
                self.err(format!(
                    "range {from}..{to} is beyond the {} batches added",
                    batches.len()
                ))
            })?
            .to_vec();
        let table = MemTable::try_new(self.schema.clone(), vec![part])
            .map_err(|e| Error::datafusion("MemoryStream: building the batch", e))?;
        ctx.read_table(Arc::new(table))
            .map_err(|e| Error::datafusion("MemoryStream: reading the batch", e))
    }
}
