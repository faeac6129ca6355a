//! A reproducible generator of order files, the seed article's `orders` topic as files:
//! `order_id, status, amount, updated_at`, JSON lines. The same arguments always give
//! the same bytes. Events for one order arrive out of order across files (up to
//! `late_ms` late), so the `updated_at` guard has work to do.

use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};

/// What to generate.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GenArgs {
    /// Folder to write `orders-NNNNN.json` files into.
    #[arg(long)]
    pub dir: PathBuf,
    /// Number of files.
    #[arg(long, default_value_t = 10)]
    pub files: usize,
    /// Rows in each file.
    #[arg(long, default_value_t = 1000)]
    pub rows_per_file: usize,
    /// Distinct order ids.
    #[arg(long, default_value_t = 3000)]
    pub keys: u64,
    /// Seed of the pseudo-random sequence.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// How late an event may arrive, in ms of event time (below 100000).
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(0..100_000))]
    pub late_ms: u64,
    /// The first file's number (to add files to a folder that has some).
    #[arg(long, default_value_t = 0)]
    pub first_file: usize,
    /// Input that looks like real input: some file names with brackets, `*`, `?`, spaces,
    /// `%` and non-ASCII letters, every 7th file empty, NULL `status`/`amount` in some rows,
    /// and rows that tie with another row of their order on `updated_at`.
    #[arg(long)]
    pub odd: bool,
    /// Also produce every line to a new Kafka topic (`--topic`) on these brokers, spread
    /// over `--partitions` partitions (for benchmarks and clusters that read Kafka).
    #[arg(long, requires = "topic")]
    pub kafka: Option<String>,
    /// The topic `--kafka` creates and fills.
    #[arg(long)]
    pub topic: Option<String>,
    /// Partitions of the `--topic`.
    #[arg(long, default_value_t = 3)]
    pub partitions: i32,
}

impl GenArgs {
    /// `files` files of `rows_per_file` rows over `keys` order ids, seeded.
    pub(crate) fn new(
        dir: PathBuf,
        files: usize,
        rows_per_file: usize,
        keys: u64,
        seed: u64,
    ) -> Self {
        GenArgs {
            dir,
            files,
            rows_per_file,
            keys,
            seed,
            late_ms: 60_000,
            first_file: 0,
            odd: false,
            kafka: None,
            topic: None,
            partitions: 3,
        }
    }
}

/// What `generate` wrote.
#[derive(Debug, Clone)]
pub(crate) struct Written {
    pub path: PathBuf,
    pub rows: usize,
}

/// The name of file number `f`: plain, or (with `odd`) one of a set of awkward names.
fn file_name(f: usize, odd: bool) -> String {
    if !odd {
        return format!("orders-{f:05}.json");
    }
    match f % 8 {
        0 => format!("orders[{f:05}].json"),
        1 => format!("orders {f:05} (copy).json"),
        2 => format!("orders-{f:05}*?.json"),
        3 => format!("örders-{f:05}-ünïcode.json"),
        4 => format!("orders%20{f:05}%.json"),
        5 => format!("orders\t{f:05}.json"),
        6 => format!("orders\n{f:05}.json"),
        _ => format!("orders-{f:05}.json"),
    }
}

/// The schema of the order files.
pub(crate) fn orders_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "updated_at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ]))
}

const STATUSES: [&str; 5] = ["created", "paid", "shipped", "delivered", "cancelled"];
/// 2026-01-01T00:00:00Z in ms.
const BASE_MS: i64 = 1_767_225_600_000;

/// A small seeded pseudo-random sequence (SplitMix64).
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Writes the files (each to a hidden temp name, then renamed, so a watching source never
/// sees half a file). Returns the files in order with their row counts.
pub(crate) fn generate(args: &GenArgs) -> Result<Vec<Written>> {
    fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let mut rng = SplitMix(args.seed);
    // Skip the sequence of earlier files so that `first_file` continues a series.
    for _ in 0..args.first_file * args.rows_per_file * 3 {
        rng.next();
    }
    let mut paths = Vec::with_capacity(args.files);
    let mut line = String::with_capacity(128);
    for f in args.first_file..args.first_file + args.files {
        let name = file_name(f, args.odd);
        let path = args.dir.join(&name);
        if path.exists() {
            anyhow::bail!(
                "{} exists: weir gen does not overwrite input (use --first-file to add files)",
                path.display()
            );
        }
        let tmp = args.dir.join(format!(".{name}.tmp"));
        let empty = args.odd && f % 7 == 3;
        let mut rows = 0;
        let mut last_of_key: std::collections::HashMap<u64, i64> = std::collections::HashMap::new();
        let mut out = std::io::BufWriter::new(
            fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        for r in 0..args.rows_per_file {
            let seq = (f * args.rows_per_file + r) as i64;
            if empty {
                // Keep the sequence of the other files the same.
                rng.next();
                rng.next();
                rng.next();
                continue;
            }
            let key = rng.next() % args.keys.max(1);
            let status = STATUSES[(rng.next() % STATUSES.len() as u64) as usize];
            let cents = rng.next() % 100_000;
            let late = if args.late_ms == 0 {
                0
            } else {
                rng.next() % args.late_ms
            };
            // Microseconds carry seq % 1000, so no two rows share a timestamp while
            // late_ms < 100 s: "the latest row per key" is always well defined.
            let mut ts_us = (BASE_MS + seq * 100 - late as i64) * 1000 + seq % 1000;
            // With `odd`, one row in 10 takes the timestamp of its order's previous row: a
            // tie that the other columns decide.
            if args.odd
                && seq % 10 == 5
                && let Some(prev) = last_of_key.get(&key)
            {
                ts_us = *prev;
            }
            last_of_key.insert(key, ts_us);
            let ts = chrono::DateTime::from_timestamp_micros(ts_us)
                .context("timestamp out of range")?
                .format("%Y-%m-%dT%H:%M:%S%.6fZ");
            line.clear();
            use std::fmt::Write as _;
            let status = if args.odd && seq % 17 == 4 {
                "null".to_string()
            } else {
                format!("\"{status}\"")
            };
            let amount = if args.odd && seq % 13 == 6 {
                "null".to_string()
            } else {
                format!("{}.{:02}", cents / 100, cents % 100)
            };
            let _ = write!(
                line,
                "{{\"order_id\":{key},\"status\":{status},\"amount\":{amount},\"updated_at\":\"{ts}\"}}"
            );
            rows += 1;
            line.push('\n');
            out.write_all(line.as_bytes())?;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        paths.push(Written { path, rows });
    }
    Ok(paths)
}
