//! Stateful operators between the transforms and the function: event-time watermarks,
//! streaming deduplication and streaming aggregation.
//!
//! Each operator keeps its state in its own [`PartitionedStore`]
//! (`state/<operator>/<partition>`: `state-partitions` partitions by key hash, each
//! partition's keys looked up on a core of its own): batch N loads version N (the store
//! holds it in memory between batches), and version N+1 is committed after the function
//! returned `Ok` and before `commits/N`. A replay of N loads version N again, so it gives
//! the same output as its first attempt.
//!
//! - `drop_duplicates(keys)` passes a row only if no row with the same key values came
//!   before it, in this batch or any earlier one (Spark's `dropDuplicates`). Without a
//!   watermark its state grows with the number of distinct keys; with one, late rows (at
//!   or below the previous batch's watermark) are dropped, and if the event-time column is one of the keys a key is
//!   evicted once the watermark passes its event time.
//! - `drop_duplicates_within_watermark(keys)` (Spark 3.5's `dropDuplicatesWithinWatermark`)
//!   keeps a key until the watermark passes its first row's event time plus the delay: a
//!   copy closer than the delay to the first is dropped, state stays bounded.
//! - aggregation: see [`aggregate`].
//!
//! Keys and values are written in an encoding of weir's own ([`keys`]); what each operator
//! was written with is recorded under `state/<operator>/_metadata`, and a query that
//! differs from it is refused.

mod aggregate;
mod dedupe;
mod keys;
pub(crate) mod on_workers;
mod watermark;

pub(crate) use dedupe::{Dedupe, DedupeMode};

pub use aggregate::{Aggregation, OutputMode};
pub(crate) use watermark::{
    EventTime, EventTimeStats, KEY as WATERMARK_KEY, check_type as check_watermark_type, iso,
    observe as observe_event_times,
};

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::prelude::{DataFrame, SessionContext};

use crate::error::{Error, Result};
use crate::state::partitioned::check_partitions;
use crate::state::{OperatorMetadata, PartitionedStore, StateConf, write_line_once};

use crate::storage::Location;

use keys::family;

/// Rows of a record batch (or keys in the state, for evictions) from which a deduplication
/// works on several threads, one per group of partitions; fewer are not worth the threads.
const PARALLEL_ROWS: usize = 16 * 1024;

/// A stateful operator of a query.
pub(crate) enum Operator {
    Dedupe(Box<Dedupe>),
    Aggregate(Box<aggregate::Aggregate>),
}

impl Operator {
    /// The `index`-th stateful operator of a query: a deduplication on `keys`.
    pub(crate) fn dedupe(
        index: u32,
        keys: Vec<String>,
        mode: DedupeMode,
        state_root: &Location,
        settings: StateSettings,
    ) -> Operator {
        let op = OperatorState::new(index, state_root, settings);
        Operator::Dedupe(Box::new(Dedupe::new(op, keys, mode)))
    }

    /// The `index`-th stateful operator of a query: an aggregation.
    pub(crate) fn aggregate(
        index: u32,
        aggregation: Aggregation,
        state_root: &Location,
        settings: StateSettings,
    ) -> Result<Operator> {
        let op = OperatorState::new(index, state_root, settings);
        Ok(Operator::Aggregate(Box::new(aggregate::Aggregate::new(
            op,
            aggregation,
        )?)))
    }

    /// The operator's output for batch `batch_id`'s rows `df`.
    pub(crate) async fn apply(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        batch_id: u64,
        event: Option<&EventTime>,
    ) -> Result<DataFrame> {
        match self {
            Operator::Dedupe(d) => d.apply(ctx, df, batch_id, event).await,
            Operator::Aggregate(a) => a.apply(ctx, df, batch_id, event).await,
        }
    }

    /// Batch `batch_id`'s rows `df` of query `query` with the operator on top, to run on the
    /// workers (see [`on_workers`]), and the schema of the rows it gives; `observe`: the
    /// watermark's column when its step comes right before.
    pub(crate) async fn plan_on_workers(
        &mut self,
        ctx: &SessionContext,
        df: DataFrame,
        (query, batch_id): (uuid::Uuid, u64),
        event: Option<&EventTime>,
        observe: Option<&str>,
    ) -> Result<(DataFrame, SchemaRef)> {
        match self {
            Operator::Dedupe(d) => {
                on_workers::plan_dedupe(d, df, (query, batch_id), event, observe).await
            }
            Operator::Aggregate(a) => {
                let schema = Arc::new(df.schema().as_arrow().clone());
                let observe = match observe {
                    Some(column) => Some(watermark::column_index(&schema, column)?),
                    None => None,
                };
                let (sketch, out) = a.prepare_for_workers(ctx, schema, batch_id, event).await?;
                a.on_workers = None;
                let spec = on_workers::AggSpec::new(
                    query,
                    a.op.operator,
                    &a.op.state_root,
                    a.op.store.partitions(),
                    a.op.settings.conf,
                    batch_id,
                    a.spec().clone(),
                    event.cloned(),
                    sketch,
                    observe,
                );
                let plan = on_workers::plan(df, on_workers::StateSpec::Aggregate(spec), &out)?;
                Ok((plan, out))
            }
        }
    }

    /// The rows the workers gave (of `schema`, from [`Self::plan_on_workers`]) out of its
    /// plan's output `out`, and the event times they saw.
    pub(crate) fn ran_on_workers(
        &mut self,
        out: Vec<RecordBatch>,
        schema: &SchemaRef,
    ) -> Result<(Vec<RecordBatch>, EventTimeStats)> {
        let (op, metrics, ran) = match self {
            Operator::Dedupe(d) => (&d.op, &mut d.metrics, &mut d.on_workers),
            Operator::Aggregate(a) => (&a.op, &mut a.metrics, &mut a.on_workers),
        };
        let (rows, done, event) = on_workers::split(out, schema, op.store.partitions(), metrics)?;
        *ran = Some(done);
        Ok((rows, event))
    }

    /// Commits the batch's updates as the next version; its progress entry (Spark's fields).
    pub(crate) async fn commit(&mut self) -> Result<serde_json::Value> {
        let (state, m, on_workers) = match self {
            Operator::Dedupe(d) => (&d.op, &d.metrics, &mut d.on_workers),
            Operator::Aggregate(a) => (&a.op, &a.metrics, &mut a.on_workers),
        };
        if let Some(ran) = on_workers.take() {
            // The workers committed each partition as they ran it.
            let parts = state.store.partitions();
            return Ok(progress_entry(
                m,
                ran.rows_total,
                ran.memory_bytes,
                ran.commit_ms,
                parts,
            ));
        }
        let (state, m) = match self {
            Operator::Dedupe(d) => (&mut d.op, d.metrics.clone()),
            Operator::Aggregate(a) => (&mut a.op, a.metrics.clone()),
        };
        let started = Instant::now();
        state.store.commit().await?;
        let commit_ms = started.elapsed().as_millis() as u64;
        let total = state.store.len() as u64;
        let memory = state.store.memory_bytes() as u64;
        Ok(progress_entry(
            &m,
            total,
            memory,
            commit_ms,
            state.store.partitions(),
        ))
    }

    /// Whether the operator evicts (or closes) by the watermark, so that a batch without
    /// data is worth running when it moves (Spark: not for complete mode).
    pub(crate) fn evicts(&self) -> bool {
        match self {
            Operator::Dedupe(_) => true,
            Operator::Aggregate(a) => a.evicts(),
        }
    }

    /// Lets retention delete the files no kept version needs (after `commits/N`).
    pub(crate) async fn purge(&mut self) -> Result<()> {
        match self {
            Operator::Dedupe(d) => d.op.store.purge().await,
            Operator::Aggregate(a) => a.op.store.purge().await,
        }
    }
}

/// An operator's progress entry (Spark's fields): what it did (`m`), the keys and memory
/// its state holds after the commit, and the commit's time.
fn progress_entry(
    m: &OperatorMetrics,
    total: u64,
    memory: u64,
    commit_ms: u64,
    partitions: u32,
) -> serde_json::Value {
    serde_json::json!({
        "operatorName": m.name,
        "numRowsTotal": total,
        "numRowsUpdated": m.updated,
        "allUpdatesTimeMs": m.update_ms,
        "numRowsRemoved": m.removed,
        "allRemovalsTimeMs": m.remove_ms,
        "commitTimeMs": commit_ms,
        "memoryUsedBytes": memory,
        "numRowsDroppedByWatermark": m.dropped_late,
        "numShufflePartitions": partitions,
        "numStateStoreInstances": partitions,
        "customMetrics": {}
    })
}

/// Refuses operator `operator` named `name` where the checkpoint's state (its metadata,
/// `found`) was written by another operator (one added before it, or a different one in
/// its place), without writing anything.
fn check_operator_name(
    found: Option<&OperatorMetadata>,
    state_root: &Location,
    operator: u32,
    name: &str,
) -> Result<()> {
    match found {
        Some(found) if found.operator_info.operator_name != name => Err(Error::Config {
            key: "state".into(),
            reason: format!(
                "the checkpoint's state for stateful operator {operator} was written by {} \
                 ({}); this query has {name} there: stateful operators cannot be added, \
                 removed or reordered on the same checkpoint; start the query on a new \
                 checkpoint",
                found.operator_info.operator_name,
                state_root.describe(&format!("{operator}/_metadata/metadata"))
            ),
        }),
        _ => Ok(()),
    }
}

impl Operator {
    /// Checks, before the query starts, that the checkpoint's state for this operator's
    /// place was written by the same kind of operator, in the number of partitions the
    /// query asks for, and makes the operator's store with the number the state has.
    pub(crate) async fn check_place(&mut self, index: u32, state_root: &Location) -> Result<()> {
        let (name, op) = match self {
            Operator::Dedupe(d) => (d.mode.name(), &mut d.op),
            Operator::Aggregate(a) => (aggregate::OPERATOR_NAME, &mut a.op),
        };
        let found = OperatorMetadata::read(state_root, index).await?;
        check_operator_name(found.as_ref(), state_root, index, name)?;
        let partitions = op.resolve_partitions(found.as_ref()).await?;
        op.store = PartitionedStore::new(
            &state_root.join(&index.to_string()),
            partitions,
            op.settings.conf,
        );
        Ok(())
    }
}

/// Refuses a query with `count` stateful operators on a checkpoint whose state has more:
/// its rows would be missing from the state (Spark refuses this too).
pub(crate) async fn check_no_operator_removed(state_root: &Location, count: usize) -> Result<()> {
    let meta = state_root.join(&format!("{count}/_metadata"));
    if meta.get("metadata").await?.is_some() {
        return Err(Error::Config {
            key: "state".into(),
            reason: format!(
                "the checkpoint holds state of stateful operator {count} ({}), which this \
                 query does not have: a stateful operator cannot be removed from a query that \
                 ran with it; start the query on a new checkpoint",
                meta.describe("metadata")
            ),
        });
    }
    Ok(())
}

/// How an operator's state is kept: its files' settings and the number of partitions
/// asked for (`state-partitions`; `None`: what the checkpoint recorded, or
/// [`DEFAULT_STATE_PARTITIONS`] for new state).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateSettings {
    pub(crate) conf: StateConf,
    pub(crate) partitions: Option<u32>,
}

/// The number of state partitions of an operator whose state is new and whose query does
/// not set `state-partitions`.
pub const DEFAULT_STATE_PARTITIONS: u32 = 8;

/// The setting the number of state partitions is given by, for errors.
const PARTITIONS_KEY: &str = "query.state-partitions";

/// The error for a query asking for `asked` state partitions where operator `operator`'s
/// state (under `state_root`) was written in `found`.
fn changed_partitions(operator: u32, found: u32, asked: u32, state_root: &Location) -> Error {
    Error::config(
        PARTITIONS_KEY,
        format!(
            "the state of stateful operator {operator} was written in {found} partition(s) \
             ({}), and this query asks for {asked}: the number of state partitions is fixed \
             when the state is first written (as Spark fixes spark.sql.shuffle.partitions); \
             set state-partitions = {found} or leave it out, or start the query on a new \
             checkpoint",
            state_root.describe(&format!("{operator}/_metadata/metadata")),
        ),
    )
}

/// Refuses `state-partitions = asked` on a checkpoint whose state (under `state_root`)
/// was written in another number of partitions, reading only the operators' metadata
/// (`weir check --connect`).
pub async fn check_state_partitions(state_root: &Location, asked: u32) -> Result<()> {
    let mut operator = 0;
    while let Some(m) = OperatorMetadata::read(state_root, operator).await? {
        if let Some(found) = m.state_store_info.first().map(|s| s.num_partitions)
            && found != asked
        {
            return Err(changed_partitions(operator, found, asked, state_root));
        }
        operator += 1;
    }
    Ok(())
}

/// What every operator has: its place in the checkpoint and its store.
pub(crate) struct OperatorState {
    operator: u32,
    state_root: Location,
    settings: StateSettings,
    store: PartitionedStore,
    /// Whether the metadata was checked by this process (and the store made with the
    /// number of partitions the state has).
    checked: bool,
    /// Whether the partitions' versions were checked by this process for a run on the
    /// workers (which load them there).
    versions_checked: bool,
}

impl OperatorState {
    /// The state of the `index`-th operator (`state/<index>/<partition>`), not loaded yet.
    fn new(index: u32, state_root: &Location, settings: StateSettings) -> Self {
        let dir = state_root.join(&index.to_string());
        OperatorState {
            operator: index,
            state_root: state_root.clone(),
            settings,
            // Made again by `Operator::check_place` with the partitions the state has.
            store: PartitionedStore::new(&dir, 1, settings.conf),
            checked: false,
            versions_checked: false,
        }
    }

    /// The store's folder, for errors.
    fn store_path(&self) -> String {
        self.state_root.describe(&self.operator.to_string())
    }

    /// The number of partitions the state has: what its metadata (`found`) recorded, else
    /// the setting, else the default; a setting that differs from what was recorded is
    /// refused.
    async fn resolve_partitions(&self, found: Option<&OperatorMetadata>) -> Result<u32> {
        let found = found.and_then(|m| m.state_store_info.first().map(|s| s.num_partitions));
        match (found, self.settings.partitions) {
            (Some(f), Some(asked)) if f != asked => Err(changed_partitions(
                self.operator,
                f,
                asked,
                &self.state_root,
            )),
            (Some(f), _) => check_partitions(PARTITIONS_KEY, f),
            (None, asked) => {
                // No metadata while partition 0 has files: the metadata was lost, and the
                // number of partitions with it.
                let first = self.state_root.join(&format!("{}/0", self.operator));
                if !first.list_names().await?.is_empty() {
                    return Err(Error::CorruptState {
                        path: self
                            .state_root
                            .describe(&format!("{}/_metadata/metadata", self.operator)),
                        reason: format!(
                            "it is missing, and the operator's state files are there ({first}): \
                             the checkpoint lost a file; restore it, or start the query on a \
                             new checkpoint"
                        ),
                    });
                }
                match asked {
                    Some(asked) => check_partitions(PARTITIONS_KEY, asked),
                    None => Ok(DEFAULT_STATE_PARTITIONS),
                }
            }
        }
    }

    /// Checks (once per process) and records what the state is written with: Spark's
    /// operator metadata, and what `description` gives as `_metadata/<file>`; then loads
    /// version `batch_id` (unless not `load`: the workers load it, and its partitions'
    /// versions are checked here once). `key` is the setting errors name.
    async fn prepare(
        &mut self,
        batch_id: u64,
        name: &str,
        file: &str,
        description: impl FnOnce() -> String,
        key: &str,
        load: bool,
    ) -> Result<()> {
        if !self.checked {
            self.check_metadata(batch_id, name, file, description(), key)
                .await?;
            self.checked = true;
        }
        let check = match load {
            true => self.store.version().is_none(),
            false => !std::mem::replace(&mut self.versions_checked, true),
        };
        if check {
            let versions = self.store.newest_versions().await?;
            let newest = versions.iter().copied().min().unwrap_or(0);
            let highest = versions.iter().copied().max().unwrap_or(0);
            if newest < batch_id && highest >= batch_id {
                // Other partitions hold the version this one lacks: its files are gone.
                let p = versions.iter().position(|v| *v == newest).unwrap_or(0);
                return Err(Error::CorruptState {
                    path: self.state_root.describe(&format!("{}/{p}", self.operator)),
                    reason: format!(
                        "state partition {p} of stateful operator {} holds versions up to \
                         {newest} and other partitions up to {highest}: batch {batch_id} \
                         needs version {batch_id} of every partition, so files of this one \
                         are missing; restore them, or start the query on a new checkpoint",
                        self.operator
                    ),
                });
            }
            if newest < batch_id {
                return Err(Error::config(
                    key,
                    format!(
                        "the state of stateful operator {} stops at version {newest} (after \
                         batch {}), and this is batch {batch_id}: the query ran batches \
                         without the operator, whose rows are not in the state (or the state's \
                         files were deleted); a stateful operator cannot be removed and added \
                         back on the same checkpoint, start the query on a new checkpoint",
                        self.operator,
                        newest.saturating_sub(1),
                    ),
                ));
            }
        }
        match load {
            true => self.store.load(batch_id).await,
            false => Ok(()),
        }
    }

    async fn check_metadata(
        &self,
        batch_id: u64,
        name: &str,
        file: &str,
        description: String,
        key: &str,
    ) -> Result<()> {
        let meta_dir = self
            .state_root
            .join(&format!("{}/_metadata", self.operator));
        if batch_id > 0 && meta_dir.get(file).await?.is_none() {
            return Err(Error::config(
                key,
                format!(
                    "the checkpoint is at batch {batch_id} and holds no state for stateful \
                     operator {} ({} is missing): a stateful operator cannot be added to a \
                     query that already ran; start it on a new checkpoint",
                    self.operator,
                    meta_dir.describe(file)
                ),
            ));
        }
        OperatorMetadata::new(self.operator, name, self.store.partitions())
            .ensure(&self.state_root)
            .await?;
        if let Some(found) = write_line_once(&meta_dir, file, description.clone()).await?
            && found != description
        {
            return Err(Error::config(
                key,
                format!(
                    "the state was written with {found} ({}); this query has {description}: \
                     a stateful operator's columns cannot change on the same checkpoint",
                    meta_dir.describe(file)
                ),
            ));
        }
        Ok(())
    }
}

/// What the workers did for one batch of an operator, over its tasks (its partitions are
/// committed already).
#[derive(Debug, Clone, Default)]
pub(crate) struct Ran {
    pub(super) rows_total: u64,
    pub(super) memory_bytes: u64,
    pub(super) commit_ms: u64,
}

/// What an operator did in the current batch, for its progress entry.
#[derive(Debug, Clone, Default)]
pub(crate) struct OperatorMetrics {
    name: &'static str,
    updated: u64,
    removed: u64,
    dropped_late: u64,
    update_ms: u64,
    remove_ms: u64,
}

impl OperatorMetrics {
    fn new(name: &'static str) -> Self {
        OperatorMetrics {
            name,
            ..Default::default()
        }
    }
}

/// The batch's rows, partition by partition in order: the batch holds its files in the
/// order the source took them, so the first row of a key is the same on every attempt.
async fn collect_in_order(df: DataFrame, batch_id: u64, key: &str) -> Result<Vec<RecordBatch>> {
    Ok(collect_partitions(df, &format!("batch {batch_id}: {key}"))
        .await?
        .into_iter()
        .flatten()
        .collect())
}

/// The rows of `df`, by partition; errors say they came from `what`.
async fn collect_partitions(df: DataFrame, what: &str) -> Result<Vec<Vec<RecordBatch>>> {
    df.collect_partitioned()
        .await
        .map_err(|e| Error::datafusion(what, e))
}

/// Rows held in memory as a DataFrame (a step's output); errors name the setting `key`.
fn frame(
    ctx: &SessionContext,
    schema: SchemaRef,
    parts: Vec<Vec<RecordBatch>>,
    key: &str,
) -> Result<DataFrame> {
    let table = MemTable::try_new(schema, parts).map_err(|e| Error::datafusion(key, e))?;
    ctx.read_table(Arc::new(table))
        .map_err(|e| Error::datafusion(key, e))
}

/// Key columns as their state records them: `[{"name": .., "type": <family>}, ..]`.
fn columns_json(names: &[String], families: &[String]) -> Vec<serde_json::Value> {
    names
        .iter()
        .zip(families)
        .map(|(k, f)| serde_json::json!({"name": k, "type": f}))
        .collect()
}

/// The [`family`] of each of `columns`; an error naming a column that cannot be a key.
fn key_families(schema: &Schema, columns: &[usize], key: &str) -> Result<Vec<String>> {
    columns
        .iter()
        .map(|i| {
            let f = schema.field(*i);
            family(f.data_type()).ok_or_else(|| {
                Error::config(
                    key,
                    format!(
                        "column `{}` has type {}, which cannot be a key of a stateful operator",
                        f.name(),
                        f.data_type()
                    ),
                )
            })
        })
        .collect()
}

/// The indexes of `keys` in `schema`; an error naming the first key it lacks.
pub(crate) fn key_columns(schema: &Schema, keys: &[String], key: &str) -> Result<Vec<usize>> {
    if keys.is_empty() {
        return Err(Error::config(key, "no key column given"));
    }
    keys.iter()
        .map(|k| {
            schema.index_of(k).map_err(|_| {
                let columns: Vec<&str> =
                    schema.fields().iter().map(|f| f.name().as_str()).collect();
                Error::config(
                    key,
                    format!("no column `{k}`; the columns are {}", columns.join(", ")),
                )
            })
        })
        .collect()
}
