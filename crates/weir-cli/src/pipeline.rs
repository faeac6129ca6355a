//! Pipelines from TOML: a dispatch over the connectors' own config types. Unknown keys and
//! bad values are refused, naming the key, before anything runs. Relative paths are taken
//! from the folder of the TOML file.
//!
//! ```toml
//! [query]
//! name = "orders"
//! checkpoint = "chk"                 # or s3://bucket/chk, az://..., gs://...
//! trigger = "available-now"          # once | 30s | 0 (as fast as possible)
//!
//! [storage]                          # object-store settings; env:NAME reads a secret
//! aws_endpoint = "http://127.0.0.1:9000"
//!
//! [source]
//! type = "files"
//! path = "in"
//! format = "json"
//! schema = ["order_id bigint", "status string", "amount double", "updated_at timestamp"]
//!
//! [transform]                        # applied in this order, each optional:
//! with-watermark = { column = "updated_at", delay = "10 minutes" }
//! drop-duplicates = ["order_id"]     # streaming dedupe (state in the checkpoint)
//! # drop-duplicates-within-watermark = ["order_id"]
//! # aggregate = { group-by = ["status"], window = { column = "updated_at", size = "5m" },
//! #               aggregates = ["count(*) AS n"], output-mode = "append" }
//! sql = "SELECT * FROM batch WHERE amount > 0"
//!
//! [[sink]]
//! type = "parquet"
//! path = "out"
//!
//! [cluster]                          # optional: run batches on `weir worker`s
//! workers = ["http://10.0.0.5:7400", "http://10.0.0.6:7400"]
//! token = "env:WEIR_CLUSTER_TOKEN"
//! ```
//!
//! Each `type` is a connector's config type (`weir::config`: adding a connector adds one
//! variant there).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
pub(crate) use weir::config::{SinkConfig, SourceConfig};
use weir_cluster::{ClusterConfig, WeirCluster};
use weir_core::connector::{BuildEnv, DurationText, RetryConfig, SinkShape, secret};
use weir_core::datafusion::arrow::datatypes::Schema;
use weir_core::engine::{Transform, TransformOutput};
use weir_core::sink::WithTimeout;
use weir_core::storage::StorageOptions;
use weir_core::{DataStreamWriter, FanOut, ForeachBatch, Trigger, WeirSession};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct Pipeline {
    pub query: QueryConfig,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub storage: BTreeMap<String, String>,
    pub source: SourceConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<TransformConfig>,
    #[serde(rename = "sink")]
    pub sinks: Vec<SinkConfig>,
    /// Workers to run batches on (`weir worker`s); without it, batches run in this process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterConfig>,
    /// The pipeline file's folder: relative paths are taken from here.
    #[serde(skip)]
    pub base: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct QueryConfig {
    pub name: String,
    pub checkpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_batches_to_retain: Option<u64>,
    /// Partitions of a stateful operator's state, by key hash (fixed once written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_partitions: Option<u32>,
    /// How long the lease of an object-store checkpoint lives without renewal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<DurationText>,
    /// How long a start waits for another process holding the checkpoint to let it go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_wait: Option<DurationText>,
    /// How failures that may pass (a server down, a connection cut) are met.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct TransformConfig {
    /// Spark's `withWatermark`, first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_watermark: Option<WatermarkConfig>,
    /// Streaming deduplication on these columns (Spark's `dropDuplicates`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_duplicates: Option<Vec<String>>,
    /// Spark's `dropDuplicatesWithinWatermark` on these columns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_duplicates_within_watermark: Option<Vec<String>>,
    /// A streaming aggregation, after the deduplication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<AggregateConfig>,
    /// SQL over the batch (after the steps above), which it sees as the view `batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sql: Option<String>,
}

impl TransformConfig {
    /// The steps, in the order they run: watermark, deduplications, aggregation, SQL.
    pub(crate) fn steps(&self) -> Result<Vec<Transform>> {
        let mut out = Vec::new();
        if let Some(w) = &self.with_watermark {
            out.push(Transform::Watermark {
                column: w.column.clone(),
                delay: w.delay.0,
            });
        }
        if let Some(keys) = &self.drop_duplicates {
            out.push(Transform::DropDuplicates(keys.clone()));
        }
        if let Some(keys) = &self.drop_duplicates_within_watermark {
            out.push(Transform::DropDuplicatesWithinWatermark(keys.clone()));
        }
        if let Some(a) = &self.aggregate {
            out.push(Transform::Aggregate(a.aggregation()?));
        }
        if let Some(sql) = &self.sql {
            out.push(Transform::Sql(sql.clone()));
        }
        Ok(out)
    }

    /// Whether any step keeps state in the checkpoint.
    pub(crate) fn is_stateful(&self) -> bool {
        self.drop_duplicates.is_some()
            || self.drop_duplicates_within_watermark.is_some()
            || self.aggregate.is_some()
    }
}

/// `with-watermark = { column = "ts", delay = "10 minutes" }`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct WatermarkConfig {
    pub column: String,
    pub delay: DurationText,
}

/// `[transform.aggregate]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct AggregateConfig {
    #[serde(default)]
    pub group_by: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowConfig>,
    /// `count(*)`, `count(col)`, `sum(col)`, `min(col)`, `max(col)`, `avg(col)` [`AS name`].
    pub aggregates: Vec<String>,
    /// `append` (default), `update` or `complete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_mode: Option<String>,
}

/// `window = { column = "ts", size = "10 minutes", slide = "5 minutes" }` (no slide:
/// tumbling).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct WindowConfig {
    pub column: String,
    pub size: DurationText,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slide: Option<DurationText>,
}

impl AggregateConfig {
    fn aggregation(&self) -> Result<weir_core::Aggregation> {
        let mut a =
            weir_core::Aggregation::new(self.aggregates.clone()).group_by(self.group_by.clone());
        if let Some(w) = &self.window {
            a = a.sliding_window(
                w.column.clone(),
                w.size.0,
                w.slide.as_ref().map_or(w.size.0, |s| s.0),
            );
        }
        if let Some(m) = &self.output_mode {
            a = a.output_mode(m.parse()?);
        }
        Ok(a)
    }
}

impl Pipeline {
    /// Reads and checks a pipeline file; relative paths are taken from its folder.
    pub(crate) fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = std::path::absolute(parent)?;
        Self::parse(&text, &path.display().to_string(), &base)
    }

    /// Parses and checks pipeline text, with relative paths taken from `base`.
    pub(crate) fn parse(text: &str, origin: &str, base: &Path) -> Result<Self> {
        let mut p: Pipeline = toml::from_str(text).map_err(|e| anyhow!("{origin}: {e}"))?;
        p.base = Some(base.to_path_buf());
        p.check().with_context(|| origin.to_string())?;
        Ok(p)
    }

    /// The pipeline as TOML (for `weir chaos`, which writes a retargeted copy).
    pub(crate) fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string(self)?)
    }

    /// Where configs are resolved: the file's folder and the `[storage]` settings.
    pub(crate) fn env(&self) -> Result<BuildEnv> {
        let mut values = BTreeMap::new();
        for (k, v) in &self.storage {
            values.insert(k.clone(), secret(&format!("storage.{k}"), v)?);
        }
        Ok(BuildEnv {
            base: self.base.clone(),
            storage: StorageOptions::new(values)?,
        })
    }

    /// Checks the values serde cannot, without reading or writing anything.
    pub(crate) fn check(&self) -> Result<()> {
        self.trigger()?;
        if let Some(n) = self.query.state_partitions {
            weir_core::state::partitioned::check_partitions("query.state-partitions", n)?;
        }
        if let Some(r) = &self.query.retry {
            r.policy().check("query.retry")?;
        }
        if let Some(c) = &self.cluster {
            c.check()?;
            if !self.source.spec().reads_on_workers() {
                anyhow::bail!(
                    "invalid setting 'cluster': the {} source does not run on a cluster yet \
                     (only the files and Kafka sources' reads are sent to workers); remove \
                     [cluster] to run this pipeline in one process",
                    self.source.kind()
                );
            }
        }
        if let Some(t) = &self.transform {
            for (name, keys) in [
                ("drop-duplicates", &t.drop_duplicates),
                (
                    "drop-duplicates-within-watermark",
                    &t.drop_duplicates_within_watermark,
                ),
            ] {
                if let Some(keys) = keys
                    && (keys.is_empty() || keys.iter().any(|k| k.is_empty()))
                {
                    anyhow::bail!(
                        "invalid setting 'transform.{name}': give the key columns by name \
                         (an empty list or an empty name cannot be a key)"
                    );
                }
            }
            weir_core::engine::check_steps(&t.steps()?)?;
        }
        let env = self.env()?;
        let checkpoint = env.location("query.checkpoint", &self.query.checkpoint)?;
        self.source.spec().check(&env)?;
        self.source.spec().read_limit()?;
        if self.sinks.is_empty() {
            anyhow::bail!("invalid setting 'sink': at least one [[sink]] is required");
        }
        for (i, s) in self.sinks.iter().enumerate() {
            s.spec()
                .build(&env)
                .with_context(|| format!("sink[{i}] ({})", s.kind()))?;
        }
        // No two places written by one pipeline may overlap, nor may a sink write into
        // the folder the source reads (it would read its own output); a dead letter has
        // its own folder, outside the checkpoint too.
        let dead = self.source.spec().dead_letter(&env);
        if let Some(d) = &dead
            && weir_core::connector::overlaps(d, &checkpoint)
        {
            anyhow::bail!(
                "invalid setting 'source.dead-letter': {d} and the checkpoint {checkpoint} \
                 use the same folder: give the dead letter its own"
            );
        }
        let places: Vec<(String, weir_core::storage::Location)> = self
            .source
            .spec()
            .location(&env)
            .map(|l| ("source".to_string(), l))
            .into_iter()
            .chain(dead.map(|l| ("source.dead-letter".to_string(), l)))
            .chain(self.sinks.iter().enumerate().filter_map(|(i, s)| {
                s.spec()
                    .location(&env)
                    .map(|l| (format!("sink[{i}] ({})", s.kind()), l))
            }))
            .collect();
        for (i, (a, la)) in places.iter().enumerate() {
            for (b, lb) in &places[i + 1..] {
                if weir_core::connector::overlaps(la, lb) {
                    anyhow::bail!(
                        "invalid setting: {a} and {b} use the same folder ({la} and {lb}): give each \
                         sink its own folder, outside the source's"
                    );
                }
            }
        }
        Ok(())
    }

    /// What `weir check` tells of the columns beyond the settings, when the source's
    /// settings fix them: the stateful steps' columns, the SQL planned over an empty batch
    /// (a misspelt column or function fails here and not at batch 0), and the key and
    /// ordering columns of each upsert sink found among the columns the sinks get.
    pub(crate) async fn check_transform(&self) -> Result<Option<String>> {
        let Some(source) = self.source.spec().schema(&self.env()?)? else {
            return Ok(self.transform.as_ref().map(|_| {
                format!(
                    "transform not planned: the {} source's columns come from its data (give \
                     source.schema to have it planned here)",
                    self.source.kind()
                )
            }));
        };
        let (columns, note): (Vec<String>, Option<String>) = match &self.transform {
            None => (names_of(&source), None),
            Some(t) => match self
                .local_session()?
                .check_transforms(source, &t.steps()?)
                .await?
            {
                TransformOutput::Schema(s) => {
                    let names = names_of(&s);
                    let note = format!("transform planned; the sinks get {}", names.join(", "));
                    (names, Some(note))
                }
                TransformOutput::Names(names) => {
                    let note = format!(
                        "transform checked against the source's columns; the sinks get {}",
                        names.join(", ")
                    );
                    (names, Some(note))
                }
                TransformOutput::Unknown => {
                    return Ok(Some(
                        "transform checked against the source's columns; its SQL reads the \
                         aggregation's output and is planned at run time"
                            .to_string(),
                    ));
                }
            },
        };
        for (i, sink) in self.sinks.iter().enumerate() {
            let SinkShape::Upsert { keys, ordering } = sink.spec().shape() else {
                continue;
            };
            let wanted = keys
                .iter()
                .map(|k| ("key", k))
                .chain([("ordering", &ordering)]);
            for (what, column) in wanted {
                if !columns.contains(column) {
                    anyhow::bail!(
                        "invalid setting: sink[{i}] ({}) has the {what} column `{column}`, \
                         which the batches it gets do not have (their columns: {})",
                        sink.kind(),
                        columns.join(", ")
                    );
                }
            }
        }
        Ok(note)
    }

    /// The trigger (default: available-now, which suits a command that should finish).
    pub(crate) fn trigger(&self) -> Result<Trigger> {
        match &self.query.trigger {
            None => Ok(Trigger::AvailableNow),
            Some(t) => t.parse::<Trigger>().map_err(|e| anyhow!("query.{e}")),
        }
    }

    /// `weir check --connect`: reaches every place and server the pipeline uses (the
    /// checkpoint, the source, each sink, the cluster's workers), writing nothing. One
    /// `(what, outcome)` per place, in that order; each is tried whatever the others gave.
    pub(crate) async fn probe(&self) -> Result<Vec<(String, Result<String, String>)>> {
        let env = self.env()?;
        let text = |r: weir_core::Result<String>| r.map_err(|e| weir_core::error::error_chain(&e));
        let mut out = Vec::new();
        let checkpoint = env.location("query.checkpoint", &self.query.checkpoint)?;
        let found = async {
            let place = checkpoint.probe().await?;
            Ok(
                match weir_core::checkpoint::Checkpoint::inspect(checkpoint.clone()).await? {
                    None => format!("{place}; no checkpoint yet (the first run makes one)"),
                    Some(cp) => {
                        if let Some(asked) = self.query.state_partitions {
                            weir_core::engine::check_state_partitions(
                                &checkpoint.join("state"),
                                asked,
                            )
                            .await?;
                        }
                        let (_, commits) = cp.batch_ids().await?;
                        format!(
                            "{place}; query {}, {}",
                            cp.query_id(),
                            match commits.last() {
                                Some(b) => format!("last committed batch {b}"),
                                None => "no batch committed".into(),
                            }
                        )
                    }
                },
            )
        }
        .await;
        out.push((format!("checkpoint {checkpoint}"), text(found)));
        out.push((
            format!("source ({})", self.source.kind()),
            text(self.source.spec().probe(&env).await),
        ));
        for (i, s) in self.sinks.iter().enumerate() {
            out.push((
                format!("sink[{i}] {}", s.spec().label(&env)),
                text(s.spec().probe(&env).await),
            ));
        }
        if let Some(c) = &self.cluster {
            use weir_core::engine::Cluster;
            let found = async {
                let cluster = WeirCluster::new(c, weir::config::NODES).map_err(|e| {
                    weir_core::Error::Config {
                        key: "cluster".into(),
                        reason: e.to_string(),
                    }
                })?;
                let usable = cluster.prepare().await?;
                Ok(format!(
                    "{} usable worker(s): {}",
                    usable.len(),
                    usable.join(", ")
                ))
            }
            .await;
            out.push(("cluster".to_string(), text(found)));
        }
        Ok(out)
    }

    /// The sinks' labels, in file order.
    pub(crate) fn labels(&self) -> Result<Vec<String>> {
        let env = self.env()?;
        Ok(self.sinks.iter().map(|s| s.spec().label(&env)).collect())
    }

    /// The sinks, in the order the file lists them, with their labels.
    pub(crate) fn sinks(&self) -> Result<Vec<(String, Arc<dyn ForeachBatch>)>> {
        let env = self.env()?;
        self.sinks
            .iter()
            .map(|s| {
                let (name, sink) = (s.spec().label(&env), s.spec().build(&env)?);
                let sink: Arc<dyn ForeachBatch> = match s.timeout() {
                    Some(after) => Arc::new(WithTimeout::new(sink, name.clone(), after)),
                    None => sink,
                };
                Ok((name, sink))
            })
            .collect()
    }

    /// The session for this pipeline: its storage settings, and its cluster if it has one.
    pub(crate) fn session(&self) -> Result<WeirSession> {
        let session = self.local_session()?;
        Ok(match &self.cluster {
            Some(c) => session.cluster(Arc::new(WeirCluster::new(c, weir::config::NODES)?)),
            None => session,
        })
    }

    /// The session without the cluster (for checks that plan without running).
    fn local_session(&self) -> Result<WeirSession> {
        Ok(WeirSession::new().storage_options(self.env()?.storage))
    }

    /// The whole query, ready for listeners and `start()`: the source with the transform,
    /// name, checkpoint, trigger, retention and the sinks in file order behind one FanOut.
    pub(crate) async fn writer(&self) -> Result<DataStreamWriter> {
        let env = self.env()?;
        let mut frame = self.source.load(&self.session()?, &env).await?;
        if let Some(t) = &self.transform {
            for step in t.steps()? {
                frame = frame.then(step);
            }
        }
        let mut writer = frame
            .write_stream()
            .query_name(&self.query.name)
            .checkpoint(env.location("query.checkpoint", &self.query.checkpoint)?)
            .trigger(self.trigger()?)
            .sink(FanOut::new(self.sinks()?).overlap_stages(true));
        if let Some(n) = self.query.state_partitions {
            writer = writer.state_partitions(n);
        }
        if let Some(n) = self.query.min_batches_to_retain {
            writer = writer.min_batches_to_retain(n);
        }
        if let Some(t) = self.query.lease_wait {
            writer = writer.lease_wait(t.0);
        }
        if let Some(t) = self.query.lease_ttl {
            writer = writer.lease_ttl(t.0);
        }
        if let Some(r) = &self.query.retry {
            writer = writer.retry(r.policy());
        }
        Ok(writer)
    }
}

/// The column names of `schema`, in order.
fn names_of(schema: &Schema) -> Vec<String> {
    schema.fields().iter().map(|f| f.name().clone()).collect()
}
