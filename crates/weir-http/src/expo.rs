//! Prometheus' text exposition format (version 0.0.4), written by hand: HELP and TYPE once
//! per metric, label values escaped.

use std::collections::HashSet;
use std::fmt::Write;

/// A page of metrics being written.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
    described: HashSet<String>,
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A number as Prometheus reads it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

impl Exposition {
    pub fn new() -> Self {
        Exposition::default()
    }

    /// `# HELP` and `# TYPE` for `name`, once.
    pub fn help(&mut self, name: &str, kind: &str, help: &str) {
        if self.described.insert(name.to_string()) {
            let _ = writeln!(self.text, "# HELP {name} {help}");
            let _ = writeln!(self.text, "# TYPE {name} {kind}");
        }
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {}", number(value));
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.help(name, "counter", help);
        self.sample(name, labels, value);
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.help(name, "gauge", help);
        self.sample(name, labels, value);
    }

    /// The page.
    pub fn finish(self) -> String {
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_escape_labels_and_describe_each_metric_once() {
        let mut e = Exposition::new();
        e.counter("a_total", "As.", &[("q", "x\"y\\z\nw")], 3.0);
        e.counter("a_total", "As.", &[("q", "b")], 0.5);
        e.gauge("g", "G.", &[], f64::INFINITY);
        assert_eq!(
            e.finish(),
            "# HELP a_total As.\n# TYPE a_total counter\na_total{q=\"x\\\"y\\\\z\\nw\"} 3\n\
             a_total{q=\"b\"} 0.5\n# HELP g G.\n# TYPE g gauge\ng +Inf\n"
        );
    }
}
