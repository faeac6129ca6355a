//! The seed article's worked example, as code: upserting orders into Delta and PostgreSQL.
//!
//! The `orders` topic carries the full current state of an order on every change (JSON
//! values with `order_id`, `status`, `amount`, `updated_at`). Each micro-batch:
//!
//! 1. keeps the newest row per `order_id` in the batch (a Delta MERGE refuses two source
//!    rows for one target row; so does `ON CONFLICT DO UPDATE`),
//! 2. caches that result, because two sinks read it,
//! 3. MERGEs it into a Delta table with the guard `s.updated_at > t.updated_at`, recording
//!    (app id, batch id) in the same commit so a replay is skipped,
//! 4. upserts the same rows into PostgreSQL, the write hardest to undo, last: staged in a
//!    persistent staging table keyed by batch (cleared first on every attempt), then ledger
//!    row + `INSERT .. ON CONFLICT .. WHERE o.updated_at < EXCLUDED.updated_at` in one
//!    transaction,
//! 5. releases the cache whatever happened, and returns any error with the batch and the
//!    sink that failed, so the batch is not committed and runs again on restart.
//!
//! ```text
//! KAFKA_BOOTSTRAP=localhost:9092 DATABASE_URL='host=localhost user=postgres dbname=postgres' \
//!   cargo run -p weir --example orders_upsert [-- <topic> <folder>]
//! ```
//!
//! The same pipeline without code is `examples/orders_upsert.toml` (`weir run`), and
//! `weir chaos` kills it a hundred times and checks both tables.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use weir::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use weir::datafusion::prelude::DataFrame;
use weir::delta::DeltaMerge;
use weir::kafka::{BadRecordMode, KafkaOptions, KafkaSource, ValueFormat};
use weir::postgres::PostgresUpsert;
use weir::{BatchContext, BoxError, ForeachBatch, Trigger, WeirSession, dedupe_latest};

/// The two writes of one batch, in order.
struct Sinks {
    delta: DeltaMerge,
    postgres: PostgresUpsert,
}

/// The function handed to `foreach_batch`: the seed's `merge_latest(batch_df, batch_id)`.
async fn merge_latest(sinks: &Sinks, batch: DataFrame, ctx: BatchContext) -> Result<()> {
    let id = ctx.batch_id;
    // 1. Collapse duplicates inside the batch: newest row per order_id, by a window.
    let latest = dedupe_latest(batch, &["order_id".to_string()], "updated_at")
        .with_context(|| format!("batch {id}: newest row per order_id"))?;
    // 2. persist(): both sinks read these rows; the batch plan runs once.
    let latest = latest
        .cache()
        .await
        .with_context(|| format!("batch {id}: caching the newest rows"))?;
    let result = async {
        // 3. Delta MERGE with the updated_at guard (the sink writes the txn action).
        sinks
            .delta
            .call(latest.clone(), ctx.clone())
            .await
            .map_err(anyhow::Error::from_boxed)
            .with_context(|| {
                format!(
                    "batch {id}: MERGE into the Delta table {}",
                    sinks.delta.location()
                )
            })?;
        // 4. PostgreSQL last: staging rows for this batch, then the ledger transaction.
        sinks
            .postgres
            .call(latest.clone(), ctx.clone())
            .await
            .map_err(anyhow::Error::from_boxed)
            .with_context(|| format!("batch {id}: upsert into PostgreSQL table orders"))
    }
    .await;
    // 5. unpersist() in all cases: the cached batches are freed here, success or not.
    drop(latest);
    result
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            "warn,buoyant_kernel::snapshot=off,deltalake_core::operations::merge=error",
        )
        .init();
    let mut args = std::env::args().skip(1);
    let topic = args.next().unwrap_or_else(|| "orders".into());
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "orders-example".into()));
    let brokers = std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "localhost:9092".into());
    let url = std::env::var("DATABASE_URL")
        .context("set DATABASE_URL to the PostgreSQL database to upsert into")?;

    let schema = Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Int64, false),
        Field::new("status", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
    ]));
    let mut options = KafkaOptions::new(&brokers, vec![topic]);
    options.value_format = ValueFormat::Json {
        schema,
        mode: BadRecordMode::FailFast,
    };

    let keys = vec!["order_id".to_string()];
    let sinks = Arc::new(Sinks {
        // Already deduplicated above: the sinks need not do it again.
        delta: DeltaMerge::new(dir.join("silver_orders"), keys.clone(), "updated_at").dedupe(false),
        postgres: PostgresUpsert::new(url, "orders", keys, "updated_at")
            .dedupe(false)
            .create_table(true)
            .staging_table("orders_batch_staging")
            .ledger("stream_batches"),
    });

    let query = WeirSession::new()
        .read_stream()
        .source(Arc::new(KafkaSource::new(options)?))
        .max_offsets_per_trigger(200_000)
        .load()
        .await?
        .write_stream()
        .query_name("orders-upsert")
        .checkpoint(dir.join("checkpoint"))
        .trigger(Trigger::ProcessingTime(std::time::Duration::from_secs(30)))
        .foreach_batch(move |batch: DataFrame, ctx: BatchContext| {
            let sinks = sinks.clone();
            async move {
                merge_latest(&sinks, batch, ctx)
                    .await
                    .map_err(BoxError::from)
            }
        })
        .start()
        .await?;
    println!(
        "orders-upsert running (query id {}); Ctrl-C stops after the current batch",
        query.id()
    );
    let stop = query.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = stop.stop().await;
        }
    });
    query.await_termination().await?;
    if let Some(p) = query.last_progress() {
        println!(
            "last batch {}: {} rows, addBatch {} ms, triggerExecution {} ms",
            p.batch_id,
            p.num_input_rows,
            p.duration_ms.get("addBatch").copied().unwrap_or(0),
            p.duration_ms.get("triggerExecution").copied().unwrap_or(0)
        );
    }
    Ok(())
}
