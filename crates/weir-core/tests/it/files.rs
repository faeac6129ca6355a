use std::path::Path;
use std::sync::{Arc, Mutex};

use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::{BatchContext, BoxError, ParquetSink, Trigger, WeirSession};

use crate::{ids, schema};

fn write_file(dir: &Path, name: &str, ids: std::ops::Range<i64>) {
    std::fs::create_dir_all(dir).unwrap();
    let body: String = ids
        .map(|i| format!("{{\"id\":{i},\"name\":\"n{i}\"}}\n"))
        .collect();
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

type Seen = Arc<Mutex<Vec<(u64, Vec<i64>)>>>;

async fn run_files(
    input: &Path,
    chk: &Path,
    seen: Seen,
    fail_at: Option<u64>,
) -> weir_core::Result<()> {
    let q = WeirSession::new()
        .read_stream()
        .files(input)
        .schema(schema())
        .max_files_per_trigger(2)
        .load()
        .await?
        .write_stream()
        .query_name("files")
        .checkpoint(chk)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, ctx: BatchContext| {
            let seen = seen.clone();
            async move {
                let got = ids(&b.collect().await?);
                seen.lock().unwrap().push((ctx.batch_id, got));
                if Some(ctx.batch_id) == fail_at {
                    return Err::<(), BoxError>("fail".into());
                }
                Ok(())
            }
        })
        .start()
        .await?;
    q.await_termination().await
}

#[tokio::test]
async fn a_replayed_file_batch_reads_exactly_its_recorded_files_even_after_more_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let (input, chk) = (dir.path().join("in"), dir.path().join("chk"));
    for f in 0..5 {
        write_file(&input, &format!("f{f}.json"), f * 10..f * 10 + 3);
    }
    // A hidden temp file is never taken.
    std::fs::write(input.join(".partial.json.tmp"), "{\"id\":999").unwrap();
    let seen: Seen = Arc::default();
    assert!(
        run_files(&input, &chk, seen.clone(), Some(1))
            .await
            .is_err()
    );
    let log1 = std::fs::read_to_string(chk.join("sources/0/1")).unwrap();
    assert!(log1.starts_with("v1\n{\"path\":\"file://"), "{log1}");
    assert!(
        log1.contains("f2.json") && log1.contains("f3.json") && log1.contains("\"batchId\":1"),
        "{log1}"
    );

    // Files that arrive now, with names that sort first, must not join batch 1.
    write_file(&input, "a-new.json", 100..103);
    let seen2: Seen = Arc::default();
    run_files(&input, &chk, seen2.clone(), None).await.unwrap();
    let first = seen.lock().unwrap().clone();
    let second = seen2.lock().unwrap().clone();
    assert_eq!(
        first,
        vec![
            (0, vec![0, 1, 2, 10, 11, 12]),
            (1, vec![20, 21, 22, 30, 31, 32])
        ]
    );
    assert_eq!(second[0], (1, vec![20, 21, 22, 30, 31, 32]));
    let all: Vec<i64> = second.iter().skip(1).flat_map(|(_, v)| v.clone()).collect();
    let mut all = all;
    all.sort_unstable();
    assert_eq!(all, vec![40, 41, 42, 100, 101, 102]);
}

#[tokio::test]
async fn a_file_deleted_before_its_batch_ran_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (input, chk) = (dir.path().join("in"), dir.path().join("chk"));
    write_file(&input, "only.json", 0..2);
    assert!(
        run_files(&input, &chk, Arc::default(), Some(0))
            .await
            .is_err()
    );
    std::fs::remove_file(input.join("only.json")).unwrap();
    let err = run_files(&input, &chk, Arc::default(), None)
        .await
        .unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("only.json") && chain.contains("is gone"),
        "{chain}"
    );
}

#[tokio::test]
async fn the_parquet_sink_writes_the_same_files_again_on_replay() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let sink = ParquetSink::new(weir_core::Location::local(&out)).target_rows_per_file(4);
    let ctx = BatchContext::new(uuid::Uuid::new_v4(), "q", 3);
    let c = SessionContext::new();
    let df = c.read_batch(crate::rows(0, 10)).unwrap();
    assert_eq!(sink.write(df.clone(), &ctx).await.unwrap(), 10);
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('_') && !n.starts_with('.'))
            .collect();
        v.sort();
        v
    };
    let first = names(&out);
    assert_eq!(
        first,
        vec![
            "batch-0000000003-part-00000.parquet",
            "batch-0000000003-part-00001.parquet",
            "batch-0000000003-part-00002.parquet"
        ]
    );
    // A stale extra part from an attempt that split the batch differently is removed.
    std::fs::copy(
        out.join(&first[0]),
        out.join("batch-0000000003-part-00007.parquet"),
    )
    .unwrap();
    assert_eq!(sink.write(df, &ctx.clone().replay(true)).await.unwrap(), 10);
    assert_eq!(names(&out), first);
    let rows = c
        .read_parquet(out.to_string_lossy().to_string(), Default::default())
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(ids(&rows), (0..10).collect::<Vec<_>>());
}

/// How [`one_file_a_batch`] reads and when its function fails.
#[derive(Default, Clone, Copy)]
struct OneFile {
    max_file_age: Option<std::time::Duration>,
    latest_first: bool,
    fail_at: Option<u64>,
}

/// Runs an available-now query over `input` taking one file a batch (keeping 3 batches),
/// recording each batch's ids in `seen`; an error when the function fails.
async fn one_file_a_batch(
    input: &Path,
    chk: &Path,
    how: OneFile,
    seen: Seen,
) -> weir_core::Result<()> {
    let mut r = WeirSession::new()
        .read_stream()
        .files(input)
        .schema(schema())
        .max_files_per_trigger(1)
        .latest_first(how.latest_first);
    if let Some(age) = how.max_file_age {
        r = r.max_file_age(age);
    }
    let q = r
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(chk)
        .min_batches_to_retain(3)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, ctx: BatchContext| {
            let seen = seen.clone();
            async move {
                let got = ids(&b.collect().await?);
                seen.lock().unwrap().push((ctx.batch_id, got));
                if Some(ctx.batch_id) == how.fail_at {
                    return Err::<(), BoxError>("fail".into());
                }
                Ok(())
            }
        })
        .start()
        .await
        .unwrap();
    q.await_termination().await
}

#[tokio::test]
async fn retention_and_compaction_keep_the_seen_files_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (input, chk) = (dir.path().join("in"), dir.path().join("chk"));
    for f in 0..25 {
        write_file(&input, &format!("f{f:02}.json"), f * 10..f * 10 + 2);
    }
    let run = |seen: Seen| async {
        one_file_a_batch(&input, &chk, OneFile::default(), seen)
            .await
            .unwrap()
    };
    let seen: Seen = Arc::default();
    run(seen.clone()).await;
    assert_eq!(seen.lock().unwrap().len(), 25);
    let mut offsets: Vec<String> = std::fs::read_dir(chk.join("offsets"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    offsets.sort();
    assert_eq!(
        offsets,
        vec!["22", "23", "24"],
        "only the last 3 batches are kept"
    );
    let mut logs: Vec<String> = std::fs::read_dir(chk.join("sources/0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    logs.sort();
    assert_eq!(
        logs,
        vec!["19.compact", "20", "21", "22", "23", "24"],
        "{logs:?}"
    );
    // The compact entry names every file taken through batch 19 once, in batch order; the
    // batches a replay may still need (17..=19 with 3 retained) keep their size for the
    // read's check, older ones only Spark's path, timestamp and batch id.
    let compact = std::fs::read_to_string(chk.join("sources/0/19.compact")).unwrap();
    let lines: Vec<serde_json::Value> = compact
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 20, "{compact}");
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["batchId"], i as u64, "{compact}");
        assert!(
            l["path"]
                .as_str()
                .unwrap()
                .ends_with(&format!("/f{i:02}.json")),
            "{compact}"
        );
        assert!(l["timestamp"].as_i64().unwrap() > 0, "{compact}");
        assert_eq!(l.get("size").is_some(), i >= 17, "{compact}");
    }
    // After a restart no old file is taken again; a new one is.
    write_file(&input, "g.json", 900..901);
    let again: Seen = Arc::default();
    run(again.clone()).await;
    assert_eq!(*again.lock().unwrap(), vec![(25, vec![900])]);
}

#[tokio::test]
async fn max_file_age_reads_a_backlog_whole_then_forgets_and_ignores_older_files() {
    use std::time::{Duration, SystemTime};
    let dir = tempfile::tempdir().unwrap();
    let (input, chk) = (dir.path().join("in"), dir.path().join("chk"));
    let hour = Duration::from_secs(3600);
    let base = SystemTime::now() - 24 * hour;
    let write_at = |name: &str, id: i64, at: SystemTime| {
        write_file(&input, name, id..id + 1);
        let f = std::fs::File::options()
            .write(true)
            .open(input.join(name))
            .unwrap();
        f.set_modified(at).unwrap();
    };
    // Ten files an hour apart: the backlog spans nine hours, the age is one.
    for i in 0..10u32 {
        write_at(&format!("f{i}.json"), i64::from(i), base + i * hour);
    }
    let aged = OneFile {
        max_file_age: Some(hour),
        ..OneFile::default()
    };
    let run = |seen: Seen| async { one_file_a_batch(&input, &chk, aged, seen).await.unwrap() };
    // The age counts from the newest file taken, not the newest listed: all ten are read,
    // oldest first, one a batch.
    let seen: Seen = Arc::default();
    run(seen.clone()).await;
    let want: Vec<(u64, Vec<i64>)> = (0..10).map(|i| (i, vec![i as i64])).collect();
    assert_eq!(*seen.lock().unwrap(), want);
    // What the source remembers is bounded by the age: the compact entry of batch 9 names
    // only the files within an hour of the newest (7, 8 and 9), not all ten.
    let compact = std::fs::read_to_string(chk.join("sources/0/9.compact")).unwrap();
    let names: Vec<String> = compact
        .lines()
        .skip(1)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["path"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(names, vec!["f7.json", "f8.json", "f9.json"], "{compact}");
    // After a restart: a file more than an hour older than the newest taken is ignored
    // (as Spark's maxFileAge), one within the hour is read, and a forgotten name that is
    // still in the folder is not read again.
    write_at("late.json", 100, base + 7 * hour);
    write_at("recent.json", 101, base + 8 * hour + hour / 2);
    let again: Seen = Arc::default();
    run(again.clone()).await;
    assert_eq!(*again.lock().unwrap(), vec![(10, vec![101])]);

    // Newest first, the age is not applied (Spark's rule): the first batch takes the newest
    // file, and after a failure and a restart every older file of the backlog is still read.
    let chk = dir.path().join("chk-latest");
    let newest_first = OneFile {
        max_file_age: Some(hour),
        latest_first: true,
        fail_at: Some(2),
    };
    let failed: Seen = Arc::default();
    assert!(
        one_file_a_batch(&input, &chk, newest_first, failed.clone())
            .await
            .is_err()
    );
    let rest: Seen = Arc::default();
    let no_fail = OneFile {
        fail_at: None,
        ..newest_first
    };
    one_file_a_batch(&input, &chk, no_fail, rest.clone())
        .await
        .unwrap();
    let mut all: Vec<i64> = failed.lock().unwrap()[..2]
        .iter()
        .chain(rest.lock().unwrap().iter())
        .flat_map(|(_, ids)| ids.clone())
        .collect();
    assert_eq!(failed.lock().unwrap()[0].1, vec![9], "the newest first");
    all.sort_unstable();
    assert_eq!(
        all,
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100, 101],
        "every file once"
    );
}

/// Later Parquet files whose column has another type: converted when every value survives
/// (int into bigint), an error naming file, column and row when one would change (4.7 or
/// 'abc' into a bigint), never a truncated value or a NULL written in its place.
#[tokio::test]
async fn a_parquet_column_of_another_type_is_read_only_without_loss() {
    use weir_core::FileFormat;
    use weir_core::datafusion::arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array};
    use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema};
    use weir_core::datafusion::arrow::record_batch::RecordBatch;
    use weir_core::datafusion::parquet::arrow::ArrowWriter;

    let dir = tempfile::tempdir().unwrap();
    let (input, chk) = (dir.path().join("in"), dir.path().join("chk"));
    std::fs::create_dir_all(&input).unwrap();
    let write = |name: &str, col: ArrayRef| {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "id",
            col.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(schema.clone(), vec![col]).unwrap();
        let mut w = ArrowWriter::try_new(
            std::fs::File::create(input.join(name)).unwrap(),
            schema,
            None,
        )
        .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    write("f0.parquet", Arc::new(Int64Array::from(vec![1, 2])));
    write("f1.parquet", Arc::new(Int32Array::from(vec![3, 4])));
    write("f2.parquet", Arc::new(Float64Array::from(vec![5.0, 4.7])));
    let seen: Seen = Arc::default();
    let run = {
        let seen = seen.clone();
        async move {
            let q = WeirSession::new()
                .read_stream()
                .files(&input)
                .format(FileFormat::Parquet)
                .schema(Arc::new(Schema::new(vec![Field::new(
                    "id",
                    DataType::Int64,
                    true,
                )])))
                .max_files_per_trigger(1)
                .load()
                .await?
                .write_stream()
                .query_name("parquet-types")
                .checkpoint(&chk)
                .trigger(Trigger::AvailableNow)
                .foreach_batch(move |b: DataFrame, ctx: BatchContext| {
                    let seen = seen.clone();
                    async move {
                        let got = b
                            .collect()
                            .await?
                            .iter()
                            .flat_map(|b| {
                                b.column(0)
                                    .as_any()
                                    .downcast_ref::<Int64Array>()
                                    .unwrap()
                                    .iter()
                                    .map(|v| v.unwrap())
                                    .collect::<Vec<_>>()
                            })
                            .collect();
                        seen.lock().unwrap().push((ctx.batch_id, got));
                        Ok::<(), BoxError>(())
                    }
                })
                .start()
                .await?;
            q.await_termination().await
        }
    };
    let err = run.await.unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("f2.parquet")
            && chain.contains("column 'id'")
            && chain.contains("row 2 holds 4.7"),
        "{chain}"
    );
    // The int file was read as bigint; nothing of the float file reached the function.
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![(0, vec![1, 2]), (1, vec![3, 4])]
    );
}
