//! Watermarks, deduplication within the watermark and windowed aggregation, each checked
//! batch by batch against a recomputation over all input seen so far under the watermark
//! rules (written here from Spark's rules, sharing no code with the engine): rows (or
//! windows) at or below the previous batch's watermark are late; state is evicted, and
//! append-mode windows close, by the batch's own watermark. The last test holds what
//! PySpark 4.3.0 itself gave on a small input.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use weir_core::datafusion::arrow::array::cast::AsArray;
use weir_core::datafusion::arrow::array::{
    Array, Int64Array, StringArray, TimestampMillisecondArray,
};
use weir_core::datafusion::arrow::datatypes::{
    DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::DataFrame;
use weir_core::{
    Aggregation, BatchContext, BoxError, MemorySource, OutputMode, StreamingQuery, Trigger,
    WeirSession,
};

const DELAY_MS: i64 = 8_000;
const SIZE_MS: i64 = 10_000;
const SLIDE_MS: i64 = 5_000;
const BASE_MS: i64 = 1_800_000_000_000;

/// One input row: key, value, event time (ms).
type Row = (Option<String>, Option<i64>, Option<i64>);

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            true,
        ),
    ]))
}

/// Batches of rows whose event times go forward with jitter: some late, some out of
/// order, a few with NULL keys, values or times.
fn input(batches: usize, per: usize) -> Vec<Vec<Row>> {
    let mut seed: u64 = 0x9e3779b97f4a7c15;
    let mut next = move |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    (0..batches)
        .map(|b| {
            (0..per)
                .map(|i| {
                    let k = match next(5) {
                        0 => None,
                        n => Some(["a", "b", "c", "d"][n as usize - 1].to_string()),
                    };
                    let v = (i % 7 != 3).then(|| next(1000) as i64 - 200);
                    let ts = (i % 17 != 5)
                        .then(|| BASE_MS + b as i64 * 6_000 + next(30_000) as i64 - 24_000);
                    (k, v, ts)
                })
                .collect()
        })
        .collect()
}

fn batch(rows: &[Row]) -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(StringArray::from(
                rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
            )),
            Arc::new(Int64Array::from(
                rows.iter().map(|r| r.1).collect::<Vec<_>>(),
            )),
            Arc::new(
                TimestampMillisecondArray::from(rows.iter().map(|r| r.2).collect::<Vec<_>>())
                    .with_timezone("UTC"),
            ),
        ],
    )
    .unwrap()
}

fn source(data: &[Vec<Row>]) -> Arc<MemorySource> {
    let s = MemorySource::new(schema());
    for b in data {
        s.add(batch(b)).unwrap();
    }
    Arc::new(s)
}

/// The watermark each batch runs with (data batches, then a no-data batch if the last
/// one moved it): 0 first, then max(previous, max event time - delay).
fn watermarks(data: &[Vec<Row>]) -> Vec<i64> {
    let mut w = 0;
    let mut out = Vec::new();
    for b in data {
        out.push(w);
        if let Some(max) = b.iter().filter_map(|r| r.2).max() {
            w = w.max(max - DELAY_MS);
        }
    }
    if w > *out.last().unwrap() {
        out.push(w);
    }
    out
}

type Recorded = Arc<Mutex<Vec<(u64, Vec<String>)>>>;

/// Runs `frame`'s query to its end with available-now, recording each batch's rows as
/// strings made by `show`.
async fn run(
    data: &[Vec<Row>],
    dir: &std::path::Path,
    build: impl Fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame,
    show: fn(&RecordBatch) -> Vec<String>,
    fail_at: Option<u64>,
) -> (StreamingQuery, Recorded) {
    try_run(data, dir, build, show, fail_at).await.unwrap()
}

/// The error a query stops with before running a batch: at its start (the checkpoint's
/// state is checked before a sink or the source is opened), or when it ends.
async fn refused(
    data: &[Vec<Row>],
    dir: &std::path::Path,
    build: impl Fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame,
) -> String {
    match try_run(data, dir, build, show_rows_none, None).await {
        Err(e) => weir_core::sink::error_chain(&e),
        Ok((q, seen)) => {
            let err = q.await_termination().await.unwrap_err();
            assert!(seen.lock().unwrap().is_empty(), "no batch ran");
            weir_core::sink::error_chain(&err)
        }
    }
}

async fn try_run(
    data: &[Vec<Row>],
    dir: &std::path::Path,
    build: impl Fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame,
    show: fn(&RecordBatch) -> Vec<String>,
    fail_at: Option<u64>,
) -> weir_core::Result<(StreamingQuery, Recorded)> {
    let seen: Recorded = Arc::default();
    let s = seen.clone();
    let frame = WeirSession::new()
        .read_stream()
        .source(source(data))
        .max_offsets_per_trigger(1)
        .load()
        .await
        .unwrap();
    let q = build(frame)
        .write_stream()
        .query_name("stateful")
        .checkpoint(dir)
        .trigger(Trigger::AvailableNow)
        .foreach_batch(move |b: DataFrame, c: BatchContext| {
            let s = s.clone();
            async move {
                let mut rows: Vec<String> = b.collect().await?.iter().flat_map(show).collect();
                rows.sort();
                s.lock().unwrap().push((c.batch_id, rows));
                if Some(c.batch_id) == fail_at {
                    return Err::<(), BoxError>("the sink refused the batch".into());
                }
                Ok(())
            }
        })
        .start()
        .await?;
    Ok((q, seen))
}

fn show_agg(b: &RecordBatch) -> Vec<String> {
    let col = |n: &str| b.column(b.schema().index_of(n).unwrap()).clone();
    let k = col("k");
    let (start, end) = (col("window_start"), col("window_end"));
    let (n, s, mn, mx, av) = (
        col("n"),
        col("s"),
        col("min(v)"),
        col("max(v)"),
        col("avg(v)"),
    );
    let int = |a: &Arc<dyn Array>, i: usize| {
        (!a.is_null(i)).then(|| a.as_primitive::<Int64Type>().value(i))
    };
    (0..b.num_rows())
        .map(|i| {
            agg_row(
                (!k.is_null(i)).then(|| k.as_string::<i32>().value(i).to_string()),
                start.as_primitive::<TimestampMicrosecondType>().value(i) / 1000,
                end.as_primitive::<TimestampMicrosecondType>().value(i) / 1000,
                n.as_primitive::<Int64Type>().value(i),
                int(&s, i),
                int(&mn, i),
                int(&mx, i),
                (!av.is_null(i)).then(|| av.as_primitive::<Float64Type>().value(i)),
            )
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn agg_row(
    k: Option<String>,
    start: i64,
    end: i64,
    n: i64,
    s: Option<i64>,
    mn: Option<i64>,
    mx: Option<i64>,
    av: Option<f64>,
) -> String {
    format!(
        "{k:?}|{start}|{end}|{n}|{s:?}|{mn:?}|{mx:?}|{:?}",
        av.map(|a| format!("{a:.6}"))
    )
}

/// The reference: batch by batch, the rows each output mode gives.
fn reference_agg(data: &[Vec<Row>], mode: OutputMode) -> (Vec<Vec<String>>, usize) {
    let mut wms = watermarks(data);
    if mode == OutputMode::Complete {
        // No batch without data: nothing would change.
        wms.truncate(data.len());
    }
    // (key, window start) -> values of the rows counted in it.
    let mut groups: BTreeMap<(Option<String>, i64), Vec<Option<i64>>> = BTreeMap::new();
    let mut emitted: BTreeSet<(Option<String>, i64)> = BTreeSet::new();
    let mut out = Vec::new();
    let show = |g: &(Option<String>, i64), vals: &Vec<Option<i64>>| {
        let vs: Vec<i64> = vals.iter().flatten().copied().collect();
        agg_row(
            g.0.clone(),
            g.1,
            g.1 + SIZE_MS,
            vals.len() as i64,
            (!vs.is_empty()).then(|| vs.iter().sum()),
            vs.iter().min().copied(),
            vs.iter().max().copied(),
            (!vs.is_empty()).then(|| vs.iter().sum::<i64>() as f64 / vs.len() as f64),
        )
    };
    for (i, w) in wms.iter().enumerate() {
        // Late by the batch before's watermark; closed and evicted by the batch's own.
        let late = match (i, mode) {
            // Complete mode counts every row.
            (_, OutputMode::Complete) => i64::MIN,
            (0, _) => 0,
            _ => wms[i - 1],
        };
        let mut touched = BTreeSet::new();
        for (k, v, ts) in data.get(i).map(Vec::as_slice).unwrap_or(&[]) {
            let Some(t) = ts else { continue };
            let mut start = t - t.rem_euclid(SLIDE_MS);
            while start > t - SIZE_MS {
                if start + SIZE_MS > late {
                    let g = (k.clone(), start);
                    groups.entry(g.clone()).or_default().push(*v);
                    touched.insert(g);
                }
                start -= SLIDE_MS;
            }
        }
        let mut rows: Vec<String> = match mode {
            OutputMode::Complete => groups.iter().map(|(g, v)| show(g, v)).collect(),
            OutputMode::Update => touched.iter().map(|g| show(g, &groups[g])).collect(),
            OutputMode::Append => groups
                .iter()
                .filter(|(g, _)| g.1 + SIZE_MS <= *w && !emitted.contains(*g))
                .map(|(g, v)| show(g, v))
                .collect(),
        };
        if mode == OutputMode::Append {
            emitted.extend(groups.keys().filter(|g| g.1 + SIZE_MS <= *w).cloned());
        }
        rows.sort();
        out.push(rows);
    }
    let last = *wms.last().unwrap();
    let state = match mode {
        OutputMode::Complete => groups.len(),
        _ => groups.keys().filter(|g| g.1 + SIZE_MS > last).count(),
    };
    (out, state)
}

fn windowed(
    mode: OutputMode,
) -> impl Fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame {
    move |f| {
        f.with_watermark("ts", Duration::from_millis(DELAY_MS as u64))
            .aggregate(
                Aggregation::new(["count(*) AS n", "sum(v) AS s", "min(v)", "max(v)", "avg(v)"])
                    .group_by(["k"])
                    .sliding_window(
                        "ts",
                        Duration::from_millis(SIZE_MS as u64),
                        Duration::from_millis(SLIDE_MS as u64),
                    )
                    .output_mode(mode),
            )
    }
}

fn state_total(q: &StreamingQuery) -> u64 {
    q.last_progress().unwrap().state_operators[0]["numRowsTotal"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn windowed_aggregation_equals_a_recomputation_in_every_output_mode() {
    let data = input(9, 40);
    let wms = watermarks(&data);
    assert!(
        wms.len() == 10,
        "the input ends with a no-data batch: {wms:?}"
    );
    for mode in [OutputMode::Append, OutputMode::Update, OutputMode::Complete] {
        let dir = tempfile::tempdir().unwrap();
        let (q, seen) = run(&data, dir.path(), windowed(mode), show_agg, None).await;
        q.await_termination().await.unwrap();
        let (want, state) = reference_agg(&data, mode);
        let got = seen.lock().unwrap().clone();
        assert_eq!(got.len(), want.len(), "{mode:?}: batches {got:?}");
        for (i, ((id, rows), want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(*id, i as u64);
            assert_eq!(rows, want, "{mode:?}: batch {i} (watermark {})", wms[i]);
        }
        assert!(
            want.iter().map(Vec::len).sum::<usize>() > 20,
            "{mode:?}: the input gives rows"
        );
        assert_eq!(state_total(&q) as usize, state, "{mode:?}");
        if mode == OutputMode::Complete {
            assert_eq!(got.len(), 9, "no batch without data in complete mode");
            continue;
        }
        let last = q.last_progress().unwrap();
        assert_eq!(
            last.num_input_rows, 0,
            "the last batch is the no-data batch"
        );
        assert_eq!(
            last.event_time["watermark"],
            weir_core::datafusion::arrow::temporal_conversions::timestamp_ms_to_datetime(
                *wms.last().unwrap()
            )
            .unwrap()
            .format("%Y-%m-%dT%H:%M:%S%.3fZ")
            .to_string()
        );
        let dropped: u64 = q
            .recent_progress()
            .iter()
            .map(|p| {
                p.state_operators[0]["numRowsDroppedByWatermark"]
                    .as_u64()
                    .unwrap()
            })
            .sum();
        assert!(dropped > 0, "{mode:?}: some rows came late");
        // The watermarks are in the logs as Spark writes them.
        let offsets = std::fs::read_to_string(dir.path().join("offsets/9")).unwrap();
        assert!(
            offsets.contains(&format!("\"batchWatermarkMs\":{}", wms[9])),
            "{offsets}"
        );
        let commit = std::fs::read_to_string(dir.path().join("commits/8")).unwrap();
        assert!(
            commit.contains(&format!("\"nextBatchWatermarkMs\":{}", wms[9])),
            "{commit}"
        );
    }
}

#[tokio::test]
async fn a_failed_batch_replays_with_its_watermark_and_state_and_gives_the_clean_runs_output() {
    let data = input(9, 40);
    for mode in [OutputMode::Append, OutputMode::Update] {
        let clean = tempfile::tempdir().unwrap();
        let (q, seen) = run(&data, clean.path(), windowed(mode), show_agg, None).await;
        q.await_termination().await.unwrap();
        let clean_rows = seen.lock().unwrap().clone();
        let clean_state = state_total(&q);

        let dir = tempfile::tempdir().unwrap();
        for fail_at in [3, 9] {
            let (q, _) = run(&data, dir.path(), windowed(mode), show_agg, Some(fail_at)).await;
            assert!(q.await_termination().await.is_err());
        }
        let (q, seen) = run(&data, dir.path(), windowed(mode), show_agg, None).await;
        q.await_termination().await.unwrap();
        let got = seen.lock().unwrap().clone();
        // The run after the failures starts at batch 9 (the no-data batch) again.
        assert_eq!(got.len(), 1, "{mode:?}: {got:?}");
        assert_eq!(got[0], clean_rows[9], "{mode:?}");
        assert_eq!(state_total(&q), clean_state, "{mode:?}");
    }
}

fn show_rows(b: &RecordBatch) -> Vec<String> {
    let k = b.column(0);
    let ts = b
        .column(2)
        .as_primitive::<weir_core::datafusion::arrow::datatypes::TimestampMillisecondType>();
    let v = b.column(1);
    (0..b.num_rows())
        .map(|i| {
            format!(
                "{:?}|{:?}|{:?}",
                (!k.is_null(i)).then(|| k.as_string::<i32>().value(i)),
                (!v.is_null(i)).then(|| v.as_primitive::<Int64Type>().value(i)),
                (!ts.is_null(i)).then(|| ts.value(i)),
            )
        })
        .collect()
}

#[tokio::test]
async fn drop_duplicates_within_watermark_equals_a_recomputation_and_its_state_expires() {
    let data = input(9, 40);
    let wms = watermarks(&data);
    let dir = tempfile::tempdir().unwrap();
    let (q, seen) = run(
        &data,
        dir.path(),
        |f| {
            f.with_watermark("ts", Duration::from_millis(DELAY_MS as u64))
                .drop_duplicates_within_watermark(["k"])
        },
        show_rows,
        None,
    )
    .await;
    q.await_termination().await.unwrap();
    // The reference: a row passes unless late or its key's expiry (first event time +
    // delay) is still ahead of the watermark; expired keys leave after each batch.
    let mut state: BTreeMap<Option<String>, i64> = BTreeMap::new();
    let mut want = Vec::new();
    let mut sizes = Vec::new();
    for (i, w) in wms.iter().enumerate() {
        let late = if i == 0 { 0 } else { wms[i - 1] };
        let mut rows = Vec::new();
        for r in data.get(i).map(Vec::as_slice).unwrap_or(&[]) {
            if r.2.is_some_and(|t| t <= late) || state.contains_key(&r.0) {
                continue;
            }
            state.insert(r.0.clone(), r.2.unwrap_or(0) + DELAY_MS);
            rows.extend(show_rows(&batch(std::slice::from_ref(r))));
        }
        state.retain(|_, exp| *exp > *w);
        sizes.push(state.len() as u64);
        rows.sort();
        want.push(rows);
    }
    let got: Vec<Vec<String>> = seen.lock().unwrap().iter().map(|b| b.1.clone()).collect();
    assert_eq!(got, want);
    assert!(
        want.iter().filter(|b| !b.is_empty()).count() > 3,
        "{want:?}"
    );
    let total: Vec<u64> = q
        .recent_progress()
        .iter()
        .map(|p| p.state_operators[0]["numRowsTotal"].as_u64().unwrap())
        .collect();
    assert_eq!(total, sizes);
    assert!(sizes.iter().any(|n| *n < 5), "keys expire: {sizes:?}");
    assert_eq!(
        q.last_progress().unwrap().state_operators[0]["operatorName"],
        "dedupeWithinWatermark"
    );
}

#[tokio::test]
async fn drop_duplicates_on_the_event_time_evicts_keys_the_watermark_passed() {
    let data = input(9, 40);
    let wms = watermarks(&data);
    let dir = tempfile::tempdir().unwrap();
    let (q, seen) = run(
        &data,
        dir.path(),
        |f| {
            f.with_watermark("ts", Duration::from_millis(DELAY_MS as u64))
                .drop_duplicates(["k", "ts"])
        },
        show_rows,
        None,
    )
    .await;
    q.await_termination().await.unwrap();
    let mut state: BTreeMap<(Option<String>, Option<i64>), ()> = BTreeMap::new();
    let mut want = Vec::new();
    let mut dropped = 0;
    for (i, w) in wms.iter().enumerate() {
        let late = if i == 0 { 0 } else { wms[i - 1] };
        let mut rows = Vec::new();
        for r in data.get(i).map(Vec::as_slice).unwrap_or(&[]) {
            if r.2.is_some_and(|t| t <= late) {
                dropped += 1;
                continue;
            }
            if state.insert((r.0.clone(), r.2), ()).is_none() {
                rows.extend(show_rows(&batch(std::slice::from_ref(r))));
            }
        }
        state.retain(|k, _| k.1.is_none_or(|t| t > *w));
        rows.sort();
        want.push(rows);
    }
    let got: Vec<Vec<String>> = seen.lock().unwrap().iter().map(|b| b.1.clone()).collect();
    assert_eq!(got, want);
    assert_eq!(state_total(&q) as usize, state.len());
    let late: u64 = q
        .recent_progress()
        .iter()
        .map(|p| {
            p.state_operators[0]["numRowsDroppedByWatermark"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert_eq!(late, dropped);
}

/// An update-mode aggregation.
fn update(aggregates: &[&str], groups: &[&str]) -> Aggregation {
    Aggregation::new(aggregates.iter().copied())
        .group_by(groups.iter().copied())
        .output_mode(OutputMode::Update)
}

#[tokio::test]
async fn stateful_settings_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let start = |build: fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame| {
        let dir = dir.path().to_path_buf();
        async move {
            let frame = WeirSession::new()
                .read_stream()
                .source(source(&[]))
                .load()
                .await
                .unwrap();
            build(frame)
                .write_stream()
                .checkpoint(dir)
                .foreach_batch(|_b: DataFrame, _c: BatchContext| async { Ok::<(), BoxError>(()) })
                .start()
                .await
                .map(|_| ())
                .unwrap_err()
                .to_string()
        }
    };
    let err = start(|f| f.with_watermark("v", Duration::from_secs(1))).await;
    assert!(
        err.contains("transform.with-watermark") && err.contains("`v`"),
        "{err}"
    );
    let err = start(|f| {
        f.with_watermark("ts", Duration::from_secs(1))
            .with_watermark("ts", Duration::from_secs(2))
    })
    .await;
    assert!(err.contains("2 watermarks"), "{err}");
    let err = start(|f| f.aggregate(Aggregation::new(["median(v)"]))).await;
    assert!(
        err.contains("transform.aggregate") && err.contains("median"),
        "{err}"
    );
    let err = start(|f| f.aggregate(update(&["sum(k)"], &["v"]))).await;
    assert!(err.contains("sum(k) cannot take column `k`"), "{err}");
    let err = start(|f| f.aggregate(update(&["count(*)"], &["kk"]))).await;
    assert!(err.contains("no column `kk`"), "{err}");
    let err = start(|f| f.aggregate(update(&["count(*)"], &["k", "k"]))).await;
    assert!(err.contains("`k` is twice"), "{err}");
    // Append needs a watermark it can close groups by; dedupe within one needs one.
    let err = start(|f| f.aggregate(Aggregation::new(["count(*)"]).group_by(["k"]))).await;
    assert!(
        err.contains("output mode append needs a watermark"),
        "{err}"
    );
    let err = start(|f| {
        f.with_watermark("ts", Duration::from_secs(1))
            .aggregate(Aggregation::new(["count(*)"]).group_by(["k"]))
    })
    .await;
    assert!(
        err.contains("output mode append needs a watermark"),
        "{err}"
    );
    let err = start(|f| f.drop_duplicates_within_watermark(["k"])).await;
    assert!(err.contains("needs a watermark"), "{err}");
    assert!(
        !dir.path().join("offsets").exists()
            || std::fs::read_dir(dir.path().join("offsets"))
                .unwrap()
                .count()
                == 0
    );
}

/// The rows, watermarks and state sizes PySpark 4.3.0 gave for this input (three files,
/// one per batch, `withWatermark("ts", "10 seconds")`, availableNow; run with
/// `dropDuplicatesWithinWatermark(["k"])`, `dropDuplicates(["k"])` and a 10-second window
/// count per `k` in update mode): weir must give the same.
#[tokio::test]
async fn the_same_rows_as_spark_4_3_on_a_small_input() {
    let t = |s: i64| Some(BASE_MS / 60_000 * 60_000 + s * 1000);
    let row = |k: &str, s: i64| (Some(k.to_string()), None, t(s));
    let data = vec![
        vec![row("a", 100), row("b", 100)],
        vec![row("c", 95), row("d", 50), row("a", 101)],
        vec![row("e", 91), row("f", 10), row("g", 180)],
    ];
    let keys = |b: &RecordBatch| -> Vec<String> {
        let k = b.column(0);
        (0..b.num_rows())
            .map(|i| k.as_string::<i32>().value(i).to_string())
            .collect()
    };
    type Build = fn(weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame;
    fn wm(f: weir_core::StreamingDataFrame) -> weir_core::StreamingDataFrame {
        f.with_watermark("ts", Duration::from_secs(10))
    }
    fn windowed(mode: OutputMode) -> Aggregation {
        Aggregation::new(["count(*)"])
            .group_by(["k"])
            .window("ts", Duration::from_secs(10))
            .output_mode(mode)
    }
    fn by_time(mode: OutputMode) -> Aggregation {
        Aggregation::new(["count(*)"])
            .group_by(["k", "ts"])
            .output_mode(mode)
    }
    // (query, rows of each batch, numRowsTotal, numRowsDroppedByWatermark), as Spark gave.
    type Case = (
        Build,
        &'static [&'static [&'static str]],
        &'static [u64],
        &'static [u64],
    );
    let cases: [Case; 6] = [
        (
            |f| wm(f).drop_duplicates_within_watermark(["k"]),
            &[&["a", "b"], &["c", "d"], &["e", "g"], &[]],
            &[2, 3, 5, 1],
            &[0, 0, 1, 0],
        ),
        (
            |f| wm(f).drop_duplicates(["k"]),
            &[&["a", "b"], &["c", "d"], &["e", "g"], &[]],
            &[2, 4, 6, 6],
            &[0, 0, 1, 0],
        ),
        (
            |f| wm(f).aggregate(windowed(OutputMode::Update)),
            &[&["a", "b"], &["a", "c", "d"], &["e", "g"], &[]],
            &[2, 3, 5, 1],
            &[0, 0, 1, 0],
        ),
        // Complete mode counts late rows, never evicts, runs no batch without data.
        (
            |f| wm(f).aggregate(windowed(OutputMode::Complete)),
            &[
                &["a", "b"],
                &["a", "b", "c", "d"],
                &["a", "b", "c", "d", "e", "f", "g"],
            ],
            &[2, 4, 7],
            &[0, 0, 0],
        ),
        // Grouped by the event-time column itself: evicted (and closed) by its value.
        (
            |f| wm(f).aggregate(by_time(OutputMode::Update)),
            &[&["a", "b"], &["a", "c", "d"], &["e", "g"], &[]],
            &[2, 4, 5, 1],
            &[0, 0, 1, 0],
        ),
        (
            |f| wm(f).aggregate(by_time(OutputMode::Append)),
            &[&[], &["d"], &["e"], &["a", "a", "b", "c"]],
            &[2, 4, 5, 1],
            &[0, 0, 1, 0],
        ),
    ];
    for (build, rows, totals, dropped) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (q, seen) = run(&data, dir.path(), build, keys, None).await;
        q.await_termination().await.unwrap();
        let got: Vec<Vec<String>> = seen.lock().unwrap().iter().map(|b| b.1.clone()).collect();
        let want: Vec<Vec<String>> = rows
            .iter()
            .map(|r| r.iter().map(|s| s.to_string()).collect())
            .collect();
        assert_eq!(got, want);
        let p = q.recent_progress();
        let marks: Vec<String> = p
            .iter()
            .map(|p| p.event_time["watermark"].clone())
            .collect();
        let at = |s: i64| {
            weir_core::datafusion::arrow::temporal_conversions::timestamp_ms_to_datetime(
                t(s).unwrap(),
            )
            .unwrap()
            .format("%Y-%m-%dT%H:%M:%S%.3fZ")
            .to_string()
        };
        let all = [
            "1970-01-01T00:00:00.000Z".to_string(),
            at(90),
            at(91),
            at(170),
        ];
        assert_eq!(marks, all[..rows.len()].to_vec());
        let op = |k: &str| -> Vec<u64> {
            p.iter()
                .map(|p| p.state_operators[0][k].as_u64().unwrap())
                .collect()
        };
        assert_eq!(op("numRowsTotal"), totals.to_vec());
        assert_eq!(op("numRowsDroppedByWatermark"), dropped.to_vec());
    }
}

/// A query without the stateful operator its checkpoint has state for is refused, as
/// Spark refuses it: the state would silently stop being applied.
#[tokio::test]
async fn removing_a_stateful_operator_from_a_checkpoint_is_refused() {
    let data = input(3, 10);
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = run(
        &data[..2],
        dir.path(),
        |f| f.drop_duplicates(["k"]),
        show_rows,
        None,
    )
    .await;
    q.await_termination().await.unwrap();
    let err = refused(&data, dir.path(), |f| f).await;
    assert!(
        err.contains("stateful operator 0") && err.contains("cannot be removed"),
        "{err}"
    );
}

/// `approx_count_distinct` keeps a sketch per group in the state: split over five batches
/// (a replayed one among them) the estimate is the one of all values in one batch, and
/// within 10% of the true count.
#[tokio::test]
async fn approx_count_distinct_sketches_merge_across_batches() {
    let rows = |from: i64, to: i64| -> Vec<Row> {
        (from..to)
            .map(|v| (Some("k".to_string()), Some(v % 7_000), Some(BASE_MS)))
            .collect()
    };
    let build = |f: weir_core::StreamingDataFrame| {
        f.aggregate(
            Aggregation::new(["approx_count_distinct(v) AS n", "count(*) AS rows"])
                .group_by(["k"])
                .output_mode(OutputMode::Complete),
        )
    };
    let show = |b: &RecordBatch| -> Vec<String> {
        let n = b.column(1).as_primitive::<Int64Type>();
        (0..b.num_rows()).map(|i| n.value(i).to_string()).collect()
    };
    let one = tempfile::tempdir().unwrap();
    let (q, seen) = run(&[rows(0, 10_000)], one.path(), build, show, None).await;
    q.await_termination().await.unwrap();
    let whole = seen.lock().unwrap()[0].1.clone();
    let est: f64 = whole[0].parse().unwrap();
    assert!((est - 7_000.0).abs() < 700.0, "{est}");

    let parts: Vec<Vec<Row>> = (0..5).map(|i| rows(i * 2_000, (i + 1) * 2_000)).collect();
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = run(&parts, dir.path(), build, show, Some(2)).await;
    assert!(q.await_termination().await.is_err());
    let (q, seen) = run(&parts, dir.path(), build, show, None).await;
    q.await_termination().await.unwrap();
    let last = seen.lock().unwrap().last().unwrap().1.clone();
    assert_eq!(last, whole);
    // New state records Spark's sketch; state written before that file existed (none at
    // batch 1 or later) keeps weir's earlier one, and is not given the file.
    let sketch = dir.path().join("state/0/_metadata/sketch");
    assert!(
        std::fs::read_to_string(&sketch)
            .unwrap()
            .contains("spark-hll++")
    );
    let old = tempfile::tempdir().unwrap();
    let (q, _) = run(&parts, old.path(), build, show, Some(1)).await;
    assert!(q.await_termination().await.is_err());
    std::fs::remove_file(old.path().join("state/0/_metadata/sketch")).unwrap();
    // (Batch 0's registers are Spark's here, so the estimate, a union of two hashes, is
    // not checked: a real earlier checkpoint has weir's earlier registers throughout.)
    let (q, _) = run(&parts, old.path(), build, show, None).await;
    q.await_termination().await.unwrap();
    assert!(!old.path().join("state/0/_metadata/sketch").exists());
}

/// An operator added in front of one the checkpoint has state for is refused before any
/// batch, naming what the state was written by.
#[tokio::test]
async fn an_operator_added_in_front_of_another_is_refused_at_start() {
    let data = input(3, 10);
    let dir = tempfile::tempdir().unwrap();
    let agg = || {
        Aggregation::new(["count(*)"])
            .group_by(["k"])
            .output_mode(OutputMode::Update)
    };
    let (q, _) = run(
        &data[..2],
        dir.path(),
        move |f| f.aggregate(agg()),
        show_rows_none,
        None,
    )
    .await;
    q.await_termination().await.unwrap();
    let err = refused(&data, dir.path(), move |f| {
        f.drop_duplicates(["k"]).aggregate(agg())
    })
    .await;
    assert!(
        err.contains("written by stateStoreSave") && err.contains("this query has dedupe"),
        "{err}"
    );
    assert!(
        !dir.path().join("offsets/2").exists(),
        "refused before planning batch 2"
    );
}

fn show_rows_none(_b: &RecordBatch) -> Vec<String> {
    Vec::new()
}

/// `numRowsDroppedByWatermark` of an aggregation counts late (group, window) pairs, as
/// PySpark 4.3.0 gave on this input (`withWatermark("ts", "10 seconds")`, a 10-second
/// window count per `k`, update and append): the last batch's nine late rows fall in three
/// (group, window) pairs (four rows of `a` in one window, split over two files in Spark's run, two
/// of `b` in it, three of `a` in another), and Spark counted 3.
#[tokio::test]
async fn late_rows_of_an_aggregation_count_per_group_and_window_as_in_spark() {
    let base = BASE_MS / 3_600_000 * 3_600_000;
    let r = |k: &str, s: i64| (Some(k.to_string()), Some(1), Some(base + s * 1000));
    // Spark ran a batch without data between the two (its watermark moved): here a batch of
    // one row on time takes its place, so the third batch is late against 00:04:51 too.
    let data = vec![
        vec![r("a", 300), r("b", 301)],
        vec![r("d", 302)],
        vec![
            r("a", 61),
            r("a", 62),
            r("b", 63),
            r("b", 64),
            r("a", 121),
            r("a", 122),
            r("a", 123),
            r("c", 400),
            r("a", 65),
            r("a", 66),
        ],
    ];
    for mode in [OutputMode::Update, OutputMode::Append] {
        let dir = tempfile::tempdir().unwrap();
        let agg = move |f: weir_core::StreamingDataFrame| {
            f.with_watermark("ts", Duration::from_secs(10)).aggregate(
                Aggregation::new(["count(*)"])
                    .group_by(["k"])
                    .window("ts", Duration::from_secs(10))
                    .output_mode(mode),
            )
        };
        let (q, _) = run(&data, dir.path(), agg, show_rows_none, None).await;
        q.await_termination().await.unwrap();
        let dropped: Vec<u64> = q
            .recent_progress()
            .iter()
            .map(|p| {
                p.state_operators[0]["numRowsDroppedByWatermark"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(dropped[..3], [0, 0, 3], "{mode:?}: {dropped:?}");
    }
}
