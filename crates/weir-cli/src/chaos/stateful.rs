//! The reference of a stateful pipeline (watermark, deduplication, windowed aggregation) for
//! `weir chaos`, written here from Spark's rules without the engine's code: the committed
//! batches are replayed from the checkpoint (which files each batch read, and which batches
//! had no data), the watermark of each batch is recomputed and compared with the one in
//! `offsets/N`, and the rows every batch passed on are computed. Sinks are then compared
//! with those rows: an append sink holds each of them once, an upsert sink the newest per
//! key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use weir_core::checkpoint::Checkpoint;
use weir_core::connector::Verdict;
use weir_core::datafusion::arrow::array::cast::AsArray;
use weir_core::datafusion::arrow::array::{Array, ArrayRef, TimestampMicrosecondArray};
use weir_core::datafusion::arrow::datatypes::{
    DataType, Field, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
};
use weir_core::datafusion::arrow::record_batch::RecordBatch;
use weir_core::datafusion::scalar::ScalarValue;
use weir_core::source::file::taken_files;

use super::input::Input;
use crate::generate::orders_schema;
use crate::pipeline::Pipeline;

/// What the pipeline's stateful steps are, as the reference needs them.
pub(super) struct Plan {
    event: usize,
    delay_us: i64,
    dedupe: Option<(Vec<usize>, bool)>,
    aggregate: Option<Agg>,
}

struct Agg {
    groups: Vec<usize>,
    /// size, slide (µs); windows are over the event-time column.
    window: Option<(i64, i64)>,
    aggs: Vec<(Func, Option<usize>, String)>,
    mode: Mode,
}

#[derive(Clone, Copy, PartialEq)]
enum Func {
    Count,
    Sum,
    Min,
    Max,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Append,
    Update,
    Complete,
}

fn column(name: &str) -> Result<usize> {
    orders_schema()
        .index_of(name)
        .map_err(|_| anyhow!("chaos: `{name}` is not a column of the generated orders"))
}

/// The plan of `p`'s stateful steps; `None` if it has none. Refuses what the reference
/// cannot compute exactly.
pub(super) fn plan(p: &Pipeline) -> Result<Option<Plan>> {
    let Some(t) = &p.transform else {
        return Ok(None);
    };
    if !t.is_stateful() && t.with_watermark.is_none() {
        return Ok(None);
    }
    if t.sql.is_some() {
        bail!("chaos: a stateful pipeline with `sql` after it has no reference to check");
    }
    let w = t
        .with_watermark
        .as_ref()
        .ok_or_else(|| anyhow!("chaos: a stateful pipeline needs with-watermark here"))?;
    let dedupe = match (&t.drop_duplicates, &t.drop_duplicates_within_watermark) {
        (Some(_), Some(_)) => bail!("chaos: one deduplication step at most"),
        (Some(k), None) => Some((k.iter().map(|c| column(c)).collect::<Result<_>>()?, false)),
        (None, Some(k)) => Some((k.iter().map(|c| column(c)).collect::<Result<_>>()?, true)),
        (None, None) => None,
    };
    let aggregate = match &t.aggregate {
        None => None,
        Some(a) => {
            let window = match &a.window {
                Some(win) => {
                    if win.column != w.column {
                        bail!("chaos: the window must be on the watermark's column");
                    }
                    let size = win.size.0.as_micros() as i64;
                    Some((
                        size,
                        win.slide.as_ref().map_or(size, |s| s.0.as_micros() as i64),
                    ))
                }
                None => None,
            };
            let aggs = a
                .aggregates
                .iter()
                .map(|s| parse_agg(s))
                .collect::<Result<_>>()?;
            let mode = match a.output_mode.as_deref().unwrap_or("append") {
                "append" => Mode::Append,
                "update" => Mode::Update,
                "complete" => Mode::Complete,
                m => bail!("chaos: output mode {m}"),
            };
            Some(Agg {
                groups: a
                    .group_by
                    .iter()
                    .map(|c| column(c))
                    .collect::<Result<_>>()?,
                window,
                aggs,
                mode,
            })
        }
    };
    Ok(Some(Plan {
        event: column(&w.column)?,
        delay_us: w.delay.0.as_micros() as i64,
        dedupe,
        aggregate,
    }))
}

/// `count(*)`, `count(c)`, `min(c)`, `max(c)`, `sum(c)` of an integer column, `AS name`.
fn parse_agg(s: &str) -> Result<(Func, Option<usize>, String)> {
    let t = s.trim();
    let (call, alias) = match t.to_ascii_lowercase().find(" as ") {
        Some(i) => (t[..i].trim(), Some(t[i + 4..].trim().to_string())),
        None => (t, None),
    };
    let open = call.find('(').ok_or_else(|| anyhow!("chaos: '{s}'"))?;
    let name = call[..open].trim().to_ascii_lowercase();
    let arg = call[open + 1..].trim_end_matches(')').trim();
    let func = match name.as_str() {
        "count" => Func::Count,
        "sum" => Func::Sum,
        "min" => Func::Min,
        "max" => Func::Max,
        _ => bail!("chaos: '{s}': the reference computes count, sum, min and max exactly"),
    };
    let col = match arg {
        "*" | "1" => None,
        c => Some(column(c)?),
    };
    if func == Func::Sum
        && col.is_none_or(|c| orders_schema().field(c).data_type() != &DataType::Int64)
    {
        bail!("chaos: '{s}': sums are checked exactly on integer columns only");
    }
    let alias = alias.unwrap_or_else(|| format!("{name}({arg})"));
    Ok((func, col, alias))
}

/// The rows the committed batches passed on, in the output's schema; mismatches of the
/// recorded watermarks go to `v`. `last_state`: the state sizes of the last batch.
pub(super) struct Reference {
    pub schema: SchemaRef,
    pub rows: Vec<RecordBatch>,
    pub state_sizes: Vec<usize>,
}

pub(super) async fn reference(
    plan: &Plan,
    input: &Input,
    cp: &Checkpoint,
    committed: u64,
    v: &mut Verdict,
) -> Result<Reference> {
    let orders = orders_schema();
    let taken = taken_files(&cp.source_log(0)).await?;
    let mut by_name: HashMap<String, RecordBatch> = HashMap::new();
    for (w, b) in input.written.iter().zip(input.rows()?) {
        by_name.insert(
            w.path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            b,
        );
    }
    let mut watermark_ms: i64 = 0;
    let mut prev_watermark_ms: i64 = 0;
    let mut prev_end: Option<u64> = None;
    // Dedupe state: key -> kept time (expiry, or event time) in µs.
    let mut seen: HashMap<Vec<String>, Option<i64>> = HashMap::new();
    // Aggregate state: (groups, window start) -> accumulators.
    let mut groups: BTreeMap<(Vec<Key>, i64), Vec<ScalarValue>> = BTreeMap::new();
    let mut out_rows: Vec<Vec<ScalarValue>> = Vec::new();
    let mut passed_rows: Vec<RecordBatch> = Vec::new();
    for n in 0..committed {
        let seq = cp.read_offsets(n).await.with_context(|| {
            format!("chaos: offsets/{n} is needed to replay the stateful batches (purged?)")
        })?;
        let end = seq.offsets[0]
            .as_ref()
            .and_then(|o| o.json()["logOffset"].as_u64())
            .ok_or_else(|| anyhow!("offsets/{n}: no logOffset"))?;
        if seq.metadata.batch_watermark_ms != watermark_ms {
            v.mismatches.push(format!(
                "batch {n}: offsets/{n} records watermark {} ms, the rules give {watermark_ms} ms",
                seq.metadata.batch_watermark_ms
            ));
            watermark_ms = seq.metadata.batch_watermark_ms;
        }
        // Late by the batch before's watermark (Spark since 3.4); evicted by the batch's own.
        let w_us = watermark_ms.saturating_mul(1000);
        let late_us = match &plan.aggregate {
            // Complete mode counts every row (Spark).
            Some(a) if a.mode == Mode::Complete => i64::MIN,
            _ => prev_watermark_ms.saturating_mul(1000),
        };
        prev_watermark_ms = watermark_ms;
        let from = prev_end.map_or(0, |e| e + 1);
        prev_end = Some(end);
        let mut rows: Vec<(RecordBatch, usize)> = Vec::new();
        for lo in from..=end {
            for f in taken.get(&lo).map(Vec::as_slice).unwrap_or(&[]) {
                let b = by_name.get(&f.name()).ok_or_else(|| {
                    anyhow!("batch {n} read {}, which chaos did not write", f.name())
                })?;
                rows.extend((0..b.num_rows()).map(|r| (b.clone(), r)));
            }
        }
        let time = |b: &RecordBatch, r: usize| -> Option<i64> {
            let c = b
                .column(plan.event)
                .as_primitive::<TimestampMicrosecondType>();
            (!c.is_null(r)).then(|| c.value(r))
        };
        let mut max_event: Option<i64> = None;
        let mut passed = Vec::new();
        for (b, r) in &rows {
            let t = time(b, *r);
            if let Some(t) = t {
                max_event = Some(max_event.map_or(t, |m: i64| m.max(t)));
            }
            let late = t.is_some_and(|t| t <= late_us);
            if let Some((keys, within)) = &plan.dedupe {
                if late {
                    continue;
                }
                let key: Vec<String> = keys.iter().map(|c| cell(b, *c, *r)).collect();
                if seen.contains_key(&key) {
                    continue;
                }
                let kept = if *within {
                    Some(t.unwrap_or(0) + plan.delay_us)
                } else if keys.contains(&plan.event) {
                    t
                } else {
                    None
                };
                seen.insert(key, kept);
            }
            passed.push((b.clone(), *r));
        }
        if plan.dedupe.is_some() {
            seen.retain(|_, kept| kept.is_none_or(|k| k > w_us));
        }
        match &plan.aggregate {
            None => {
                for (b, r) in &passed {
                    passed_rows.push(b.slice(*r, 1));
                }
            }
            Some(a) => {
                let mut touched = BTreeSet::new();
                for (b, r) in &passed {
                    let t = time(b, *r);
                    let starts: Vec<i64> = match (a.window, t) {
                        (Some(_), None) => continue,
                        (Some((size, slide)), Some(t)) => {
                            let mut s = t - t.rem_euclid(slide);
                            let mut v = Vec::new();
                            while s > t - size {
                                if s + size > late_us {
                                    v.push(s);
                                }
                                s -= slide;
                            }
                            v
                        }
                        (None, t) => {
                            if t.is_some_and(|t| t <= late_us) {
                                continue;
                            }
                            vec![0]
                        }
                    };
                    let key: Vec<Key> = a
                        .groups
                        .iter()
                        .map(|c| {
                            Key(ScalarValue::try_from_array(b.column(*c), *r)
                                .unwrap_or(ScalarValue::Null))
                        })
                        .collect();
                    for s in starts {
                        let g = (key.clone(), s);
                        let acc = groups.entry(g.clone()).or_insert_with(|| {
                            a.aggs
                                .iter()
                                .map(|(f, c, _)| match (f, c) {
                                    (Func::Count, _) => ScalarValue::Int64(Some(0)),
                                    (_, Some(c)) => {
                                        ScalarValue::try_from(orders.field(*c).data_type())
                                            .unwrap_or(ScalarValue::Null)
                                    }
                                    (_, None) => ScalarValue::Null,
                                })
                                .collect()
                        });
                        for ((f, c, _), acc) in a.aggs.iter().zip(acc.iter_mut()) {
                            let val = c.map(|c| {
                                ScalarValue::try_from_array(b.column(c), *r)
                                    .unwrap_or(ScalarValue::Null)
                            });
                            *acc = accumulate(*f, acc, val)?;
                        }
                        touched.insert(g);
                    }
                }
                let size = a.window.map_or(0, |w| w.0);
                // Closed by the window's end, or by the event-time group column's value.
                let by_group = a.groups.iter().position(|c| *c == plan.event);
                let closed = |g: &(Vec<Key>, i64)| match (a.window, by_group) {
                    (Some(_), _) => g.1 + size <= w_us,
                    (None, Some(pos)) => match &g.0[pos].0 {
                        ScalarValue::TimestampMicrosecond(Some(t), _) => *t <= w_us,
                        _ => false,
                    },
                    (None, None) => false,
                };
                let emit: Vec<(Vec<Key>, i64)> = match a.mode {
                    Mode::Complete => groups.keys().cloned().collect(),
                    Mode::Update => touched.into_iter().collect(),
                    Mode::Append => groups.keys().filter(|g| closed(g)).cloned().collect(),
                };
                for g in &emit {
                    let mut row: Vec<ScalarValue> = g.0.iter().map(|k| k.0.clone()).collect();
                    if a.window.is_some() {
                        row.push(ScalarValue::TimestampMicrosecond(
                            Some(g.1),
                            Some("UTC".into()),
                        ));
                        row.push(ScalarValue::TimestampMicrosecond(
                            Some(g.1 + size),
                            Some("UTC".into()),
                        ));
                    }
                    row.extend(groups[g].iter().cloned());
                    out_rows.push(row);
                }
                if a.mode != Mode::Complete {
                    groups.retain(|g, _| !closed(g));
                }
            }
        }
        if let Some(m) = max_event {
            watermark_ms = watermark_ms.max(m.div_euclid(1000) - plan.delay_us / 1000);
        }
    }
    let mut state_sizes = Vec::new();
    if plan.dedupe.is_some() {
        state_sizes.push(seen.len());
    }
    if plan.aggregate.is_some() {
        state_sizes.push(groups.len());
    }
    let Some(a) = &plan.aggregate else {
        return Ok(Reference {
            schema: orders,
            rows: passed_rows,
            state_sizes,
        });
    };
    let mut fields: Vec<Field> = a
        .groups
        .iter()
        .map(|c| orders.field(*c).clone().with_nullable(true))
        .collect();
    if a.window.is_some() {
        let ts = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        fields.push(Field::new("window_start", ts.clone(), false));
        fields.push(Field::new("window_end", ts, false));
    }
    for (f, c, alias) in &a.aggs {
        let dt = match (f, c) {
            (Func::Count, _) => DataType::Int64,
            (_, Some(c)) => orders.field(*c).data_type().clone(),
            (_, None) => DataType::Null,
        };
        fields.push(Field::new(alias, dt, true));
    }
    let schema: SchemaRef = Arc::new(Schema::new(fields));
    let mut cols: Vec<ArrayRef> = Vec::new();
    for (i, f) in schema.fields().iter().enumerate() {
        let values: Vec<ScalarValue> = out_rows.iter().map(|r| r[i].clone()).collect();
        cols.push(if values.is_empty() {
            weir_core::datafusion::arrow::array::new_empty_array(f.data_type())
        } else if let DataType::Timestamp(..) = f.data_type() {
            let v: Vec<Option<i64>> = values
                .iter()
                .map(|s| match s {
                    ScalarValue::TimestampMicrosecond(v, _) => *v,
                    _ => None,
                })
                .collect();
            Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC"))
        } else {
            ScalarValue::iter_to_array(values)?
        });
    }
    let batch = RecordBatch::try_new(schema.clone(), cols)?;
    Ok(Reference {
        schema,
        rows: vec![batch],
        state_sizes,
    })
}

/// A group value, ordered (ScalarValue is only partially ordered; values of one column
/// always compare).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key(ScalarValue);

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (self.0.is_null(), other.0.is_null()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Less,
            (false, true) => std::cmp::Ordering::Greater,
            (false, false) => self
                .0
                .partial_cmp(&other.0)
                .unwrap_or_else(|| self.0.to_string().cmp(&other.0.to_string())),
        }
    }
}

/// Row `r` of column `c` as text, NULL apart from every value.
fn cell(b: &RecordBatch, c: usize, r: usize) -> String {
    let col = b.column(c);
    if col.is_null(r) {
        return "\u{0}NULL".to_string();
    }
    weir_core::datafusion::arrow::util::display::array_value_to_string(col, r).unwrap_or_default()
}

/// Adds one row's value (`None`: count(*)) to an accumulator.
fn accumulate(f: Func, acc: &ScalarValue, val: Option<ScalarValue>) -> Result<ScalarValue> {
    let val = match val {
        None => return Ok(add_one(acc)),
        Some(v) if v.is_null() => return Ok(acc.clone()),
        Some(v) => v,
    };
    if f == Func::Count {
        return Ok(add_one(acc));
    }
    if acc.is_null() {
        return Ok(val);
    }
    Ok(match f {
        Func::Sum => match (acc, &val) {
            (ScalarValue::Int64(Some(a)), ScalarValue::Int64(Some(b))) => ScalarValue::Int64(Some(
                a.checked_add(*b)
                    .ok_or_else(|| anyhow!("chaos: the reference sum overflowed"))?,
            )),
            _ => bail!("chaos: sum of {val}"),
        },
        Func::Min if val < *acc => val,
        Func::Max if val > *acc => val,
        _ => acc.clone(),
    })
}

fn add_one(acc: &ScalarValue) -> ScalarValue {
    match acc {
        ScalarValue::Int64(Some(n)) => ScalarValue::Int64(Some(n + 1)),
        _ => ScalarValue::Int64(Some(1)),
    }
}

/// The state of the last committed batch: each operator's `numRowsTotal` in its progress
/// report (if the report was written before the run ended) against the reference's.
pub(super) fn check_state_sizes(
    r: &Reference,
    progress: &[serde_json::Value],
    committed: u64,
    v: &mut Verdict,
) {
    let Some(last) = committed.checked_sub(1) else {
        return;
    };
    let Some(line) = progress
        .iter()
        .rev()
        .find(|l| l["batchId"].as_u64() == Some(last))
    else {
        v.notes.push(format!(
            "stateful: batch {last} left no progress report; state sizes not compared"
        ));
        return;
    };
    for (i, want) in r.state_sizes.iter().enumerate() {
        let got = line["stateOperators"][i]["numRowsTotal"].as_u64();
        if got != Some(*want as u64) {
            v.mismatches.push(format!(
                "batch {last}: stateful operator {i} holds {got:?} rows, the reference {want}"
            ));
        }
    }
    v.notes.push(format!(
        "stateful: state after batch {last} as the reference's: {:?} rows",
        r.state_sizes
    ));
}
