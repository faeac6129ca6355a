use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray, new_null_array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

use super::*;
use crate::engine::stateful::OperatorMetrics;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Utf8, true),
    ]))
}

/// A session as weir makes one: its planner and the shuffle rule, `target` partitions.
fn session(target: usize) -> SessionContext {
    let state = SessionStateBuilder::new()
        .with_config(SessionConfig::new().with_target_partitions(target))
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(StateShuffle))
        .with_query_planner(Arc::new(crate::engine::WeirQueryPlanner))
        .build();
    SessionContext::new_with_state(state)
}

/// Batch `batch_id` of rows `(k, v)` deduplicated by `k` in 4 partitions under `dir`, run
/// in this process: the rows passed, sorted, and what the tasks did.
async fn dedupe(
    dir: &std::path::Path,
    batch_id: u64,
    rows: &[(i64, &str)],
    target: usize,
) -> (Vec<(i64, String)>, OperatorMetrics) {
    let ctx = session(target);
    let k = Int64Array::from(rows.iter().map(|r| r.0).collect::<Vec<_>>());
    let v = StringArray::from(rows.iter().map(|r| r.1).collect::<Vec<_>>());
    let batch = RecordBatch::try_new(schema(), vec![Arc::new(k), Arc::new(v)]).unwrap();
    // Rows spread over 3 input partitions, as 3 reading tasks would give them.
    let parts: Vec<Vec<RecordBatch>> = (0..3)
        .map(|i| {
            let n = batch.num_rows();
            let (from, to) = (n * i / 3, n * (i + 1) / 3);
            vec![batch.slice(from, to - from)]
        })
        .collect();
    let table = MemTable::try_new(schema(), parts).unwrap();
    let df = ctx.read_table(Arc::new(table)).unwrap();
    let rules = Rules {
        columns: vec![0],
        event: None,
        keep_time: false,
        mode: DedupeMode::Plain,
    };
    let spec = DedupeSpec::new(
        uuid::Uuid::nil(),
        0,
        &Location::local(dir),
        4,
        StateConf::default(),
        batch_id,
        &rules,
        None,
    );
    let out = plan(df, StateSpec::Dedupe(spec), &schema())
        .unwrap()
        .collect()
        .await
        .unwrap();
    let mut metrics = OperatorMetrics::new("dedupe");
    let (passed, _, _) = split(out, &schema(), 4, &mut metrics).unwrap();
    let mut got = Vec::new();
    for b in passed {
        let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let v = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        for i in 0..b.num_rows() {
            got.push((k.value(i), v.value(i).to_string()));
        }
    }
    got.sort();
    (got, metrics)
}

#[tokio::test]
async fn the_plan_shuffles_by_partition_and_passes_each_key_once_across_batches() {
    let dir = tempfile::tempdir().unwrap();
    // Copies of key 1 differ: the smallest row passes, wherever the copies were read.
    let rows = [(1, "b"), (2, "x"), (1, "a"), (3, "y"), (2, "x"), (1, "c")];
    let (got, m) = dedupe(dir.path(), 0, &rows, 2).await;
    let want: Vec<(i64, String)> = [(1, "a"), (2, "x"), (3, "y")]
        .iter()
        .map(|(k, v)| (*k, v.to_string()))
        .collect();
    assert_eq!(got, want);
    assert_eq!(m.updated, 3);
    // Every partition committed version 1, keys or not.
    for p in 0..4 {
        assert!(
            dir.path().join(format!("{p}/1.delta")).exists(),
            "partition {p}"
        );
    }
    // Batch 1 (one target partition this time: the tasks own other partitions) passes
    // only keys not seen.
    let (got, m) = dedupe(dir.path(), 1, &[(3, "z"), (4, "w"), (1, "a")], 1).await;
    assert_eq!(got, vec![(4, "w".to_string())]);
    assert_eq!(m.updated, 1);
    // A replay of batch 1 loads version 1 again and passes the same row.
    let (again, _) = dedupe(dir.path(), 1, &[(3, "z"), (4, "w"), (1, "a")], 3).await;
    assert_eq!(again, got);
    for p in 0..4 {
        assert!(
            dir.path().join(format!("{p}/2.delta")).exists(),
            "partition {p}"
        );
    }
}

#[tokio::test]
async fn the_shuffle_sits_between_the_tag_and_the_deduplication() {
    let ctx = session(2);
    let table = MemTable::try_new(schema(), vec![vec![]]).unwrap();
    let df = ctx.read_table(Arc::new(table)).unwrap();
    let rules = Rules {
        columns: vec![0],
        event: None,
        keep_time: false,
        mode: DedupeMode::Plain,
    };
    let dir = tempfile::tempdir().unwrap();
    let spec = DedupeSpec::new(
        uuid::Uuid::nil(),
        0,
        &Location::local(dir.path()),
        4,
        StateConf::default(),
        0,
        &rules,
        None,
    );
    let physical = plan(df, StateSpec::Dedupe(spec), &schema())
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let shown = datafusion::physical_plan::displayable(physical.as_ref())
        .indent(false)
        .to_string();
    let lines: Vec<&str> = shown.lines().map(str::trim).collect();
    let at = |name: &str| lines.iter().position(|l| l.starts_with(name)).unwrap();
    let (d, r, t) = (
        at("DedupeStateExec"),
        at("RepartitionExec: partitioning=Hash([__weir_state_partition"),
        at("PartitionTagExec"),
    );
    assert!(d + 1 == r && r + 1 == t, "{shown}");
}

/// A side row saying what a task committed.
fn side(partitions: &[u32]) -> RecordBatch {
    let out = out_schema(&schema());
    let meta = Meta {
        partitions: partitions.to_vec(),
        ..Meta::default()
    };
    let mut cols: Vec<_> = out.fields()[..2]
        .iter()
        .map(|f| new_null_array(f.data_type(), 1))
        .collect();
    cols.push(Arc::new(StringArray::from(vec![
        serde_json::to_string(&meta).unwrap(),
    ])));
    RecordBatch::try_new(out, cols).unwrap()
}

#[test]
fn a_partition_committed_twice_or_never_fails_the_batch_naming_it() {
    let mut m = OperatorMetrics::new("dedupe");
    let out = vec![side(&[0, 1]), side(&[1, 2])];
    let err = split(out, &schema(), 4, &mut m).unwrap_err().to_string();
    assert!(
        err.contains("partition 1 by 2 tasks") && err.contains("partition 3 by 0 tasks"),
        "{err}"
    );
    let ok = split(vec![side(&[0, 3]), side(&[2, 1])], &schema(), 4, &mut m);
    assert!(ok.is_ok_and(|(rows, _, _)| rows.is_empty()));
}
