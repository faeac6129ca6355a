//! The newest row per key without a sort: `row_number() OVER (PARTITION BY k ORDER BY o
//! DESC) = 1` (the seed's dedupe pattern) is planned by DataFusion as a sort of the whole
//! batch and a window over it. This physical optimizer rule (Spark has the same idea as
//! `InsertWindowGroupLimit`) replaces the sort and the window under such a filter with
//! [`TopOnePerKeyExec`]: one pass over the rows that keeps, per key, the first row in the
//! window's order, and gives the window's columns (the row number is 1 for every row it
//! keeps). Rows that tie on the whole order are decided by input order, as the sort would
//! do for them.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, UInt64Array};
use datafusion::arrow::compute::interleave_record_batch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::row::{RowConverter, Rows, SortField};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, HashMap, Result as DfResult, ScalarValue};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::window::{StandardWindowExpr, WindowExpr};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{
    Boundedness, ChildrenPropertiesMode, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec, WindowUDFExpr};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
    SendableRecordBatchStream,
};
use futures::TryStreamExt;

/// The rule; registered in every weir session.
#[derive(Debug, Default)]
pub struct TopOnePerKey;

impl PhysicalOptimizerRule for TopOnePerKey {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            Ok(match rewrite(&node)? {
                Some(new) => Transformed::yes(new),
                None => Transformed::no(node),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "weir_top_one_per_key"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `FilterExec(rn = 1)` over a row_number window over a sort, as the filter over a
/// [`TopOnePerKeyExec`]; `None` if `node` is not that shape.
fn rewrite(node: &Arc<dyn ExecutionPlan>) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let Some(filter) = node.downcast_ref::<FilterExec>() else {
        return Ok(None);
    };
    let window = filter.input();
    let (exprs, window_input) = if let Some(w) = window.downcast_ref::<BoundedWindowAggExec>() {
        (w.window_expr(), w.input())
    } else if let Some(w) = window.downcast_ref::<WindowAggExec>() {
        (w.window_expr(), w.input())
    } else {
        return Ok(None);
    };
    let [expr] = exprs else {
        return Ok(None);
    };
    if !is_row_number(expr) || expr.partition_by().is_empty() || expr.order_by().is_empty() {
        return Ok(None);
    }
    // The row number is the window's last column.
    let rn = window.schema().fields().len() - 1;
    if !is_equal_to_one(filter.predicate(), rn) {
        return Ok(None);
    }
    let Some(sort) = window_input.downcast_ref::<SortExec>() else {
        return Ok(None);
    };
    if sort.fetch().is_some() {
        return Ok(None);
    }
    // The sort is by the keys, then the window's order: the rows kept come out in it, so
    // whatever above relied on the window's output order still gets it.
    let ordering: Vec<PhysicalSortExpr> = sort.expr().iter().cloned().collect();
    let keys = expr.partition_by();
    if ordering.len() < keys.len()
        || ordering
            .iter()
            .zip(keys)
            .any(|(o, k)| o.expr.as_ref() != k.as_ref())
    {
        return Ok(None);
    }
    let mut input = Arc::clone(sort.input());
    if !sort.preserve_partitioning() && input.output_partitioning().partition_count() > 1 {
        input = Arc::new(CoalescePartitionsExec::new(input));
    }
    let top: Arc<dyn ExecutionPlan> = Arc::new(TopOnePerKeyExec::new(
        input,
        ordering[..keys.len()].to_vec(),
        expr.order_by().to_vec(),
        window.schema(),
    ));
    let new = Arc::clone(node).replace_children(
        vec![top],
        ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
    )?;
    Ok(Some(new))
}

fn is_row_number(expr: &Arc<dyn WindowExpr>) -> bool {
    expr.as_any()
        .downcast_ref::<StandardWindowExpr>()
        .and_then(|s| {
            s.get_standard_func_expr()
                .as_any()
                .downcast_ref::<WindowUDFExpr>()
        })
        .is_some_and(|u| u.fun().name() == "row_number")
}

/// `col = 1` or `1 = col` for the column at `index`.
fn is_equal_to_one(pred: &Arc<dyn PhysicalExpr>, index: usize) -> bool {
    let Some(b) = pred.downcast_ref::<BinaryExpr>() else {
        return false;
    };
    if *b.op() != Operator::Eq {
        return false;
    }
    let column = |e: &Arc<dyn PhysicalExpr>| {
        e.downcast_ref::<Column>()
            .is_some_and(|c| c.index() == index)
    };
    let one = |e: &Arc<dyn PhysicalExpr>| {
        e.downcast_ref::<Literal>().is_some_and(|l| {
            matches!(
                l.value(),
                ScalarValue::UInt64(Some(1))
                    | ScalarValue::Int64(Some(1))
                    | ScalarValue::Int32(Some(1))
            )
        })
    };
    (column(b.left()) && one(b.right())) || (one(b.left()) && column(b.right()))
}

/// Per partition, the first row of each key in the given order, with the window's columns,
/// sorted by the keys (as the window gave them).
#[derive(Debug)]
pub struct TopOnePerKeyExec {
    input: Arc<dyn ExecutionPlan>,
    /// The partition keys, with the order the sort had for them.
    keys: Vec<PhysicalSortExpr>,
    order: Vec<PhysicalSortExpr>,
    schema: SchemaRef,
    cache: Arc<PlanProperties>,
}

impl TopOnePerKeyExec {
    /// The first row per `keys` of `input` in `order`, with the window's columns
    /// (`schema`: the input's and the row number). On a cluster a codec rebuilds it on a
    /// worker from these parts.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        keys: Vec<PhysicalSortExpr>,
        order: Vec<PhysicalSortExpr>,
        schema: SchemaRef,
    ) -> Self {
        let ordering: Vec<PhysicalSortExpr> = keys.iter().chain(&order).cloned().collect();
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new_with_orderings(Arc::clone(&schema), [ordering]),
            input.output_partitioning().clone(),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        TopOnePerKeyExec {
            input,
            keys,
            order,
            schema,
            cache,
        }
    }
}

impl TopOnePerKeyExec {
    /// The partition keys, with the order the sort had for them.
    pub fn keys(&self) -> &[PhysicalSortExpr] {
        &self.keys
    }

    /// The window's order within a key.
    pub fn order(&self) -> &[PhysicalSortExpr] {
        &self.order
    }

    /// The input.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for TopOnePerKeyExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|k| k.to_string()).collect();
        let order: Vec<String> = self.order.iter().map(|o| o.to_string()).collect();
        write!(
            f,
            "TopOnePerKeyExec: keys=[{}], order=[{}]",
            keys.join(", "),
            order.join(", ")
        )
    }
}

impl ExecutionPlan for TopOnePerKeyExec {
    fn name(&self) -> &str {
        "TopOnePerKeyExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        for k in &self.keys {
            if f(&k.expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        for o in &self.order {
            if f(&o.expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    /// With `Keep` (an input with the same properties, e.g. a kept plan given the next
    /// batch's rows) the properties are not computed again.
    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [input] = <[_; 1]>::try_from(children).map_err(|_| {
            datafusion::error::DataFusionError::Internal("TopOnePerKeyExec takes one input".into())
        })?;
        Ok(Arc::new(match options.children_properties {
            ChildrenPropertiesMode::Keep => TopOnePerKeyExec {
                input,
                keys: self.keys.clone(),
                order: self.order.clone(),
                schema: Arc::clone(&self.schema),
                cache: Arc::clone(&self.cache),
            },
            ChildrenPropertiesMode::Recompute => TopOnePerKeyExec::new(
                input,
                self.keys.clone(),
                self.order.clone(),
                Arc::clone(&self.schema),
            ),
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let keys = self.keys.clone();
        let order = self.order.clone();
        let schema = Arc::clone(&self.schema);
        let out_schema = Arc::clone(&schema);
        let fut = async move {
            let batches: Vec<RecordBatch> = input.try_collect().await?;
            top_one(&batches, &keys, &order, &schema)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            out_schema,
            futures::stream::once(fut),
        )))
    }
}

/// The first row of each key of `batches` in `order` (ties: the first in input order), in
/// key order, with a row number 1.
fn top_one(
    batches: &[RecordBatch],
    keys: &[PhysicalSortExpr],
    order: &[PhysicalSortExpr],
    schema: &SchemaRef,
) -> DfResult<RecordBatch> {
    let Some(first) = batches.first() else {
        return Ok(RecordBatch::new_empty(Arc::clone(schema)));
    };
    let eval = |b: &RecordBatch, exprs: &mut dyn Iterator<Item = &Arc<dyn PhysicalExpr>>| {
        exprs
            .map(|e| e.evaluate(b).and_then(|v| v.into_array(b.num_rows())))
            .collect::<DfResult<Vec<ArrayRef>>>()
    };
    let input = first.schema();
    let converter = |exprs: &[PhysicalSortExpr]| -> DfResult<RowConverter> {
        let fields = exprs
            .iter()
            .map(|e| {
                Ok(SortField::new_with_options(
                    e.expr.data_type(&input)?,
                    e.options,
                ))
            })
            .collect::<DfResult<Vec<_>>>()?;
        Ok(RowConverter::new(fields)?)
    };
    let (key_conv, order_conv) = (converter(keys)?, converter(order)?);
    // Every batch's keys and orders as comparable bytes, kept while the map borrows them
    // (no allocation per key).
    let mut key_rows = Vec::with_capacity(batches.len());
    let mut order_rows = Vec::with_capacity(batches.len());
    for b in batches {
        key_rows.push(key_conv.convert_columns(&eval(b, &mut keys.iter().map(|k| &k.expr))?)?);
        order_rows.push(order_conv.convert_columns(&eval(b, &mut order.iter().map(|o| &o.expr))?)?);
    }
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if u32::try_from(rows).is_err() {
        return Err(DataFusionError::Execution(format!(
            "newest row per key: {rows} rows in one batch, more than {} (lower the rows per trigger)",
            u32::MAX
        )));
    }
    let picks = match (narrow(&key_rows), narrow(&order_rows)) {
        (Some(width), Some(_)) if width <= 9 && one_first_byte(&key_rows) => {
            // No NULL key (or only NULL keys): the leading null byte tells no key from
            // another, and the rest fits 8 bytes (a 16-byte map entry, not 32).
            pick(&key_rows, &order_rows, rows, |k| number64(&k[1..]), number)
        }
        (Some(_), Some(_)) => pick(&key_rows, &order_rows, rows, number, number),
        // Keys and orders as comparable bytes.
        _ => pick(&key_rows, &order_rows, rows, |k| k, |o| o),
    };
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    let rows = interleave_record_batch(&refs, &picks)?;
    let mut columns = rows.columns().to_vec();
    columns.push(Arc::new(UInt64Array::from(vec![1u64; picks.len()])));
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// The common length of the rows of `rows` if it is at most 16 bytes (one fixed-width key
/// or order column: a null byte and up to 8 value bytes), so [`number`] orders them as their
/// bytes; None otherwise.
fn narrow(rows: &[Rows]) -> Option<usize> {
    let width = rows
        .iter()
        .find(|r| r.num_rows() > 0)?
        .row(0)
        .as_ref()
        .len();
    let same = rows
        .iter()
        .all(|r| r.iter().all(|row| row.as_ref().len() == width));
    (width <= 16 && same).then_some(width)
}

/// A row of at most 16 bytes as a number that sorts as its bytes do (among rows of one
/// length).
fn number(row: &[u8]) -> u128 {
    u128::from_be_bytes(head(row))
}

/// [`number`] for rows of at most 8 bytes.
fn number64(row: &[u8]) -> u64 {
    u64::from_be_bytes(head(row))
}

/// The first `N` bytes of `row`, zero-padded.
fn head<const N: usize>(row: &[u8]) -> [u8; N] {
    let mut head = [0u8; N];
    let n = row.len().min(N);
    head[..n].copy_from_slice(&row[..n]);
    head
}

/// Whether every row of `rows` starts with the same byte.
fn one_first_byte(rows: &[Rows]) -> bool {
    let mut firsts = rows
        .iter()
        .flat_map(|r| r.iter())
        .map(|row| row.as_ref().first().copied());
    let first = firsts.next().flatten();
    first.is_some() && firsts.all(|b| b == first)
}

/// The (batch, row) of the first row of each key in order (ties: the first in input order),
/// in key order: keys as `key` makes them and orders as `order` makes them from their row
/// bytes (the bytes themselves, or numbers that compare as the bytes do, for [`narrow`]
/// rows).
fn pick<'a, K, O>(
    key_rows: &'a [Rows],
    order_rows: &'a [Rows],
    rows: usize,
    key: impl Fn(&'a [u8]) -> K,
    order: impl Fn(&'a [u8]) -> O,
) -> Vec<(usize, usize)>
where
    K: std::hash::Hash + Eq + Ord,
    O: Ord,
{
    // key -> (batch, row) of the best row so far (the caller checked rows fit a u32).
    let mut best: HashMap<K, (u32, u32)> = HashMap::with_capacity(rows);
    for (bi, (k, o)) in key_rows.iter().zip(order_rows).enumerate() {
        for r in 0..k.num_rows() {
            let slot = best
                .entry(key(k.row(r).data()))
                .or_insert((bi as u32, r as u32));
            let held = order_rows[slot.0 as usize].row(slot.1 as usize);
            if order(o.row(r).data()) < order(held.data()) {
                *slot = (bi as u32, r as u32);
            }
        }
    }
    let mut kept: Vec<(K, u32, u32)> = best.into_iter().map(|(k, (b, r))| (k, b, r)).collect();
    kept.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    kept.into_iter()
        .map(|(_, b, r)| (b as usize, r as usize))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float64Array, Int64Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::execution::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};

    fn batch(seed: u64, n: usize) -> RecordBatch {
        let mut x = seed;
        let mut next = move |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let mut k = Vec::new();
        let mut t = Vec::new();
        let mut s = Vec::new();
        let mut a = Vec::new();
        for i in 0..n {
            k.push((next(7) != 0).then(|| next(300) as i64));
            t.push((i % 11 != 3).then(|| next(50) as i64));
            s.push((i % 5 != 1).then(|| ["x", "y", "z"][next(3) as usize]));
            a.push((i % 13 != 2).then(|| next(1000) as f64 / 10.0));
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("t", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("a", DataType::Float64, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(k)),
                Arc::new(Int64Array::from(t)),
                Arc::new(StringArray::from(s)),
                Arc::new(Float64Array::from(a)),
            ],
        )
        .unwrap()
    }

    async fn run(ctx: &SessionContext, sql: &str) -> (Vec<String>, String) {
        let df = ctx.sql(sql).await.unwrap();
        let plan = df.clone().create_physical_plan().await.unwrap();
        let shown = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(true)
            .to_string();
        let rows =
            datafusion::arrow::util::pretty::pretty_format_batches(&df.collect().await.unwrap())
                .unwrap()
                .to_string();
        let mut lines: Vec<String> = rows.lines().map(str::to_string).collect();
        lines.sort();
        (lines, shown)
    }

    /// A session with `target` partitions, with or without the rule, whose `batch` holds
    /// `parts`.
    fn session(target: usize, rule: bool, parts: Vec<Vec<RecordBatch>>) -> SessionContext {
        let mut state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(target))
            .with_default_features();
        if rule {
            state = state.with_physical_optimizer_rule(Arc::new(TopOnePerKey));
        }
        let ctx = SessionContext::new_with_state(state.build());
        let t = datafusion::datasource::MemTable::try_new(batch(0, 1).schema(), parts).unwrap();
        ctx.register_table("batch", Arc::new(t)).unwrap();
        ctx
    }

    /// The rows of `sql` as a table, in the order the query gives them.
    async fn in_order(ctx: &SessionContext, sql: &str) -> String {
        let rows = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        datafusion::arrow::util::pretty::pretty_format_batches(&rows)
            .unwrap()
            .to_string()
    }

    /// The seed's newest-per-key query gives the same rows with the rule as with the sort
    /// and window, over NULL keys, NULL orderings, ties broken by the other columns, and
    /// several input partitions; and the plan shows the rule fired.
    #[tokio::test]
    async fn newest_per_key_equals_the_window_plan() {
        let three = || (0..3).map(|i| vec![batch(i, 700)]).collect();
        let (with, without) = (session(3, true, three()), session(3, false, three()));
        for sql in [
            "SELECT k, t, s, a FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC NULLS LAST, s DESC NULLS LAST, a DESC NULLS LAST) AS rn FROM batch) WHERE rn = 1",
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY k, s ORDER BY t ASC NULLS FIRST, a DESC) AS rn FROM batch) WHERE 1 = rn",
            // One fixed-width key and order (compared as numbers); ties are not shown.
            "SELECT k, t FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC) AS rn FROM batch) WHERE rn = 1",
            "SELECT k, t FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t ASC NULLS FIRST) AS rn FROM batch) WHERE rn = 1",
            "SELECT t, a FROM (SELECT *, row_number() OVER (PARTITION BY t ORDER BY a ASC NULLS LAST) AS rn FROM batch) WHERE rn = 1",
            // No NULL key: compared without the null byte, as 8-byte numbers (negative
            // ones too).
            "SELECT k2, t FROM (SELECT *, row_number() OVER (PARTITION BY k2 ORDER BY t DESC) AS rn FROM (SELECT coalesce(k, -1) - 150 AS k2, t FROM batch)) WHERE rn = 1",
            // A fixed-width key, an order of text (compared as bytes).
            "SELECT k, s FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY s DESC NULLS LAST) AS rn FROM batch) WHERE rn = 1",
        ] {
            let (got, plan) = run(&with, sql).await;
            let (want, plain) = run(&without, sql).await;
            assert!(plan.contains("TopOnePerKeyExec"), "{plan}");
            assert!(!plain.contains("TopOnePerKeyExec"));
            assert!(got.len() > 50, "{}", got.len());
            assert_eq!(got, want, "{sql}");
        }
        // A global order, which the window's sort may have given: still in order.
        let sql = "SELECT k, t FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC, s DESC, a DESC) AS rn FROM batch) WHERE rn = 1 ORDER BY k";
        assert_eq!(in_order(&with, sql).await, in_order(&without, sql).await);
        let sql = "SELECT k, t FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC) AS rn FROM batch) WHERE rn = 1 ORDER BY k DESC";
        assert_eq!(in_order(&with, sql).await, in_order(&without, sql).await);
        let sql = "SELECT k2, t FROM (SELECT *, row_number() OVER (PARTITION BY k2 ORDER BY t ASC) AS rn FROM (SELECT coalesce(k, 7) - 150 AS k2, t FROM batch)) WHERE rn = 1 ORDER BY k2";
        assert_eq!(in_order(&with, sql).await, in_order(&without, sql).await);
        // weir's batches: one partition in, two target partitions (the default).
        let one = || vec![vec![batch(5, 900)]];
        let (two, plain) = (session(2, true, one()), session(2, false, one()));
        let (_, plan) = run(
            &two,
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC) AS rn FROM batch) WHERE rn = 1",
        )
        .await;
        assert!(plan.contains("TopOnePerKeyExec"), "{plan}");
        // The window's order may be all that orders the result: still in order.
        let sql = "SELECT k, t FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t DESC, s DESC, a DESC) AS rn FROM batch) WHERE rn = 1 ORDER BY k NULLS LAST";
        assert_eq!(in_order(&two, sql).await, in_order(&plain, sql).await);
        // Not this shape: left to DataFusion.
        let (_, plan) = run(
            &with,
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY k ORDER BY t) AS rn FROM batch) WHERE rn = 2",
        )
        .await;
        assert!(!plan.contains("TopOnePerKeyExec"), "{plan}");
    }
}
