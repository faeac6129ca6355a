//! Offsets: what each batch reads.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::client::BaseConsumer;
use async_trait::async_trait;
use bytes::Bytes;
use weir_core::datafusion::arrow::datatypes::SchemaRef;
use weir_core::datafusion::prelude::{DataFrame, SessionContext};
use weir_core::logfile::{parse_line, parse_versioned, render};
use weir_core::source::dead_letter::{self, Letter};
use weir_core::source::leaf::{ScanTable, scans_on_cluster};
use weir_core::source::{SourceInit, decode};
use weir_core::storage::{Location, WriteOutcome};
use weir_core::{Error, ReadLimit, Result, Source, SourceOffset};

use crate::client::{self, consumer, partitions, watermarks, with_client};
use crate::error::KafkaSourceError;
use crate::leaf::{KafkaRangeExec, KafkaScan};
use crate::marks::Marks;
use crate::offsets::{self, check_loss, split_limit, wait_for_more};
use crate::options::{KafkaOptions, StartingOffsets, Subscribe, ValueFormat};
use crate::{PartitionOffsets, read};

/// A Kafka topic (or topics) as a replayable source. See the crate docs.
pub struct KafkaSource {
    opts: Arc<KafkaOptions>,
    schema: SchemaRef,
    log: Mutex<Option<Location>>,
    /// Per-partition lag after the last planned batch, for progress.
    behind: Mutex<BTreeMap<String, String>>,
    /// When the last batch was planned (or the source opened), for maxTriggerDelay.
    last_batch: Mutex<Instant>,
    /// The consumer that reads metadata, watermarks and every batch's records, made at first
    /// use and kept (its connections and metadata with it) until a call on it fails.
    reader: Arc<Mutex<Option<BaseConsumer>>>,
    /// The client that commits end offsets to `commit_to_group`, made at the first commit.
    committer: Arc<Mutex<Option<BaseConsumer>>>,
    /// For AvailableNow: the latest offsets when the query started.
    available_now: Mutex<Option<BTreeMap<(String, i32), i64>>>,
    /// Where the last planned batch ended, for `reached_available_now`.
    last_end: Mutex<Option<BTreeMap<(String, i32), i64>>>,
    /// The latest offsets at the last `latest_offset`, for progress.
    latest: Mutex<Option<SourceOffset>>,
    /// Tombstones dropped by the last read (`tombstones = "skip"`), for progress.
    skipped: Mutex<Option<u64>>,
    /// With a dead letter: the bad records of the ranges read and not yet committed, by
    /// range (the batch's and the one read ahead), written at `before_commit`.
    letters: Mutex<Vec<(Range, Vec<Letter>)>>,
    /// The last records read in each partition, to tell a topic made again (see
    /// [`crate::marks`]); kept in `sources/0/marks` before each commit.
    marks: Arc<Mutex<Marks>>,
    /// Batches are read on a cluster's workers: the driver reads each range's last record
    /// itself for its mark, before the commit.
    read_on_workers: std::sync::atomic::AtomicBool,
    /// The checkpoint's query id (names the dead letter's files).
    query_id: Mutex<uuid::Uuid>,
}

/// The source log's file of [`Marks`].
const MARKS: &str = "marks";

/// A batch's range as its start and end offsets' JSON.
type Range = (Option<serde_json::Value>, serde_json::Value);

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

type Positions = BTreeMap<(String, i32), i64>;

impl KafkaSource {
    /// Checks the options (a bad pattern is refused here).
    pub fn new(opts: KafkaOptions) -> Result<Self> {
        if let Subscribe::Pattern(p) = &opts.subscribe {
            regex::Regex::new(p).map_err(|e| Error::config("subscribePattern", e.to_string()))?;
        }
        if let Subscribe::Topics(t) = &opts.subscribe
            && t.is_empty()
        {
            return Err(Error::config("subscribe", "no topic given"));
        }
        if let ValueFormat::Json { schema, .. } = &opts.value_format {
            decode::check_corrupt_column(schema).map_err(|r| Error::config("schema", r))?;
        }
        crate::tombstone::check(&opts)?;
        let schema = read::output_schema(&opts.value_format, opts.include_headers, opts.tombstones);
        Ok(KafkaSource {
            opts: Arc::new(opts),
            schema,
            log: Mutex::new(None),
            behind: Mutex::new(BTreeMap::new()),
            last_batch: Mutex::new(Instant::now()),
            available_now: Mutex::new(None),
            reader: Arc::new(Mutex::new(None)),
            committer: Arc::new(Mutex::new(None)),
            last_end: Mutex::new(None),
            latest: Mutex::new(None),
            skipped: Mutex::new(None),
            letters: Mutex::new(Vec::new()),
            marks: Arc::new(Mutex::new(Marks::default())),
            read_on_workers: std::sync::atomic::AtomicBool::new(false),
            query_id: Mutex::new(uuid::Uuid::nil()),
        })
    }

    fn err(&self, e: KafkaSourceError) -> Error {
        Error::from_source(self.description(), e.boxed())
    }

    fn poisoned(&self) -> Error {
        self.err(KafkaSourceError::Invalid {
            what: "state".into(),
            reason: "poisoned by an earlier panic".into(),
        })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&KafkaOptions) -> std::result::Result<T, KafkaSourceError> + Send + 'static,
    ) -> Result<T> {
        let opts = self.opts.clone();
        match tokio::task::spawn_blocking(move || f(&opts)).await {
            Ok(r) => r.map_err(|e| self.err(e)),
            Err(e) => Err(self.err(KafkaSourceError::Invalid {
                what: "Kafka task".into(),
                reason: e.to_string(),
            })),
        }
    }

    /// Runs `f` on the blocking pool with the source's long-lived consumer (see
    /// [`with_client`]).
    async fn with_reader<T: Send + 'static>(
        &self,
        f: impl FnOnce(&BaseConsumer, &KafkaOptions) -> std::result::Result<T, KafkaSourceError>
        + Send
        + 'static,
    ) -> Result<T> {
        let reader = self.reader.clone();
        self.blocking(move |o| with_client(&reader, || consumer(o), |c| f(c, o)))
            .await
    }

    /// Keeps the mark of the last record of each partition's range `[start, end)` (read
    /// on the workers), read here: the next batch's tasks check their first records
    /// against it. A range whose last offset holds no record (a transaction marker, or
    /// deleted since) leaves no mark, as a read of it would not.
    async fn mark_last_records(
        &self,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<()> {
        let begin = self.start_of(start).await?;
        let end = offsets::parse(end.json()).map_err(|e| self.err(e))?;
        let mut from = PartitionOffsets::new();
        let mut to = PartitionOffsets::new();
        for (t, ps) in &end {
            for (&p, &e) in ps {
                let b = begin.get(t).and_then(|m| m.get(&p)).copied().unwrap_or(0);
                if e > b && e > 0 {
                    from.entry(t.clone()).or_default().insert(p, e - 1);
                    to.entry(t.clone()).or_default().insert(p, e);
                }
            }
        }
        if to.is_empty() {
            return Ok(());
        }
        let read::Read { marks: last, .. } = self
            .with_reader(move |c, o| {
                // The raw records: nothing to decode, and a loss was the batch's to report.
                let mut raw = o.clone();
                raw.value_format = ValueFormat::Raw;
                raw.fail_on_data_loss = false;
                read::read(c, &raw, &from, &to, &Marks::default())
            })
            .await?;
        let mut marks = self.marks.lock().map_err(|_| self.poisoned())?;
        for (t, p, m) in last {
            marks.add(&t, p, m);
        }
        Ok(())
    }

    /// The first batch's start: recorded in `sources/0/0` once, then always read from there.
    async fn initial_offsets(&self) -> Result<PartitionOffsets> {
        let log = self
            .log
            .lock()
            .map_err(|_| self.poisoned())?
            .clone()
            .ok_or_else(|| {
                self.err(KafkaSourceError::Invalid {
                    what: "state".into(),
                    reason: "latest_offset called before open".into(),
                })
            })?;
        if let Some(bytes) = log.get("0").await? {
            let path = log.describe("0");
            let lines = parse_versioned(&bytes, &path, 1, "Kafka initial offsets log")?;
            let line = lines.first().cloned().unwrap_or_default();
            let v: serde_json::Value = parse_line(&path, 2, &line)?;
            return offsets::parse(&v).map_err(|e| self.err(e));
        }
        let starting = self.opts.starting_offsets.clone();
        let initial = self
            .with_reader(move |c, o| {
                let mut out = PartitionOffsets::new();
                for (t, p) in partitions(c, o)? {
                    let (low, high) = watermarks(c, &t, p)?;
                    let at = match &starting {
                        StartingOffsets::Earliest => low,
                        StartingOffsets::Latest => high,
                        StartingOffsets::Explicit(m) => match m.get(&t).and_then(|ps| ps.get(&p)) {
                            Some(-2) | None => low,
                            Some(-1) => high,
                            Some(&o) => o,
                        },
                    };
                    out.entry(t).or_default().insert(p, at);
                }
                Ok(out)
            })
            .await?;
        let body: Bytes = render([offsets::to_json(&initial).to_string()]);
        if log.put_new("0", body).await? == WriteOutcome::AlreadyExists {
            return Err(Error::CheckpointInUse {
                dir: log.to_string(),
                detail: format!("{} was written by someone else", log.describe("0")),
            });
        }
        Ok(initial)
    }

    async fn start_of(&self, start: Option<&SourceOffset>) -> Result<PartitionOffsets> {
        match start {
            Some(s) => offsets::parse(s.json()).map_err(|e| self.err(e)),
            None => self.initial_offsets().await,
        }
    }

    /// Each partition's latest offset now, checking nothing against the query's position.
    async fn latest_now(&self) -> Result<Positions> {
        self.with_reader(move |c, o| {
            let mut highs = BTreeMap::new();
            for (t, p) in partitions(c, o)? {
                let (_, high) = watermarks(c, &t, p)?;
                highs.insert((t, p), high);
            }
            Ok(highs)
        })
        .await
    }

    /// Where each partition begins (checked for data loss) and its latest offset now.
    async fn positions(&self, begin: PartitionOffsets) -> Result<(Positions, Positions)> {
        let fail = self.opts.fail_on_data_loss;
        self.with_reader(move |c, o| {
            let mut begins = BTreeMap::new();
            let mut highs = BTreeMap::new();
            let current = partitions(c, o)?;
            for (t, ps) in &begin {
                for p in ps.keys() {
                    if !current.contains(&(t.clone(), *p)) {
                        let e = KafkaSourceError::DataLoss {
                            topic: t.clone(),
                            partition: *p,
                            detail: "the partition is gone".into(),
                        };
                        if fail {
                            return Err(e);
                        }
                        tracing::warn!("{e}; dropping it (failOnDataLoss=false)");
                    }
                }
            }
            for (t, p) in current {
                let (low, high) = watermarks(c, &t, p)?;
                let b = match begin.get(&t).and_then(|ps| ps.get(&p)) {
                    Some(&b) => check_loss(fail, &t, p, b, low, high)?,
                    // A partition added since the last batch starts at 0, as in Spark;
                    // anything else means its first records are gone.
                    None => {
                        let b = check_loss(fail, &t, p, 0, low, high)?;
                        tracing::info!("topic {t}: new partition {p}, read from offset {b}");
                        b
                    }
                };
                begins.insert((t.clone(), p), b);
                highs.insert((t, p), high);
            }
            Ok((begins, highs))
        })
        .await
    }
}

#[async_trait]
impl Source for KafkaSource {
    fn description(&self) -> String {
        match &self.opts.subscribe {
            Subscribe::Topics(t) => format!("KafkaV2[Subscribe[{}]]", t.join(",")),
            Subscribe::Pattern(p) => format!("KafkaV2[SubscribePattern[{p}]]"),
        }
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn reads_on_workers(&self) -> bool {
        self.opts.dead_letter.is_none()
    }

    async fn open(&self, init: &SourceInit) -> Result<()> {
        *self.log.lock().map_err(|_| self.poisoned())? = Some(init.log.clone());
        *self.query_id.lock().map_err(|_| self.poisoned())? = init.query_id;
        self.letters.lock().map_err(|_| self.poisoned())?.clear();
        let marks = match init.log.get(MARKS).await? {
            Some(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                self.err(KafkaSourceError::Invalid {
                    what: init.log.describe(MARKS),
                    reason: format!("not the marks weir writes: {e}"),
                })
            })?,
            None => Marks::default(),
        };
        *self.marks.lock().map_err(|_| self.poisoned())? = marks;
        Ok(())
    }

    async fn prepare_available_now(&self) -> Result<()> {
        // Spark's prepareForTriggerAvailableNow: the latest offsets now are the target.
        // Only the latest offsets: where the query stands is checked when a batch is
        // planned (checking from offset 0 here reported data loss, "offsets 0..N were
        // deleted", for any topic whose retention had removed its first records).
        let highs = self.latest_now().await?;
        *self.available_now.lock().map_err(|_| self.poisoned())? = Some(highs);
        Ok(())
    }

    async fn reached_available_now(&self) -> Result<bool> {
        let target = self
            .available_now
            .lock()
            .map_err(|_| self.poisoned())?
            .clone();
        let Some(target) = target else {
            return Ok(true);
        };
        let end = self.last_end.lock().map_err(|_| self.poisoned())?.clone();
        let end = end.unwrap_or_default();
        Ok(target
            .iter()
            .all(|(tp, want)| end.get(tp).is_some_and(|at| at >= want) || *want == 0))
    }

    async fn latest_offset(
        &self,
        start: Option<&SourceOffset>,
        limit: ReadLimit,
    ) -> Result<Option<SourceOffset>> {
        let begin = self.start_of(start).await?;
        let (begins, mut highs) = self.positions(begin).await?;
        let mut latest = PartitionOffsets::new();
        for ((t, p), h) in &highs {
            latest.entry(t.clone()).or_default().insert(*p, *h);
        }
        *self.latest.lock().map_err(|_| self.poisoned())? =
            Some(SourceOffset::new(offsets::to_json(&latest)));
        // AvailableNow: never beyond what was there at the start.
        if let Some(target) = self
            .available_now
            .lock()
            .map_err(|_| self.poisoned())?
            .as_ref()
        {
            for (tp, h) in highs.iter_mut() {
                *h = (*h).min(target.get(tp).copied().unwrap_or(0));
            }
        }
        let backlog: Positions = begins
            .iter()
            .map(|(tp, b)| (tp.clone(), (highs[tp] - b).max(0)))
            .collect();
        let take = match limit.max_rows {
            Some(l) => split_limit(&backlog, l.max(1)),
            None => backlog.clone(),
        };
        let mut end = PartitionOffsets::new();
        let mut end_flat = Positions::new();
        let mut behind = Vec::new();
        for (tp, b) in &begins {
            let e = b + take.get(tp).copied().unwrap_or(0);
            behind.push(highs[tp] - e);
            end.entry(tp.0.clone()).or_default().insert(tp.1, e);
            end_flat.insert(tp.clone(), e);
        }
        if let Ok(mut m) = self.behind.lock() {
            m.clear();
            if !behind.is_empty() {
                let n = behind.len() as f64;
                m.insert(
                    "minOffsetsBehindLatest".into(),
                    behind.iter().min().unwrap_or(&0).to_string(),
                );
                m.insert(
                    "maxOffsetsBehindLatest".into(),
                    behind.iter().max().unwrap_or(&0).to_string(),
                );
                m.insert(
                    "avgOffsetsBehindLatest".into(),
                    format!("{:.1}", behind.iter().sum::<i64>() as f64 / n),
                );
            }
        }
        let mut moved = take.values().any(|&n| n > 0);
        if let Some((min, delay)) = limit.min_rows {
            let available: i64 = backlog.values().sum();
            let waited = self
                .last_batch
                .lock()
                .map(|t| t.elapsed())
                .unwrap_or_default();
            if moved && wait_for_more(available as u64, min, waited, delay) {
                tracing::debug!(
                    "{available} new records < minOffsetsPerTrigger {min}; waiting (maxTriggerDelay {delay:?})"
                );
                moved = false;
            }
        }
        if !moved {
            // Where the query stands: the start, for reached_available_now.
            *self.last_end.lock().map_err(|_| self.poisoned())? = Some(begins);
            return Ok(start.cloned());
        }
        if let Ok(mut t) = self.last_batch.lock() {
            *t = Instant::now();
        }
        *self.last_end.lock().map_err(|_| self.poisoned())? = Some(end_flat);
        Ok(Some(SourceOffset::new(offsets::to_json(&end))))
    }

    async fn read_range(
        &self,
        ctx: &SessionContext,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<DataFrame> {
        let range: Range = (start.map(|s| s.json().clone()), end.json().clone());
        let begin = self.start_of(start).await?;
        let end = offsets::parse(end.json()).map_err(|e| self.err(e))?;
        if scans_on_cluster(ctx) {
            // Read where the plan runs: the workers, each its share of the partitions.
            let scan = KafkaScan::new(&self.opts, &begin, &end);
            let decode_schema = match &self.opts.value_format {
                ValueFormat::Raw => self.schema.clone(),
                ValueFormat::Json { schema, .. } => schema.clone(),
            };
            let planning = |e| {
                Error::datafusion(
                    format!("{}: planning the batch's read", self.description()),
                    e,
                )
            };
            let exec = KafkaRangeExec::try_new(scan, decode_schema)
                .map_err(planning)?
                .with_live_marks(self.marks.clone());
            self.read_on_workers
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return ctx
                .read_table(Arc::new(ScanTable::new(Arc::new(exec))))
                .map_err(planning);
        }
        let marks = self.marks.lock().map_err(|_| self.poisoned())?.clone();
        let read::Read {
            batches,
            skipped,
            letters,
            marks: last,
        } = self
            .with_reader(move |c, o| read::read(c, o, &begin, &end, &marks))
            .await?;
        {
            let mut marks = self.marks.lock().map_err(|_| self.poisoned())?;
            for (t, p, m) in last {
                marks.add(&t, p, m);
            }
        }
        if self.opts.dead_letter.is_some() {
            let mut kept = self.letters.lock().map_err(|_| self.poisoned())?;
            kept.retain(|(r, _)| *r != range);
            // The batch running and the one read ahead; anything older was abandoned.
            while kept.len() >= 2 {
                kept.remove(0);
            }
            kept.push((range, letters));
        }
        if self.opts.tombstones == crate::options::Tombstones::Skip
            && let Ok(mut s) = self.skipped.lock()
        {
            *s = Some(skipped);
        }
        ctx.read_batches(batches)
            .map_err(|e| Error::datafusion(format!("{}: holding the batch", self.description()), e))
    }

    /// Keeps the marks of the records read (`sources/0/marks`), and writes the bad records
    /// of the batch's range to the dead letter, once: the file's name is fixed by the batch
    /// id and the write is put-if-absent (a replay reads the same range again, and finds
    /// the file written).
    async fn before_commit(
        &self,
        batch_id: u64,
        start: Option<&SourceOffset>,
        end: &SourceOffset,
    ) -> Result<()> {
        if self
            .read_on_workers
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.mark_last_records(start, end).await?;
        }
        let marks = self.marks.lock().map_err(|_| self.poisoned())?.clone();
        if !marks.is_empty() {
            let log = self.log.lock().map_err(|_| self.poisoned())?.clone();
            if let Some(log) = log {
                let body = serde_json::to_vec(&marks).map_err(|e| {
                    self.err(KafkaSourceError::Invalid {
                        what: log.describe(MARKS),
                        reason: e.to_string(),
                    })
                })?;
                log.put(MARKS, Bytes::from(body)).await?;
            }
        }
        let Some(dead) = &self.opts.dead_letter else {
            return Ok(());
        };
        let range: Range = (start.map(|s| s.json().clone()), end.json().clone());
        let letters = {
            let mut kept = self.letters.lock().map_err(|_| self.poisoned())?;
            match kept.iter().position(|(r, _)| *r == range) {
                Some(i) => kept.remove(i).1,
                None => {
                    return Err(self.err(KafkaSourceError::Invalid {
                        what: format!("the dead letter of batch {batch_id}"),
                        reason: "the batch's range was not read in this process".into(),
                    }));
                }
            }
        };
        let to = dead_letter::DeadLetter {
            dir: dead.clone(),
            query_id: *self.query_id.lock().map_err(|_| self.poisoned())?,
        };
        dead_letter::write(&to, None, batch_id, &letters).await
    }

    async fn commit(&self, end: &SourceOffset) -> Result<()> {
        let Some(group) = self.opts.commit_to_group.clone() else {
            return Ok(());
        };
        let offsets = offsets::parse(end.json()).map_err(|e| self.err(e))?;
        let committer = self.committer.clone();
        self.blocking(move |o| {
            with_client(
                &committer,
                || client::group_committer(o, &group),
                |c| client::commit_offsets(c, &group, &offsets),
            )
        })
        .await
    }

    fn metrics(&self) -> BTreeMap<String, String> {
        let mut m = self.behind.lock().map(|m| m.clone()).unwrap_or_default();
        if let Some(n) = self.skipped.lock().ok().and_then(|s| *s) {
            m.insert("tombstonesSkipped".into(), n.to_string());
        }
        m
    }

    fn latest_seen(&self) -> Option<SourceOffset> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }
}
