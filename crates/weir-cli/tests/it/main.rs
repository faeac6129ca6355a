//! The `weir` binary end to end: kills at every fault point, bad configs, the demo.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bad_records;
mod chaos;
mod cluster;
mod cluster_delta;
mod cluster_kafka;
mod cluster_merge;
mod cluster_network;
mod cluster_pg;
mod cluster_state;
mod cluster_tls;
mod config;
mod durability;
mod kafka_dead_letter;
mod kafka_recreated;
mod kills;
mod monitor;
mod outages;
mod signals;
mod spark;
mod startup;
mod storage;
mod tombstones;

use std::path::{Path, PathBuf};

use weir_core::datafusion::prelude::{JsonReadOptions, SessionContext};
use weir_testkit::{rows, run_weir};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_weir"))
}

pub fn gen_orders(input: &Path, files: usize, rows_per_file: usize, keys: u64) {
    weir_gen(input, files, rows_per_file, &["--keys", &keys.to_string()]);
}

/// Order files numbered from `first`, `files` of `rows` rows over 5 keys, into `input`.
pub fn gen_orders_from(input: &Path, first: usize, files: usize, rows: usize, _keys: u64) {
    weir_gen(input, files, rows, &["--first-file", &first.to_string()]);
}

/// `weir gen` of `files` files of `rows` rows into `input`, with `extra` arguments; it must
/// succeed.
pub fn weir_gen(input: &Path, files: usize, rows: usize, extra: &[&str]) {
    let (files, rows) = (files.to_string(), rows.to_string());
    let mut args = vec![
        "gen",
        "--dir",
        input.to_str().unwrap(),
        "--files",
        &files,
        "--rows-per-file",
        &rows,
    ];
    args.extend_from_slice(extra);
    let out = run_weir(&bin(), &args, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub const SCHEMA: &str =
    r#"["order_id bigint", "status string", "amount double", "updated_at timestamp"]"#;

pub fn pipeline(dir: &Path, sinks: &str) -> PathBuf {
    pipeline_with(dir, 1, sinks)
}

/// The orders pipeline over `dir/in` taking `max_files` files a batch, with `rest` (the
/// transform, sinks, cluster) after its source.
pub fn pipeline_with(dir: &Path, max_files: usize, rest: &str) -> PathBuf {
    let p = dir.join("pipeline.toml");
    let text = format!(
        r#"[query]
name = "orders"
checkpoint = "chk"
trigger = "available-now"

[source]
type = "files"
path = "in"
format = "json"
schema = {SCHEMA}
max-files-per-trigger = {max_files}

{rest}
"#
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// Runs `weir run p --progress progress` (with `WEIR_FAULT=fault`, if any).
pub fn run_with_progress(p: &Path, progress: &Path, fault: Option<&str>) -> std::process::Output {
    run_weir(
        &bin(),
        &[
            "run",
            p.to_str().unwrap(),
            "--progress",
            progress.to_str().unwrap(),
        ],
        fault,
    )
}

/// Runs `p` to its end (it must succeed); its last progress report.
pub fn run_to_end(p: &Path, progress: &Path) -> serde_json::Value {
    let out = run_with_progress(p, progress, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    last_progress(progress)
}

/// The last line of a progress file.
pub fn last_progress(progress: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(progress).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

pub async fn input_rows(input: &Path) -> Vec<String> {
    let ctx = SessionContext::new();
    let schema = weir_cli_schema();
    let df = ctx
        .read_json(
            input.to_str().unwrap(),
            JsonReadOptions::default()
                .schema(&schema)
                .file_extension(".json"),
        )
        .await
        .unwrap();
    rows(df).await
}

pub fn weir_cli_schema() -> weir_core::datafusion::arrow::datatypes::Schema {
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
    Schema::new(vec![
        Field::new("order_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ])
}

pub fn progress_batches(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["batchId"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// The orders schema as the pipelines in these tests declare it.
pub fn orders_schema() -> weir_core::datafusion::arrow::datatypes::SchemaRef {
    std::sync::Arc::new(weir_cli_schema())
}

/// Every row of the generated files in `input`, decoded with the orders schema.
pub async fn input_batches(
    input: &Path,
) -> Vec<weir_core::datafusion::arrow::record_batch::RecordBatch> {
    let ctx = SessionContext::new();
    ctx.read_json(
        input.to_str().unwrap(),
        JsonReadOptions::default()
            .schema(&weir_cli_schema())
            .file_extension(".json"),
    )
    .await
    .unwrap()
    .collect()
    .await
    .unwrap()
}
