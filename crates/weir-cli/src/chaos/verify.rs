//! The checks after the last run: every sink against the reference computed from the input
//! (through each connector's own reader), the sinks' bookkeeping, and the source: everything
//! produced was read, and every batch read exactly the rows of its recorded range.

use std::collections::BTreeMap;

use anyhow::Result;
use serde_json::Value;
use weir_core::checkpoint::Checkpoint;
use weir_core::connector::{
    Feed, QueryIdentity, SinkShape, Verdict, compare_append, compare_upsert,
};
use weir_core::source::file::taken_files;

use super::input::Input;
use crate::pipeline::Pipeline;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::arrow::record_batch::RecordBatch;

/// Every sink's rows against `all` (the input, or what the stateful steps passed on), and
/// its bookkeeping for `committed` batches.
pub(super) async fn check_sinks(
    p: &Pipeline,
    schema: &SchemaRef,
    all: &[RecordBatch],
    query: &QueryIdentity,
    committed: u64,
) -> Result<Verdict> {
    let env = p.env()?;
    let mut v = Verdict::default();
    for s in &p.sinks {
        let spec = s.harness();
        let Some(reader) = spec.verifier(&env)? else {
            continue;
        };
        let what = spec.label(&env);
        let got = reader.rows(schema).await?;
        match s.spec().shape() {
            SinkShape::Append => v.merge(compare_append(&what, &got, all, schema)?),
            SinkShape::Upsert { keys, ordering } => {
                v.merge(compare_upsert(&what, &got, all, schema, &keys, &ordering)?)
            }
            SinkShape::Unchecked => {}
        }
        v.merge(reader.check_bookkeeping(query, committed).await?);
    }
    Ok(v)
}

/// The source: the committed batches read everything that was produced, each input once,
/// and every progress report counts exactly the rows of its range.
pub(super) async fn check_source(
    feed: &Feed,
    input: &Input,
    checkpoint: &Checkpoint,
    committed: u64,
    progress: &[Value],
) -> Result<Verdict> {
    let mut v = Verdict::default();
    let Some(last) = committed.checked_sub(1) else {
        return Ok(v);
    };
    let end = checkpoint.read_offsets(last).await?.source(0, "offsets")?;
    match feed {
        Feed::Kafka { brokers, topic } => {
            let want = weir_kafka::end_offsets(brokers, topic).await?;
            let got: BTreeMap<i32, i64> = end.json()[topic]
                .as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(p, o)| Some((p.parse().ok()?, o.as_i64()?)))
                        .collect()
                })
                .unwrap_or_default();
            if got != want {
                v.mismatches.push(format!(
                    "kafka {topic}: the last committed batch ends at {got:?}, the topic at {want:?}: records left unread"
                ));
            }
            v.notes.push(format!(
                "kafka {topic}: {} records produced, all committed",
                input.sent
            ));
            for line in progress {
                let rows = line["numInputRows"].as_u64().unwrap_or(0);
                let s = &line["sources"][0];
                let want = kafka_range(&s["startOffset"], &s["endOffset"], topic);
                if rows != want {
                    v.mismatches.push(format!(
                        "batch {}: numInputRows {rows}, but its offsets hold {want} records",
                        line["batchId"]
                    ));
                }
            }
        }
        Feed::Files { .. } => {
            let taken = taken_files(&checkpoint.source_log(0)).await?;
            let by_name = input.rows_by_name();
            let mut seen: BTreeMap<String, u32> = BTreeMap::new();
            let mut rows_of_batch: BTreeMap<u64, u64> = BTreeMap::new();
            for (batch, files) in &taken {
                for f in files {
                    *seen.entry(f.name()).or_default() += 1;
                    *rows_of_batch.entry(*batch).or_default() +=
                        by_name.get(&f.name()).copied().unwrap_or(0) as u64;
                }
            }
            let end_id = end.json()["logOffset"].as_u64().unwrap_or(0);
            for name in by_name.keys() {
                match seen.get(name) {
                    Some(1) => {}
                    Some(n) => v
                        .mismatches
                        .push(format!("input file {name} was taken {n} times")),
                    None => v
                        .mismatches
                        .push(format!("input file {name} was never taken")),
                }
            }
            for (batch, files) in &taken {
                if *batch > end_id {
                    v.mismatches.push(format!(
                        "logOffset {batch} ({} files) is beyond the last committed logOffset {end_id}",
                        files.len()
                    ));
                }
            }
            v.notes.push(format!(
                "files: {} input files, each taken once",
                by_name.len()
            ));
            for line in progress {
                let rows = line["numInputRows"].as_u64().unwrap_or(0);
                let s = &line["sources"][0];
                let from = s["startOffset"]["logOffset"].as_u64().map_or(0, |x| x + 1);
                let to = s["endOffset"]["logOffset"].as_u64().unwrap_or(0);
                let want: u64 = (from..=to)
                    .map(|b| rows_of_batch.get(&b).copied().unwrap_or(0))
                    .sum();
                if rows != want {
                    v.mismatches.push(format!(
                        "batch {}: numInputRows {rows}, but its files hold {want} rows",
                        line["batchId"]
                    ));
                }
            }
        }
    }
    Ok(v)
}

/// Records in `(start, end]` of `topic` (a missing start is offset 0 of each partition).
fn kafka_range(start: &Value, end: &Value, topic: &str) -> u64 {
    let Some(end) = end[topic].as_object() else {
        return 0;
    };
    end.iter()
        .map(|(p, e)| {
            let s = start[topic][p].as_i64().unwrap_or(0);
            (e.as_i64().unwrap_or(0) - s).max(0) as u64
        })
        .sum()
}
