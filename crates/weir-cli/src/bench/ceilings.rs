//! The ceilings weir's figures are set beside: what PostgreSQL itself needs for the worked
//! example's upserts (driven by `psql`), and what a bare librdkafka loop reads.

use std::path::{Path, PathBuf};

use std::time::Instant;

use anyhow::{Result, bail};

/// PostgreSQL's own floor for the example's database work, measured with `psql` (no weir
/// code on the path): the input lines cut into batches of `batch_rows` in order (the Kafka
/// batches hold the same lines: round-robin partitions, proportional limits), newest row per
/// `order_id` in each (as the example's transform), then per batch: `\copy` into an unlogged
/// staging table, and in one transaction a ledger row, `INSERT .. ON CONFLICT .. WHERE
/// t.updated_at < EXCLUDED.updated_at` from staging in key order, and clearing the staging
/// rows. Returns each batch's time as the sum of psql's `\timing` figures (ms).
pub(super) fn postgres_floor(
    dir: &Path,
    files: &[PathBuf],
    batch_rows: usize,
    url: &str,
) -> Result<Vec<f64>> {
    use std::collections::HashMap;
    use std::io::Write;
    type Row = (Option<String>, Option<String>, Option<f64>);
    let floor = dir.join("floor");
    std::fs::create_dir_all(&floor)?;
    let mut script = String::from(
        "\\set ON_ERROR_STOP on\n\
         DROP TABLE IF EXISTS weir_floor_orders, weir_floor_staging, weir_floor_ledger;\n\
         CREATE TABLE weir_floor_orders (order_id bigint PRIMARY KEY, status text, amount float8, updated_at timestamptz);\n\
         CREATE UNLOGGED TABLE weir_floor_staging (order_id bigint, status text, amount float8, updated_at timestamptz);\n\
         CREATE TABLE weir_floor_ledger (app_id text, batch_id bigint, PRIMARY KEY (app_id, batch_id));\n\
         \\timing on\n",
    );
    let mut batch: HashMap<i64, Row> = HashMap::new();
    let mut in_batch = 0;
    let mut written = 0;
    let mut flush = |batch: &mut HashMap<i64, Row>, script: &mut String| -> Result<()> {
        let path = floor.join(format!("batch-{written}.csv"));
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        let mut keys: Vec<&i64> = batch.keys().collect();
        keys.sort_unstable();
        for k in keys {
            let (t, s, a) = &batch[k];
            let a = a.map(|a| a.to_string()).unwrap_or_default();
            writeln!(
                out,
                "{k},{},{a},{}",
                s.as_deref().unwrap_or(""),
                t.as_deref().unwrap_or("")
            )?;
        }
        out.flush()?;
        script.push_str(&format!(
            "\\echo BATCH\n\\copy weir_floor_staging FROM '{}' WITH (FORMAT csv)\n\
             BEGIN;\n\
             INSERT INTO weir_floor_ledger VALUES ('floor', {written});\n\
             INSERT INTO weir_floor_orders AS t SELECT * FROM weir_floor_staging ORDER BY order_id \
             ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, amount = EXCLUDED.amount, \
             updated_at = EXCLUDED.updated_at WHERE t.updated_at < EXCLUDED.updated_at;\n\
             DELETE FROM weir_floor_staging;\n\
             COMMIT;\n",
            path.display()
        ));
        batch.clear();
        written += 1;
        Ok(())
    };
    for f in files {
        for line in std::fs::read_to_string(f)?.lines() {
            let v: serde_json::Value = serde_json::from_str(line)?;
            let Some(k) = v["order_id"].as_i64() else {
                bail!("floor: a line without order_id in {}", f.display());
            };
            let row: Row = (
                v["updated_at"].as_str().map(str::to_string),
                v["status"].as_str().map(str::to_string),
                v["amount"].as_f64(),
            );
            // Newest per key: updated_at, then status, then amount, NULL lowest (None < Some).
            let newer = batch.get(&k).is_none_or(|old| {
                (&row.0, &row.1)
                    .cmp(&(&old.0, &old.1))
                    .then(
                        row.2
                            .partial_cmp(&old.2)
                            .unwrap_or(std::cmp::Ordering::Equal),
                    )
                    .is_gt()
            });
            if newer {
                batch.insert(k, row);
            }
            in_batch += 1;
            if in_batch == batch_rows {
                flush(&mut batch, &mut script)?;
                in_batch = 0;
            }
        }
    }
    if in_batch > 0 {
        flush(&mut batch, &mut script)?;
    }
    script.push_str(
        "\\timing off\nDROP TABLE weir_floor_orders, weir_floor_staging, weir_floor_ledger;\n",
    );
    let out = std::process::Command::new("psql")
        .args(["-X", "-q", "-d", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(script.as_bytes())?;
            }
            child.wait_with_output()
        })
        .map_err(|e| anyhow::anyhow!("running psql for the PostgreSQL floor: {e}"))?;
    if !out.status.success() {
        bail!(
            "psql failed measuring the PostgreSQL floor: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut per_batch: Vec<f64> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line == "BATCH" {
            per_batch.push(0.0);
        } else if let Some(ms) = line
            .strip_prefix("Time: ")
            .and_then(|t| t.split_whitespace().next())
            .and_then(|t| t.parse::<f64>().ok())
            && let Some(last) = per_batch.last_mut()
        {
            *last += ms;
        }
    }
    let _ = std::fs::remove_dir_all(&floor);
    Ok(per_batch)
}

/// What librdkafka itself reaches against the broker: a new consumer assigned to every
/// partition from offset 0, polling until `n` records came, touching each payload's length
/// and nothing more (no copy, no parse). Records/s.
pub(super) fn librdkafka_ceiling(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    n: usize,
) -> Result<f64> {
    use weir_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use weir_kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("weir-bench-ceiling-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("receive.message.max.bytes", "2147483647")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    let started = Instant::now();
    c.assign(&tpl)?;
    let (mut got, mut bytes) = (0usize, 0usize);
    while got < n {
        match c.poll(std::time::Duration::from_secs(10)) {
            Some(Ok(m)) => {
                bytes += m.payload().map_or(0, <[u8]>::len);
                got += 1;
            }
            Some(Err(e)) => bail!("consume-only loop: {e}"),
            None => bail!("consume-only loop: nothing for 10 s after {got} of {n} records"),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    tracing::debug!("consume-only loop: {got} records, {bytes} bytes in {secs:.3} s");
    Ok(got as f64 / secs)
}
