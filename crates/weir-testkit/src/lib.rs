//! Dev-only helpers for weir's tests: run the `weir` binary with a fault point, read what
//! the sinks wrote, and compare it with a reference computed from the input.
//!
//! No mocks: outputs are read from the real files and tables the sinks wrote.

use std::path::Path;
use std::process::{Command, Output};

use weir_core::datafusion::arrow::util::display::array_value_to_string;
use weir_core::datafusion::prelude::{DataFrame, ParquetReadOptions, SessionContext};

/// Runs `bin args...` with `WEIR_FAULT` set to `fault` (or unset).
pub fn run_weir(bin: &Path, args: &[&str], fault: Option<&str>) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_remove("WEIR_FAULT")
        .env("RUST_LOG", "warn");
    if let Some(f) = fault {
        cmd.env("WEIR_FAULT", f);
    }
    match cmd.output() {
        Ok(o) => o,
        Err(e) => panic!("cannot run {}: {e}", bin.display()),
    }
}

/// Every row of `df` as a string `a|b|c`, sorted: a multiset to compare outputs with.
pub async fn rows(df: DataFrame) -> Vec<String> {
    let batches = match df.collect().await {
        Ok(b) => b,
        Err(e) => panic!("collecting rows: {e}"),
    };
    let mut out = Vec::new();
    for b in &batches {
        for r in 0..b.num_rows() {
            let cells: Vec<String> = b
                .columns()
                .iter()
                .map(|c| array_value_to_string(c, r).unwrap_or_else(|e| format!("<{e}>")))
                .collect();
            out.push(cells.join("|"));
        }
    }
    out.sort();
    out
}

/// The rows of all Parquet files in `dir`, sorted (empty if the folder has none).
pub async fn parquet_rows(dir: &Path, columns: &[&str]) -> Vec<String> {
    let has_files = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().ends_with(".parquet"))
        })
        .unwrap_or(false);
    if !has_files {
        return Vec::new();
    }
    let ctx = SessionContext::new();
    let df = match ctx
        .read_parquet(
            dir.to_string_lossy().to_string(),
            ParquetReadOptions::default(),
        )
        .await
        .and_then(|d| d.select_columns(columns))
    {
        Ok(d) => d,
        Err(e) => panic!("reading Parquet in {}: {e}", dir.display()),
    };
    rows(df).await
}

/// A temp folder that `postgres` and other users can read (under /tmp).
pub fn temp_dir() -> tempfile::TempDir {
    match tempfile::Builder::new()
        .prefix("weir-test-")
        .tempdir_in("/tmp")
    {
        Ok(d) => d,
        Err(e) => panic!("cannot create a temp folder: {e}"),
    }
}

mod pg;
pub use pg::{PgServer, postgres, start_postgres};

/// Runs `sql` on the server at `url` and returns the rows as `a|b|c` strings, sorted.
/// Every column must be castable to text (the query should `::text` what it selects).
pub async fn pg_rows(url: &str, sql: &str) -> Vec<String> {
    let (client, conn) = match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => panic!("connecting to PostgreSQL: {e}"),
    };
    tokio::spawn(conn);
    let rows = match client.query(sql, &[]).await {
        Ok(r) => r,
        Err(e) => panic!("{sql}: {e}"),
    };
    let mut out: Vec<String> = rows
        .iter()
        .map(|r| {
            (0..r.len())
                .map(|i| {
                    r.get::<_, Option<String>>(i)
                        .unwrap_or_else(|| "NULL".into())
                })
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect();
    out.sort();
    out
}

/// Runs statements on the server at `url`.
pub async fn pg_exec(url: &str, sql: &str) {
    let (client, conn) = match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => panic!("connecting to PostgreSQL: {e}"),
    };
    tokio::spawn(conn);
    if let Err(e) = client.batch_execute(sql).await {
        panic!("{sql}: {e}");
    }
}

mod kafka;
pub use kafka::{KafkaBroker, OwnBroker, kafka, start_kafka};

mod azure;
mod delay;
pub use delay::DelayProxy;
mod kafka_tls;
mod s3;
pub mod service;
pub use azure::{Azurite, azurite};
pub use kafka_tls::{TlsBroker, kafka_tls};
pub use s3::{S3Server, s3};

/// A DataFrame of orders `(order_id, status, updated_at)`; `updated_at` given in seconds.
pub fn order_rows(rows: &[(i64, &str, i64)]) -> DataFrame {
    let rows: Vec<(Option<i64>, &str, Option<i64>)> =
        rows.iter().map(|r| (Some(r.0), r.1, Some(r.2))).collect();
    order_rows_opt(&rows)
}

/// Like [`order_rows`], with NULLs allowed in `order_id` and `updated_at`.
pub fn order_rows_opt(rows: &[(Option<i64>, &str, Option<i64>)]) -> DataFrame {
    use std::sync::Arc;
    use weir_core::datafusion::arrow::array::{Int64Array, StringArray, TimestampMicrosecondArray};
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
    use weir_core::datafusion::arrow::record_batch::RecordBatch;
    let schema = Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ]));
    let ts: Vec<Option<i64>> = rows.iter().map(|r| r.2.map(|s| s * 1_000_000)).collect();
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(
                rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            )),
            Arc::new(StringArray::from(
                rows.iter().map(|r| r.1).collect::<Vec<_>>(),
            )),
            Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("UTC")),
        ],
    );
    match batch.and_then(|b| SessionContext::new().read_batch(b).map_err(Into::into)) {
        Ok(df) => df,
        Err(e) => panic!("building order rows: {e}"),
    }
}

/// The context a sink sees for batch `batch_id` of query `orders` with id `query_id`
/// (a checkpoint counts as new at batch 0).
pub fn batch_context(query_id: uuid::Uuid, batch_id: u64) -> weir_core::BatchContext {
    weir_core::BatchContext::new(query_id, "orders", batch_id)
}
