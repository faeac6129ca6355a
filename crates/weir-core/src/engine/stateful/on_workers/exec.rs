//! The two plan nodes of a deduplication on the workers and one task's work (see the
//! parent module).

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatch, StringArray, UInt32Array, new_null_array,
};
use datafusion::arrow::array::{DynComparator, make_comparator};
use datafusion::arrow::compute::{SortOptions, concat_batches, filter_record_batch};
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
    SendableRecordBatchStream,
};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::super::dedupe::{encode_keys, evict_passed, pass_new};
use super::super::keys::encode_value;
use super::{DedupeSpec, Meta, out_schema, tag_schema};
use crate::error::{Error, Result};
use crate::state::{StateConf, StateStore, partition_of};
use crate::storage::{Location, StorageOptions};

pub(super) fn props(
    schema: SchemaRef,
    partitions: usize,
    emission: EmissionType,
) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(schema),
        Partitioning::UnknownPartitioning(partitions),
        emission,
        Boundedness::Bounded,
    ))
}

/// The methods every node of this module has alike: its name, its cached properties, its
/// one input, no expressions, and no use for more input partitions.
macro_rules! one_input_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &Arc<PlanProperties> {
            &self.cache
        }

        fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
            vec![&self.input]
        }

        fn benefits_from_input_partitioning(&self) -> Vec<bool> {
            vec![false]
        }

        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
        ) -> DfResult<TreeNodeRecursion> {
            Ok(TreeNodeRecursion::Continue)
        }
    };
}
pub(super) use one_input_methods;

/// `col` as the array type `T` a node of this module put in it; an internal error naming
/// the column (`what`) otherwise.
pub(super) fn typed<'a, T: Array + 'static>(col: &'a ArrayRef, what: &str) -> Result<&'a T> {
    col.as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| Error::Internal {
            what: format!("{what} is {}, not the type its node wrote", col.data_type()),
        })
}

/// The one input of a node of this module (`with_new_children`'s argument).
pub(super) fn one_input(
    children: Vec<Arc<dyn ExecutionPlan>>,
    name: &str,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    let [input] = <[_; 1]>::try_from(children)
        .map_err(|_| DataFusionError::Internal(format!("{name} takes one input")))?;
    Ok(input)
}

/// A state node's stream for one task partition: all of `input` (of `in_schema`) at once
/// to `work`, then its rows in `out` and the task's side row; `work`'s error names `what`.
pub(super) fn state_stream<F, Fut>(
    input: SendableRecordBatchStream,
    in_schema: SchemaRef,
    out: SchemaRef,
    what: String,
    work: F,
) -> SendableRecordBatchStream
where
    F: FnOnce(RecordBatch) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(Vec<RecordBatch>, Meta)>> + Send,
{
    let out2 = Arc::clone(&out);
    let fut = async move {
        let batches: Vec<RecordBatch> = input.try_collect().await?;
        let all = concat_batches(&in_schema, &batches)?;
        let (rows, meta) = work(all).await.map_err(|e| {
            DataFusionError::Execution(format!(
                "{what} on a worker: {}",
                crate::error::error_chain(&e)
            ))
        })?;
        output(&out2, rows, &meta)
    };
    let stream = futures::stream::once(fut)
        .map_ok(|v| futures::stream::iter(v.into_iter().map(Ok)))
        .try_flatten();
    Box::pin(RecordBatchStreamAdapter::new(out, stream))
}

/// A task's output: its rows (the data columns of `out`) and its side row.
fn output(out: &SchemaRef, rows: Vec<RecordBatch>, meta: &Meta) -> DfResult<Vec<RecordBatch>> {
    let data = out.fields().len() - 1;
    let mut batches = Vec::with_capacity(rows.len() + 1);
    for b in rows {
        if b.num_columns() < data {
            return Err(DataFusionError::Internal(format!(
                "a state node gave {} columns, {data} planned",
                b.num_columns()
            )));
        }
        let mut cols = b.columns()[..data].to_vec();
        cols.push(new_null_array(&DataType::Utf8, b.num_rows()));
        batches.push(RecordBatch::try_new(Arc::clone(out), cols)?);
    }
    let text = serde_json::to_string(meta)
        .map_err(|e| DataFusionError::Internal(format!("a task's report: {e}")))?;
    let mut side: Vec<ArrayRef> = out.fields()[..data]
        .iter()
        .map(|f| new_null_array(f.data_type(), 1))
        .collect();
    side.push(Arc::new(StringArray::from(vec![text])));
    batches.push(RecordBatch::try_new(Arc::clone(out), side)?);
    Ok(batches)
}

/// Tags each row with its key's state partition, and sends one marker row per partition
/// from its first partition.
#[derive(Debug)]
pub struct PartitionTagExec {
    input: Arc<dyn ExecutionPlan>,
    pub(super) keys: Vec<usize>,
    pub(super) partitions: u32,
    cache: Arc<PlanProperties>,
}

/// [`PartitionTagExec`]'s description on the wire.
#[derive(Serialize, Deserialize)]
pub(super) struct TagBody {
    pub(super) keys: Vec<usize>,
    pub(super) partitions: u32,
}

impl PartitionTagExec {
    pub(super) fn new(input: Arc<dyn ExecutionPlan>, keys: Vec<usize>, partitions: u32) -> Self {
        let schema = tag_schema(&input.schema());
        let n = input.output_partitioning().partition_count();
        PartitionTagExec {
            input,
            keys,
            partitions: partitions.max(1),
            cache: props(schema, n, EmissionType::Incremental),
        }
    }
}

impl DisplayAs for PartitionTagExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "PartitionTagExec: keys={:?}, partitions={}",
            self.keys, self.partitions
        )
    }
}

/// The rows of `batch` with their partition tags (`tags`) and markers (`marks`).
fn with_tags(
    schema: &SchemaRef,
    batch: &RecordBatch,
    tags: Vec<u32>,
    mark: bool,
) -> DfResult<RecordBatch> {
    let n = tags.len();
    let mut cols = batch.columns().to_vec();
    cols.push(Arc::new(UInt32Array::from(tags)));
    cols.push(Arc::new(BooleanArray::from(vec![mark; n])));
    Ok(RecordBatch::try_new(Arc::clone(schema), cols)?)
}

fn tag(
    schema: &SchemaRef,
    batch: &RecordBatch,
    keys: &[usize],
    parts: u32,
) -> DfResult<RecordBatch> {
    let cols: Vec<&ArrayRef> = keys.iter().map(|i| batch.column(*i)).collect();
    let mut key = Vec::new();
    let tags = (0..batch.num_rows())
        .map(|row| {
            key.clear();
            for c in &cols {
                encode_value(&mut key, c, row);
            }
            partition_of(&key, parts) as u32
        })
        .collect();
    with_tags(schema, batch, tags, false)
}

/// One marker row per partition: data columns NULL.
fn markers(schema: &SchemaRef, parts: u32) -> DfResult<RecordBatch> {
    let n = parts as usize;
    let data: Vec<ArrayRef> = schema.fields()[..schema.fields().len() - 2]
        .iter()
        .map(|f| new_null_array(f.data_type(), n))
        .collect();
    let fields = schema.fields()[..data.len()].to_vec();
    let empty = RecordBatch::try_new(Arc::new(Schema::new(fields)), data)?;
    with_tags(schema, &empty, (0..parts).collect(), true)
}

impl ExecutionPlan for PartitionTagExec {
    one_input_methods!("PartitionTagExec");

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = one_input(children, "PartitionTagExec")?;
        Ok(Arc::new(PartitionTagExec::new(
            input,
            self.keys.clone(),
            self.partitions,
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let schema = self.schema();
        let (keys, parts) = (self.keys.clone(), self.partitions);
        let s = Arc::clone(&schema);
        let tagged = input.map(move |b| b.and_then(|b| tag(&s, &b, &keys, parts)));
        let stream = match partition {
            0 => futures::stream::once(futures::future::ready(markers(&schema, parts)))
                .chain(tagged)
                .boxed(),
            _ => tagged.boxed(),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

/// Deduplicates the rows of the state partitions whose tags reach it, loading and
/// committing each partition's state.
#[derive(Debug)]
pub struct DedupeStateExec {
    pub(super) input: Arc<dyn ExecutionPlan>,
    pub(super) spec: Arc<DedupeSpec>,
    cache: Arc<PlanProperties>,
}

impl DedupeStateExec {
    pub(super) fn new(input: Arc<dyn ExecutionPlan>, spec: Arc<DedupeSpec>) -> Self {
        let fields = input.schema().fields().len();
        let data = Schema::new(input.schema().fields()[..fields.saturating_sub(2)].to_vec());
        let n = input.output_partitioning().partition_count();
        DedupeStateExec {
            input,
            spec,
            cache: props(out_schema(&data), n, EmissionType::Final),
        }
    }
}

impl DisplayAs for DedupeStateExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "DedupeStateExec: operator={}, batch={}, keys={:?}, partitions={}",
            self.spec.operator, self.spec.batch_id, self.spec.keys, self.spec.partitions
        )
    }
}

impl ExecutionPlan for DedupeStateExec {
    one_input_methods!("DedupeStateExec");

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let input = one_input(children, "DedupeStateExec")?;
        Ok(Arc::new(DedupeStateExec::new(
            input,
            Arc::clone(&self.spec),
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
            "batch {}: deduplication (stateful operator {})",
            spec.batch_id, spec.operator
        );
        Ok(state_stream(
            input,
            self.input.schema(),
            self.schema(),
            what,
            move |all| async move {
                let (rows, meta) = run(&spec, all).await?;
                Ok((vec![rows], meta))
            },
        ))
    }
}

/// Partition stores a worker committed, kept for its next batch (by the query's id and the
/// partition's URL).
static KEPT: LazyLock<Mutex<HashMap<String, StateStore>>> = LazyLock::new(Default::default);

/// The store kept under `key` if it holds `version` (one that holds another is let go: a
/// fresh store lists and reads the checkpoint as it is now).
fn kept(key: &str, version: u64) -> Option<StateStore> {
    KEPT.lock()
        .ok()
        .and_then(|mut k| k.remove(key))
        .filter(|s| s.version() == Some(version))
}

/// Partition `p` of the operator in `dir` (query `query`) at version `batch_id`, kept
/// from the batch before or read from the checkpoint, its files past retention deleted
/// (`commits/N-1` made version N final); and the key it is kept by.
pub(super) async fn load_partition(
    query: &uuid::Uuid,
    dir: &Location,
    p: u32,
    batch_id: u64,
    conf: StateConf,
) -> Result<(String, StateStore)> {
    let part_dir = dir.join(&p.to_string());
    let key = format!("{query} {}", part_dir.url());
    let mut store = kept(&key, batch_id).unwrap_or_else(|| StateStore::new(part_dir, conf));
    store.relist().await?;
    store.load(batch_id).await?;
    store.purge().await?;
    Ok((key, store))
}

pub(super) fn keep(url: String, store: StateStore) {
    if let Ok(mut k) = KEPT.lock() {
        k.insert(url, store);
    }
}

/// Lets go of the partitions of the operator in `dir` kept at a version older than
/// `batch_id` (another worker ran them since: versions only grow, and a store is reused
/// only at the version it holds) or for another query (a checkpoint deleted and made
/// again on the same path).
pub(super) fn forget_older(query: &uuid::Uuid, dir: &str, batch_id: u64) {
    let query = query.to_string();
    if let Ok(mut k) = KEPT.lock() {
        k.retain(|key, s| match key.split_once(' ') {
            Some((q, url)) if url.starts_with(dir) => {
                q == query && s.version().is_some_and(|v| v >= batch_id)
            }
            _ => true,
        });
    }
}

/// Whether a column has an order the rows are sorted by (see the module docs).
pub(crate) fn orderable(t: &DataType) -> bool {
    t.is_primitive()
        || matches!(
            t,
            DataType::Boolean
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Utf8View
                | DataType::Binary
                | DataType::LargeBinary
                | DataType::BinaryView
                | DataType::FixedSizeBinary(_)
        )
}

/// Compares two rows of `batch` by every column that has an order, ascending, NULLs
/// first (the order the driver sorts the workers' rows in).
struct RowOrder(Vec<DynComparator>);

impl RowOrder {
    fn new(batch: &RecordBatch) -> Result<RowOrder> {
        let opts = SortOptions {
            descending: false,
            nulls_first: true,
        };
        let cmps = batch
            .columns()
            .iter()
            .filter(|c| orderable(c.data_type()))
            .map(|c| make_comparator(c.as_ref(), c.as_ref(), opts))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::datafusion("ordering the rows", e.into()))?;
        Ok(RowOrder(cmps))
    }

    fn cmp(&self, a: usize, b: usize) -> Ordering {
        self.0
            .iter()
            .map(|c| c(a, b))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    }
}

/// Of `rows` (of one partition), the least row of each key (`key_of`) by `order`: the
/// copy a deduplication judges, whatever order the shuffle brought them in.
fn least_of_each_key<'k>(
    rows: &[u32],
    key_of: impl Fn(usize) -> &'k [u8],
    order: &RowOrder,
) -> Vec<u32> {
    let mut least: HashMap<&[u8], u32> = HashMap::with_capacity(rows.len());
    for &row in rows {
        least
            .entry(key_of(row as usize))
            .and_modify(|l| {
                if order.cmp(row as usize, *l as usize).is_lt() {
                    *l = row;
                }
            })
            .or_insert(row);
    }
    let mut out: Vec<u32> = least.into_values().collect();
    out.sort_unstable();
    out
}

/// One task's work: `all` is its rows and markers, tagged.
async fn run(spec: &DedupeSpec, all: RecordBatch) -> Result<(RecordBatch, Meta)> {
    let failed = |e: datafusion::arrow::error::ArrowError| {
        Error::datafusion("the deduplication's rows", e.into())
    };
    let data_cols = all.num_columns() - 2;
    let tags: &UInt32Array = typed(all.column(data_cols), "the partition tag")?;
    let owned: BTreeSet<u32> = tags.values().iter().copied().collect();
    let marks: &BooleanArray = typed(all.column(data_cols + 1), "the marker column")?;
    let is_data = datafusion::arrow::compute::not(marks).map_err(failed)?;
    let rows = filter_record_batch(&all, &is_data).map_err(failed)?;
    let rows = rows
        .project(&(0..data_cols).collect::<Vec<_>>())
        .map_err(failed)?;
    let order = RowOrder::new(&rows)?;

    let mut meta = Meta::default();
    if let Some(i) = spec.observe {
        meta.event.observe(std::slice::from_ref(&rows), i)?;
    }
    let rules = spec.rules();
    let conf = StateConf::new(spec.snapshot_every, spec.retain)?;
    let storage = StorageOptions::new(spec.storage.clone())?;
    let dir = Location::parse("checkpoint", &spec.dir, None, &storage)?;
    let enc = encode_keys(&rows, &rules, spec.partitions, &mut meta.dropped_late)?;
    forget_older(&spec.query, dir.url().as_str(), spec.batch_id);
    let mut mask = vec![false; rows.num_rows()];
    let mut update_ms = 0;
    for p in owned {
        let (url, mut store) = load_partition(&spec.query, &dir, p, spec.batch_id, conf).await?;
        let t = Instant::now();
        let rows_of = enc.by_part.get(p as usize).map_or(&[][..], Vec::as_slice);
        let judged = least_of_each_key(rows_of, |r| enc.keys.key(r), &order);
        for row in pass_new(
            &mut store,
            &judged,
            |r| enc.keys.key(r),
            |r| rules.kept_value(enc.time_of(r)),
        ) {
            mask[row as usize] = true;
            meta.updated += 1;
        }
        update_ms += t.elapsed().as_millis() as u64;
        if let Some(e) = rules.evicts() {
            let t = Instant::now();
            meta.removed += evict_passed(&mut store, e);
            meta.remove_ms += t.elapsed().as_millis() as u64;
        }
        let t = Instant::now();
        store.commit().await?;
        meta.commit_ms += t.elapsed().as_millis() as u64;
        meta.rows_total += store.len() as u64;
        meta.memory_bytes += store.memory_bytes() as u64;
        meta.partitions.push(p);
        keep(url, store);
    }
    meta.update_ms = update_ms;
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
    let passed = filter_record_batch(&rows, &BooleanArray::from(mask)).map_err(failed)?;
    Ok((passed, meta))
}
