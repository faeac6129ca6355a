//! The aggregation operator: one batch in phases, each a function of what the one before
//! gave.
//!
//! 1. [`Aggregate::shape`]: where the columns are, what leaves the state by the watermark,
//!    and the state's metadata checked;
//! 2. [`Aggregate::expand`]: one row per (input row, window), late rows counted and dropped;
//! 3. [`partials`]: DataFusion's partial results per group, and HyperLogLog sketches;
//! 4. [`Aggregate::merge`]: the partials merged into the state;
//! 5. [`Aggregate::emit`]: what the output mode passes on, and what leaves the state;
//! 6. [`output`]: the rows passed on, as a DataFrame.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, Int64Array, TimestampMicrosecondArray, UInt32Array};
use datafusion::arrow::compute::{concat_batches, take};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::logical_expr::Expr;
use datafusion::prelude::{DataFrame, SessionContext, ident};
use datafusion::scalar::ScalarValue;

use super::expand::{Shape, expansions, layout};
use super::hll::{HLL_REGISTERS, SPARK_SKETCH, Sketch, SlotSource, hll_estimate, sketch_rows};
use super::{
    AggExpr, Aggregation, Expiry, Func, KEY, OPERATOR_NAME, OutputMode, Slot, decode_slots,
    group_time, merge, scalars_to_array, window_start,
};
use crate::engine::stateful::keys::{decode_value, encode_scalar, encode_value, family};
use crate::engine::stateful::watermark::EventTime;
use crate::engine::stateful::{
    OperatorMetrics, OperatorState, collect_in_order, columns_json, frame,
};
use crate::error::{Error, Result};
use crate::state::{read_line, write_line_once};

/// One aggregation of a query.
pub(crate) struct Aggregate {
    pub(in crate::engine::stateful) op: OperatorState,
    spec: Aggregation,
    exprs: Vec<AggExpr>,
    pub(in crate::engine::stateful) metrics: OperatorMetrics,
    /// How the state's sketches hash and estimate, once known.
    sketch: Option<Sketch>,
    /// What the workers did in this batch, when it ran there: its partitions are
    /// committed already.
    pub(in crate::engine::stateful) on_workers: Option<crate::engine::stateful::Ran>,
}

/// One batch's partial results per group.
struct Partials {
    batches: Vec<RecordBatch>,
    /// How each state slot merges.
    slots: Vec<Slot>,
    /// Where each slot's value comes from.
    sources: Vec<SlotSource>,
    /// Each slot's type in the state.
    slot_types: Vec<DataType>,
    /// The sketches of each group (by state key), for the sketched slots.
    sketches: HashMap<Vec<u8>, Vec<Vec<u8>>>,
}

impl Aggregate {
    pub(in crate::engine::stateful) fn evicts(&self) -> bool {
        self.spec.output_mode != OutputMode::Complete
    }

    pub(in crate::engine::stateful) fn new(op: OperatorState, spec: Aggregation) -> Result<Self> {
        let exprs = spec.validate()?;
        Ok(Aggregate {
            op,
            spec,
            exprs,
            metrics: OperatorMetrics::new(OPERATOR_NAME),
            sketch: None,
            on_workers: None,
        })
    }

    pub(in crate::engine::stateful) async fn apply(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<DataFrame> {
        let schema = Arc::new(df.schema().as_arrow().clone());
        let shape = self.shape(schema, batch_id, event, true).await?;
        let batches = collect_in_order(df, batch_id, KEY).await?;
        let all = concat_batches(&shape.schema, &batches)
            .map_err(|e| Error::datafusion(KEY, e.into()))?;
        let (rows, starts) = self.expand(&all, &shape)?;
        let partials = partials(ctx, &self.exprs, &all, rows, starts, &shape, batch_id).await?;
        let updated = self.merge(&partials, &shape, batch_id)?;
        let out = self.emit(updated, &shape)?;
        output(
            ctx,
            &self.exprs,
            out,
            &shape,
            &partials.slot_types,
            self.op.store_path(),
        )
    }

    /// An aggregation run by a worker's task over the state partitions it owns (see
    /// `engine::stateful::on_workers`): `op`'s store holds them, `sketch` is what the
    /// driver found the state written with.
    pub(in crate::engine::stateful) fn for_worker(
        op: OperatorState,
        spec: Aggregation,
        sketch: Sketch,
    ) -> Result<Self> {
        let mut a = Aggregate::new(op, spec)?;
        a.sketch = Some(sketch);
        Ok(a)
    }

    /// The aggregation's spec.
    pub(in crate::engine::stateful) fn spec(&self) -> &Aggregation {
        &self.spec
    }

    /// For a run on the workers, on the driver: the state's metadata checked for a batch
    /// of `schema` (not loaded), the sketch the state uses, and the schema of the rows
    /// the aggregation gives (found by aggregating no rows).
    pub(in crate::engine::stateful) async fn prepare_for_workers(
        &mut self,
        ctx: &SessionContext,
        schema: SchemaRef,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<(Sketch, SchemaRef)> {
        let shape = self.shape(schema, batch_id, event, false).await?;
        let empty = RecordBatch::new_empty(Arc::clone(&shape.schema));
        let partials = partials(ctx, &self.exprs, &empty, vec![], vec![], &shape, batch_id).await?;
        let out = output(
            ctx,
            &self.exprs,
            Vec::new(),
            &shape,
            &partials.slot_types,
            self.op.store_path(),
        )?;
        Ok((shape.sketch, Arc::new(out.schema().as_arrow().clone())))
    }

    /// On a worker: aggregates `all` (rows already one per window, each window's start in
    /// `starts`, none late) into the state, and gives what the output mode passes on.
    pub(in crate::engine::stateful) async fn run_expanded(
        &mut self,
        ctx: &SessionContext,
        shape: &Shape<'_>,
        all: &RecordBatch,
        starts: Vec<i64>,
        batch_id: u64,
    ) -> Result<Vec<RecordBatch>> {
        let rows = (0..all.num_rows() as u32).collect();
        let partials = partials(ctx, &self.exprs, all, rows, starts, shape, batch_id).await?;
        let updated = self.merge(&partials, shape, batch_id)?;
        let out = self.emit(updated, shape)?;
        output(
            ctx,
            &self.exprs,
            out,
            shape,
            &partials.slot_types,
            self.op.store_path(),
        )?
        .collect()
        .await
        .map_err(|e| Error::datafusion(format!("batch {batch_id}: {KEY}"), e))
    }

    /// Phase 1: the batch's columns, what leaves the state by the watermark, and the state's
    /// metadata checked against this aggregation.
    async fn shape<'e>(
        &mut self,
        schema: SchemaRef,
        batch_id: u64,
        event: Option<&'e EventTime>,
        load: bool,
    ) -> Result<Shape<'e>> {
        let (columns, event, expiry) = layout(&self.spec, &self.exprs, &schema, event)?;
        let description = || {
            serde_json::json!({
            "groupBy": columns_json(&self.spec.group_by, &columns.families),
            "window": self.spec.window.as_ref().map(|w| serde_json::json!({
                "column": w.column, "sizeMs": w.size.as_millis() as u64,
                "slideMs": w.slide.as_millis() as u64})),
            "aggregates": self.exprs.iter().zip(&columns.inputs).map(|(e, t)| serde_json::json!({
                "function": format!("{:?}", e.func).to_ascii_lowercase(),
                "column": e.column,
                "type": t.as_ref().and_then(family)})).collect::<Vec<_>>(),
            // A state kept for one mode is not what another needs (update evicts windows
            // complete would still show).
            "outputMode": format!("{:?}", self.spec.output_mode).to_ascii_lowercase(),
            })
            .to_string()
        };
        self.op
            .prepare(
                batch_id,
                OPERATOR_NAME,
                "aggregation",
                description,
                KEY,
                load,
            )
            .await?;
        let sketch = self.sketch(batch_id).await?;
        self.metrics = OperatorMetrics::new(OPERATOR_NAME);
        Ok(Shape {
            schema,
            columns,
            event,
            expiry,
            sketch,
        })
    }

    /// How the state's sketches hash: Spark's HLL++ for state first written now (batch 0),
    /// recorded as `_metadata/sketch`; state written before that file existed keeps weir's
    /// earlier sketch.
    async fn sketch(&mut self, batch_id: u64) -> Result<Sketch> {
        if let Some(s) = self.sketch {
            return Ok(s);
        }
        let dir = self
            .op
            .state_root
            .join(&format!("{}/_metadata", self.op.operator));
        let found = match read_line(&dir, "sketch").await? {
            Some(line) => line,
            // New state: written with Spark's sketch (a file another start wrote meanwhile
            // is what it holds).
            None if batch_id == 0 => write_line_once(&dir, "sketch", SPARK_SKETCH.into())
                .await?
                .unwrap_or_else(|| SPARK_SKETCH.into()),
            None => String::new(),
        };
        let sketch = match found.as_str() {
            SPARK_SKETCH => Sketch::Spark,
            "" => Sketch::Legacy,
            other => {
                return Err(Error::CorruptState {
                    path: dir.describe("sketch"),
                    reason: format!("it names the sketch `{other}`, which this weir does not know"),
                });
            }
        };
        self.sketch = Some(sketch);
        Ok(sketch)
    }

    /// Phase 2: the rows of `all` to aggregate, one per (row, window), and each one's window
    /// start; late rows are left out. `numRowsDroppedByWatermark` counts the late (group,
    /// window) pairs, not rows: Spark filters late rows after its partial aggregation, so
    /// four late rows of one group and window count 1 (checked with PySpark 4.3.0: 9 late
    /// rows in 3 groups and windows, split over two files, counted 3).
    fn expand(&mut self, all: &RecordBatch, shape: &Shape<'_>) -> Result<(Vec<u32>, Vec<i64>)> {
        let ex = expansions(all, shape)?;
        let mut late: HashSet<(Vec<u8>, i64)> = HashSet::new();
        for (row, start) in ex.late {
            let mut key = Vec::new();
            for g in &shape.columns.groups {
                encode_value(&mut key, all.column(*g), row as usize);
            }
            late.insert((key, start));
        }
        self.metrics.dropped_late += late.len() as u64;
        Ok((ex.rows, ex.starts))
    }

    /// Phase 4: merges the partial results into the state; the keys it changed.
    fn merge(
        &mut self,
        partials: &Partials,
        shape: &Shape<'_>,
        batch_id: u64,
    ) -> Result<Vec<Vec<u8>>> {
        let started = Instant::now();
        let state_path = self.op.store_path();
        let path = || state_path.clone();
        let groups = shape.columns.groups.len();
        let nkey = shape.key_len();
        let slot_types = &partials.slot_types;
        let mut updated: Vec<Vec<u8>> = Vec::new();
        for b in &partials.batches {
            for row in 0..b.num_rows() {
                let mut key = Vec::new();
                if shape.windowed() {
                    encode_value(&mut key, b.column(groups), row);
                }
                for g in 0..groups {
                    encode_value(&mut key, b.column(g), row);
                }
                let old = match self.op.store.get(&key) {
                    Some(v) => {
                        decode_slots(v, slot_types).map_err(|reason| Error::CorruptState {
                            path: path(),
                            reason,
                        })?
                    }
                    None => slot_types
                        .iter()
                        .map(|t| ScalarValue::try_from(t).map_err(|e| Error::datafusion(KEY, e)))
                        .collect::<Result<_>>()?,
                };
                let mut value = Vec::new();
                let mut sketch = partials.sketches.get(&key).map(|v| v.iter());
                for (s, (slot, old)) in partials.slots.iter().zip(old).enumerate() {
                    let new = match partials.sources[s] {
                        SlotSource::Partial(c) => {
                            ScalarValue::try_from_array(b.column(nkey + c), row)
                                .map_err(|e| Error::datafusion(KEY, e))?
                        }
                        SlotSource::Sketch(_) => ScalarValue::Binary(Some(
                            sketch
                                .as_mut()
                                .and_then(|it| it.next())
                                .cloned()
                                .unwrap_or_else(|| vec![0; HLL_REGISTERS]),
                        )),
                    };
                    let merged = merge(*slot, old, new)
                        .map_err(|why| Error::config(KEY, format!("batch {batch_id}: {why}")))?;
                    encode_scalar(&mut value, &merged).map_err(|e| Error::Internal { what: e })?;
                }
                self.op.store.put(key.clone(), value);
                updated.push(key);
            }
        }
        self.metrics.updated = updated.len() as u64;
        self.metrics.update_ms = started.elapsed().as_millis() as u64;
        Ok(updated)
    }

    /// Phase 5: the state entries the output mode passes on (sorted by window start, then by
    /// the groups' bytes), after removing those the watermark closed.
    fn emit(
        &mut self,
        updated: Vec<Vec<u8>>,
        shape: &Shape<'_>,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let started = Instant::now();
        let state_path = self.op.store_path();
        let corrupt = |reason: String| Error::CorruptState {
            path: state_path.clone(),
            reason,
        };
        let group_types = shape.group_types();
        let mut closed: Vec<Vec<u8>> = Vec::new();
        if let Some((e, how)) = shape.expiry {
            for (k, _) in self.op.store.iter() {
                let time = match how {
                    Expiry::WindowEnd(size) => {
                        Some(window_start(k).map_err(corrupt)?.saturating_add(size))
                    }
                    Expiry::Group(pos) => {
                        group_time(k, shape.windowed(), &group_types, pos).map_err(corrupt)?
                    }
                };
                if time.is_some_and(|t| e.passed(t)) {
                    closed.push(k.to_vec());
                }
            }
        }
        let mut out: Vec<(Vec<u8>, Vec<u8>)> = match self.spec.output_mode {
            OutputMode::Append => closed
                .iter()
                .filter_map(|k| self.op.store.get(k).map(|v| (k.clone(), v.to_vec())))
                .collect(),
            OutputMode::Update => updated
                .iter()
                .filter_map(|k| self.op.store.get(k).map(|v| (k.clone(), v.to_vec())))
                .collect(),
            OutputMode::Complete => self
                .op
                .store
                .iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect(),
        };
        self.metrics.removed = closed.len() as u64;
        for k in closed {
            self.op.store.remove(k);
        }
        self.metrics.remove_ms = started.elapsed().as_millis() as u64;
        // Rows in a stable order: by window start, then by the groups' bytes.
        out.sort_by(|a, b| {
            (window_start(&a.0).unwrap_or(0), &a.0).cmp(&(window_start(&b.0).unwrap_or(0), &b.0))
        });
        Ok(out)
    }
}

/// Phase 3: the rows `rows` of `all` (with window starts `starts`) aggregated into partial
/// results per group by DataFusion, and sketched for `approx_count_distinct`.
async fn partials(
    ctx: &SessionContext,
    exprs: &[AggExpr],
    all: &RecordBatch,
    rows: Vec<u32>,
    starts: Vec<i64>,
    shape: &Shape<'_>,
    batch_id: u64,
) -> Result<Partials> {
    let schema = &shape.schema;
    let groups = &shape.columns.groups;
    let idx = UInt32Array::from(rows);
    let mut fields = Vec::new();
    let mut cols: Vec<ArrayRef> = Vec::new();
    let mut group_exprs = Vec::new();
    for (n, g) in groups.iter().enumerate() {
        let name = format!("__g{n}");
        fields.push(Field::new(
            &name,
            schema.field(*g).data_type().clone(),
            true,
        ));
        cols.push(take(all.column(*g), &idx, None).map_err(|e| Error::datafusion(KEY, e.into()))?);
        group_exprs.push(ident(name));
    }
    if shape.windowed() {
        fields.push(Field::new("__w", DataType::Int64, false));
        cols.push(Arc::new(Int64Array::from(starts)));
        group_exprs.push(ident("__w"));
    }
    let mut aggr_exprs: Vec<Expr> = Vec::new();
    let mut slots = Vec::new();
    // Per slot: the partial result's column, or the sketched input column.
    let mut sources: Vec<SlotSource> = Vec::new();
    for (n, e) in exprs.iter().enumerate() {
        let arg = match &e.column {
            Some(c) => {
                let name = format!("__a{n}");
                let i = schema
                    .index_of(c)
                    .map_err(|e| Error::datafusion(KEY, e.into()))?;
                fields.push(Field::new(&name, schema.field(i).data_type().clone(), true));
                cols.push(
                    take(all.column(i), &idx, None)
                        .map_err(|e| Error::datafusion(KEY, e.into()))?,
                );
                Some(ident(name))
            }
            None => None,
        };
        if e.func == Func::ApproxDistinct {
            slots.push(Slot::Hll);
            sources.push(SlotSource::Sketch(cols.len() - 1));
            continue;
        }
        for (slot, expr) in e.partials(arg) {
            sources.push(SlotSource::Partial(aggr_exprs.len()));
            aggr_exprs.push(expr.alias(format!("__s{}", aggr_exprs.len())));
            slots.push(slot);
        }
    }
    let expanded = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)
        .map_err(|e| Error::datafusion(KEY, e.into()))?;
    let sketches = sketch_rows(
        &expanded,
        groups.len(),
        shape.windowed(),
        &sources,
        shape.sketch,
    );
    let partial = ctx
        .read_batch(expanded)
        .and_then(|d| d.aggregate(group_exprs, aggr_exprs))
        .map_err(|e| Error::datafusion(format!("batch {batch_id}: {KEY}"), e))?;
    let partial_schema = partial.schema().as_arrow().clone();
    let slot_types: Vec<DataType> = sources
        .iter()
        .map(|s| match s {
            SlotSource::Partial(c) => partial_schema
                .field(shape.key_len() + c)
                .data_type()
                .clone(),
            SlotSource::Sketch(_) => DataType::Binary,
        })
        .collect();
    let batches = partial
        .collect()
        .await
        .map_err(|e| Error::datafusion(format!("batch {batch_id}: {KEY}"), e))?;
    Ok(Partials {
        batches,
        slots,
        sources,
        slot_types,
        sketches,
    })
}

/// Phase 6: the state entries `out` as the operator's output rows: the group columns, the
/// window's start and end, then one column per aggregate.
fn output(
    ctx: &SessionContext,
    exprs: &[AggExpr],
    out: Vec<(Vec<u8>, Vec<u8>)>,
    shape: &Shape<'_>,
    slot_types: &[DataType],
    state_path: String,
) -> Result<DataFrame> {
    let schema = &shape.schema;
    let groups = &shape.columns.groups;
    let group_types = shape.group_types();
    let mut key_cols: Vec<Vec<ScalarValue>> =
        vec![Vec::with_capacity(out.len()); group_types.len()];
    let mut win_starts = Vec::with_capacity(out.len());
    let mut slot_cols: Vec<Vec<ScalarValue>> =
        vec![Vec::with_capacity(out.len()); slot_types.len()];
    for (k, v) in &out {
        let mut at = 0;
        let corrupt = |reason: String| Error::CorruptState {
            path: state_path.clone(),
            reason,
        };
        if shape.windowed() {
            let ScalarValue::Int64(Some(s)) =
                decode_value(k, &mut at, &DataType::Int64).map_err(corrupt)?
            else {
                return Err(corrupt("a window start is NULL".into()));
            };
            win_starts.push(s);
        }
        for (g, t) in group_types.iter().enumerate() {
            key_cols[g].push(decode_value(k, &mut at, t).map_err(corrupt)?);
        }
        for (s, v) in decode_slots(v, slot_types)
            .map_err(corrupt)?
            .into_iter()
            .enumerate()
        {
            slot_cols[s].push(v);
        }
    }
    let mut fields = Vec::new();
    let mut cols: Vec<ArrayRef> = Vec::new();
    for ((g, t), values) in groups.iter().zip(&group_types).zip(key_cols) {
        fields.push(Field::new(schema.field(*g).name(), t.clone(), true));
        cols.push(scalars_to_array(values, t)?);
    }
    if let Some((_, size, _, tz)) = &shape.columns.window {
        let ts = DataType::Timestamp(TimeUnit::Microsecond, tz.clone());
        fields.push(Field::new("window_start", ts.clone(), false));
        fields.push(Field::new("window_end", ts, false));
        let ends: Vec<i64> = win_starts.iter().map(|s| s.saturating_add(*size)).collect();
        cols.push(Arc::new(
            TimestampMicrosecondArray::from(win_starts).with_timezone_opt(tz.clone()),
        ));
        cols.push(Arc::new(
            TimestampMicrosecondArray::from(ends).with_timezone_opt(tz.clone()),
        ));
    }
    let mut slot_iter = slot_cols.into_iter().zip(slot_types);
    for e in exprs {
        let (values, t) = slot_iter.next().ok_or_else(|| Error::Internal {
            what: "aggregate slots".into(),
        })?;
        let (array, dt) = if e.func == Func::ApproxDistinct {
            let n: Vec<i64> = values
                .iter()
                .map(|v| match v {
                    ScalarValue::Binary(Some(r)) => hll_estimate(r, shape.sketch),
                    _ => 0,
                })
                .collect();
            (Arc::new(Int64Array::from(n)) as ArrayRef, DataType::Int64)
        } else if e.func == Func::Avg {
            let (counts, _) = slot_iter.next().ok_or_else(|| Error::Internal {
                what: "aggregate slots".into(),
            })?;
            let avg: Vec<Option<f64>> = values
                .iter()
                .zip(&counts)
                .map(|(s, c)| match (s, c) {
                    (ScalarValue::Float64(Some(s)), ScalarValue::Int64(Some(c))) if *c > 0 => {
                        Some(s / *c as f64)
                    }
                    _ => None,
                })
                .collect();
            (
                Arc::new(datafusion::arrow::array::Float64Array::from(avg)) as ArrayRef,
                DataType::Float64,
            )
        } else {
            (scalars_to_array(values, t)?, t.clone())
        };
        fields.push(Field::new(
            &e.alias,
            dt,
            !matches!(e.func, Func::Count | Func::ApproxDistinct),
        ));
        cols.push(array);
    }
    let out_schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(out_schema.clone(), cols)
        .map_err(|e| Error::datafusion(KEY, e.into()))?;
    frame(ctx, out_schema, vec![vec![batch]], KEY)
}
