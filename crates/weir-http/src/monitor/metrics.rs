//! The query's figures in Prometheus' text format (`/metrics`).

use super::*;

impl Monitor {
    /// The metrics in Prometheus' text format (without the `process_` ones).
    pub fn render(&self, out: &mut crate::expo::Exposition) {
        let q = [("query", self.name.as_str())];
        // A poisoned state renders nothing of the query's.
        let _ = self.with(|s| {
            out.gauge(
                "weir_query_up",
                "1 while the query runs (starting, active or retrying), 0 once it stopped or failed",
                &q,
                f64::from(u8::from(matches!(
                    s.phase,
                    Phase::Starting | Phase::Active | Phase::Retrying
                ))),
            );
            out.counter(
                "weir_batches_committed_total",
                "Batches committed",
                &q,
                s.committed as f64,
            );
            out.counter(
                "weir_batches_failed_total",
                "Batches that failed (the query stopped with the error)",
                &q,
                s.failed as f64,
            );
            out.counter(
                "weir_query_retries_total",
                "Runs that failed with an error that may pass (a server down, a connection \
                 cut) and were started again from the checkpoint after a pause",
                &q,
                s.retried as f64,
            );
            out.counter(
                "weir_batches_replayed_total",
                "Uncommitted batches run again at start, with their recorded id and offsets",
                &q,
                s.replayed as f64,
            );
            out.help(
                "weir_input_rows_total",
                "counter",
                "Rows read from the source",
            );
            for (source, rows) in &s.input_rows {
                out.sample(
                    "weir_input_rows_total",
                    &[("query", &self.name), ("source", source)],
                    *rows as f64,
                );
            }
            if let Some(n) = s.last_workers {
                out.gauge(
                    "weir_cluster_workers",
                    "Cluster workers that ran tasks of the last batch",
                    &q,
                    n as f64,
                );
                out.help(
                    "weir_cluster_worker_tasks_total",
                    "counter",
                    "Tasks of the batches' plans a cluster worker ran",
                );
                for (url, (tasks, _)) in &s.workers {
                    out.sample(
                        "weir_cluster_worker_tasks_total",
                        &[("query", &self.name), ("worker", url)],
                        *tasks as f64,
                    );
                }
                out.help(
                    "weir_cluster_worker_input_rows_total",
                    "counter",
                    "Input rows a cluster worker's tasks read",
                );
                for (url, (_, rows)) in &s.workers {
                    out.sample(
                        "weir_cluster_worker_input_rows_total",
                        &[("query", &self.name), ("worker", url)],
                        *rows as f64,
                    );
                }
            }
            out.help("weir_sink_rows_total", "counter", "Rows a sink wrote");
            for (sink, f) in &s.sinks {
                out.sample(
                    "weir_sink_rows_total",
                    &[("query", &self.name), ("sink", sink)],
                    f.rows as f64,
                );
            }
            out.help(
                "weir_sink_skipped_batches_total",
                "counter",
                "Batches a sink found already written (a replay) and skipped",
            );
            for (sink, f) in &s.sinks {
                out.sample(
                    "weir_sink_skipped_batches_total",
                    &[("query", &self.name), ("sink", sink)],
                    f.skipped as f64,
                );
            }
            out.help(
                "weir_batch_phase_duration_seconds",
                "histogram",
                "Time per durationMs phase of a batch",
            );
            for (phase, h) in &s.phases {
                h.render(
                    out,
                    "weir_batch_phase_duration_seconds",
                    &[("query", &self.name), ("phase", phase)],
                );
            }
            out.help(
                "weir_sink_duration_seconds",
                "histogram",
                "Time a sink took per batch",
            );
            for (sink, f) in &s.sinks {
                if f.duration.count() > 0 {
                    f.duration.render(
                        out,
                        "weir_sink_duration_seconds",
                        &[("query", &self.name), ("sink", sink)],
                    );
                }
            }
            if let Some(r) = s.add_batch_ratio {
                out.gauge(
                    "weir_add_batch_interval_ratio",
                    "The last batch's addBatch time over the trigger interval",
                    &q,
                    r,
                );
            }
            out.gauge(
                "weir_falling_behind",
                "1 while addBatch stays above the alert fraction of the trigger interval",
                &q,
                f64::from(u8::from(s.behind)),
            );
            if let Some((id, at)) = s.last_batch {
                out.gauge(
                    "weir_last_committed_batch_id",
                    "The last committed batch id",
                    &q,
                    id as f64,
                );
                out.gauge(
                    "weir_last_commit_timestamp_seconds",
                    "When the last batch was committed (Unix time)",
                    &q,
                    at,
                );
            }
            let behind = sources_behind(s);
            out.help(
                "weir_source_records_behind",
                "gauge",
                "Records after the last batch's end, per source that counts them (Kafka)",
            );
            for (source, b) in &behind {
                if let Some(r) = b.records {
                    out.sample(
                        "weir_source_records_behind",
                        &[("query", &self.name), ("source", source)],
                        r as f64,
                    );
                }
            }
            out.help(
                "weir_source_seconds_behind",
                "gauge",
                "Seconds a source has had a backlog without a break (its newest offset beyond \
                 every batch's end since); 0 when the last batch caught up",
            );
            for (source, b) in &behind {
                out.sample(
                    "weir_source_seconds_behind",
                    &[("query", &self.name), ("source", source)],
                    b.seconds as f64,
                );
            }
            out.help(
                "weir_kafka_records_behind",
                "gauge",
                "Kafka records after the last committed offset, per partition",
            );
            for ((topic, p), lag) in &s.lag {
                out.sample(
                    "weir_kafka_records_behind",
                    &[("query", &self.name), ("topic", topic), ("partition", p)],
                    *lag as f64,
                );
            }
        });
    }
}
