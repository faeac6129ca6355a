//! An aggregation's state partitions on the workers: the same plan as a deduplication's
//! (see the parent module), with the tagging node expanding each row into its windows
//! first, since a row of a sliding window belongs to several groups, each in the state
//! partition of its own key (the window's start, then the group columns).
//!
//! The tag's flags say what a row is for: a marker (its partition only), a late (row,
//! window) pair (counted by (group, window), as Spark counts late rows), the first
//! expansion of an input row (its event time counts for the watermark once), or an input
//! row no window takes (a NULL window time: not aggregated, its watermark time counted).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, UInt8Array, UInt32Array, new_null_array,
};
use datafusion::arrow::compute::{
    SortColumn, SortOptions, filter_record_batch, lexsort_to_indices, take, take_record_batch,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::EmissionType;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
    SendableRecordBatchStream,
};
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::super::aggregate::{
    AggExpr, Aggregate, Aggregation, Shape, Sketch, expansions, state_key,
};
use super::super::watermark::EventTime;
use super::super::{OperatorState, StateSettings};
use super::exec::{keep, load_partition, one_input, one_input_methods, props, state_stream, typed};
use super::orderable;
use super::{MARK_COL, Meta, PART_COL, nullable};
use crate::error::{Error, Result};
use crate::state::{PartitionedStore, StateConf, StateStore, partition_of};
use crate::storage::{Location, StorageOptions};

/// The window start of each row (0 without a window).
pub(super) const WINDOW_COL: &str = "__weir_window";

const MARKER: u8 = 1;
const LATE: u8 = 2;
const FIRST: u8 = 4;
const STATS_ONLY: u8 = 8;

/// What an aggregation on the workers needs: all of it travels with the plan.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct AggSpec {
    /// The query's id (see [`super::DedupeSpec`]).
    query: uuid::Uuid,
    pub(super) operator: u32,
    /// The checkpoint's `state` folder as a URL and the object store's settings there
    /// (never shown).
    state_root: String,
    storage: BTreeMap<String, String>,
    pub(super) partitions: u32,
    snapshot_every: u64,
    retain: u64,
    pub(super) batch_id: u64,
    aggregation: Aggregation,
    event: Option<EventTime>,
    sketch: Sketch,
    /// The watermark's column, when its step comes right before.
    observe: Option<usize>,
}

impl fmt::Debug for AggSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AggSpec")
            .field("operator", &self.operator)
            .field("state_root", &self.state_root)
            .field("partitions", &self.partitions)
            .field("batch_id", &self.batch_id)
            .finish_non_exhaustive()
    }
}

impl AggSpec {
    #[allow(clippy::too_many_arguments)]
    pub(in crate::engine::stateful) fn new(
        query: uuid::Uuid,
        operator: u32,
        state_root: &Location,
        partitions: u32,
        conf: StateConf,
        batch_id: u64,
        aggregation: Aggregation,
        event: Option<EventTime>,
        sketch: Sketch,
        observe: Option<usize>,
    ) -> AggSpec {
        AggSpec {
            query,
            operator,
            state_root: state_root.url().to_string(),
            storage: state_root.options().as_map().clone(),
            partitions,
            snapshot_every: conf.snapshot_every(),
            retain: conf.retain(),
            batch_id,
            aggregation,
            event,
            sketch,
            observe,
        }
    }

    fn conf(&self) -> Result<StateConf> {
        StateConf::new(self.snapshot_every, self.retain)
    }

    /// The shape of a batch of `schema`, the aggregates parsed as `exprs` (once per task
    /// partition: [`Aggregation::validate`]).
    fn shape(&self, exprs: &[AggExpr], schema: SchemaRef) -> Result<Shape<'_>> {
        Shape::of(
            &self.aggregation,
            exprs,
            schema,
            self.event.as_ref(),
            self.sketch,
        )
    }
}

fn tag_schema(data: &Schema) -> SchemaRef {
    let mut fields = nullable(data);
    fields.push(Field::new(WINDOW_COL, DataType::Int64, false));
    fields.push(Field::new(PART_COL, DataType::UInt32, false));
    fields.push(Field::new(MARK_COL, DataType::UInt8, false));
    Arc::new(Schema::new(fields))
}

/// Expands each row into its windows and tags it with its state partition; sends one
/// marker row per partition from its first partition.
#[derive(Debug)]
pub struct AggTagExec {
    input: Arc<dyn ExecutionPlan>,
    pub(super) spec: Arc<AggSpec>,
    cache: Arc<PlanProperties>,
}

impl AggTagExec {
    pub(super) fn new(input: Arc<dyn ExecutionPlan>, spec: Arc<AggSpec>) -> Self {
        let schema = tag_schema(&input.schema());
        let n = input.output_partitioning().partition_count();
        AggTagExec {
            input,
            spec,
            cache: props(schema, n, EmissionType::Incremental),
        }
    }
}

impl DisplayAs for AggTagExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "AggTagExec: operator={}, partitions={}",
            self.spec.operator, self.spec.partitions
        )
    }
}

/// `batch`'s rows expanded and tagged (schema `out`), by `spec`.
fn expand_and_tag(
    spec: &AggSpec,
    exprs: &[AggExpr],
    out: &SchemaRef,
    batch: &RecordBatch,
) -> Result<RecordBatch> {
    let shape = spec.shape(exprs, batch.schema())?;
    let ex = expansions(batch, &shape)?;
    let n = batch.num_rows();
    let mut seen = vec![false; n];
    let mut rows: Vec<u32> = Vec::with_capacity(ex.rows.len() + ex.late.len());
    let mut starts: Vec<i64> = Vec::with_capacity(rows.capacity());
    let mut flags: Vec<u8> = Vec::with_capacity(rows.capacity());
    // Without a window every start is 0 (the expansion keeps none).
    let taken = ex
        .rows
        .iter()
        .enumerate()
        .map(|(i, r)| (*r, ex.starts.get(i).copied().unwrap_or(0), 0u8));
    let late = ex.late.iter().map(|(r, s)| (*r, *s, LATE));
    for (row, start, flag) in taken.chain(late) {
        let first = !std::mem::replace(&mut seen[row as usize], true);
        rows.push(row);
        starts.push(start);
        flags.push(flag | if first { FIRST } else { 0 });
    }
    for (row, seen) in seen.iter().enumerate() {
        if !seen && spec.observe.is_some() {
            rows.push(row as u32);
            starts.push(0);
            flags.push(STATS_ONLY);
        }
    }
    let mut key = Vec::new();
    let tags: Vec<u32> = rows
        .iter()
        .zip(&starts)
        .zip(&flags)
        .map(|((r, s), f)| {
            if f & STATS_ONLY != 0 {
                return 0;
            }
            key.clear();
            state_key(&mut key, batch, &shape, *r as usize, *s);
            partition_of(&key, spec.partitions) as u32
        })
        .collect();
    let idx = UInt32Array::from(rows);
    let failed = |e: datafusion::arrow::error::ArrowError| {
        Error::datafusion("expanding the aggregation's rows", e.into())
    };
    let mut cols: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| take(c.as_ref(), &idx, None))
        .collect::<std::result::Result<_, _>>()
        .map_err(failed)?;
    cols.push(Arc::new(Int64Array::from(starts)));
    cols.push(Arc::new(UInt32Array::from(tags)));
    cols.push(Arc::new(UInt8Array::from(flags)));
    RecordBatch::try_new(Arc::clone(out), cols).map_err(failed)
}

/// One marker row per partition: data columns NULL.
fn markers(schema: &SchemaRef, parts: u32) -> DfResult<RecordBatch> {
    let n = parts as usize;
    let mut cols: Vec<ArrayRef> = schema.fields()[..schema.fields().len() - 3]
        .iter()
        .map(|f| new_null_array(f.data_type(), n))
        .collect();
    cols.push(Arc::new(Int64Array::from(vec![0; n])));
    cols.push(Arc::new(UInt32Array::from((0..parts).collect::<Vec<_>>())));
    cols.push(Arc::new(UInt8Array::from(vec![MARKER; n])));
    Ok(RecordBatch::try_new(Arc::clone(schema), cols)?)
}

impl ExecutionPlan for AggTagExec {
    one_input_methods!("AggTagExec");

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = one_input(children, "AggTagExec")?;
        Ok(Arc::new(AggTagExec::new(input, Arc::clone(&self.spec))))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let schema = self.schema();
        let spec = Arc::clone(&self.spec);
        let failed = |e: Error| DataFusionError::Execution(crate::error::error_chain(&e));
        let exprs = spec.aggregation.validate().map_err(failed)?;
        let s = Arc::clone(&schema);
        let tagged = input
            .map(move |b| b.and_then(|b| expand_and_tag(&spec, &exprs, &s, &b).map_err(failed)));
        let stream = match partition {
            0 => futures::stream::once(futures::future::ready(markers(
                &schema,
                self.spec.partitions,
            )))
            .chain(tagged)
            .boxed(),
            _ => tagged.boxed(),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

/// Aggregates the rows of the state partitions whose tags reach it into their state,
/// loading and committing each partition.
#[derive(Debug)]
pub struct AggStateExec {
    pub(super) input: Arc<dyn ExecutionPlan>,
    pub(super) spec: Arc<AggSpec>,
    /// The aggregation's rows with the side column (as the driver planned them).
    out: SchemaRef,
    cache: Arc<PlanProperties>,
}

impl AggStateExec {
    pub(super) fn new(input: Arc<dyn ExecutionPlan>, spec: Arc<AggSpec>, out: SchemaRef) -> Self {
        let n = input.output_partitioning().partition_count();
        AggStateExec {
            input,
            spec,
            cache: props(Arc::clone(&out), n, EmissionType::Final),
            out,
        }
    }
}

impl DisplayAs for AggStateExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "AggStateExec: operator={}, batch={}, partitions={}",
            self.spec.operator, self.spec.batch_id, self.spec.partitions
        )
    }
}

impl ExecutionPlan for AggStateExec {
    one_input_methods!("AggStateExec");

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = one_input(children, "AggStateExec")?;
        Ok(Arc::new(AggStateExec::new(
            input,
            Arc::clone(&self.spec),
            Arc::clone(&self.out),
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let spec = Arc::clone(&self.spec);
        let what = format!(
            "batch {}: aggregation (stateful operator {})",
            spec.batch_id, spec.operator
        );
        Ok(state_stream(
            input,
            self.input.schema(),
            Arc::clone(&self.out),
            what,
            move |all| async move { run(&spec, all).await },
        ))
    }
}

/// One task's work: `all` is its rows, markers and flagged rows, tagged.
async fn run(spec: &AggSpec, all: RecordBatch) -> Result<(Vec<RecordBatch>, Meta)> {
    let failed = |e: datafusion::arrow::error::ArrowError| {
        Error::datafusion("the aggregation's rows", e.into())
    };
    let data_cols = all.num_columns() - 3;
    let starts_col: &Int64Array = typed(all.column(data_cols), "the window column")?;
    let tags: &UInt32Array = typed(all.column(data_cols + 1), "the partition tag")?;
    let flags: &UInt8Array = typed(all.column(data_cols + 2), "the flags")?;
    let owned: BTreeSet<u32> = tags.values().iter().copied().collect();
    let data_schema = Arc::new(Schema::new(all.schema().fields()[..data_cols].to_vec()));
    let data = all
        .project(&(0..data_cols).collect::<Vec<_>>())
        .map_err(failed)?;
    let exprs = spec.aggregation.validate()?;
    let shape = spec.shape(&exprs, Arc::clone(&data_schema))?;
    let mut meta = Meta::default();
    if let Some(i) = spec.observe {
        let counted: Vec<bool> = flags
            .values()
            .iter()
            .map(|f| f & (FIRST | STATS_ONLY) != 0 && f & MARKER == 0)
            .collect();
        let counted = filter_record_batch(&data, &BooleanArray::from(counted)).map_err(failed)?;
        meta.event.observe(std::slice::from_ref(&counted), i)?;
    }
    // Late (group, window) pairs, each counted once (as Spark counts them).
    let mut late: HashSet<Vec<u8>> = HashSet::new();
    let mut rows = Vec::new();
    for r in 0..all.num_rows() {
        let f = flags.value(r);
        if f & LATE != 0 {
            let mut key = Vec::new();
            state_key(&mut key, &data, &shape, r, starts_col.value(r));
            late.insert(key);
        } else if f & (MARKER | STATS_ONLY) == 0 {
            rows.push(r as u32);
        }
    }
    meta.dropped_late = late.len() as u64;
    // In a fixed order (window start, then every column that has one): the shuffle
    // interleaves the tasks' rows differently from run to run, and a floating-point sum
    // depends on the order it adds in, so a replay would not give the same bits.
    let idx = UInt32Array::from(rows);
    let taken = take_record_batch(&data, &idx).map_err(failed)?;
    let starts = take(starts_col, &idx, None).map_err(failed)?;
    let opts = Some(SortOptions {
        descending: false,
        nulls_first: true,
    });
    let by: Vec<SortColumn> = std::iter::once(&starts)
        .chain(taken.columns().iter().filter(|c| orderable(c.data_type())))
        .map(|c| SortColumn {
            values: Arc::clone(c),
            options: opts,
        })
        .collect();
    let order = lexsort_to_indices(&by, None).map_err(failed)?;
    let taken = take_record_batch(&taken, &order).map_err(failed)?;
    let starts = take(starts.as_ref(), &order, None).map_err(failed)?;
    let starts: Vec<i64> = typed::<Int64Array>(&starts, "the window column")?
        .values()
        .to_vec();

    let conf = spec.conf()?;
    let storage = StorageOptions::new(spec.storage.clone())?;
    let state_root = Location::parse("checkpoint", &spec.state_root, None, &storage)?;
    let dir = state_root.join(&spec.operator.to_string());
    let settings = StateSettings {
        conf,
        partitions: Some(spec.partitions),
    };
    let mut op = OperatorState::new(spec.operator, &state_root, settings);
    op.store = PartitionedStore::new(&dir, spec.partitions, conf);
    op.checked = true;
    super::exec::forget_older(&spec.query, dir.url().as_str(), spec.batch_id);
    let mut urls = Vec::new();
    for p in &owned {
        let (url, store) = load_partition(&spec.query, &dir, *p, spec.batch_id, conf).await?;
        op.store.replace(*p as usize, store);
        urls.push((*p, url));
    }
    let mut agg = Aggregate::for_worker(op, spec.aggregation.clone(), spec.sketch)?;
    // One partition: DataFusion would otherwise split the rows over threads and add the
    // threads' partial sums in whichever order they finish.
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(1));
    let out = agg
        .run_expanded(&ctx, &shape, &taken, starts, spec.batch_id)
        .await?;
    meta.updated = agg.metrics.updated;
    meta.removed = agg.metrics.removed;
    meta.update_ms = agg.metrics.update_ms;
    meta.remove_ms = agg.metrics.remove_ms;
    for p in 0..spec.partitions {
        let changed = agg
            .op
            .store
            .store_mut(p as usize)
            .is_some_and(|s| s.has_changes());
        if changed && !owned.contains(&p) {
            return Err(Error::Internal {
                what: format!(
                    "a key of state partition {p} reached the task owning partitions {owned:?}"
                ),
            });
        }
    }
    let started = Instant::now();
    for (p, url) in urls {
        let Some(store) = agg.op.store.store_mut(p as usize) else {
            continue;
        };
        store.commit().await?;
        meta.rows_total += store.len() as u64;
        meta.memory_bytes += store.memory_bytes() as u64;
        meta.partitions.push(p);
        let dir = dir.join(&p.to_string());
        if let Some(s) = agg.op.store.replace(p as usize, StateStore::new(dir, conf)) {
            keep(url, s);
        }
    }
    meta.commit_ms = started.elapsed().as_millis() as u64;
    tracing::info!(
        batch_id = spec.batch_id,
        "batch {}: state partitions {:?} of stateful operator {} committed at version {} \
         ({} keys)",
        spec.batch_id,
        meta.partitions,
        spec.operator,
        spec.batch_id + 1,
        meta.rows_total
    );
    Ok((out, meta))
}
