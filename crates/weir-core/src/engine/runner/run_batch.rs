//! Steps 3-5 of a planned batch (see the loop's docs): read it (unless read ahead), apply
//! the steps, call the function while `commits/N` is prepared, commit the state, then link
//! `commits/N` and tell the source.

use super::*;

impl Runner {
    /// Steps 3-5 for a planned batch: read (unless read ahead), apply the steps, call the
    /// function while `commits/N` is prepared, commit the state, link `commits/N`.
    pub(super) async fn run_batch(
        &self,
        p: &Planned,
        read: Option<ReadRows>,
        start: Option<&SourceOffset>,
        late_watermark_ms: i64,
        durations: &mut Durations,
    ) -> Result<Ran> {
        let id = p.id;
        self.shared.set_current_batch(id);
        let ctx = &self.spec.ctx;
        let read = match read {
            Some(r) => r,
            None => {
                let t = Instant::now();
                let r = read_rows(self.spec.source.as_ref(), ctx, start, &p.end)
                    .await
                    .map_err(self.in_batch(id, "reading the source"))?;
                durations.since(Phase::GetBatch, t);
                r
            }
        };
        let ReadRows {
            input,
            count: rows,
            metrics: source_metrics,
        } = read;

        let t = Instant::now();
        let event = self.steps.watermark().map(|(column, delay_ms)| EventTime {
            column: column.clone(),
            delay_ms: *delay_ms,
            watermark_ms: p.metadata.batch_watermark_ms,
            late_ms: late_watermark_ms,
        });
        let applied = self
            .steps
            .apply(
                ctx,
                input,
                id,
                event.as_ref(),
                self.spec.cluster.as_ref().map(|c| (c, self.shared.id)),
            )
            .await
            .map_err(self.in_batch(id, "applying the transforms"))?;
        let (df, event_times) = (applied.df, applied.event_times);
        durations.since(Phase::QueryPlanning, t);
        // On a cluster the plan runs on the workers now (reading is part of it) and the
        // function gets its rows, held here; a sink that writes on the workers gets the plan
        // instead, and the rows stay there.
        // A query with a stateful step ran its plan on the workers already, and its rows
        // are here.
        let on_workers = match &self.spec.cluster {
            Some(c) if applied.ran.is_none() && self.spec.sink.writes_on_workers() => {
                Some(OnCluster::new(c.clone(), id))
            }
            _ => None,
        };
        let (df, rows, cluster) = match (&self.spec.cluster, applied.ran) {
            (_, Some((read, workers))) => (df, read, Some(workers)),
            (Some(c), None) if on_workers.is_none() => {
                let t = Instant::now();
                let (df, read, workers) = run_and_hold(c, ctx, df, id)
                    .await
                    .map_err(self.in_batch(id, "running the batch's plan on the cluster"))?;
                let read_ms = durations.get(Phase::GetBatch) + t.elapsed().as_millis() as u64;
                durations.set(Phase::GetBatch, read_ms);
                (df, read, Some(workers))
            }
            _ => (df, rows, None),
        };

        // The next batch is read while this one's function writes (see the module docs).
        let ahead = reads_ahead(&self.spec.trigger);
        if ahead {
            let handle = tokio::spawn(
                read_ahead(
                    self.spec.source.clone(),
                    ctx.clone(),
                    p.end.clone(),
                    self.read_limit(),
                )
                .instrument(self.batch_span(id + 1)),
            );
            *self.ahead.lock().await = Some(handle);
        }

        let t = Instant::now();
        let metrics = Arc::new(SinkMetrics::default());
        let app_name = self
            .spec
            .checkpoint
            .created_name()
            .unwrap_or(&self.shared.name)
            .to_string();
        let mut bctx =
            BatchContext::on_session(self.shared.id, self.shared.name.clone(), id, ctx.clone())
                .with_run(self.shared.run_id, p.metadata.batch_timestamp_ms)
                .replay(p.replay)
                .new_checkpoint(self.spec.checkpoint.is_new())
                .with_app_name(app_name);
        bctx.metrics = metrics.clone();
        let next_watermark = match &event {
            Some(e) => event_times.next_watermark(e.watermark_ms, e.delay_ms),
            None => 0,
        };
        // `commits/N`'s content is known before the function runs: it is made durable under
        // a temp name meanwhile and linked into place only after the function (and the
        // state) succeeded. A failure drops it unlinked.
        let commit = CommitMetadata {
            next_batch_watermark_ms: next_watermark,
        };
        let staged = batch::call(
            self.spec.sink.as_ref(),
            df,
            bctx,
            on_workers.as_ref(),
            self.spec.checkpoint.prepare_commit(id, &commit),
        )
        .await?;
        let (rows, cluster) = match &on_workers {
            Some(run) => {
                let (read, workers) = run.ran();
                (read, Some(workers))
            }
            None => (rows, cluster),
        };

        // State version N+1, before `commits/N` (a replay of N loads version N again).
        let state_operators = self
            .steps
            .commit(id, self.in_batch(id, "committing the state"))
            .await?;

        // The source's writes for the batch (a dead letter), before `commits/N`.
        self.spec
            .source
            .before_commit(id, start, &p.end)
            .await
            .map_err(self.in_batch(id, "writing the source's dead letter"))?;
        durations.since(Phase::AddBatch, t);

        let t = Instant::now();
        fault::hit(BEFORE_COMMIT_WRITE, id)?;
        self.spec.checkpoint.finish_commit(id, staged?).await?;
        fault::hit(AFTER_COMMIT_WRITE, id)?;
        // With a read ahead running, the source hears of the commit once that read is done
        // (a source is never asked two things at once).
        *self.untold.lock().await = Some((id, p.end.clone()));
        if !ahead {
            self.tell_committed().await?;
        }
        if let Some(keep_from) = retention::keep_from(id, self.spec.retain) {
            self.spec.checkpoint.purge(keep_from).await?;
        }
        self.steps
            .purge(self.in_batch(id, "deleting state files past retention"))
            .await?;
        durations.since(Phase::CommitOffsets, t);
        let event_time = match &event {
            Some(e) => event_times.progress(e.watermark_ms),
            None => BTreeMap::new(),
        };
        Ok(Ran {
            rows,
            metrics,
            source_metrics,
            state_operators,
            next_watermark,
            event_time,
            cluster,
        })
    }
}
