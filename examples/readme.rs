//! The README's Rust example, as code that `cargo test` builds and the weir crate's tests
//! run. Keep the block between the markers equal to the README's (a test checks it).

// README-BEGIN
use std::sync::Arc;

use weir::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use weir::delta::DeltaMerge;
use weir::{FileFormat, ForeachBatch, ParquetSink, Trigger, WeirSession, dedupe_latest};

#[tokio::main]
async fn main() -> Result<(), weir::BoxError> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ]));
    // Sinks take local paths or object-store URLs (session.location("key", "s3://...")?).
    let merge = DeltaMerge::new(
        std::path::Path::new("lake/orders"),
        ["order_id"],
        "updated_at",
    );
    let parquet = ParquetSink::new(std::path::Path::new("lake/orders_applied"));
    let query = WeirSession::new()
        .read_stream()
        .files("in")
        .format(FileFormat::Json)
        .schema(schema)
        .max_files_per_trigger(20)
        .load()
        .await?
        .write_stream()
        .query_name("orders-upsert")
        .checkpoint("chk/orders-upsert")
        .trigger(Trigger::AvailableNow) // or Trigger::ProcessingTime(Duration::from_secs(30))
        .foreach_batch_with(
            (merge, parquet),
            |(merge, parquet), batch, ctx| async move {
                let latest = dedupe_latest(batch, &["order_id".into()], "updated_at")?
                    .cache()
                    .await?; // persist(): both sinks read these rows
                merge.call(latest.clone(), ctx.clone()).await?; // Delta MERGE, skipped on replay
                parquet.call(latest, ctx).await?; // files named by batch id
                Ok(())
            },
        )
        .start()
        .await?;
    query.await_termination().await?;
    if let Some(p) = query.last_progress() {
        println!("batch {}: {} rows", p.batch_id, p.num_input_rows);
    }
    Ok(())
}
// README-END
