use datafusion::arrow::array::{Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, col, lit};

use super::*;

fn ctx() -> SessionContext {
    let state = SessionStateBuilder::new()
        .with_config(SessionConfig::new().with_target_partitions(2))
        .with_default_features()
        .with_physical_optimizer_rule(Arc::new(super::super::top_one::TopOnePerKey))
        .with_query_planner(Arc::new(WeirQueryPlanner))
        .build();
    SessionContext::new_with_state(state)
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("v", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
    ]))
}

/// Rows (k, v, s) in two record batches.
fn rows(rows: &[(Option<i64>, i64, &str)]) -> Vec<Vec<RecordBatch>> {
    let half = rows.len() / 2;
    let batch = |r: &[(Option<i64>, i64, &str)]| {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(Int64Array::from_iter(r.iter().map(|x| x.0))),
                Arc::new(Int64Array::from_iter_values(r.iter().map(|x| x.1))),
                Arc::new(StringArray::from_iter_values(r.iter().map(|x| x.2))),
            ],
        )
        .unwrap()
    };
    vec![vec![batch(&rows[..half]), batch(&rows[half..])]]
}

async fn text(df: DataFrame) -> String {
    pretty_format_batches(&df.collect().await.unwrap())
        .unwrap()
        .to_string()
}

/// What the SQL gives over `parts` planned from scratch on a plain in-memory table.
async fn fresh(sql: &str, parts: Vec<Vec<RecordBatch>>) -> String {
    let ctx = ctx();
    let table = datafusion::datasource::MemTable::try_new(schema(), parts).unwrap();
    ctx.register_table(crate::engine::BATCH_VIEW, Arc::new(table))
        .unwrap();
    text(ctx.sql(sql).await.unwrap()).await
}

fn batches() -> Vec<Vec<(Option<i64>, i64, &'static str)>> {
    vec![
        vec![
            (Some(1), 10, "a"),
            (Some(1), 30, "b"),
            (Some(2), 5, "c"),
            (None, 7, "d"),
        ],
        // Smaller values than the batch before: a filter or a count kept from it
        // would show.
        vec![
            (Some(3), 1, "e"),
            (Some(1), 2, "f"),
            (Some(3), 4, "g"),
            (Some(4), 3, "h"),
        ],
        vec![],
        vec![(Some(9), 100, "i"), (None, 50, "j")],
    ]
}

async fn check_kept(sql: &str) {
    // One partition holds both batches of a part (operators that concatenate their
    // input see several batches); two hold one each.
    for n in [1, 2] {
        check_kept_in(sql, n).await;
    }
}

async fn check_kept_in(sql: &str, n: usize) {
    let ctx = ctx();
    let mut plan = SqlPlan::default();
    for (i, b) in batches().into_iter().enumerate() {
        let parts = if b.is_empty() { vec![vec![]] } else { rows(&b) };
        let df = plan
            .frame(&ctx, sql, schema(), deal(parts.clone(), n))
            .await
            .unwrap();
        let SqlPlan::Kept { template, .. } = &plan else {
            panic!("{sql}: plan not kept");
        };
        // The batch's plan is the template's nodes anew, not planned again.
        let run = df.clone().create_physical_plan().await.unwrap();
        assert!(
            Arc::ptr_eq(run.properties(), template.properties()),
            "{sql}: properties computed again"
        );
        let want = fresh(sql, parts).await;
        // Planned twice, run twice: fresh state each time.
        assert_eq!(text(df.clone()).await, want, "{sql}, batch {i}");
        assert_eq!(text(df.clone()).await, want, "{sql}, batch {i} again");
        // A function may build on the batch (the node inside a larger plan).
        let more = text(df.filter(col("v").gt(lit(3))).unwrap()).await;
        let table = datafusion::datasource::MemTable::try_new(
            schema(),
            if b.is_empty() { vec![vec![]] } else { rows(&b) },
        )
        .unwrap();
        let c2 = self::ctx();
        c2.register_table(crate::engine::BATCH_VIEW, Arc::new(table))
            .unwrap();
        let want_more = text(
            c2.sql(sql)
                .await
                .unwrap()
                .filter(col("v").gt(lit(3)))
                .unwrap(),
        )
        .await;
        assert_eq!(more, want_more, "{sql}, batch {i}, filtered");
    }
}

#[tokio::test]
async fn a_kept_plan_gives_each_batch_its_own_rows() {
    for sql in [
        "SELECT k, v, s FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY v DESC) \
         AS rn FROM batch) WHERE rn = 1 ORDER BY k NULLS FIRST",
        "SELECT count(*) AS n, sum(v) AS v, max(s) AS s FROM batch",
        "SELECT k, v, s FROM batch ORDER BY v DESC LIMIT 2",
        "SELECT a.k, a.v, b.s FROM batch a JOIN batch b ON a.k = b.k AND a.v <> b.v \
         ORDER BY a.v, b.s",
        "SELECT k, count(*) AS v, min(s) AS s FROM batch GROUP BY k ORDER BY k NULLS LAST",
        "SELECT k, v, upper(s) AS s FROM batch WHERE v > 4 ORDER BY v",
        // Scans of fewer columns than the batch has (a projection in the leaf) under
        // a sort, an ordered window and an ordered aggregate.
        "SELECT v, s FROM batch ORDER BY v DESC",
        "SELECT v FROM batch ORDER BY v LIMIT 3",
        "SELECT s, sum(v) OVER (ORDER BY s ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS v \
         FROM batch ORDER BY s",
        "SELECT k, string_agg(s, ',' ORDER BY s) AS s, max(v) AS v FROM batch GROUP BY k \
         ORDER BY k NULLS FIRST",
    ] {
        check_kept(sql).await;
    }
}

#[tokio::test]
async fn plans_that_may_differ_per_batch_are_not_kept() {
    let ctx = ctx();
    let other = datafusion::datasource::MemTable::try_new(schema(), rows(&batches()[0])).unwrap();
    ctx.register_table("dim", Arc::new(other)).unwrap();
    for sql in [
        "SELECT k, v, s, now() AS at FROM batch",
        "SELECT k, v, s, random() AS r FROM batch",
        "SELECT batch.k, batch.v, dim.s FROM batch JOIN dim ON batch.k = dim.k",
        "SELECT k, v, s FROM batch WHERE v > (SELECT avg(v) FROM batch)",
        "SELECT 1 AS one",
    ] {
        let mut plan = SqlPlan::default();
        for b in batches() {
            let parts = if b.is_empty() { vec![vec![]] } else { rows(&b) };
            let df = plan
                .frame(&ctx, sql, schema(), deal(parts, 2))
                .await
                .unwrap();
            df.collect().await.unwrap();
            assert!(matches!(plan, SqlPlan::PerBatch), "{sql}: kept");
        }
    }
}

#[tokio::test]
async fn now_is_the_time_of_each_batch() {
    let ctx = ctx();
    let mut plan = SqlPlan::default();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let df = plan
            .frame(
                &ctx,
                "SELECT now() AS at FROM batch LIMIT 1",
                schema(),
                deal(rows(&batches()[0]), 2),
            )
            .await
            .unwrap();
        seen.push(text(df).await);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_ne!(seen[0], seen[1]);
}

/// SQL over a batch is a query: DDL, DML, COPY and SET are refused before they run.
#[tokio::test]
async fn statements_over_a_batch_are_refused_before_they_run() {
    let dir = tempfile::tempdir().unwrap();
    let leak = dir.path().join("leak.json");
    let ctx = ctx();
    for sql in [
        "CREATE VIEW v AS SELECT * FROM batch".to_string(),
        "INSERT INTO batch SELECT * FROM batch".to_string(),
        format!(
            "COPY (SELECT * FROM batch) TO '{}' STORED AS JSON",
            leak.display()
        ),
        "SET datafusion.execution.batch_size = 1".to_string(),
    ] {
        let table =
            datafusion::datasource::MemTable::try_new(schema(), rows(&batches()[0])).unwrap();
        let err = crate::engine::transform::sql_over_table(&ctx, Arc::new(table), &sql)
            .await
            .err()
            .unwrap_or_else(|| panic!("{sql} was planned"));
        assert!(err.to_string().contains("not supported"), "{sql}: {err}");
        let mut plan = SqlPlan::default();
        assert!(
            plan.frame(&ctx, &sql, schema(), deal(rows(&batches()[0]), 2))
                .await
                .is_err(),
            "{sql}"
        );
    }
    assert!(ctx.table("v").await.is_err(), "the view was made");
    assert!(!leak.exists(), "the COPY ran");
}

#[tokio::test]
async fn another_schema_is_planned_again() {
    let ctx = ctx();
    let mut plan = SqlPlan::default();
    let sql = "SELECT * FROM batch";
    let df = plan
        .frame(&ctx, sql, schema(), deal(rows(&batches()[0]), 2))
        .await
        .unwrap();
    assert_eq!(df.schema().fields().len(), 3);
    let narrow = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
    let b = RecordBatch::try_new(
        Arc::clone(&narrow),
        vec![Arc::new(Int64Array::from(vec![Some(1), None]))],
    )
    .unwrap();
    let df = plan
        .frame(&ctx, sql, narrow, deal(vec![vec![b]], 2))
        .await
        .unwrap();
    assert_eq!(df.schema().fields().len(), 1);
    assert_eq!(df.count().await.unwrap(), 2);
    // Dealt into another number of partitions (the session's target changed).
    let df = plan
        .frame(&ctx, sql, schema(), deal(rows(&batches()[1]), 3))
        .await
        .unwrap();
    assert_eq!(df.count().await.unwrap(), 4);
    assert!(matches!(plan, SqlPlan::Kept { partitions: 3, .. }));
}

#[test]
fn dealing_keeps_every_batch_once_in_order() {
    let parts = rows(&batches()[0]);
    let dealt = deal(parts.clone(), 3);
    assert_eq!(dealt.len(), 3);
    assert_eq!(dealt[0], vec![parts[0][0].clone()]);
    assert_eq!(dealt[1], vec![parts[0][1].clone()]);
    assert!(dealt[2].is_empty());
}
