//! librdkafka repeats itself: while a broker is down its client reports "AllBrokersDown"
//! several times a second (517 identical lines in 40 s here), which buries weir's own lines
//! about the retry. The source's clients take this context: each distinct librdkafka log
//! line or error is shown once a minute per process; weir's own lines are untouched.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;

/// How long the same librdkafka message stays quiet after it was shown.
const WINDOW: Duration = Duration::from_secs(60);

/// At most this many distinct messages remembered (a bound on memory; older ones go).
const REMEMBERED: usize = 1_000;

/// Whether `message`, seen `now`, is shown: not shown within `window` before. Records it.
fn first_in_window(
    shown: &mut HashMap<String, Instant>,
    message: &str,
    now: Instant,
    window: Duration,
) -> bool {
    if let Some(at) = shown.get(message)
        && now.duration_since(*at) < window
    {
        return false;
    }
    if shown.len() >= REMEMBERED {
        shown.retain(|_, at| now.duration_since(*at) < window);
    }
    shown.insert(message.to_string(), now);
    true
}

/// Whether this process shows `message` now.
fn show(message: &str) -> bool {
    static SHOWN: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    match SHOWN.get_or_init(Default::default).lock() {
        Ok(mut shown) => first_in_window(&mut shown, message, Instant::now(), WINDOW),
        Err(_) => true,
    }
}

/// The context of the source's consumers: librdkafka's lines, repeats held back.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        let line = format!("librdkafka: {fac} {log_message}");
        if !show(&line) {
            return;
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", "{line}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", "{line}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "{line}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", "{line}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let line = format!("librdkafka: {error}: {reason}");
        if show(&line) {
            tracing::error!(target: "librdkafka", "{line} (repeats held back for a minute)");
        }
    }
}

impl ConsumerContext for Quiet {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_librdkafka_message_is_shown_once_a_minute() {
        let mut shown = HashMap::new();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // message, seconds after t0, shown
        for (message, at, want) in [
            ("AllBrokersDown", 0, true),
            ("AllBrokersDown", 1, false),
            ("Connect failed", 1, true),
            ("AllBrokersDown", 59, false),
            ("AllBrokersDown", 61, true),
            ("AllBrokersDown", 62, false),
        ] {
            assert_eq!(
                first_in_window(&mut shown, message, t0 + s(at), WINDOW),
                want,
                "{message} at {at} s"
            );
        }
    }
}
