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
//! or below the previous batch's watermark; without a window, a row at or below it is
//! dropped. `numRowsDroppedByWatermark` counts the late (group, window) pairs, as Spark
//! does (it drops late rows after its partial aggregation). Output columns: the group columns, then
//! `window_start` and `window_end` (timestamps in microseconds) when there is a window,
//! then one column per aggregate, named by its alias.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::array::{ArrayRef, new_empty_array};
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::functions_aggregate::expr_fn::{count, max, min, sum};
use datafusion::logical_expr::{Expr, cast, lit};
use datafusion::scalar::ScalarValue;

mod expand;
mod hll;
mod hll_tables;
mod operator;

pub(in crate::engine::stateful) use expand::{Shape, expansions, state_key};
pub(in crate::engine::stateful) use hll::Sketch;
pub(crate) use operator::Aggregate;

use super::keys::{decode_value, family};
use super::{key_columns, key_families};
use crate::error::{Error, Result};

/// The setting errors name (the pipeline file's spelling; `aggregate` in the API).
const KEY: &str = "transform.aggregate";

/// Spark's name for the operator in progress reports and the state metadata.
pub(super) const OPERATOR_NAME: &str = "stateStoreSave";

/// Which rows an aggregation passes on each batch (Spark's output modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Window {
    pub column: String,
    pub size: Duration,
    pub slide: Duration,
}

/// A streaming aggregation (see the module documentation).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
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
pub(in crate::engine::stateful) struct Columns {
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

/// What a group's entry leaves the state by, when the watermark passes it.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine::stateful) enum Expiry {
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
    use datafusion::arrow::datatypes::Field;
    use datafusion::arrow::record_batch::RecordBatch;

    use super::hll::{Sketch, SlotSource, hll_estimate, sketch_rows};
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
            let mut m = sketch_rows(&b, 0, false, &[SlotSource::Sketch(0)], Sketch::Spark);
            m.remove(&Vec::new()).unwrap().remove(0)
        };
        assert_eq!(hll_estimate(&sketch(0..3), Sketch::Spark), 3);
        let all = sketch(0..20_000);
        let est = hll_estimate(&all, Sketch::Spark) as f64;
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
