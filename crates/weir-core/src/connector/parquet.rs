//! The Parquet sink in a pipeline file, and its reader for checks.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde::{Deserialize, Serialize};

use super::{
    BuildEnv, QueryIdentity, Relocation, SinkConnector, SinkHarness, SinkShape, SinkSpec,
    SinkVerifier, Verdict,
};
use crate::error::{Error, Result};
use crate::sink::{ForeachBatch, OWNER, PARQUET_POINTS, ParquetCompression, ParquetSink};
use crate::storage::{Location, blocking, is_hidden};

/// `[[sink]] type = "parquet"`.
///
/// ```toml
/// [[sink]]
/// type = "parquet"
/// path = "out"                    # or s3://bucket/prefix, ...
/// target-rows-per-file = 1000000
/// compression = "snappy"          # Spark's default; zstd | lz4 | gzip | none
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ParquetConfig {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_rows_per_file: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<ParquetCompression>,
}

impl ParquetConfig {
    fn location(&self, env: &BuildEnv) -> Result<Location> {
        env.location("sink.path", &self.path)
    }
}

impl SinkSpec for ParquetConfig {
    fn label(&self, env: &BuildEnv) -> String {
        match self.location(env) {
            Ok(l) => ParquetSink::new(l).label(),
            Err(_) => format!("parquet {}", self.path),
        }
    }

    fn build(&self, env: &BuildEnv) -> Result<Arc<dyn ForeachBatch>> {
        let mut p = ParquetSink::new(self.location(env)?);
        if let Some(n) = self.target_rows_per_file {
            p = p.target_rows_per_file(n);
        }
        if let Some(c) = self.compression {
            p = p.compression(c);
        }
        Ok(Arc::new(p))
    }

    fn app_id(&self, _query: &QueryIdentity) -> Option<String> {
        None
    }

    fn location(&self, env: &BuildEnv) -> Option<Location> {
        self.location(env).ok()
    }

    fn shape(&self) -> SinkShape {
        SinkShape::Append
    }
}

impl SinkHarness for ParquetConfig {
    fn fault_points(&self) -> Vec<&'static str> {
        PARQUET_POINTS.to_vec()
    }

    fn relocate(&mut self, to: &Relocation) -> Result<()> {
        self.path = to.dir.url_string();
        Ok(())
    }

    fn verifier(&self, env: &BuildEnv) -> Result<Option<Box<dyn SinkVerifier>>> {
        Ok(Some(Box::new(ParquetReader {
            dir: self.location(env)?,
        })))
    }
}

impl SinkConnector for ParquetConfig {
    const KIND: &'static str = "parquet";
}

/// Reads every part file of a Parquet sink's folder.
pub struct ParquetReader {
    pub dir: Location,
}

impl ParquetReader {
    /// (batch id, name) of every part file.
    async fn parts(&self) -> Result<Vec<(u64, String)>> {
        let mut out = Vec::new();
        for name in self.dir.list_names().await? {
            if is_hidden(&name) || !name.ends_with(".parquet") {
                continue;
            }
            let id = name
                .strip_prefix("batch-")
                .and_then(|r| r.split('-').next())
                .and_then(|n| n.parse::<u64>().ok())
                .ok_or_else(|| Error::Internal {
                    what: format!(
                        "{} is not a part file of the sink",
                        self.dir.describe(&name)
                    ),
                })?;
            out.push((id, name));
        }
        out.sort();
        Ok(out)
    }
}

#[async_trait]
impl SinkVerifier for ParquetReader {
    async fn rows(&self, schema: &SchemaRef) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::new();
        for (_, name) in self.parts().await? {
            let shown = self.dir.describe(&name);
            let bytes = self.dir.get(&name).await?.unwrap_or_default();
            let schema = schema.clone();
            let batches = blocking(move || {
                let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
                    .and_then(|b| b.build())
                    .map_err(|e| Error::Internal {
                        what: format!("reading {shown}: {e}"),
                    })?;
                let mut v = Vec::new();
                for b in reader {
                    let b = b.map_err(|e| Error::Internal {
                        what: format!("reading {shown}: {e}"),
                    })?;
                    v.push(select(&b, &schema, &shown)?);
                }
                Ok(v)
            })
            .await?;
            out.extend(batches);
        }
        Ok(out)
    }

    async fn check_bookkeeping(&self, query: &QueryIdentity, committed: u64) -> Result<Verdict> {
        let mut v = Verdict::default();
        let what = format!("parquet {}", self.dir);
        let parts = self.parts().await?;
        let beyond: Vec<&String> = parts
            .iter()
            .filter(|(id, _)| *id >= committed)
            .map(|(_, n)| n)
            .collect();
        if !beyond.is_empty() {
            v.mismatches.push(format!(
                "{what}: {} part files of batches that were not committed, e.g. {}",
                beyond.len(),
                beyond[0]
            ));
        }
        let owner = self.dir.get(OWNER).await?.unwrap_or_default();
        if !String::from_utf8_lossy(&owner).contains(&query.query_id.to_string())
            && !parts.is_empty()
        {
            v.mismatches.push(format!(
                "{what}: {OWNER} does not name the query {}",
                query.query_id
            ));
        }
        v.notes.push(format!("{what}: {} part files", parts.len()));
        Ok(v)
    }
}

/// The columns of `schema` from `b`, by name, cast to its types.
pub(crate) fn select(b: &RecordBatch, schema: &SchemaRef, shown: &str) -> Result<RecordBatch> {
    let mut cols = Vec::new();
    for f in schema.fields() {
        let c = b.column_by_name(f.name()).ok_or_else(|| Error::Internal {
            what: format!("{shown}: no column '{}'", f.name()),
        })?;
        cols.push(
            datafusion::arrow::compute::cast(c, f.data_type()).map_err(|e| Error::Internal {
                what: format!("{shown}: column '{}': {e}", f.name()),
            })?,
        );
    }
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| Error::Internal {
        what: format!("{shown}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_is_spark_s_names_and_a_wrong_one_is_refused_by_name() {
        let c: ParquetConfig =
            serde_json::from_value(serde_json::json!({"path": "out", "compression": "zstd"}))
                .unwrap();
        assert_eq!(c.compression, Some(ParquetCompression::Zstd));
        let e = serde_json::from_value::<ParquetConfig>(
            serde_json::json!({"path": "out", "compression": "brotli"}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("brotli") && e.contains("snappy") && e.contains("zstd"),
            "{e}"
        );
    }
}
