//! Phase 2 of a batch (see [`super::operator`]) as plain functions, shared by the driver
//! and a worker's tag node: where the aggregation's columns are, each row's windows, the
//! late (row, window) pairs, and a group's state key.

use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;

use super::hll::Sketch;
use super::{APPEND_NEEDS, AggExpr, Aggregation, Columns, Expiry, KEY, OutputMode};
use crate::engine::stateful::keys::{encode_i64, encode_value};
use crate::engine::stateful::watermark::{self, EventTime};
use crate::error::{Error, Result};

/// Where a batch's columns are, and how its groups leave the state.
pub(in crate::engine::stateful) struct Shape<'e> {
    pub(super) schema: SchemaRef,
    pub(super) columns: Columns,
    /// The watermark and its column's index, unless the output mode is complete.
    pub(super) event: Option<(&'e EventTime, usize)>,
    /// What a group leaves the state by, with the watermark that decides it.
    pub(super) expiry: Option<(&'e EventTime, Expiry)>,
    /// How the state's sketches hash and estimate.
    pub(super) sketch: Sketch,
}

impl<'e> Shape<'e> {
    /// The shape of a batch of `schema` for aggregation `spec` (parsed as `exprs`), with
    /// the batch's watermark `event` and the state's `sketch`.
    pub(in crate::engine::stateful) fn of(
        spec: &Aggregation,
        exprs: &[AggExpr],
        schema: SchemaRef,
        event: Option<&'e EventTime>,
        sketch: Sketch,
    ) -> Result<Shape<'e>> {
        let (columns, event, expiry) = layout(spec, exprs, &schema, event)?;
        Ok(Shape {
            schema,
            columns,
            event,
            expiry,
            sketch,
        })
    }

    pub(super) fn windowed(&self) -> bool {
        self.columns.window.is_some()
    }

    /// The number of key columns of a partial result: the groups and the window start.
    pub(super) fn key_len(&self) -> usize {
        self.columns.groups.len() + usize::from(self.windowed())
    }

    pub(super) fn group_types(&self) -> Vec<DataType> {
        self.columns
            .groups
            .iter()
            .map(|g| self.schema.field(*g).data_type().clone())
            .collect()
    }
}

/// Where the aggregation `spec` (parsed as `exprs`) finds its columns in `schema`, the
/// watermark and its column (none in complete mode), and what a group leaves the state by;
/// append mode without an expiry is refused.
#[allow(clippy::type_complexity)]
pub(super) fn layout<'e>(
    spec: &Aggregation,
    exprs: &[AggExpr],
    schema: &SchemaRef,
    event: Option<&'e EventTime>,
) -> Result<(
    Columns,
    Option<(&'e EventTime, usize)>,
    Option<(&'e EventTime, Expiry)>,
)> {
    let columns = spec.resolve(schema, exprs)?;
    let event = match event {
        Some(e) => e.index_in(schema)?.map(|i| (e, i)),
        None => None,
    };
    // Complete mode keeps every group and counts every row, late or not (Spark).
    let event = event.filter(|_| spec.output_mode != OutputMode::Complete);
    // Groups leave the state (and close, in append mode) by the watermark if it is on
    // the window's column (by the window's end) or on a group column (by its value).
    let expiry = match (&columns.window, event) {
        (Some((w, size, ..)), Some((e, i))) if *w == i => Some((e, Expiry::WindowEnd(*size))),
        (None, Some((e, i))) => columns
            .groups
            .iter()
            .position(|g| *g == i)
            .map(|pos| (e, Expiry::Group(pos))),
        _ => None,
    };
    if spec.output_mode == OutputMode::Append && expiry.is_none() {
        return Err(Error::config(KEY, APPEND_NEEDS));
    }
    Ok((columns, event, expiry))
}

/// A batch's rows as the aggregation takes them: one per (row, window), each with its
/// window's start (0 without a window), and the late ones apart.
#[derive(Debug, Default)]
pub(in crate::engine::stateful) struct Expanded {
    pub(in crate::engine::stateful) rows: Vec<u32>,
    pub(in crate::engine::stateful) starts: Vec<i64>,
    /// Late (row, window start) pairs, counted by (group, window) and dropped.
    pub(in crate::engine::stateful) late: Vec<(u32, i64)>,
}

/// The rows of `all` to aggregate by `shape`, one per (row, window), and the late ones.
pub(in crate::engine::stateful) fn expansions(
    all: &RecordBatch,
    shape: &Shape<'_>,
) -> Result<Expanded> {
    let window = &shape.columns.window;
    let windowed_watermark = match shape.expiry {
        Some((e, Expiry::WindowEnd(_))) => Some(e),
        _ => None,
    };
    let mut out = Expanded {
        rows: Vec::with_capacity(all.num_rows()),
        ..Expanded::default()
    };
    let times = match (window, shape.event) {
        (Some((i, ..)), _) => Some(watermark::micros(all.column(*i))?),
        (None, Some((_, i))) => Some(watermark::micros(all.column(i))?),
        (None, None) => None,
    };
    for row in 0..all.num_rows() {
        let t = times.as_ref().and_then(|t| t[row]);
        match (window, t) {
            // Spark drops rows without an event time from windowed aggregations.
            (Some(_), None) => {}
            (Some((_, size, slide, _)), Some(t)) => {
                let mut start = t - t.rem_euclid(*slide);
                while start > t - size {
                    let end = start + size;
                    if windowed_watermark.is_some_and(|e| e.late(end)) {
                        out.late.push((row as u32, start));
                    } else {
                        out.rows.push(row as u32);
                        out.starts.push(start);
                    }
                    start -= slide;
                }
            }
            (None, t) => {
                if let (Some((e, _)), Some(t)) = (shape.event, t)
                    && e.late(t)
                {
                    out.late.push((row as u32, 0));
                    continue;
                }
                out.rows.push(row as u32);
            }
        }
    }
    Ok(out)
}

/// The state key of row `row` of `all` in the window starting at `start`: the window's
/// start (when windowed), then the group columns, as the state holds it.
pub(in crate::engine::stateful) fn state_key(
    out: &mut Vec<u8>,
    all: &RecordBatch,
    shape: &Shape<'_>,
    row: usize,
    start: i64,
) {
    if shape.windowed() {
        encode_i64(out, start);
    }
    for g in &shape.columns.groups {
        encode_value(out, all.column(*g), row);
    }
}
