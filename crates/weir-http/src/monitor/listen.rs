//! What each engine event does to the monitor's state.

use super::*;

impl QueryListener for Monitor {
    fn on_query_started(&self, e: &QueryStarted) {
        self.with(|s| {
            // Started again after a failure: retrying until a batch gets through.
            s.phase = if s.next_attempt.is_some() {
                Phase::Retrying
            } else {
                Phase::Active
            };
            s.query_id = Some(e.id);
            s.started = Instant::now();
            s.last_activity = Instant::now();
            if e.replay {
                s.replayed += 1;
            }
        });
    }

    fn on_query_progress(&self, p: &StreamingQueryProgress) {
        let interval_ms = self.interval.as_millis() as f64;
        self.with(|s| {
            // A batch ended: a retry, if one ran, got through.
            s.next_attempt = None;
            s.phase = Phase::Active;
            s.last_activity = Instant::now();
            s.idle = false;
            s.committed += 1;
            s.last_batch = Some((p.batch_id, now_seconds()));
            for source in &p.sources {
                *s.input_rows.entry(source.description.clone()).or_default() +=
                    source.num_input_rows;
                let lag = kafka_lag(source.end_offset.as_ref(), source.latest_offset.as_ref());
                let records = (!lag.is_empty()).then(|| lag.iter().map(|(_, l)| l).sum::<i64>());
                s.records_behind.insert(source.description.clone(), records);
                let backlog = source
                    .latest_offset
                    .as_ref()
                    .is_some_and(|latest| Some(latest) != source.end_offset.as_ref())
                    || records.is_some_and(|r| r > 0)
                    // A file source's files listed and not yet taken.
                    || source
                        .metrics
                        .get("numFilesQueued")
                        .and_then(|n| n.parse::<u64>().ok())
                        .is_some_and(|n| n > 0);
                if backlog {
                    s.behind_since
                        .entry(source.description.clone())
                        .or_insert_with(Instant::now);
                } else {
                    s.behind_since.remove(&source.description);
                }
                s.lag.extend(lag);
            }
            if let Some(c) = &p.cluster {
                s.last_workers = Some(c.workers.len());
                for w in &c.workers {
                    let f = s.workers.entry(w.url.clone()).or_default();
                    f.0 += w.tasks;
                    f.1 += w.input_rows;
                }
            }
            for phase in DURATION_PHASES {
                if let Some(ms) = p.duration_ms.get(phase) {
                    s.phases
                        .entry(phase)
                        .or_default()
                        .observe(*ms as f64 / 1000.0);
                }
            }
            for (key, value) in &p.sink.metrics {
                if key == CACHE_DURATION_KEY {
                    continue;
                }
                let Some((sink, metric)) = SinkMetric::parse_key(key) else {
                    continue;
                };
                let f = s.sinks.entry(sink.to_string()).or_default();
                match metric {
                    SinkMetric::Rows => f.rows += value.parse::<u64>().unwrap_or(0),
                    SinkMetric::Skipped => f.skipped += 1,
                    SinkMetric::DurationMs => f
                        .duration
                        .observe(value.parse::<f64>().unwrap_or(0.0) / 1000.0),
                    _ => {}
                }
            }
            let add = p.duration(weir_core::engine::Phase::AddBatch) as f64;
            if interval_ms > 0.0 {
                let r = add / interval_ms;
                s.add_batch_ratio = Some(r);
                if r <= s.behind_fraction {
                    s.behind = false;
                }
            }
            if s.recent_json.len() == RECENT {
                s.recent_json.pop_front();
            }
            s.recent_json.push_back(p.json());
        });
    }

    fn on_batch_started(&self, _e: &BatchStarted) {
        self.with(|s| {
            // A batch after a quiet spell: the stall limit counts from its start, and the
            // query is not idle while it runs.
            s.idle = false;
            s.last_activity = Instant::now();
        });
    }

    fn on_query_idle(&self, _e: &QueryIdle) {
        self.with(|s| {
            s.last_activity = Instant::now();
            s.idle = true;
            // Nothing was left to run: a retry, if one ran, got through.
            if s.next_attempt.take().is_some() {
                s.phase = Phase::Active;
            }
        });
    }

    fn on_query_terminated(&self, e: &QueryTerminated) {
        self.with(|s| match &e.error {
            Some(err) => {
                s.phase = Phase::Failed;
                s.failed += 1;
                s.last_error = Some(err.clone());
            }
            None => s.phase = Phase::Stopped,
        });
    }

    fn on_query_retrying(&self, e: &QueryRetrying) {
        self.with(|s| {
            s.phase = Phase::Retrying;
            s.retried += 1;
            s.last_error = Some(e.error.clone());
            s.next_attempt = Some(NextAttempt {
                batch_id: e.batch_id,
                failed: e.failed,
                attempts: e.attempts,
                at: now_seconds() + e.pause_ms as f64 / 1000.0,
            });
        });
    }

    fn on_falling_behind(&self, e: &FallingBehind) {
        self.with(|s| {
            s.behind = true;
            s.behind_fraction = e.fraction;
        });
    }
}
