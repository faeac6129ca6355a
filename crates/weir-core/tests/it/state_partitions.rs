//! `state-partitions`: a deduplication's state split by key hash gives the rows one
//! partition gives (checked against a recomputation that shares no code with the engine),
//! on batches big enough to run on several threads; the number is fixed once written; a
//! state commit cut off between partitions is replayed exactly.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use weir_core::datafusion::arrow::array::{Array, Int64Array, StringArray};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::{BatchContext, BoxError, MemorySource, StreamingQuery, Trigger, WeirSession};

/// Rows per micro-batch: more than a record batch the dedupe looks up on one thread.
const PER_BATCH: i64 = 40_000;
const BATCHES: i64 = 4;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("tag", DataType::Utf8, true),
    ]))
}

/// Batch `b`'s keys: repeats inside the batch and across batches, a few NULLs; the tag
/// says which row of which batch it is, so the first row of a key can be told apart.
fn keys(b: i64) -> Vec<Option<i64>> {
    (0..PER_BATCH)
        .map(|i| (i % 997 != 13).then_some((i * 7919 + b * 104_729) % 90_000))
        .collect()
}

fn source() -> Arc<MemorySource> {
    let s = MemorySource::new(schema());
    for b in 0..BATCHES {
        let k = keys(b);
        let tags: Vec<String> = (0..PER_BATCH).map(|i| format!("{b}:{i}")).collect();
        let batch = RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(Int64Array::from(k)),
                Arc::new(StringArray::from(tags)),
            ],
        )
        .unwrap();
        s.add(batch).unwrap();
    }
    Arc::new(s)
}

/// What each batch must pass: the first row of each key not seen in an earlier batch.
fn reference() -> Vec<Vec<String>> {
    let mut seen: HashSet<Option<i64>> = HashSet::new();
    (0..BATCHES)
        .map(|b| {
            let mut rows: Vec<String> = keys(b)
                .into_iter()
                .enumerate()
                .filter(|(_, k)| seen.insert(*k))
                .map(|(i, k)| format!("{k:?}|{b}:{i}"))
                .collect();
            rows.sort();
            rows
        })
        .collect()
}

type Seen = Arc<Mutex<Vec<(u64, Vec<String>)>>>;

async fn start(
    dir: &Path,
    partitions: Option<u32>,
    fail_at: Option<u64>,
) -> weir_core::Result<(StreamingQuery, Seen)> {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let frame = WeirSession::new()
        .read_stream()
        .source(source())
        .max_offsets_per_trigger(1)
        .load()
        .await?;
    let mut writer = frame
        .drop_duplicates(["k"])
        .write_stream()
        .query_name("parts")
        .checkpoint(dir)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |df: DataFrame, c: BatchContext| {
            let s = s.clone();
            async move {
                let mut rows = Vec::new();
                for b in df.collect().await? {
                    let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                    let t = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
                    for i in 0..b.num_rows() {
                        let key = (!k.is_null(i)).then(|| k.value(i));
                        rows.push(format!("{key:?}|{}", t.value(i)));
                    }
                }
                rows.sort();
                s.lock().unwrap().push((c.batch_id, rows));
                if Some(c.batch_id) == fail_at {
                    return Err::<(), BoxError>("the sink refused the batch".into());
                }
                Ok(())
            }
        });
    if let Some(n) = partitions {
        writer = writer.state_partitions(n);
    }
    Ok((writer.start().await?, seen))
}

/// The error a query with `partitions` on `dir` stops with before running a batch.
async fn refused(dir: &Path, partitions: Option<u32>) -> String {
    match start(dir, partitions, None).await {
        Err(e) => e.to_string(),
        Ok((q, seen)) => {
            let err = q.await_termination().await.expect_err("refused");
            assert!(seen.lock().unwrap().is_empty(), "no batch ran");
            weir_core::error::error_chain(&err)
        }
    }
}

fn partition_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("state/0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "_metadata")
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn every_number_of_partitions_passes_the_rows_one_partition_passes() {
    let want = reference();
    for partitions in [Some(1), Some(3), None] {
        let dir = tempfile::tempdir().unwrap();
        let (q, seen) = start(dir.path(), partitions, None).await.unwrap();
        q.await_termination().await.unwrap();
        let got: Vec<Vec<String>> = seen.lock().unwrap().iter().map(|b| b.1.clone()).collect();
        assert_eq!(got.len(), want.len(), "{partitions:?}");
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "{partitions:?}: batch {b}: rows passed");
            assert_eq!(g, w, "{partitions:?}: batch {b}");
        }
        let n = partitions.unwrap_or(weir_core::engine::DEFAULT_STATE_PARTITIONS);
        let progress = q.last_progress().unwrap();
        let op = &progress.state_operators[0];
        assert_eq!(op["numStateStoreInstances"], n, "{op}");
        let distinct: usize = want.iter().map(Vec::len).sum();
        assert_eq!(op["numRowsTotal"], distinct as u64, "{op}");
        let dirs = partition_dirs(dir.path());
        let mut expected: Vec<String> = (0..n).map(|p| p.to_string()).collect();
        expected.sort();
        assert_eq!(dirs, expected);
        for p in &dirs {
            let last = dir.path().join(format!("state/0/{p}/{BATCHES}.delta"));
            assert!(
                last.exists(),
                "{}: every partition commits every version",
                last.display()
            );
        }
        let meta = std::fs::read_to_string(dir.path().join("state/0/_metadata/metadata")).unwrap();
        assert!(meta.contains(&format!("\"numPartitions\":{n}")), "{meta}");
    }
}

#[tokio::test]
async fn the_number_of_partitions_is_fixed_once_the_state_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = start(dir.path(), Some(3), Some(1)).await.unwrap();
    assert!(q.await_termination().await.is_err());
    // Another number is refused before anything runs, naming the setting and the file.
    let text = refused(dir.path(), Some(4)).await;
    assert!(
        text.contains("query.state-partitions")
            && text.contains("3 partition")
            && text.contains("_metadata"),
        "{text}"
    );
    assert!(!dir.path().join("offsets/2").exists(), "nothing ran");
    // Left out, the recorded number is used, and the run ends as a clean one.
    let (q, seen) = start(dir.path(), None, None).await.unwrap();
    q.await_termination().await.unwrap();
    let got: Vec<(u64, Vec<String>)> = seen.lock().unwrap().clone();
    let want = reference();
    assert_eq!(got.first().map(|b| b.0), Some(1), "batch 1 runs again");
    for (id, rows) in &got {
        assert_eq!(rows, &want[*id as usize], "batch {id}");
    }
    assert_eq!(partition_dirs(dir.path()), ["0", "1", "2"]);
    let op = &q.last_progress().unwrap().state_operators[0];
    assert_eq!(op["numStateStoreInstances"], 3, "{op}");
    // Out of range is refused.
    let text = refused(dir.path(), Some(0)).await;
    assert!(text.contains("query.state-partitions"), "{text}");
}

/// A kill in the middle of a state commit leaves some partitions at version N+1 and the
/// others at N (and no `commits/N`): the replay loads N in every partition and writes N+1
/// again, passing the rows the first attempt passed.
#[tokio::test]
async fn a_state_commit_cut_off_between_partitions_is_replayed_exactly() {
    let want = reference();
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = start(dir.path(), Some(4), None).await.unwrap();
    q.await_termination().await.unwrap();
    // Batch 2's commit as a kill between its partitions would leave it: commits/2 and
    // everything after gone, partition 1 without version 3, the others with it.
    for b in 2..BATCHES {
        std::fs::remove_file(dir.path().join(format!("commits/{b}"))).unwrap();
    }
    for b in 3..BATCHES {
        std::fs::remove_file(dir.path().join(format!("offsets/{b}"))).unwrap();
    }
    for p in 0..4 {
        for v in 4..=BATCHES {
            let _ = std::fs::remove_file(dir.path().join(format!("state/0/{p}/{v}.delta")));
        }
    }
    std::fs::remove_file(dir.path().join("state/0/1/3.delta")).unwrap();
    let (q, seen) = start(dir.path(), None, None).await.unwrap();
    q.await_termination().await.unwrap();
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.iter().map(|b| b.0).collect::<Vec<_>>(), [2, 3]);
    for (id, rows) in &got {
        assert_eq!(rows, &want[*id as usize], "batch {id}");
    }
    let op = &q.last_progress().unwrap().state_operators[0];
    let distinct: usize = want.iter().map(Vec::len).sum();
    assert_eq!(op["numRowsTotal"], distinct as u64, "{op}");
}

/// Temp files a kill left anywhere the checkpoint's holder writes (a state partition, the
/// state's metadata, a source's log, the logs) are removed by the next holder; other
/// hidden names are left alone.
#[tokio::test]
async fn the_next_holder_removes_the_temp_files_a_kill_left() {
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = start(dir.path(), Some(2), Some(1)).await.unwrap();
    assert!(q.await_termination().await.is_err());
    let hex = "0123456789abcdef0123456789abcdef";
    let left = [
        format!("state/0/1/.2.delta.{hex}.tmp"),
        format!("state/0/_metadata/.keys.{hex}.tmp"),
        format!("sources/0/.3.{hex}.tmp"),
        format!("commits/.1.{hex}.tmp"),
    ];
    let kept = ["state/0/0/.notes.tmp", "sources/0/.keep"];
    for name in left.iter().map(String::as_str).chain(kept) {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"half").unwrap();
    }
    let (q, seen) = start(dir.path(), None, None).await.unwrap();
    q.await_termination().await.unwrap();
    for name in &left {
        assert!(!dir.path().join(name).exists(), "{name} was left");
    }
    for name in kept {
        assert!(dir.path().join(name).exists(), "{name} is not weir's");
    }
    let want = reference();
    for (id, rows) in seen.lock().unwrap().iter() {
        assert_eq!(rows, &want[*id as usize], "batch {id}");
    }
}

/// A partition whose files are gone (the others hold the version the batch needs) is an
/// error naming that partition's folder, and the run stops before calling the function.
#[tokio::test]
async fn a_partition_that_lost_its_files_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = start(dir.path(), Some(3), Some(2)).await.unwrap();
    assert!(q.await_termination().await.is_err());
    std::fs::remove_dir_all(dir.path().join("state/0/1")).unwrap();
    let text = refused(dir.path(), None).await;
    assert!(
        text.contains("state partition 1") && text.contains("state/0/1"),
        "{text}"
    );
    // The operator's metadata lost while its files are there: named too.
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = start(dir.path(), Some(3), Some(2)).await.unwrap();
    assert!(q.await_termination().await.is_err());
    std::fs::remove_file(dir.path().join("state/0/_metadata/metadata")).unwrap();
    let text = refused(dir.path(), None).await;
    assert!(
        text.contains("_metadata/metadata") && text.contains("lost a file"),
        "{text}"
    );
}
