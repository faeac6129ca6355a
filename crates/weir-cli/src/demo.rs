//! `weir demo`: the seed's orders pipeline on embedded defaults. Local files in, a local
//! Delta table out (MERGE, newest row per order_id), plus a Parquet folder of the rows
//! each batch applied. Ends with a check of the table against the input.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use weir_core::datafusion::prelude::{JsonReadOptions, SessionContext};
use weir_core::{ForeachBatch, Location, ParquetSink, Trigger, WeirSession, dedupe_latest};
use weir_delta::{DeltaMerge, read_table, table_version};
use weir_kafka::{BadRecordMode, KafkaOptions, KafkaSource, ValueFormat};
use weir_postgres::{PostgresUpsert, tokio_postgres};

use crate::generate::{GenArgs, generate, orders_schema};
use crate::report::HumanLines;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DemoArgs {
    /// Working folder (input, checkpoint, tables). Recreated on each run.
    #[arg(long, default_value = "weir-demo")]
    pub dir: PathBuf,
    /// Order files to write.
    #[arg(long, default_value_t = 10)]
    pub files: usize,
    /// Rows per file.
    #[arg(long, default_value_t = 2000)]
    pub rows_per_file: usize,
    /// Distinct order ids.
    #[arg(long, default_value_t = 5000)]
    pub keys: u64,
    /// Files per batch (maxFilesPerTrigger).
    #[arg(long, default_value_t = 2)]
    pub max_files_per_trigger: usize,
    /// Also upsert into PostgreSQL (table `weir_demo_orders`), the worked example's second
    /// sink: libpq form (`host=.. port=.. user=.. dbname=..`) or a `postgresql://` URL.
    #[arg(long)]
    pub postgres: Option<String>,
    /// Read the orders from Kafka instead of the folder: the demo first produces the same
    /// order lines into a new 3-partition topic on these brokers.
    #[arg(long)]
    pub kafka: Option<String>,
}

/// Empties `dir` for a command that owns it: a folder holding files but no `.weir-<command>`
/// marker was not made by the command and is refused, never deleted.
pub(crate) fn prepare_dir(dir: &Path, command: &str) -> Result<()> {
    let marker = dir.join(format!(".weir-{command}"));
    if dir.exists() {
        let empty = std::fs::read_dir(dir)?.next().is_none();
        if !empty && !marker.exists() {
            bail!(
                "{} exists and was not made by `weir {command}`; pick another folder with --dir",
                dir.display()
            );
        }
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        marker,
        format!("made by weir {command}; removed on the next run\n"),
    )?;
    Ok(())
}

pub(crate) async fn run(args: DemoArgs) -> Result<()> {
    let dir = &args.dir;
    prepare_dir(dir, "demo")?;
    if let Some(url) = &args.postgres {
        // The demo owns this table: start it afresh like the folder.
        pg_exec(url, &format!("DROP TABLE IF EXISTS {PG_TABLE}")).await?;
    }
    let input = dir.join("input");
    generate(&GenArgs::new(
        input.clone(),
        args.files,
        args.rows_per_file,
        args.keys,
        42,
    ))?;
    let delta_path = dir.join("orders_delta");
    let parquet_path = dir.join("orders_applied_parquet");
    println!(
        "wrote {} order files ({} rows, {} order ids) to {}",
        args.files,
        args.files * args.rows_per_file,
        args.keys,
        input.display()
    );

    let delta_at = Location::local(&delta_path);
    let merge = DeltaMerge::new(delta_at.clone(), ["order_id"], "updated_at");
    let parquet = ParquetSink::new(Location::local(&parquet_path));
    let pg = args.postgres.as_ref().map(|url| {
        PostgresUpsert::new(url, PG_TABLE, ["order_id"], "updated_at")
            .create_table(true)
            .dedupe(false)
    });
    let session = WeirSession::new();
    let stream = match &args.kafka {
        None => {
            session
                .read_stream()
                .files(&input)
                .schema(orders_schema())
                .max_files_per_trigger(args.max_files_per_trigger)
                .load()
                .await?
        }
        Some(brokers) => {
            let topic = produce_orders(brokers, &input).await?;
            println!("produced the orders to Kafka topic {topic} on {brokers}");
            let mut o = KafkaOptions::new(brokers, vec![topic]);
            o.value_format = ValueFormat::Json {
                schema: orders_schema(),
                mode: BadRecordMode::FailFast,
            };
            session
                .read_stream()
                .source(Arc::new(KafkaSource::new(o)?))
                .max_offsets_per_trigger((args.max_files_per_trigger * args.rows_per_file) as u64)
                .load()
                .await?
        }
    };
    let query = stream
        .write_stream()
        .query_name("orders-demo")
        .checkpoint(dir.join("checkpoint"))
        .trigger(Trigger::AvailableNow)
        .listener(Arc::new(HumanLines))
        .foreach_batch_with(
            (merge, parquet, pg),
            |(merge, parquet, pg), batch, ctx| async move {
                // The worked example: newest row per order, held once for every write,
                // the write hardest to undo (PostgreSQL) last.
                let latest = dedupe_latest(batch, &["order_id".to_string()], "updated_at")?
                    .cache()
                    .await?;
                merge.call(latest.clone(), ctx.clone()).await?;
                parquet.call(latest.clone(), ctx.clone()).await?;
                if let Some(pg) = pg {
                    pg.call(latest, ctx).await?;
                }
                Ok(())
            },
        )
        .start()
        .await?;
    query.await_termination().await?;

    let ctx = SessionContext::new();
    let all = ctx
        .read_json(
            input.to_string_lossy().to_string(),
            JsonReadOptions::default()
                .schema(&orders_schema())
                .file_extension(".json"),
        )
        .await?;
    let input_rows = all.clone().count().await?;
    let reference = dedupe_latest(all, &["order_id".to_string()], "updated_at")?;
    let expected = reference.clone().count().await?;
    let table = read_table(&ctx, &delta_at).await?;
    let table_rows = table.clone().count().await?;
    let missing = reference.clone().except(table.clone())?.count().await?;
    let extra = table.except(reference)?.count().await?;
    let version = table_version(&delta_at)
        .await?
        .map_or("none".to_string(), |v| v.to_string());
    let applied = ctx
        .read_parquet(
            parquet_path.to_string_lossy().to_string(),
            Default::default(),
        )
        .await?
        .count()
        .await?;
    let batches = query.recent_progress().len();
    println!("---");
    println!(
        "input       {input_rows} rows in {} files, {expected} distinct order ids",
        args.files
    );
    println!(
        "batches     {batches} (max {} files each)",
        args.max_files_per_trigger
    );
    println!(
        "delta       {} : {table_rows} rows, version {version}",
        delta_path.display()
    );
    println!(
        "parquet     {} : {applied} rows applied",
        parquet_path.display()
    );
    println!(
        "check       {missing} rows missing, {extra} rows extra against the newest row per order_id"
    );
    if missing != 0 || extra != 0 || table_rows != expected {
        bail!("the Delta table does not match the input: {missing} missing, {extra} extra");
    }
    if let Some(url) = &args.postgres {
        let n = postgres_count(url).await?;
        println!("postgres    {PG_TABLE} : {n} rows");
        if n != expected as i64 {
            bail!("the PostgreSQL table has {n} rows, expected {expected}");
        }
    }
    Ok(())
}

const PG_TABLE: &str = "weir_demo_orders";

/// Produces every line of the order files to a new 3-partition topic.
async fn produce_orders(brokers: &str, input: &Path) -> Result<String> {
    let topic = format!("weir-demo-orders-{}", chrono::Utc::now().timestamp_millis());
    weir_kafka::create_topic(brokers, &topic, 3).await?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(input)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    files.sort();
    produce_lines(brokers, &topic, 3, &files, 0, false).await?;
    Ok(topic)
}

/// Produces every line of `files` to `topic`, round-robin over `partitions` starting after
/// `sent` earlier records (with `skew`, 4 records in 5 go to partition 0); all are in flight
/// at once, then each delivery is awaited. Returns the number of records produced.
pub(crate) async fn produce_lines(
    brokers: &str,
    topic: &str,
    partitions: i32,
    files: &[PathBuf],
    sent: u64,
    skew: bool,
) -> Result<u64> {
    use weir_kafka::rdkafka::ClientConfig;
    use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "2000000")
        .set("queue.buffering.max.kbytes", "2097151")
        .create()?;
    let mut pending = Vec::new();
    let mut i = sent;
    for f in files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        for line in text.lines() {
            let n = partitions.max(1) as u64;
            let partition = if skew && n > 1 {
                if i % 5 < 4 { 0 } else { 1 + (i / 5) % (n - 1) }
            } else {
                i % n
            };
            let record = FutureRecord::<(), _>::to(topic)
                .partition(partition as i32)
                .payload(line);
            let delivery = producer
                .send_result(record)
                .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
            pending.push(delivery);
            i += 1;
        }
    }
    for d in pending {
        d.await
            .map_err(|_| anyhow::anyhow!("producing to {topic}: the producer went away"))?
            .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
    }
    Ok(i - sent)
}

async fn pg_exec(url: &str, sql: &str) -> Result<()> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL (--postgres)")?;
    tokio::spawn(conn);
    client
        .batch_execute(sql)
        .await
        .with_context(|| sql.to_string())?;
    Ok(())
}

async fn postgres_count(url: &str) -> Result<i64> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL to count the demo's rows")?;
    tokio::spawn(conn);
    let row = client
        .query_one(&format!("SELECT count(*) FROM {PG_TABLE}"), &[])
        .await?;
    Ok(row.get(0))
}
