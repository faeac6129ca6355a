//! A fixed-bucket histogram in seconds, as Prometheus histograms are.

use crate::expo::Exposition;

/// Upper bounds in seconds: from 1 ms to 10 minutes.
pub(crate) const BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0,
];

#[derive(Debug, Default, Clone)]
pub(crate) struct Histogram {
    /// Observations at or below each bound (not cumulative; summed when rendered).
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub(crate) fn observe(&mut self, seconds: f64) {
        if let Some(i) = BUCKETS.iter().position(|b| seconds <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += seconds;
    }

    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// `_bucket` lines (cumulative, `+Inf` last), `_sum` and `_count`.
    pub(crate) fn render(&self, out: &mut Exposition, name: &str, labels: &[(&str, &str)]) {
        let bucket = format!("{name}_bucket");
        let mut seen = 0;
        for (b, c) in BUCKETS.iter().zip(self.counts) {
            seen += c;
            let le = format!("{b}");
            let mut l = labels.to_vec();
            l.push(("le", &le));
            out.sample(&bucket, &l, seen as f64);
        }
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        out.sample(&bucket, &l, self.count as f64);
        // Observations are whole milliseconds: round away the float noise of the sum.
        out.sample(
            &format!("{name}_sum"),
            labels,
            (self.sum * 1e6).round() / 1e6,
        );
        out.sample(&format!("{name}_count"), labels, self.count as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_end_at_the_count() {
        let mut h = Histogram::default();
        for s in [0.0005, 0.003, 0.003, 700.0] {
            h.observe(s);
        }
        let mut e = Exposition::new();
        h.render(&mut e, "t_seconds", &[("q", "a")]);
        let text = e.finish();
        assert!(
            text.contains("t_seconds_bucket{q=\"a\",le=\"0.001\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{q=\"a\",le=\"0.005\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{q=\"a\",le=\"600\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{q=\"a\",le=\"+Inf\"} 4\n"),
            "{text}"
        );
        assert!(text.contains("t_seconds_count{q=\"a\"} 4\n"), "{text}");
    }
}
