//! The upsert on a cluster: the seed's staging pattern, with the staging done by the tasks.
//!
//! ```text
//! driver:  DELETE FROM <staging> WHERE app = $1 AND batch <= $2      -- earlier attempts'
//! tasks:   COPY <staging> (..., weir_app_id, weir_batch_id, weir_task) FROM STDIN
//!          -- each task its share, NULL rules applied, tagged with a new id of its own;
//!          -- outputs its tag, rows and NULL counts
//! driver:  the NULL rules' verdict over every task's counts, then
//!          BEGIN;
//!          SELECT count(*) FROM <staging> WHERE app = $1 AND batch = $2
//!            AND weir_task = ANY($3);             -- exactly the rows the tasks reported
//!          INSERT INTO weir_stage SELECT DISTINCT ON (<keys>) ... WHERE .. weir_task = ANY($3)
//!            ORDER BY <keys>, <newest>;
//!          INSERT INTO <ledger> ...;             -- the claim; a landed batch stops here
//!          INSERT INTO <target> ... FROM weir_stage ON CONFLICT ... WHERE <newer>;
//!          DELETE FROM <staging> WHERE app = $1 AND batch <= $2;
//!          COMMIT;
//! ```
//!
//! The batch's rows never pass through the driver: the in-batch dedupe runs in the server,
//! in the same total order as one process's (`weir_core::sink::upsert`, text in byte
//! order). Each task's COPY lands whole or not at all. Only the rows of the attempt that
//! succeeded are read, by their tasks' tags: rows a failed attempt staged, or a task cut
//! off from the driver that finished late, are never counted nor upserted (the commit's
//! `DELETE` of the batch, or a later batch's, removes them). The count check then catches
//! workers that reached another server than the driver (`host=localhost` on other
//! machines): the batch fails before anything is upserted.
//!
//! The staging table is weir's: its columns must be the batch's (checked when the sink
//! first writes; a table of another shape is made again), and a batch may not have columns
//! of its names.

use std::fmt;
use std::sync::Arc;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_postgres::Client;
use tokio_postgres::types::Type;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::common::{DataFusionError, Result as DfResult};
use weir_core::datafusion::execution::{SendableRecordBatchStream, TaskContext};
use weir_core::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use weir_core::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties,
};
use weir_core::datafusion::prelude::DataFrame;
use weir_core::sink::upsert::{NullCount, NullScreen};
use weir_core::sink::{
    PlanRunner, WorkerWrite, WriteKind, WritePlan, on_workers, read_body, task_data_error,
    task_error, write_body, write_properties, written_batch, written_rows, written_schema,
};
use weir_core::{BatchContext, SinkMetric, fault};

use super::rows::{CopyFailure, CopyWriter, copy_column};
use super::{Open, PostgresUpsert};
use crate::error::PostgresSinkError;
use crate::ledger::{Claim, claim};
use crate::types::{Cell, pg_type, prepare_columns};
use crate::{
    POINT_AFTER_COMMIT, POINT_AFTER_STAGING, POINT_BEFORE_BEGIN, POINT_BEFORE_COMMIT, quote_ident,
    quote_list,
};

/// What the tasks of one batch's staging need: plain data, sent with the plan.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StagingWrite {
    /// The server, as the sink was given it (never shown: it may hold a password).
    pub url: String,
    /// The target table, for errors.
    pub table: String,
    pub staging: String,
    pub app_id: String,
    pub batch_id: u64,
    pub keys: Vec<String>,
    pub ordering: String,
}

impl fmt::Debug for StagingWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingWrite")
            .field("table", &self.table)
            .field("staging", &self.staging)
            .field("app_id", &self.app_id)
            .field("batch_id", &self.batch_id)
            .finish_non_exhaustive()
    }
}

/// What one partition of a task staged: a row of the write's output.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct TaskStaged {
    /// The `weir_task` of its rows.
    pub tag: String,
    pub rows: u64,
    pub nulls: NullCount,
}

/// The staging table's own columns, after the batch's.
pub(crate) const STAGING_COLUMNS: [&str; 3] = ["weir_app_id", "weir_batch_id", "weir_task"];

/// COPYs its input's rows into the staging table, partition by partition, and outputs
/// what it staged (see the module docs).
#[derive(Debug)]
pub struct PgStagingExec {
    input: Arc<dyn ExecutionPlan>,
    write: StagingWrite,
    props: Arc<PlanProperties>,
}

impl PgStagingExec {
    pub fn new(input: Arc<dyn ExecutionPlan>, write: StagingWrite) -> Self {
        let props = write_properties(&input);
        PgStagingExec {
            input,
            write,
            props,
        }
    }

    /// What the node writes.
    pub fn write(&self) -> &StagingWrite {
        &self.write
    }
}

impl DisplayAs for PgStagingExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "PgStagingExec: staging={}, batch={}",
            self.write.staging, self.write.batch_id
        )
    }
}

impl ExecutionPlan for PgStagingExec {
    fn name(&self) -> &str {
        "PgStagingExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(
            &Arc<dyn weir_core::datafusion::physical_expr::PhysicalExpr>,
        )
            -> DfResult<weir_core::datafusion::common::tree_node::TreeNodeRecursion>,
    ) -> DfResult<weir_core::datafusion::common::tree_node::TreeNodeRecursion> {
        Ok(weir_core::datafusion::common::tree_node::TreeNodeRecursion::Continue)
    }

    /// More partitions would only mean more connections.
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [input] = <[_; 1]>::try_from(children)
            .map_err(|_| DataFusionError::Internal("PgStagingExec takes one input".into()))?;
        Ok(Arc::new(PgStagingExec::new(input, self.write.clone())))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let write = self.write.clone();
        let schema = self.input.schema();
        let out = async move {
            let staged = stage(input, &write, &schema).await.map_err(|e| {
                if e.is_data_error() {
                    task_data_error(e)
                } else {
                    task_error(e)
                }
            })?;
            let text = serde_json::to_string(&staged).map_err(task_error)?;
            written_batch(vec![text])
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            written_schema(),
            futures::stream::once(out),
        )))
    }
}

/// One partition's rows, NULL rules applied, COPYed into the staging table on a connection
/// of its own (opened at its first row).
async fn stage(
    mut input: SendableRecordBatchStream,
    write: &StagingWrite,
    schema: &SchemaRef,
) -> Result<TaskStaged, PostgresSinkError> {
    let id = write.batch_id;
    let db = |action: &'static str| {
        move |source| PostgresSinkError::Db {
            table: write.table.clone(),
            batch_id: id,
            action,
            source,
        }
    };
    let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    let types = schema
        .fields()
        .iter()
        .map(|f| {
            pg_type(f.data_type()).map(|(t, _)| t).ok_or_else(|| {
                PostgresSinkError::UnsupportedType {
                    table: write.table.clone(),
                    column: f.name().clone(),
                    data_type: f.data_type().to_string(),
                }
            })
        })
        .collect::<Result<Vec<Type>, _>>()?;
    let screen = NullScreen::new(&names, &write.keys, &write.ordering);
    let mut out = TaskStaged {
        tag: uuid::Uuid::new_v4().simple().to_string(),
        ..TaskStaged::default()
    };
    let mut copy: Option<(Client, CopyWriter)> = None;
    let computing = |source| PostgresSinkError::DataFusion {
        table: write.table.clone(),
        batch_id: id,
        action: "computing the batch",
        source,
    };
    while let Some(b) = input.next().await {
        let b = screen
            .apply(b.map_err(computing)?, &mut out.nulls)
            .map_err(|e| computing(e.into()))?;
        if b.num_rows() == 0 {
            continue;
        }
        let rows = prepare_columns(b.columns(), &names).map_err(|(column, reason)| {
            PostgresSinkError::BadValue {
                table: write.table.clone(),
                batch_id: id,
                column,
                reason,
            }
        })?;
        let (_, writer) = match &mut copy {
            Some(c) => c,
            None => copy.insert(open_copy(write, &names, &types).await?),
        };
        let extra = [
            Cell::Text(&write.app_id),
            Cell::I64(id as i64),
            Cell::Text(&out.tag),
        ];
        writer.put(&rows, &extra).await.map_err(|e| match e {
            CopyFailure::Value(i, reason) => PostgresSinkError::BadValue {
                table: write.table.clone(),
                batch_id: id,
                column: copy_column(&names, i),
                reason,
            },
            CopyFailure::Db(e) => db("COPY into the staging table")(e),
        })?;
        out.rows += b.num_rows() as u64;
    }
    if let Some((_client, writer)) = copy {
        writer
            .finish()
            .await
            .map_err(db("COPY into the staging table"))?;
    }
    Ok(out)
}

/// A connection of the task's and its COPY into the staging table, begun.
async fn open_copy(
    write: &StagingWrite,
    names: &[String],
    types: &[Type],
) -> Result<(Client, CopyWriter), PostgresSinkError> {
    let db = |action: &'static str| {
        move |source| PostgresSinkError::Db {
            table: write.table.clone(),
            batch_id: write.batch_id,
            action,
            source,
        }
    };
    let client = crate::ledger::connect(&write.url)
        .await
        .map_err(db("connecting (from a task on a worker)"))?;
    let sql = format!(
        "COPY {} ({}, {}) FROM STDIN (FORMAT binary)",
        quote_ident(&write.staging),
        quote_list(names),
        STAGING_COLUMNS.join(", ")
    );
    let sink = client
        .copy_in(&sql)
        .await
        .map_err(db("COPY into the staging table"))?;
    let mut types = types.to_vec();
    types.extend([Type::TEXT, Type::INT8, Type::TEXT]);
    let writer = CopyWriter::new(sink, types);
    Ok((client, writer))
}

impl WorkerWrite for PgStagingExec {
    fn kind(&self) -> &'static str {
        PG_STAGING.kind
    }

    fn encode(&self) -> DfResult<(SchemaRef, String)> {
        let body = write_body(self.kind(), &self.write)?;
        Ok((written_schema(), body))
    }
}

/// The write's name on the wire.
const KIND: &str = "weir.PgStaging.v1";

/// The PostgreSQL upsert's staging on the wire.
pub const PG_STAGING: WriteKind = WriteKind {
    kind: KIND,
    find: |node| {
        node.downcast_ref::<PgStagingExec>()
            .map(|w| w as &dyn WorkerWrite)
    },
    decode: |input, _schema, body| {
        let write: StagingWrite = read_body(KIND, body)?;
        Ok(Arc::new(PgStagingExec::new(input, write)))
    },
};

/// How the sink puts its staging on a batch's plan.
#[derive(Debug)]
struct StagingPlan(StagingWrite);

impl WritePlan for StagingPlan {
    fn describe(&self) -> String {
        format!(
            "PostgreSQL staging of batch {} in {}",
            self.0.batch_id, self.0.staging
        )
    }

    fn plan(&self, input: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(PgStagingExec::new(input, self.0.clone())))
    }
}

impl PostgresUpsert {
    /// The staging table: the one set, or `<table>_weir_staging` beside the table.
    pub(super) fn staging_name(&self) -> String {
        self.staging
            .clone()
            .unwrap_or_else(|| format!("{}_weir_staging", self.table))
    }

    /// The batch staged by the tasks, then upserted from the staging table by this
    /// process's transaction (see the module docs).
    pub(super) async fn upsert_on_workers(
        &self,
        batch: DataFrame,
        ctx: &BatchContext,
        run: &dyn PlanRunner,
    ) -> Result<(), PostgresSinkError> {
        let id = ctx.batch_id;
        self.check_keys()?;
        let cols = self.columns(batch.schema().inner())?;
        let app_id = self.ledger_key(&ctx.query());
        let staging = self.staging_name();
        let st = quote_ident(&staging);
        self.check_staging_names(&cols)?;
        let mine = "WHERE weir_app_id = $1 AND weir_batch_id = $2 AND weir_task = ANY($3)";
        let up_to = "WHERE weir_app_id = $1 AND weir_batch_id <= $2";
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&app_id, &(id as i64)];
        {
            let mut guard = self
                .conn
                .get(&self.ledger)
                .await
                .map_err(self.db(id, "connecting"))?;
            let client = guard
                .as_mut()
                .ok_or_else(|| PostgresSinkError::no_connection(&self.table))?;
            self.make_tables(client, &cols, Some(&staging), id).await?;
            // An earlier attempt's rows (a driver that died), and any a task of an older
            // batch's failed attempt staged after that batch landed.
            client
                .execute(&format!("DELETE FROM {st} {up_to}"), &params)
                .await
                .map_err(self.db(id, "clearing the batch's staging rows"))?;
        }
        let write = StagingWrite {
            url: self.conn.url().to_string(),
            table: self.table.clone(),
            staging: staging.clone(),
            app_id: app_id.clone(),
            batch_id: id,
            keys: self.keys.clone(),
            ordering: self.ordering.clone(),
        };
        let out = run
            .run(on_workers(batch, Arc::new(StagingPlan(write))))
            .await
            .map_err(self.engine(id))?;
        let mut staged = 0u64;
        let mut tags: Vec<String> = Vec::new();
        let mut nulls = NullCount::default();
        for text in written_rows(&out).map_err(self.engine(id))? {
            let task: TaskStaged =
                serde_json::from_str(&text).map_err(|e| PostgresSinkError::Config {
                    table: self.table.clone(),
                    key: "cluster",
                    reason: format!("a task's report cannot be read ({e}): {text}"),
                })?;
            staged += task.rows;
            if task.rows > 0 {
                tags.push(task.tag);
            }
            nulls.add(&task.nulls);
        }
        let sink = self.label();
        let dropped = nulls
            .verdict(
                self.null_keys,
                self.null_ordering,
                &self.ordering,
                &sink,
                id,
            )
            .map_err(self.engine(id))?;
        if dropped > 0 {
            ctx.metrics.record(&sink, SinkMetric::Dropped, dropped);
        }
        fault::hit(POINT_AFTER_STAGING, id).map_err(self.engine(id))?;
        fault::hit(POINT_BEFORE_BEGIN, id).map_err(self.engine(id))?;
        let guard = self
            .conn
            .get(&self.ledger)
            .await
            .map_err(self.db(id, "connecting"))?;
        let mut open = Open {
            attempt: (ctx.run_id.as_u128(), id),
            guard: Some(guard),
            rows: 0,
            new: true,
        };
        let client = open
            .guard
            .as_mut()
            .and_then(|g| g.as_mut())
            .ok_or_else(|| PostgresSinkError::no_connection(&self.table))?;
        // From here on, an error drops `open`, which rolls back.
        client
            .batch_execute("BEGIN")
            .await
            .map_err(self.db(id, "BEGIN"))?;
        let tagged: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&app_id, &(id as i64), &tags];
        let found: i64 = client
            .query_one(&format!("SELECT count(*) FROM {st} {mine}"), &tagged)
            .await
            .map_err(self.db(id, "counting the staged rows"))?
            .get(0);
        if found.max(0) as u64 != staged {
            return Err(PostgresSinkError::StagingMissing {
                table: self.table.clone(),
                batch_id: id,
                staging,
                staged,
                found: found.max(0) as u64,
            });
        }
        let temp = "weir_stage";
        client
            .batch_execute(&format!(
                "CREATE TEMP TABLE {temp} ({}) ON COMMIT DROP",
                Self::column_defs(&cols)
            ))
            .await
            .map_err(self.db(id, "creating the temp table"))?;
        let rows = client
            .execute(&self.dedupe_sql(&cols, temp, &st, mine), &tagged)
            .await
            .map_err(self.db(id, "keeping the newest staged row per key"))?;
        open.rows = rows as usize;
        let claimed = claim(&*client, &self.ledger, &app_id, id, rows as i64)
            .await
            .map_err(self.db(id, "claiming the batch in the ledger"))?;
        if claimed == Claim::New {
            for sql in self.apply_sql(&cols, temp, "") {
                client
                    .execute(&sql, &[])
                    .await
                    .map_err(self.db(id, "upserting"))?;
            }
        } else {
            self.landed_before(claimed, id, ctx.is_replay, &app_id)?;
            open.new = false;
        }
        client
            .execute(&format!("DELETE FROM {st} {up_to}"), &params)
            .await
            .map_err(self.db(id, "clearing the batch's staging rows"))?;
        fault::hit(POINT_BEFORE_COMMIT, id).map_err(self.engine(id))?;
        let new = open.new;
        open.commit().await.map_err(self.db(id, "COMMIT"))?;
        fault::hit(POINT_AFTER_COMMIT, id).map_err(self.engine(id))?;
        if new {
            ctx.metrics.add_output_rows(rows);
        } else {
            tracing::info!(table = %self.table, "batch {id} skipped: the ledger {} already has it", self.ledger);
            ctx.metrics.add_skipped(&sink);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_is_not_shown() {
        let write = StagingWrite {
            url: "host=db user=u password=hunter2".into(),
            table: "t".into(),
            staging: "t_weir_staging".into(),
            app_id: "a".into(),
            batch_id: 3,
            keys: vec!["id".into()],
            ordering: "ts".into(),
        };
        let shown = format!("{write:?}");
        assert!(shown.contains("t_weir_staging"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
