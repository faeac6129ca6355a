//! Progress for people (one line per batch) and for machines (JSON lines).

use std::io::Write;
use std::sync::Mutex;

use anyhow::{Context, Result};
use weir_core::SinkMetric;
use weir_core::engine::{
    FallingBehind, Phase, QueryListener, QueryStarted, StreamingQueryProgress,
};
use weir_core::sink::CACHE_DURATION_KEY;

/// One human line per batch on stdout.
pub(crate) struct HumanLines;

/// A line on stdout for a person. A stdout that went away (a closed pipe, `| head`) drops
/// the line: a reader leaving must not stop or hang the query, as a panicking `println!`
/// did.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

impl QueryListener for HumanLines {
    fn on_query_started(&self, e: &QueryStarted) {
        let what = if e.replay {
            "running it again (it was not committed)"
        } else {
            "new"
        };
        say!(
            "query '{}' [id {}] starts at batch {} ({what})",
            e.name,
            e.id,
            e.first_batch_id
        );
    }

    fn on_query_progress(&self, p: &StreamingQueryProgress) {
        let mut skipped: Vec<&str> = Vec::new();
        let mut per_sink: Vec<String> = Vec::new();
        for (k, v) in &p.sink.metrics {
            match SinkMetric::parse_key(k) {
                Some((sink, SinkMetric::Skipped)) => skipped.push(sink),
                Some((sink, SinkMetric::DurationMs)) if k != CACHE_DURATION_KEY => {
                    per_sink.push(format!("{sink} {v} ms"))
                }
                _ => {}
            }
        }
        let out = if p.sink.num_output_rows >= 0 {
            format!(", {} rows written", p.sink.num_output_rows)
        } else {
            String::new()
        };
        let skip = if skipped.is_empty() {
            String::new()
        } else {
            format!(", skipped as already written: {}", skipped.join(", "))
        };
        let per_sink = if per_sink.len() > 1 {
            format!(": {}", per_sink.join(", "))
        } else {
            String::new()
        };
        say!(
            "batch {}: {} rows in{out}{skip} in {} ms (addBatch {} ms{per_sink})",
            p.batch_id,
            p.num_input_rows,
            p.duration(Phase::TriggerExecution),
            p.duration(Phase::AddBatch)
        );
    }

    fn on_falling_behind(&self, e: &FallingBehind) {
        say!(
            "warning: query '{}' is falling behind: addBatch {} ms vs a {} ms trigger for {} batches",
            e.name,
            e.add_batch_ms,
            e.trigger_interval_ms,
            e.consecutive
        );
    }
}

/// Progress JSON lines, to a file or stdout.
pub(crate) struct JsonLines {
    out: Mutex<Box<dyn Write + Send>>,
}

impl JsonLines {
    pub(crate) fn open(target: &str) -> Result<Self> {
        let out: Box<dyn Write + Send> = if target == "-" {
            Box::new(std::io::stdout())
        } else {
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(target)
                    .with_context(|| format!("opening progress file {target}"))?,
            )
        };
        Ok(JsonLines {
            out: Mutex::new(out),
        })
    }
}

impl QueryListener for JsonLines {
    fn on_query_progress(&self, p: &StreamingQueryProgress) {
        if let Ok(mut out) = self.out.lock() {
            // Progress is advisory: a full disk must not fail a batch that has committed.
            let _ = writeln!(out, "{}", p.json()).and_then(|()| out.flush());
        }
    }
}
