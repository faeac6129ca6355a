use std::sync::{Arc, Mutex};
use std::time::Duration;

use weir_core::datafusion::prelude::DataFrame;
use weir_core::engine::{FallingBehind, QueryListener};
use weir_core::{BatchContext, BoxError, Error, MemorySource, Trigger, WeirSession};

use crate::{ids, rows, schema};

type Calls = Arc<Mutex<Vec<(u64, bool, Vec<i64>)>>>;

/// A function that records (batch id, is_replay, ids) and fails at `fail_at`.
fn recorder(
    calls: Calls,
    fail_at: Option<u64>,
) -> impl Fn(DataFrame, BatchContext) -> futures_like::Fut + Send + Sync {
    move |batch: DataFrame, ctx: BatchContext| {
        let calls = calls.clone();
        Box::pin(async move {
            let got = ids(&batch.collect().await?);
            calls
                .lock()
                .unwrap()
                .push((ctx.batch_id, ctx.is_replay, got));
            if Some(ctx.batch_id) == fail_at {
                return Err::<(), BoxError>("sink refused the write".into());
            }
            Ok(())
        })
    }
}

mod futures_like {
    pub(super) type Fut = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(), weir_core::BoxError>> + Send>,
    >;
}

fn source_with(batches: &[(i64, i64)]) -> MemorySource {
    let s = MemorySource::new(schema());
    for (a, b) in batches {
        s.add(rows(*a, *b)).unwrap();
    }
    s
}

#[tokio::test]
async fn a_failed_batch_is_not_committed_and_runs_again_with_the_same_id_and_rows() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(source_with(&[(0, 3), (3, 5), (5, 9)]));
    let calls: Calls = Arc::default();
    let q = WeirSession::new()
        .read_stream()
        .source(src.clone())
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap()
        .write_stream()
        .query_name("replay")
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(recorder(calls.clone(), Some(1)))
        .start()
        .await
        .unwrap();
    let err = q.await_termination().await.unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("batch 1 failed in foreachBatch") && chain.contains("sink refused"),
        "{chain}"
    );
    assert!(dir.path().join("offsets/1").exists());
    assert!(!dir.path().join("commits/1").exists());
    // Batch 2 was read ahead while batch 1 ran, but never recorded.
    assert!(!dir.path().join("offsets/2").exists());

    let calls2: Calls = Arc::default();
    let q = WeirSession::new()
        .read_stream()
        .source(src)
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap()
        .write_stream()
        .query_name("replay")
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(recorder(calls2.clone(), None))
        .start()
        .await
        .unwrap();
    q.await_termination().await.unwrap();
    let first = calls.lock().unwrap().clone();
    let second = calls2.lock().unwrap().clone();
    assert_eq!(
        first,
        vec![(0, false, vec![0, 1, 2]), (1, false, vec![3, 4])]
    );
    assert_eq!(
        second,
        vec![(1, true, vec![3, 4]), (2, false, vec![5, 6, 7, 8])]
    );
    let p = q.last_progress().unwrap();
    assert_eq!((p.batch_id, p.num_input_rows), (2, 4));
    assert_eq!(
        p.sources[0].start_offset,
        Some(serde_json::json!({"batches": 2}))
    );
    assert_eq!(
        p.sources[0].end_offset,
        Some(serde_json::json!({"batches": 3}))
    );
    assert_eq!(q.recent_progress().len(), 2);
}

#[tokio::test]
async fn a_panic_in_the_function_stops_the_query_naming_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[(0, 2)])))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(|_b: DataFrame, ctx: BatchContext| async move {
            if ctx.batch_id == 0 {
                panic!("boom in user code");
            }
            Ok::<(), BoxError>(())
        })
        .start()
        .await
        .unwrap();
    let chain = weir_core::sink::error_chain(&q.await_termination().await.unwrap_err());
    assert!(
        chain.contains("batch 0") && chain.contains("boom in user code"),
        "{chain}"
    );
    assert!(!dir.path().join("commits/0").exists());
}

#[tokio::test]
async fn continuous_trigger_is_refused_with_sparks_words() {
    let dir = tempfile::tempdir().unwrap();
    let err = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[])))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::Continuous(Duration::from_secs(1)))
        .foreach_batch(|_b: DataFrame, _c: BatchContext| async { Ok::<(), BoxError>(()) })
        .start()
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "'foreachBatch' is not supported with continuous trigger."
    );
}

#[tokio::test]
async fn a_second_query_on_the_same_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let entered = Arc::new(tokio::sync::Notify::new());
    let (g, e) = (gate.clone(), entered.clone());
    let a = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[(0, 2)])))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .foreach_batch(move |_b: DataFrame, _c: BatchContext| {
            let (g, e) = (g.clone(), e.clone());
            async move {
                e.notify_one();
                g.notified().await;
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    entered.notified().await;
    // B finds the checkpoint held by A and is refused before it reads anything.
    let err = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[(0, 2)])))
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(|_b, _c| async { Ok(()) })
        .start()
        .await
        .unwrap_err();
    let chain = weir_core::sink::error_chain(&err);
    assert!(
        chain.contains("another query is using the checkpoint") && chain.contains(".lock"),
        "{chain}"
    );
    assert!(!dir.path().join("commits/0").exists());
    gate.notify_one();
    a.stop().await.unwrap();
    assert!(
        dir.path().join("commits/0").exists(),
        "A finished its batch"
    );
}

#[derive(Default)]
struct Alerts(Mutex<Vec<FallingBehind>>);

impl QueryListener for Alerts {
    fn on_falling_behind(&self, e: &FallingBehind) {
        self.0.lock().unwrap().push(e.clone());
    }
}

#[tokio::test(start_paused = true)]
async fn processing_time_batches_start_on_interval_ticks_and_slow_batches_raise_the_alert() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(source_with(&[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let alerts = Arc::new(Alerts::default());
    let origin = tokio::time::Instant::now();
    let s = starts.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(src)
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::ProcessingTime(Duration::from_secs(10)))
        .listener(alerts.clone())
        .foreach_batch(move |_b: DataFrame, ctx: BatchContext| {
            let s = s.clone();
            async move {
                s.lock()
                    .unwrap()
                    .push((ctx.batch_id, origin.elapsed().as_secs()));
                // 8 s of a 10 s interval: above the 70 % line.
                tokio::time::sleep(Duration::from_secs(8)).await;
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(45)).await;
    q.stop().await.unwrap();
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts, vec![(0, 0), (1, 10), (2, 20), (3, 30), (4, 40)]);
    let alerts = alerts.0.lock().unwrap();
    assert_eq!(alerts.len(), 1, "one alert after 3 slow batches in a row");
    assert_eq!((alerts[0].batch_id, alerts[0].consecutive), (2, 3));
}

#[tokio::test]
async fn available_now_stops_after_the_data_present_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let src = Arc::new(source_with(&[(0, 2), (2, 4)]));
    let late = src.clone();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(src)
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, _c: BatchContext| {
            let (s, late) = (s.clone(), late.clone());
            async move {
                let got = ids(&b.collect().await?);
                s.lock().unwrap().extend(got);
                late.add(rows(100, 101))?;
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    q.await_termination().await.unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(q.recent_progress().len(), 2);
}

#[tokio::test]
async fn sql_transform_sees_the_batch_view_and_progress_counts_input_rows() {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let q = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[(0, 10)])))
        .load()
        .await
        .unwrap()
        .sql("SELECT id * 2 AS id, name FROM batch WHERE id % 2 = 0")
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::Once)
        .foreach_batch(move |b: DataFrame, _c: BatchContext| {
            let s = s.clone();
            async move {
                let got = ids(&b.collect().await?);
                s.lock().unwrap().extend(got);
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    q.await_termination().await.unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0, 4, 8, 12, 16]);
    assert_eq!(q.last_progress().unwrap().num_input_rows, 10);
}

#[tokio::test]
async fn a_missing_checkpoint_or_function_is_a_setting_error() {
    let err = WeirSession::new()
        .read_stream()
        .source(Arc::new(source_with(&[])))
        .load()
        .await
        .unwrap()
        .write_stream()
        .foreach_batch(|_b: DataFrame, _c: BatchContext| async { Ok::<(), BoxError>(()) })
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Config { ref key, .. } if key == "checkpoint"),
        "{err}"
    );
}

/// A memory source that logs what the engine asks of it.
struct Logged {
    inner: MemorySource,
    log: Arc<Mutex<Vec<String>>>,
}

fn batch_of(o: Option<&weir_core::SourceOffset>) -> i64 {
    o.and_then(|o| o.json()["batches"].as_i64()).unwrap_or(0)
}

#[async_trait::async_trait]
impl weir_core::Source for Logged {
    fn description(&self) -> String {
        self.inner.description()
    }
    fn schema(&self) -> weir_core::datafusion::arrow::datatypes::SchemaRef {
        self.inner.schema()
    }
    async fn latest_offset(
        &self,
        start: Option<&weir_core::SourceOffset>,
        limit: weir_core::ReadLimit,
    ) -> weir_core::Result<Option<weir_core::SourceOffset>> {
        let out = self.inner.latest_offset(start, limit).await?;
        self.log.lock().unwrap().push(format!(
            "latest {}->{}",
            batch_of(start),
            batch_of(out.as_ref())
        ));
        Ok(out)
    }
    async fn read_range(
        &self,
        ctx: &weir_core::datafusion::prelude::SessionContext,
        start: Option<&weir_core::SourceOffset>,
        end: &weir_core::SourceOffset,
    ) -> weir_core::Result<DataFrame> {
        self.log
            .lock()
            .unwrap()
            .push(format!("read {}->{}", batch_of(start), batch_of(Some(end))));
        self.inner.read_range(ctx, start, end).await
    }
    async fn commit(&self, end: &weir_core::SourceOffset) -> weir_core::Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("commit {}", batch_of(Some(end))));
        self.inner.commit(end).await
    }
}

/// Available-now: the next batch's range is planned and read while the function writes the
/// current one, but `offsets/N+1` is written only after `commits/N`, and the source hears of
/// a commit only after the read beside it ended. Every row comes once, in order.
#[tokio::test]
async fn the_next_batch_is_read_while_the_function_runs_and_recorded_after_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let src = Arc::new(Logged {
        inner: source_with(&[(0, 3), (3, 5), (5, 9)]),
        log: log.clone(),
    });
    let seen: Calls = Arc::default();
    let (s, l, d) = (seen.clone(), log.clone(), dir.path().to_path_buf());
    let q = WeirSession::new()
        .read_stream()
        .source(src)
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap()
        .write_stream()
        .checkpoint(dir.path())
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, c: BatchContext| {
            let (s, l, d) = (s.clone(), l.clone(), d.clone());
            async move {
                let id = c.batch_id;
                // Wait until the read ahead of the next batch (if any) has happened.
                let want = format!("read {}->{}", id + 1, id + 2);
                for _ in 0..200 {
                    if id == 2 || l.lock().unwrap().contains(&want) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                l.lock().unwrap().push(format!("fn {id}"));
                // The batch read ahead is not recorded while this one runs.
                assert!(!d.join(format!("offsets/{}", id + 1)).exists());
                let got = ids(&b.collect().await?);
                s.lock().unwrap().push((id, c.is_replay, got));
                Ok::<(), BoxError>(())
            }
        })
        .start()
        .await
        .unwrap();
    q.await_termination().await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (0, false, vec![0, 1, 2]),
            (1, false, vec![3, 4]),
            (2, false, vec![5, 6, 7, 8])
        ]
    );
    let log = log.lock().unwrap().clone();
    let at = |e: &str| {
        log.iter()
            .position(|x| x == e)
            .unwrap_or_else(|| panic!("{e} not in {log:?}"))
    };
    // Batch 1 was planned and read before batch 0's function returned, and the source heard
    // of batch 0's commit only after that read.
    assert!(at("read 1->2") < at("fn 0"), "{log:?}");
    assert!(at("read 1->2") < at("commit 1"), "{log:?}");
    assert!(at("read 2->3") < at("fn 1"), "{log:?}");
    assert!(
        at("commit 1") < at("commit 2") && at("commit 2") < at("commit 3"),
        "{log:?}"
    );
    // Each range was read once.
    assert_eq!(
        log.iter().filter(|x| x.starts_with("read")).count(),
        3,
        "{log:?}"
    );
    let p = q.recent_progress();
    assert_eq!(p.len(), 3);
    assert_eq!(p[1].duration("latestOffset"), 0);
    assert_eq!(p.iter().map(|p| p.num_input_rows).sum::<u64>(), 9);
}
