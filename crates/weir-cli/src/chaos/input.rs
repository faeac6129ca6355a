//! The chaos run's input: order files in a folder, and for Kafka a topic holding the same
//! lines. With `odd`, input that looks like real input (awkward names, empty files, NULLs,
//! ties, skewed partitions).

use std::path::PathBuf;

use anyhow::{Context, Result};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::source::decode;

use crate::demo::produce_lines;
use crate::generate::{GenArgs, Written, generate, orders_schema};

pub(super) const PARTITIONS: i32 = 3;

pub(super) struct Input {
    pub files_dir: PathBuf,
    pub kafka: Option<(String, String)>,
    pub next_file: usize,
    pub seed: u64,
    pub keys: u64,
    pub rows_per_file: usize,
    pub odd: bool,
    /// Records produced to Kafka so far.
    pub sent: u64,
    pub written: Vec<Written>,
}

impl Input {
    /// Adds `files` files of orders (and produces them for Kafka); returns the rows added.
    pub(super) async fn add(&mut self, files: usize) -> Result<u64> {
        let mut args = GenArgs::new(
            self.files_dir.clone(),
            files,
            self.rows_per_file,
            self.keys,
            self.seed,
        );
        args.first_file = self.next_file;
        args.odd = self.odd;
        let new = generate(&args)?;
        self.next_file += files;
        let rows: u64 = new.iter().map(|w| w.rows as u64).sum();
        if let Some((brokers, topic)) = &self.kafka {
            let paths: Vec<PathBuf> = new.iter().map(|w| w.path.clone()).collect();
            self.sent +=
                produce_lines(brokers, topic, PARTITIONS, &paths, self.sent, self.odd).await?;
        }
        self.written.extend(new);
        Ok(rows)
    }

    /// Every input row, in the orders schema.
    pub(super) fn rows(&self) -> Result<Vec<RecordBatch>> {
        let schema = orders_schema();
        let mut out = Vec::new();
        for w in &self.written {
            let bytes =
                std::fs::read(&w.path).with_context(|| format!("reading {}", w.path.display()))?;
            let b = decode::json_all(&schema, &bytes, Some(w.rows))
                .map_err(|e| anyhow::anyhow!("{}: {e}", w.path.display()))?;
            out.push(b);
        }
        Ok(out)
    }

    /// The rows of each input file, by file name.
    pub(super) fn rows_by_name(&self) -> std::collections::HashMap<String, usize> {
        self.written
            .iter()
            .filter_map(|w| Some((w.path.file_name()?.to_string_lossy().into_owned(), w.rows)))
            .collect()
    }
}
