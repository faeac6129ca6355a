//! Streaming aggregation: `count`, `sum`, `min`, `max` and `avg` per group of key columns
//! and, optionally, per event-time window (tumbling, or sliding when the slide is shorter
//! than the window), as Spark's `groupBy(window(...), keys).agg(...)` on a stream.
//!
//! Each batch is aggregated by DataFusion into partial results per group (for `avg`, a sum
//! and a count), which are merged into the state: one entry per group and window, holding
//! the partial results. What the operator passes on depends on the output mode:
//!
//! - `append`: a window's row once, in the first batch whose watermark is at or past the
//!   window's end; the group then leaves the state. Needs a watermark on the window's
//!   column.
//! - `update`: the groups the batch changed, with their values so far; with a watermark,
//!   windows that end at or below it leave the state (without a row).
//! - `complete`: every group, every batch; nothing leaves the state.
//!
//! With a watermark on the window's column, a row is not counted in a window that ends at
//! or below the previous batch's watermark (`numRowsDroppedByWatermark`); without a window,
//! a row at or below it is dropped. Output columns: the group columns, then
//! `window_start` and `window_end` (timestamps in microseconds) when there is a window,
//! then one column per aggregate, named by its alias.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::array::{ArrayRef, Int64Array, TimestampMicrosecondArray, new_empty_array};
use datafusion::arrow::compute::{concat_batches, take};
use datafusion::arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::functions_aggregate::expr_fn::{count, max, min, sum};
use datafusion::logical_expr::{Expr, cast, lit};
use datafusion::prelude::{DataFrame, SessionContext, ident};
use datafusion::scalar::ScalarValue;

use super::keys::{decode_value, encode_scalar, encode_value, family};
use super::watermark::{self, EventTime};
use super::{OperatorMetrics, OperatorState, collect_in_order, frame, key_columns, key_families};
use crate::error::{Error, Result};

/// The setting errors name (the pipeline file's spelling; `aggregate` in the API).
const KEY: &str = "transform.aggregate";

/// Spark's name for the operator in progress reports and the state metadata.
pub(super) const OPERATOR_NAME: &str = "stateStoreSave";

/// Which rows an aggregation passes on each batch (Spark's output modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputMode {
    /// Each window once, when the watermark passes its end (Spark's default).
    #[default]
    Append,
    /// The groups the batch changed.
    Update,
    /// Every group, every batch.
    Complete,
}

impl FromStr for OutputMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "append" => Ok(OutputMode::Append),
            "update" => Ok(OutputMode::Update),
            "complete" => Ok(OutputMode::Complete),
            other => Err(Error::config(
                "transform.aggregate.output-mode",
                format!("'{other}' is not an output mode: use append, update or complete"),
            )),
        }
    }
}

/// An event-time window: `size` long, starting every `slide` (tumbling if they are equal).
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub column: String,
    pub size: Duration,
    pub slide: Duration,
}

/// A streaming aggregation (see the module documentation).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Aggregation {
    pub group_by: Vec<String>,
    pub window: Option<Window>,
    /// `count(*)`, `count(col)`, `sum(col)`, `min(col)`, `max(col)`, `avg(col)`, each with
    /// an optional `AS alias`.
    pub aggregates: Vec<String>,
    pub output_mode: OutputMode,
}

impl Aggregation {
    /// An aggregation computing `aggregates` (such as `count(*) AS n`, `avg(amount)`).
    pub fn new<I, S>(aggregates: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Aggregation {
            aggregates: aggregates.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// Groups by these columns (besides the window).
    pub fn group_by<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.group_by = keys.into_iter().map(Into::into).collect();
        self
    }

    /// Groups by tumbling windows of `size` over the timestamp column `column`.
    pub fn window(self, column: impl Into<String>, size: Duration) -> Self {
        self.sliding_window(column, size, size)
    }

    /// Groups by windows of `size` starting every `slide` (a row counts in each window
    /// that holds it).
    pub fn sliding_window(
        mut self,
        column: impl Into<String>,
        size: Duration,
        slide: Duration,
    ) -> Self {
        self.window = Some(Window {
            column: column.into(),
            size,
            slide,
        });
        self
    }

    /// Spark's output mode (append by default).
    pub fn output_mode(mut self, mode: OutputMode) -> Self {
        self.output_mode = mode;
        self
    }

    /// Checks what can be checked without the data: the aggregates parse, the window is
    /// valid, output names are distinct.
    pub fn check(&self) -> Result<()> {
        self.validate().map(|_| ())
    }

    pub(crate) fn validate(&self) -> Result<Vec<AggExpr>> {
        if self.aggregates.is_empty() {
            return Err(Error::config(KEY, "no aggregate given (such as count(*))"));
        }
        if let Some(w) = &self.window
            && (w.size.is_zero() || w.slide.is_zero() || w.slide > w.size)
        {
            {
                return Err(Error::config(
                    KEY,
                    format!(
                        "a window of {:?} sliding by {:?}: both must be longer than 0 and the \
                         slide no longer than the window",
                        w.size, w.slide
                    ),
                ));
            }
        }
        let exprs: Vec<AggExpr> = self
            .aggregates
            .iter()
            .map(|s| AggExpr::parse(s))
            .collect::<Result<_>>()?;
        let mut names: Vec<&str> = Vec::new();
        for g in &self.group_by {
            if names.contains(&g.as_str()) {
                return Err(Error::config(KEY, format!("`{g}` is twice in group-by")));
            }
            names.push(g);
        }
        if self.window.is_some() {
            names.extend(["window_start", "window_end"]);
        }
        for e in &exprs {
            if names.contains(&e.alias.as_str()) {
                return Err(Error::config(
                    KEY,
                    format!(
                        "two output columns are named `{}`; give one an alias (AS name)",
                        e.alias
                    ),
                ));
            }
            names.push(&e.alias);
        }
        Ok(exprs)
    }

    /// Checks the steps before the aggregation (given as the watermark's column, if there
    /// is one before it) without the data: append mode needs a watermark it can close
    /// groups by.
    pub(crate) fn check_watermark(&self, watermark: Option<&str>) -> Result<()> {
        if self.output_mode != OutputMode::Append {
            return Ok(());
        }
        let closes = watermark.is_some_and(|w| {
            self.window
                .as_ref()
                .map_or(self.group_by.iter().any(|g| g == w), |win| win.column == w)
        });
        if closes {
            Ok(())
        } else {
            Err(Error::config(KEY, APPEND_NEEDS))
        }
    }

    /// Checks the columns against the operator's input schema.
    pub(crate) fn check_columns(&self, schema: &Schema) -> Result<()> {
        self.resolve(schema, &self.validate()?).map(|_| ())
    }

    /// The names of the columns the aggregation gives over a batch of `schema`, in order:
    /// the group-by columns, `window_start` and `window_end` with a window, the aggregates.
    pub(crate) fn output_names(&self, schema: &Schema) -> Result<Vec<String>> {
        let exprs = self.validate()?;
        let cols = self.resolve(schema, &exprs)?;
        let mut names: Vec<String> = cols
            .groups
            .iter()
            .map(|g| schema.field(*g).name().clone())
            .collect();
        if cols.window.is_some() {
            names.extend(["window_start".to_string(), "window_end".to_string()]);
        }
        names.extend(exprs.into_iter().map(|e| e.alias));
        Ok(names)
    }

    /// Where the aggregation's columns are in `schema`, checked.
    fn resolve(&self, schema: &Schema, exprs: &[AggExpr]) -> Result<Columns> {
        let groups = key_columns_or_none(schema, &self.group_by)?;
        let families = key_families(schema, &groups, KEY)?;
        let window = match &self.window {
            Some(w) => {
                let i = key_columns(schema, std::slice::from_ref(&w.column), KEY)?[0];
                let DataType::Timestamp(_, tz) = schema.field(i).data_type() else {
                    return Err(Error::config(
                        KEY,
                        format!(
                            "the window column `{}` has type {}; it must be a timestamp",
                            w.column,
                            schema.field(i).data_type()
                        ),
                    ));
                };
                Some((i, micros_of(w.size), micros_of(w.slide), tz.clone()))
            }
            None => None,
        };
        let inputs = exprs
            .iter()
            .map(|e| e.input_type(schema))
            .collect::<Result<_>>()?;
        Ok(Columns {
            groups,
            families,
            window,
            inputs,
        })
    }
}

/// The aggregation's columns in a batch's schema.
struct Columns {
    groups: Vec<usize>,
    families: Vec<String>,
    /// The window column's index, size and slide (µs) and time zone.
    window: Option<(usize, i64, i64, Option<Arc<str>>)>,
    /// Each aggregate's input type (`None`: count(*)).
    inputs: Vec<Option<DataType>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Func {
    Count,
    /// Spark's `approx_count_distinct`: a HyperLogLog sketch per group.
    ApproxDistinct,
    Sum,
    Min,
    Max,
    Avg,
}

/// One parsed aggregate.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AggExpr {
    func: Func,
    /// `None`: `count(*)`.
    column: Option<String>,
    alias: String,
}

impl AggExpr {
    fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::config(
                KEY,
                format!(
                    "'{s}' {why}; write count(*), count(col), sum(col), min(col), max(col), \
                     avg(col) or approx_count_distinct(col), optionally followed by AS name"
                ),
            )
        };
        let t = s.trim();
        let open = t.find('(').ok_or_else(|| bad("is not an aggregate"))?;
        let close = t
            .rfind(')')
            .ok_or_else(|| bad("has no closing parenthesis"))?;
        if close < open {
            return Err(bad("is not an aggregate"));
        }
        let name = t[..open].trim().to_ascii_lowercase();
        let arg = t[open + 1..close].trim();
        let rest = t[close + 1..].trim();
        let func = match name.as_str() {
            "count" => Func::Count,
            "sum" => Func::Sum,
            "min" => Func::Min,
            "max" => Func::Max,
            "avg" | "mean" => Func::Avg,
            "approx_count_distinct" | "approx_distinct" => Func::ApproxDistinct,
            _ => return Err(bad(&format!("uses `{name}`, which is not supported"))),
        };
        let arg = arg.trim_matches('`');
        if arg.is_empty() {
            return Err(bad("has no column"));
        }
        let column = match (func, arg) {
            (Func::Count, "*" | "1") => None,
            (_, "*") => return Err(bad("uses * outside count")),
            (_, a) => Some(a.to_string()),
        };
        let alias = if rest.is_empty() {
            format!("{name}({})", column.as_deref().unwrap_or("1"))
        } else {
            let mut words = rest.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some(a), Some(alias), None) if a.eq_ignore_ascii_case("as") => {
                    alias.trim_matches('`').to_string()
                }
                _ => return Err(bad("has something other than AS name after it")),
            }
        };
        Ok(AggExpr {
            func,
            column,
            alias,
        })
    }

    /// The input column's type (`None` for count(*)); an error if the function cannot take it.
    fn input_type(&self, schema: &Schema) -> Result<Option<DataType>> {
        let Some(c) = &self.column else {
            return Ok(None);
        };
        let i = key_columns(schema, std::slice::from_ref(c), KEY)?[0];
        let dt = schema.field(i).data_type().clone();
        let fam = family(&dt);
        let ok = match self.func {
            Func::Count => true,
            Func::Min | Func::Max | Func::ApproxDistinct => fam.is_some(),
            Func::Sum | Func::Avg => fam.as_deref().is_some_and(|f| {
                matches!(f, "integer" | "unsigned" | "float") || f.starts_with("decimal")
            }),
        };
        if !ok {
            return Err(Error::config(
                KEY,
                format!(
                    "{}({c}) cannot take column `{c}` of type {dt}",
                    format!("{:?}", self.func).to_ascii_lowercase()
                ),
            ));
        }
        Ok(Some(dt))
    }

    /// The partial results this aggregate keeps, as DataFusion aggregates of column `arg`.
    fn partials(&self, arg: Option<Expr>) -> Vec<(Slot, Expr)> {
        let a = arg.unwrap_or_else(|| lit(1i64));
        match self.func {
            // Sketched by weir itself, not by DataFusion.
            Func::ApproxDistinct => vec![],
            Func::Count => vec![(Slot::Add, count(a))],
            Func::Sum => vec![(Slot::Add, sum(a))],
            Func::Min => vec![(Slot::Min, min(a))],
            Func::Max => vec![(Slot::Max, max(a))],
            Func::Avg => vec![
                (Slot::Add, sum(cast(a.clone(), DataType::Float64))),
                (Slot::Add, count(a)),
            ],
        }
    }
}

/// How a partial result merges with the state's.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Slot {
    Add,
    Min,
    Max,
    /// HyperLogLog registers, merged by their maximum.
    Hll,
}

fn merge(
    slot: Slot,
    old: ScalarValue,
    new: ScalarValue,
) -> std::result::Result<ScalarValue, String> {
    if old.is_null() {
        return Ok(new);
    }
    if new.is_null() {
        return Ok(old);
    }
    Ok(match slot {
        Slot::Add => old
            .add_checked(&new)
            .map_err(|e| format!("adding {new} to {old}: {e}"))?,
        Slot::Min => {
            if new < old {
                new
            } else {
                old
            }
        }
        Slot::Max => {
            if new > old {
                new
            } else {
                old
            }
        }
        Slot::Hll => match (old, new) {
            (ScalarValue::Binary(Some(mut a)), ScalarValue::Binary(Some(b)))
                if a.len() == b.len() =>
            {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = (*x).max(y);
                }
                ScalarValue::Binary(Some(a))
            }
            (old, new) => return Err(format!("sketches {old} and {new} do not merge")),
        },
    })
}

/// The groups of a key: its columns in the input, or none for a global aggregate.
fn key_columns_or_none(schema: &Schema, keys: &[String]) -> Result<Vec<usize>> {
    if keys.is_empty() {
        Ok(Vec::new())
    } else {
        key_columns(schema, keys, KEY)
    }
}

/// One aggregation of a query.
pub(crate) struct Aggregate {
    pub(super) op: OperatorState,
    spec: Aggregation,
    exprs: Vec<AggExpr>,
    pub(super) metrics: OperatorMetrics,
}

impl Aggregate {
    pub(super) fn evicts(&self) -> bool {
        self.spec.output_mode != OutputMode::Complete
    }

    pub(super) fn new(op: OperatorState, spec: Aggregation) -> Result<Self> {
        let exprs = spec.validate()?;
        Ok(Aggregate {
            op,
            spec,
            exprs,
            metrics: OperatorMetrics::new(OPERATOR_NAME),
        })
    }

    pub(super) async fn apply(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<DataFrame> {
        let schema = Arc::new(df.schema().as_arrow().clone());
        let Columns {
            groups,
            families,
            window,
            inputs,
        } = self.spec.resolve(&schema, &self.exprs)?;
        let event = match event {
            Some(e) => e.index_in(&schema)?.map(|i| (e, i)),
            None => None,
        };
        // Complete mode keeps every group and counts every row, late or not (Spark).
        let event = event.filter(|_| self.spec.output_mode != OutputMode::Complete);
        // Groups leave the state (and close, in append mode) by the watermark if it is on
        // the window's column (by the window's end) or on a group column (by its value).
        let expiry = match (&window, event) {
            (Some((w, size, ..)), Some((e, i))) if *w == i => Some((e, Expiry::WindowEnd(*size))),
            (None, Some((e, i))) => groups
                .iter()
                .position(|g| *g == i)
                .map(|pos| (e, Expiry::Group(pos))),
            _ => None,
        };
        let windowed_watermark = match expiry {
            Some((e, Expiry::WindowEnd(_))) => Some(e),
            _ => None,
        };
        if self.spec.output_mode == OutputMode::Append && expiry.is_none() {
            return Err(Error::config(KEY, APPEND_NEEDS));
        }
        let description = || {
            serde_json::json!({
            "groupBy": super::columns_json(&self.spec.group_by, &families),
            "window": self.spec.window.as_ref().map(|w| serde_json::json!({
                "column": w.column, "sizeMs": w.size.as_millis() as u64,
                "slideMs": w.slide.as_millis() as u64})),
            "aggregates": self.exprs.iter().zip(&inputs).map(|(e, t)| serde_json::json!({
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
            .prepare(batch_id, OPERATOR_NAME, "aggregation", description, KEY)
            .await?;
        self.metrics = OperatorMetrics::new(OPERATOR_NAME);

        // The batch, one row per (row, window), with its groups, window start and inputs.
        let batches = collect_in_order(df, batch_id, KEY).await?;
        let all =
            concat_batches(&schema, &batches).map_err(|e| Error::datafusion(KEY, e.into()))?;
        let mut rows: Vec<u32> = Vec::with_capacity(all.num_rows());
        let mut starts: Vec<i64> = Vec::new();
        let times = match (&window, event) {
            (Some((i, ..)), _) => Some(watermark::micros(all.column(*i))?),
            (None, Some((_, i))) => Some(watermark::micros(all.column(i))?),
            (None, None) => None,
        };
        for row in 0..all.num_rows() {
            let t = times.as_ref().and_then(|t| t[row]);
            match (&window, t) {
                // Spark drops rows without an event time from windowed aggregations.
                (Some(_), None) => {}
                (Some((_, size, slide, _)), Some(t)) => {
                    let mut start = t - t.rem_euclid(*slide);
                    while start > t - size {
                        let end = start + size;
                        if windowed_watermark.is_some_and(|e| e.late(end)) {
                            self.metrics.dropped_late += 1;
                        } else {
                            rows.push(row as u32);
                            starts.push(start);
                        }
                        start -= slide;
                    }
                }
                (None, t) => {
                    if let (Some((e, _)), Some(t)) = (event, t)
                        && e.late(t)
                    {
                        self.metrics.dropped_late += 1;
                        continue;
                    }
                    rows.push(row as u32);
                }
            }
        }
        let idx = datafusion::arrow::array::UInt32Array::from(rows);
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
            cols.push(
                take(all.column(*g), &idx, None).map_err(|e| Error::datafusion(KEY, e.into()))?,
            );
            group_exprs.push(ident(name));
        }
        if window.is_some() {
            fields.push(Field::new("__w", DataType::Int64, false));
            cols.push(Arc::new(Int64Array::from(starts)));
            group_exprs.push(ident("__w"));
        }
        let mut aggr_exprs = Vec::new();
        let mut slots = Vec::new();
        // Per slot: the partial result's column, or the sketched input column.
        let mut sources: Vec<SlotSource> = Vec::new();
        for (n, e) in self.exprs.iter().enumerate() {
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
        let sketches = sketch_rows(&expanded, groups.len(), window.is_some(), &sources);
        let partial = ctx
            .read_batch(expanded)
            .and_then(|d| d.aggregate(group_exprs, aggr_exprs))
            .map_err(|e| Error::datafusion(format!("batch {batch_id}: {KEY}"), e))?;
        let partial_schema = partial.schema().as_arrow().clone();
        let slot_types: Vec<DataType> = sources
            .iter()
            .map(|s| match s {
                SlotSource::Partial(c) => partial_schema
                    .field(groups.len() + usize::from(window.is_some()) + c)
                    .data_type()
                    .clone(),
                SlotSource::Sketch(_) => DataType::Binary,
            })
            .collect();
        let partial = partial
            .collect()
            .await
            .map_err(|e| Error::datafusion(format!("batch {batch_id}: {KEY}"), e))?;

        // Merge into the state.
        let started = Instant::now();
        let state_path = self.op.store_path();
        let path = || state_path.clone();
        let mut updated: Vec<Vec<u8>> = Vec::new();
        let nkey = groups.len() + usize::from(window.is_some());
        for b in &partial {
            for row in 0..b.num_rows() {
                let mut key = Vec::new();
                if window.is_some() {
                    encode_value(&mut key, b.column(groups.len()), row);
                }
                for g in 0..groups.len() {
                    encode_value(&mut key, b.column(g), row);
                }
                let old = match self.op.store.get(&key) {
                    Some(v) => {
                        decode_slots(v, &slot_types).map_err(|reason| Error::CorruptState {
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
                let mut sketch = sketches.get(&key).map(|v| v.iter());
                for (s, (slot, old)) in slots.iter().zip(old).enumerate() {
                    let new = match sources[s] {
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

        // What to pass on, and what leaves the state.
        let started = Instant::now();
        let group_types: Vec<DataType> = groups
            .iter()
            .map(|g| schema.field(*g).data_type().clone())
            .collect();
        let mut closed: Vec<Vec<u8>> = Vec::new();
        if let Some((e, how)) = expiry {
            for (k, _) in self.op.store.iter() {
                let time = match how {
                    Expiry::WindowEnd(size) => Some(
                        window_start(k)
                            .map_err(|reason| Error::CorruptState {
                                path: path(),
                                reason,
                            })?
                            .saturating_add(size),
                    ),
                    Expiry::Group(pos) => group_time(k, window.is_some(), &group_types, pos)
                        .map_err(|reason| Error::CorruptState {
                            path: path(),
                            reason,
                        })?,
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
        let mut key_cols: Vec<Vec<ScalarValue>> =
            vec![Vec::with_capacity(out.len()); group_types.len()];
        let mut win_starts = Vec::with_capacity(out.len());
        let mut slot_cols: Vec<Vec<ScalarValue>> = vec![Vec::with_capacity(out.len()); slots.len()];
        for (k, v) in &out {
            let mut at = 0;
            let corrupt = |reason: String| Error::CorruptState {
                path: path(),
                reason,
            };
            if window.is_some() {
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
            for (s, v) in decode_slots(v, &slot_types)
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
        if let Some((_, size, _, tz)) = &window {
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
        let mut slot_iter = slot_cols.into_iter().zip(&slot_types);
        for e in &self.exprs {
            let (values, t) = slot_iter.next().ok_or_else(|| Error::Internal {
                what: "aggregate slots".into(),
            })?;
            let (array, dt) = if e.func == Func::ApproxDistinct {
                let n: Vec<i64> = values
                    .iter()
                    .map(|v| match v {
                        ScalarValue::Binary(Some(r)) => hll_estimate(r),
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
}

/// Where a state slot's value for a batch comes from.
#[derive(Debug, Clone, Copy)]
enum SlotSource {
    /// This column of DataFusion's partial results (after the group columns).
    Partial(usize),
    /// A sketch of this column of the expanded batch.
    Sketch(usize),
}

/// HyperLogLog with 2^9 registers: Spark's default precision for `approx_count_distinct`
/// (relative standard deviation 0.05).
const HLL_BITS: u32 = 9;
const HLL_REGISTERS: usize = 1 << HLL_BITS;

/// For each group of the expanded batch (its state key), the registers of each sketched
/// slot, in slot order.
fn sketch_rows(
    batch: &RecordBatch,
    groups: usize,
    windowed: bool,
    sources: &[SlotSource],
) -> std::collections::HashMap<Vec<u8>, Vec<Vec<u8>>> {
    let sketched: Vec<usize> = sources
        .iter()
        .filter_map(|s| match s {
            SlotSource::Sketch(c) => Some(*c),
            SlotSource::Partial(_) => None,
        })
        .collect();
    let mut out: std::collections::HashMap<Vec<u8>, Vec<Vec<u8>>> = Default::default();
    if sketched.is_empty() {
        return out;
    }
    let mut key = Vec::new();
    let mut value = Vec::new();
    for row in 0..batch.num_rows() {
        key.clear();
        if windowed {
            encode_value(&mut key, batch.column(groups), row);
        }
        for g in 0..groups {
            encode_value(&mut key, batch.column(g), row);
        }
        let regs = out
            .entry(key.clone())
            .or_insert_with(|| vec![vec![0; HLL_REGISTERS]; sketched.len()]);
        for (n, c) in sketched.iter().enumerate() {
            let col = batch.column(*c);
            if col.is_null(row) {
                continue;
            }
            value.clear();
            encode_value(&mut value, col, row);
            let h = hash64(&value);
            let idx = (h >> (64 - HLL_BITS)) as usize;
            let rank = ((h << HLL_BITS) | (1 << (HLL_BITS - 1))).leading_zeros() as u8 + 1;
            regs[n][idx] = regs[n][idx].max(rank);
        }
    }
    out
}

/// FNV-1a, then SplitMix64's finalizer: a hash that is the same on every platform and
/// release (the registers are kept in the checkpoint).
fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The HyperLogLog estimate of the registers, with linear counting for small counts.
fn hll_estimate(regs: &[u8]) -> i64 {
    let m = regs.len() as f64;
    if regs.is_empty() {
        return 0;
    }
    let sum: f64 = regs.iter().map(|r| 2f64.powi(-i32::from(*r))).sum();
    let alpha = 0.7213 / (1.0 + 1.079 / m);
    let raw = alpha * m * m / sum;
    let zeros = regs.iter().filter(|r| **r == 0).count() as f64;
    let est = if raw <= 2.5 * m && zeros > 0.0 {
        m * (m / zeros).ln()
    } else {
        raw
    };
    est.round() as i64
}

/// What a group's entry leaves the state by, when the watermark passes it.
#[derive(Debug, Clone, Copy)]
enum Expiry {
    /// The end of its window (start + this size, µs).
    WindowEnd(i64),
    /// The value of this group column (the event-time column).
    Group(usize),
}

const APPEND_NEEDS: &str = "output mode append needs a watermark (with_watermark before \
    the aggregation) on the window's column or on a group-by column: without one a group \
    never closes; use update or complete";

/// The event time (µs) in group column `pos` of a state key.
fn group_time(
    key: &[u8],
    windowed: bool,
    types: &[DataType],
    pos: usize,
) -> std::result::Result<Option<i64>, String> {
    let mut at = 0;
    if windowed {
        decode_value(key, &mut at, &DataType::Int64)?;
    }
    let mut value = ScalarValue::Null;
    for t in &types[..=pos] {
        value = decode_value(key, &mut at, t)?;
    }
    Ok(match value {
        ScalarValue::TimestampSecond(v, _) => v.map(|v| v.saturating_mul(1_000_000)),
        ScalarValue::TimestampMillisecond(v, _) => v.map(|v| v.saturating_mul(1000)),
        ScalarValue::TimestampMicrosecond(v, _) => v,
        ScalarValue::TimestampNanosecond(v, _) => v.map(|v| v.div_euclid(1000)),
        _ => None,
    })
}

fn micros_of(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The window start at the front of a state key.
fn window_start(key: &[u8]) -> std::result::Result<i64, String> {
    match decode_value(key, &mut 0, &DataType::Int64)? {
        ScalarValue::Int64(Some(s)) => Ok(s),
        _ => Err("a window start is NULL".into()),
    }
}

fn decode_slots(v: &[u8], types: &[DataType]) -> std::result::Result<Vec<ScalarValue>, String> {
    let mut at = 0;
    let out = types
        .iter()
        .map(|t| decode_value(v, &mut at, t))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if at != v.len() {
        return Err(format!("{} bytes left after the values", v.len() - at));
    }
    Ok(out)
}

fn scalars_to_array(values: Vec<ScalarValue>, t: &DataType) -> Result<ArrayRef> {
    if values.is_empty() {
        return Ok(new_empty_array(t));
    }
    ScalarValue::iter_to_array(values).map_err(|e| Error::datafusion(KEY, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregates_parse_as_spark_names_them() {
        let e = AggExpr::parse("count(*)").unwrap();
        assert_eq!(
            (e.func, e.column, e.alias.as_str()),
            (Func::Count, None, "count(1)")
        );
        let e = AggExpr::parse(" AVG(amount)  as  mean_amount ").unwrap();
        assert_eq!(
            (e.func, e.column.as_deref(), e.alias.as_str()),
            (Func::Avg, Some("amount"), "mean_amount")
        );
        for bad in ["median(x)", "sum(*)", "count", "sum(x) total", "sum()"] {
            let err = AggExpr::parse(bad).unwrap_err().to_string();
            assert!(
                err.contains("transform.aggregate") && err.contains(bad),
                "{err}"
            );
        }
        assert!(
            Aggregation::new(["count(*) as n", "sum(x) as n"])
                .validate()
                .is_err()
        );
        assert!(
            Aggregation::new(["count(*)"])
                .sliding_window("ts", Duration::from_secs(60), Duration::from_secs(120))
                .validate()
                .is_err()
        );
        assert_eq!("Update".parse::<OutputMode>().unwrap(), OutputMode::Update);
        assert!("upsert".parse::<OutputMode>().is_err());
    }

    #[test]
    fn sketches_estimate_distinct_counts_and_merge_as_a_union() {
        use datafusion::arrow::array::Int64Array;
        let sketch = |values: std::ops::Range<i64>| -> Vec<u8> {
            let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, true)]));
            let b =
                RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))])
                    .unwrap();
            let mut m = sketch_rows(&b, 0, false, &[SlotSource::Sketch(0)]);
            m.remove(&Vec::new()).unwrap().remove(0)
        };
        assert_eq!(hll_estimate(&sketch(0..3)), 3);
        let all = sketch(0..20_000);
        let est = hll_estimate(&all) as f64;
        assert!((est - 20_000.0).abs() < 20_000.0 * 0.15, "{est}");
        let merged = merge(
            Slot::Hll,
            ScalarValue::Binary(Some(sketch(0..12_000))),
            ScalarValue::Binary(Some(sketch(8_000..20_000))),
        )
        .unwrap();
        assert_eq!(merged, ScalarValue::Binary(Some(all)));
    }

    #[test]
    fn partial_results_merge_as_the_aggregate_would() {
        let i = |v: i64| ScalarValue::Int64(Some(v));
        assert_eq!(merge(Slot::Add, i(2), i(3)).unwrap(), i(5));
        assert_eq!(
            merge(Slot::Add, ScalarValue::Int64(None), i(3)).unwrap(),
            i(3)
        );
        assert_eq!(merge(Slot::Min, i(2), i(3)).unwrap(), i(2));
        assert_eq!(
            merge(Slot::Max, i(2), ScalarValue::Int64(None)).unwrap(),
            i(2)
        );
        assert!(merge(Slot::Add, i(i64::MAX), i(1)).is_err());
    }
}
