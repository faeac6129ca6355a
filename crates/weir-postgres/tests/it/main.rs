//! The PostgreSQL sink against a real server (ephemeral, from the installed binaries).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use weir_core::datafusion::arrow::array::{
    ArrayRef, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float32Array, Float64Array,
    Int8Array, Int16Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray,
    UInt32Array,
};
use weir_core::datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::{BatchContext, ForeachBatch};
use weir_postgres::{PostgresLedger, PostgresUpsert};
use weir_testkit::{pg_exec, pg_rows, postgres};

fn df(rows: &[(i64, &str, i64)]) -> DataFrame {
    weir_testkit::order_rows(rows)
}

fn ctx(query_id: uuid::Uuid, batch_id: u64) -> BatchContext {
    weir_testkit::batch_context(query_id, batch_id)
}

async fn orders(table: &str) -> Vec<String> {
    pg_rows(
        &postgres().url,
        &format!("SELECT order_id::text, status FROM {table}"),
    )
    .await
}

#[tokio::test]
async fn upsert_keeps_the_newest_row_per_key_and_a_replay_is_skipped_by_the_ledger() {
    let url = &postgres().url;
    let sink = PostgresUpsert::new(url, "orders_a", ["order_id"], "updated_at").create_table(true);
    let q = uuid::Uuid::new_v4();
    sink.call(
        df(&[(1, "created", 10), (1, "paid", 20), (2, "created", 10)]),
        ctx(q, 0),
    )
    .await
    .unwrap();
    assert_eq!(orders("orders_a").await, vec!["1|paid", "2|created"]);
    // Newer row for 2, late older row for 1, new key 3.
    sink.call(
        df(&[(2, "shipped", 30), (1, "created", 15), (3, "new", 1)]),
        ctx(q, 1),
    )
    .await
    .unwrap();
    assert_eq!(
        orders("orders_a").await,
        vec!["1|paid", "2|shipped", "3|new"]
    );
    // Replay of batch 1 with different rows (as a non-deterministic transform would give):
    // the ledger proves batch 1 landed, so nothing changes.
    let replay = ctx(q, 1).replay(true);
    sink.call(df(&[(9, "must-not-appear", 99)]), replay.clone())
        .await
        .unwrap();
    assert_eq!(replay.metrics.skipped(), 1);
    assert_eq!(
        orders("orders_a").await,
        vec!["1|paid", "2|shipped", "3|new"]
    );
    let ledger = pg_rows(
        url,
        &format!(
            "SELECT batch_id::text, rows::text FROM weir_batches WHERE app_id = '{}/orders_a'",
            replay.app_id()
        ),
    )
    .await;
    assert_eq!(ledger, vec!["0|2", "1|3"]);
}

#[tokio::test]
async fn the_staging_variant_lands_each_batch_once_and_clears_its_staging_rows() {
    let url = &postgres().url;
    let sink = PostgresUpsert::new(url, "orders_b", ["order_id"], "updated_at")
        .create_table(true)
        .staging_table("orders_b_staging");
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "a", 1), (2, "b", 1)]), ctx(q, 0))
        .await
        .unwrap();
    // Rows left by a dead attempt of batch 1 in staging are cleared by the next attempt.
    pg_exec(url, &format!(
        "INSERT INTO orders_b_staging VALUES (7, 'stale', now(), 'orders-{q}/orders_b', 1), (7, 'stale', now(), 'orders-{q}/orders_b', 1)"
    ))
    .await;
    sink.call(df(&[(2, "c", 5)]), ctx(q, 1).replay(true))
        .await
        .unwrap();
    sink.call(df(&[(2, "c", 5)]), ctx(q, 1).replay(true))
        .await
        .unwrap();
    assert_eq!(orders("orders_b").await, vec!["1|a", "2|c"]);
    assert_eq!(
        pg_rows(url, "SELECT count(*)::text FROM orders_b_staging").await,
        vec!["0"]
    );
}

/// The tables are made once per sink, not per batch; a table dropped while the query runs
/// fails that attempt (naming it) and the next attempt makes it again.
#[tokio::test]
async fn tables_dropped_under_a_running_sink_are_made_again_by_the_next_attempt() {
    let url = &postgres().url;
    let sink = PostgresUpsert::new(url, "orders_drop", ["order_id"], "updated_at")
        .create_table(true)
        .staging_table("orders_drop_staging");
    let q = uuid::Uuid::new_v4();
    sink.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    pg_exec(url, "DROP TABLE orders_drop, orders_drop_staging").await;
    let err = sink
        .call(df(&[(2, "b", 1)]), ctx(q, 1))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("orders_drop") && err.contains("batch 1"),
        "{err}"
    );
    sink.call(df(&[(2, "b", 1)]), ctx(q, 1).replay(true))
        .await
        .unwrap();
    assert_eq!(orders("orders_drop").await, vec!["2|b"]);
    assert_eq!(
        pg_rows(url, "SELECT count(*)::text FROM orders_drop_staging").await,
        vec!["0"]
    );
}

#[tokio::test]
async fn types_round_trip_through_binary_copy() {
    let url = &postgres().url;
    let s = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int32, false),
        Field::new("i8", DataType::Int8, true),
        Field::new("i16", DataType::Int16, true),
        Field::new("u32", DataType::UInt32, true),
        Field::new("f32", DataType::Float32, true),
        Field::new("f64", DataType::Float64, true),
        Field::new("b", DataType::Boolean, true),
        Field::new("d", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new(
            "tstz",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        Field::new("dec", DataType::Decimal128(12, 2), true),
        Field::new("bin", DataType::Binary, true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int32Array::from(vec![1, 2])),
        Arc::new(Int8Array::from(vec![Some(-8), None])),
        Arc::new(Int16Array::from(vec![Some(300), None])),
        Arc::new(UInt32Array::from(vec![Some(4_000_000_000), None])),
        Arc::new(Float32Array::from(vec![Some(1.5), None])),
        Arc::new(Float64Array::from(vec![Some(-2.25), None])),
        Arc::new(BooleanArray::from(vec![Some(true), None])),
        Arc::new(Date32Array::from(vec![Some(20_454), None])),
        Arc::new(TimestampMicrosecondArray::from(vec![
            Some(1_767_225_600_123_456),
            None,
        ])),
        Arc::new(
            TimestampMicrosecondArray::from(vec![Some(1_767_225_600_000_001), None])
                .with_timezone("UTC"),
        ),
        Arc::new(
            Decimal128Array::from(vec![Some(-1_234_567), None])
                .with_precision_and_scale(12, 2)
                .unwrap(),
        ),
        Arc::new(BinaryArray::from(vec![Some(&b"\x00\xff"[..]), None])),
        Arc::new(StringArray::from(vec![Some("é \"quoted\""), None])),
    ];
    let batch = RecordBatch::try_new(s, cols).unwrap();
    let sink = PostgresUpsert::new(url, "types_t", ["k"], "k").create_table(true);
    sink.call(
        SessionContext::new().read_batch(batch).unwrap(),
        ctx(uuid::Uuid::new_v4(), 0),
    )
    .await
    .unwrap();
    let got = pg_rows(
        url,
        "SELECT k::text, i8::text, i16::text, u32::text, f32::text, f64::text, b::text, d::text, ts::text, \
         (tstz AT TIME ZONE 'UTC')::text, dec::text, encode(bin, 'hex'), s FROM types_t",
    )
    .await;
    assert_eq!(
        got,
        vec![
            "1|-8|300|4000000000|1.5|-2.25|true|2026-01-01|2026-01-01 00:00:00.123456|2026-01-01 00:00:00.000001|-12345.67|00ff|é \"quoted\"",
            "2|NULL|NULL|NULL|NULL|NULL|NULL|NULL|NULL|NULL|NULL|NULL|NULL",
        ]
    );
}

#[tokio::test]
async fn an_unsupported_type_is_refused_before_anything_is_written() {
    let url = &postgres().url;
    let s = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("when", DataType::Time64(TimeUnit::Microsecond), false),
    ]));
    let b = RecordBatch::try_new(
        s,
        vec![
            Arc::new(Int64Array::from(vec![1])),
            Arc::new(weir_core::datafusion::arrow::array::Time64MicrosecondArray::from(vec![5])),
        ],
    )
    .unwrap();
    let sink = PostgresUpsert::new(url, "unsupported_t", ["k"], "k").create_table(true);
    let err = sink
        .call(
            SessionContext::new().read_batch(b).unwrap(),
            ctx(uuid::Uuid::new_v4(), 0),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("column 'when'"), "{err}");
    assert!(pg_rows(url, "SELECT to_regclass('unsupported_t')::text").await == vec!["NULL"]);
}

#[tokio::test]
async fn a_refused_connection_fails_the_batch_naming_table_and_batch_and_a_later_run_lands_it_once()
{
    let url = &postgres().url;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bad = format!("host=127.0.0.1 port={port} user=postgres password=hunter2 dbname=postgres");
    let q = uuid::Uuid::new_v4();
    let err = PostgresUpsert::new(&bad, "orders_c", ["order_id"], "updated_at")
        .call(df(&[(1, "a", 1)]), ctx(q, 4))
        .await
        .unwrap_err();
    let msg = weir_core::sink::error_chain(err.as_ref());
    assert!(
        msg.contains("orders_c") && msg.contains("batch 4") && msg.contains("connecting"),
        "{msg}"
    );
    assert!(
        !msg.contains("hunter2"),
        "the password is never printed: {msg}"
    );
    let good = PostgresUpsert::new(url, "orders_c", ["order_id"], "updated_at").create_table(true);
    good.call(df(&[(1, "a", 1)]), ctx(q, 4).replay(true))
        .await
        .unwrap();
    good.call(df(&[(1, "a", 1)]), ctx(q, 4).replay(true))
        .await
        .unwrap();
    assert_eq!(orders("orders_c").await, vec!["1|a"]);
}

#[tokio::test]
async fn a_constraint_violation_fails_the_batch_and_commits_nothing() {
    let url = &postgres().url;
    pg_exec(url, "CREATE TABLE orders_d (order_id bigint PRIMARY KEY, status text CHECK (status <> 'bad'), updated_at timestamptz)").await;
    let sink = PostgresUpsert::new(url, "orders_d", ["order_id"], "updated_at").ledger("ledger_d");
    let q = uuid::Uuid::new_v4();
    let err = sink
        .call(df(&[(1, "ok", 1), (2, "bad", 1)]), ctx(q, 0))
        .await
        .unwrap_err();
    let msg = weir_core::sink::error_chain(err.as_ref());
    assert!(
        msg.contains("orders_d") && msg.contains("batch 0") && msg.contains("check constraint"),
        "{msg}"
    );
    assert!(orders("orders_d").await.is_empty());
    assert_eq!(
        pg_rows(url, "SELECT count(*)::text FROM ledger_d").await,
        vec!["0"]
    );
    // The fixed batch lands once.
    sink.call(df(&[(1, "ok", 1), (2, "fine", 1)]), ctx(q, 0))
        .await
        .unwrap();
    assert_eq!(orders("orders_d").await, vec!["1|ok", "2|fine"]);
}

#[tokio::test]
async fn the_ledger_helper_runs_user_sql_once_per_batch() {
    let url = &postgres().url;
    pg_exec(url, "CREATE TABLE counter_e (n bigint)").await;
    let ledger = PostgresLedger::new(url, "ledger_e");
    let q = uuid::Uuid::new_v4();
    for replay in [false, true] {
        let c = ctx(q, 7).replay(replay);
        ledger
            .run_once(&c, |tx| {
                Box::pin(async move {
                    tx.execute("INSERT INTO counter_e VALUES (1)", &[]).await?;
                    Ok(1)
                })
            })
            .await
            .unwrap();
    }
    assert_eq!(
        pg_rows(url, "SELECT count(*)::text FROM counter_e").await,
        vec!["1"]
    );
    // A failing function rolls back its ledger claim too.
    let err = ledger
        .run_once(&ctx(q, 8), |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO counter_e VALUES (1)", &[]).await?;
                Err("refused".into())
            })
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("batch 8"), "{err}");
    assert_eq!(
        pg_rows(url, "SELECT count(*)::text FROM counter_e").await,
        vec!["1"]
    );
    assert_eq!(
        pg_rows(url, "SELECT batch_id::text FROM ledger_e").await,
        vec!["7"]
    );
}

#[tokio::test]
async fn the_insert_load_mode_gives_the_same_table_as_copy() {
    let url = &postgres().url;
    let q = uuid::Uuid::new_v4();
    for (table, mode) in [
        ("orders_copy_f", weir_postgres::LoadMode::Copy),
        ("orders_insert_f", weir_postgres::LoadMode::Insert),
    ] {
        let sink = PostgresUpsert::new(url, table, ["order_id"], "updated_at")
            .create_table(true)
            .load_mode(mode);
        sink.call(df(&[(1, "a", 1), (2, "b", 1), (1, "c", 2)]), ctx(q, 0))
            .await
            .unwrap();
        sink.call(df(&[(2, "d", 3), (3, "e", 1)]), ctx(q, 1))
            .await
            .unwrap();
    }
    assert_eq!(orders("orders_copy_f").await, vec!["1|c", "2|d", "3|e"]);
    assert_eq!(
        orders("orders_insert_f").await,
        orders("orders_copy_f").await
    );
}

#[tokio::test]
async fn a_ledger_row_on_a_first_attempt_is_another_querys_and_is_refused() {
    let url = &postgres().url;
    let old = PostgresUpsert::new(url, "orders_g", ["order_id"], "updated_at")
        .create_table(true)
        .app_id("orders-v1");
    let q = uuid::Uuid::new_v4();
    old.call(df(&[(1, "a", 1)]), ctx(q, 0)).await.unwrap();
    // A new checkpoint reusing the explicit app id: batch 0 is not a replay.
    let err = old
        .call(df(&[(2, "b", 1)]), ctx(uuid::Uuid::new_v4(), 0))
        .await
        .unwrap_err();
    let msg = weir_core::sink::error_chain(err.as_ref());
    assert!(
        msg.contains("already holds batch 0 for 'orders-v1'") && msg.contains("new app-id"),
        "{msg}"
    );
    assert_eq!(orders("orders_g").await, vec!["1|a"]);
}

#[tokio::test]
async fn ties_and_nulls_follow_the_same_rules_as_the_delta_merge() {
    let url = &postgres().url;
    let q = uuid::Uuid::new_v4();
    // Three rows of key 1 tie on updated_at; the greatest status ("c") wins, however the
    // rows are split into batches.
    let rows = [(1, "b", 5), (1, "c", 5), (1, "a", 5)];
    for (t, split) in [
        ("ties_h1", vec![3]),
        ("ties_h2", vec![1, 1, 1]),
        ("ties_h3", vec![2, 1]),
    ] {
        let sink = PostgresUpsert::new(url, t, ["order_id"], "updated_at").create_table(true);
        let mut at = 0;
        for (b, n) in split.iter().enumerate() {
            sink.call(df(&rows[at..at + n]), ctx(q, b as u64))
                .await
                .unwrap();
            at += n;
        }
        assert_eq!(orders(t).await, vec!["1|c"], "{t}");
    }
    // NULL keys: refused by default, naming the rows.
    let sink = PostgresUpsert::new(url, "nulls_h", ["order_id"], "updated_at").create_table(true);
    let err = sink
        .call(
            weir_testkit::order_rows_opt(&[(None, "x", Some(1)), (Some(1), "y", Some(1))]),
            ctx(q, 0),
        )
        .await
        .unwrap_err();
    let msg = weir_core::sink::error_chain(err.as_ref());
    assert!(msg.contains("1 row(s) have a NULL in order_id"), "{msg}");
    // NULL ordering taken as oldest: a value replaces it, it never replaces a value.
    let oldest = sink.clone().null_ordering(weir_core::NullOrdering::Oldest);
    oldest
        .call(
            weir_testkit::order_rows_opt(&[(Some(1), "null", None), (Some(2), "two", Some(1))]),
            ctx(q, 0),
        )
        .await
        .unwrap();
    oldest
        .call(
            weir_testkit::order_rows_opt(&[
                (Some(1), "real", Some(1)),
                (Some(2), "late null", None),
            ]),
            ctx(q, 1),
        )
        .await
        .unwrap();
    assert_eq!(orders("nulls_h").await, vec!["1|real", "2|two"]);
}

#[tokio::test]
async fn values_are_written_exactly_or_refused_naming_the_column() {
    use weir_core::datafusion::arrow::array::{TimestampNanosecondArray, TimestampSecondArray};
    let url = &postgres().url;
    let q = uuid::Uuid::new_v4();
    // A decimal with a negative scale: 123 * 10^2.
    let s = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("dec", DataType::Decimal128(5, -2), true),
    ]));
    let b = RecordBatch::try_new(
        s,
        vec![
            Arc::new(Int64Array::from(vec![1, 2])),
            Arc::new(
                Decimal128Array::from(vec![Some(123), Some(-7)])
                    .with_precision_and_scale(5, -2)
                    .unwrap(),
            ),
        ],
    )
    .unwrap();
    PostgresUpsert::new(url, "dec_i", ["k"], "k")
        .create_table(true)
        .call(SessionContext::new().read_batch(b).unwrap(), ctx(q, 0))
        .await
        .unwrap();
    assert_eq!(
        pg_rows(url, "SELECT k::text, dec::text FROM dec_i").await,
        vec!["1|12300", "2|-700"]
    );
    // A timestamp before 4714 BC, and one with nanoseconds: refused, nothing written.
    for (t, col) in [
        (
            "ts_old_i",
            Arc::new(TimestampSecondArray::from(vec![-300_000_000_000i64])) as ArrayRef,
        ),
        (
            "ts_ns_i",
            Arc::new(TimestampNanosecondArray::from(vec![1_001i64])) as ArrayRef,
        ),
    ] {
        let s = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("at", col.data_type().clone(), true),
        ]));
        let b = RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(vec![1])), col]).unwrap();
        let err = PostgresUpsert::new(url, t, ["k"], "k")
            .create_table(true)
            .call(SessionContext::new().read_batch(b).unwrap(), ctx(q, 0))
            .await
            .unwrap_err();
        let msg = weir_core::sink::error_chain(err.as_ref());
        assert!(
            msg.contains("column 'at'") && msg.contains("nothing was written"),
            "{msg}"
        );
        assert_eq!(
            pg_rows(url, &format!("SELECT to_regclass('{t}')::text")).await,
            vec!["NULL"],
            "{t}"
        );
    }
}

/// The ledger keeps the newest `LEDGER_KEEP_BATCHES` batches per app id, however many ran;
/// a replay of the newest still skips, and a new checkpoint reusing the app id is still
/// refused (its batch 0 is long gone from the ledger, but a later batch is there) or, when
/// reuse is allowed, skipped without writing.
#[tokio::test]
async fn the_ledger_keeps_the_newest_batches_and_still_tells_replays_from_other_queries() {
    let url = &postgres().url;
    let keep = weir_postgres::LEDGER_KEEP_BATCHES;
    let sink = PostgresUpsert::new(url, "orders_k", ["order_id"], "updated_at")
        .create_table(true)
        .app_id("orders-k");
    let q = uuid::Uuid::new_v4();
    let batches = keep + 3;
    for id in 0..batches {
        let i = id as i64;
        sink.call(df(&[(i % 10, "x", i)]), ctx(q, id))
            .await
            .unwrap();
    }
    let ledger = |sql: &'static str| async move { pg_rows(url, sql).await };
    let range = ledger(
        "SELECT min(batch_id)::text || '..' || max(batch_id)::text || ' ' || count(*)::text \
         FROM weir_batches WHERE app_id = 'orders-k'",
    )
    .await;
    assert_eq!(range, vec![format!("3..{} {keep}", batches - 1)]);
    let before = orders("orders_k").await;
    assert_eq!(before.len(), 10);

    let replay = ctx(q, batches - 1).replay(true);
    sink.call(df(&[(99, "replayed", 0)]), replay.clone())
        .await
        .unwrap();
    assert_eq!(replay.metrics.skipped(), 1);

    let err = sink
        .call(df(&[(99, "other query", 0)]), ctx(uuid::Uuid::new_v4(), 0))
        .await
        .unwrap_err();
    let msg = weir_core::sink::error_chain(err.as_ref());
    assert!(
        msg.contains(&format!(
            "already holds batch {} for 'orders-k'",
            batches - 1
        )),
        "{msg}"
    );
    let reuse = PostgresUpsert::new(url, "orders_k", ["order_id"], "updated_at")
        .app_id("orders-k")
        .allow_app_id_reuse(true);
    let other = ctx(uuid::Uuid::new_v4(), 5);
    reuse
        .call(df(&[(99, "other query", 0)]), other.clone())
        .await
        .unwrap();
    assert_eq!(other.metrics.skipped(), 1);
    assert_eq!(
        orders("orders_k").await,
        before,
        "nothing written by either"
    );
    let range = ledger(
        "SELECT min(batch_id)::text || '..' || max(batch_id)::text || ' ' || count(*)::text \
         FROM weir_batches WHERE app_id = 'orders-k'",
    )
    .await;
    assert_eq!(range, vec![format!("3..{} {keep}", batches - 1)]);

    // The helper follows the same rules.
    let helper = PostgresLedger::new(url, "ledger_k").app_id("helper-k");
    for id in 0..batches {
        assert!(
            helper
                .run_once(&ctx(q, id), |_| Box::pin(async { Ok(1) }))
                .await
                .unwrap()
        );
    }
    let count = ledger("SELECT count(*)::text FROM ledger_k").await;
    assert_eq!(count, vec![keep.to_string()]);
    let err = helper
        .run_once(&ctx(uuid::Uuid::new_v4(), 2), |_| Box::pin(async { Ok(1) }))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already holds batch"), "{err}");
}

/// In a fan-out the upsert runs beside the sink before it, up to its COMMIT, which waits for
/// that sink: a failure there rolls the upsert back (table and ledger untouched), and the
/// same sink object then lands the replayed batch once, on the same connection.
#[tokio::test]
async fn in_a_fan_out_the_upsert_commits_only_after_the_sinks_before_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use weir_core::{BoxError, FanOut};
    let url = postgres().url.clone();
    for staging in [true, false] {
        let table = format!("orders_fan_{staging}");
        let mut pg =
            PostgresUpsert::new(&url, &table, ["order_id"], "updated_at").create_table(true);
        if staging {
            pg = pg.staging_table(format!("{table}_staging"));
        }
        let pg = Arc::new(pg);
        // The table and the ledger exist before (another query's empty batch makes them).
        pg.call(df(&[]), ctx(uuid::Uuid::new_v4(), 0))
            .await
            .unwrap();
        let q = uuid::Uuid::new_v4();
        let app_id = format!("{}/{table}", ctx(q, 0).app_id());
        // The sink before: while it runs, the upsert must not be visible; it fails at first.
        let fail = Arc::new(AtomicBool::new(true));
        let seen: Arc<std::sync::Mutex<Vec<Vec<String>>>> = Arc::default();
        let (f, s, u, t, a) = (
            fail.clone(),
            seen.clone(),
            url.clone(),
            table.clone(),
            app_id.clone(),
        );
        let before = Arc::new(move |_df: DataFrame, _ctx: BatchContext| {
            let (f, s, u, t, a) = (f.clone(), s.clone(), u.clone(), t.clone(), a.clone());
            async move {
                // Give the upsert time to run up to its COMMIT beside this sink.
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                let visible = pg_rows(
                    &u,
                    &format!(
                        "SELECT order_id::text FROM {t} UNION ALL SELECT 'ledger' FROM weir_batches WHERE app_id = '{a}'"
                    ),
                )
                .await;
                s.lock().unwrap().push(visible);
                if f.load(Ordering::SeqCst) {
                    return Err::<(), BoxError>("the sink before fails".into());
                }
                Ok(())
            }
        }) as Arc<dyn ForeachBatch>;
        let fan = FanOut::new([
            ("before", before.clone()),
            ("pg", pg.clone() as Arc<dyn ForeachBatch>),
        ])
        .overlap_stages(true);
        let err = fan
            .call(df(&[(1, "a", 1), (2, "b", 1)]), ctx(q, 0))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("before"), "{err}");
        // Rolled back: nothing in the table or the ledger, and no session left waiting.
        assert!(orders(&table).await.is_empty(), "staging={staging}");
        assert_eq!(
            pg_rows(
                &url,
                &format!("SELECT count(*)::text FROM weir_batches WHERE app_id = '{app_id}'")
            )
            .await,
            vec!["0"]
        );
        fail.store(false, Ordering::SeqCst);
        let replay = ctx(q, 0).replay(true);
        fan.call(df(&[(1, "a", 1), (2, "b", 1)]), replay.clone())
            .await
            .unwrap();
        assert_eq!(orders(&table).await, vec!["1|a", "2|b"]);
        assert_eq!(replay.metrics.output_rows(), 2);
        // The sink before never saw the upsert's rows or ledger row (both attempts).
        for v in seen.lock().unwrap().iter() {
            assert!(
                v.is_empty(),
                "staging={staging}: visible before COMMIT: {v:?}"
            );
        }
        // A second replay finds the ledger row and changes nothing.
        let again = ctx(q, 0).replay(true);
        fan.call(df(&[(9, "must-not-appear", 9)]), again.clone())
            .await
            .unwrap();
        assert_eq!(orders(&table).await, vec!["1|a", "2|b"]);
        assert_eq!(again.metrics.skipped(), 1);
        if staging {
            assert_eq!(
                pg_rows(&url, &format!("SELECT count(*)::text FROM {table}_staging")).await,
                vec!["0"]
            );
        }
        // Two upserts of the same rows after a sink that fails: the second one's stage waits
        // for the first one's locks, which the failure releases (no hang), and nothing lands.
        fail.store(true, Ordering::SeqCst);
        let other = Arc::new(
            PostgresUpsert::new(&url, &table, ["order_id"], "updated_at").app_id("second"),
        ) as Arc<dyn ForeachBatch>;
        let fan2 = FanOut::new([
            ("before", before),
            ("pg", pg.clone() as Arc<dyn ForeachBatch>),
            ("pg2", other),
        ])
        .overlap_stages(true);
        let q2 = uuid::Uuid::new_v4();
        let failed = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            fan2.call(df(&[(1, "z", 50), (3, "z", 50)]), ctx(q2, 0)),
        )
        .await
        .expect("the fan-out ends after its failure");
        assert!(failed.is_err());
        assert_eq!(orders(&table).await, vec!["1|a", "2|b"]);
        fail.store(false, Ordering::SeqCst);
        fan2.call(df(&[(1, "z", 50), (3, "z", 50)]), ctx(q2, 0).replay(true))
            .await
            .unwrap();
        assert_eq!(orders(&table).await, vec!["1|z", "2|b", "3|z"]);
    }
}
