//! The `[cluster]` table of a pipeline.
//!
//! ```toml
//! [cluster]
//! workers = ["http://10.0.0.5:7400", "http://10.0.0.6:7400"]  # or one DNS name for many
//! # workers = ["https://10.0.0.5:7400"] with tls-ca = "ca.pem": TLS, certificates checked
//! # against that CA (tls-domain = "weir-workers" when they name another host than the URL)
//! token = "env:WEIR_CLUSTER_TOKEN"    # checked by every worker on every request
//! max-batch-attempts = 3              # a batch's plan, run again on the workers left
//! connect-timeout = "5s"
//! liveness-timeout = "20s"           # a worker silent this long fails the batch's attempt
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use url::Url;

use crate::{Error, Result};

/// How long a peer may leave keep-alive pings unanswered, by default.
pub const DEFAULT_LIVENESS: Duration = Duration::from_secs(20);

/// The `[cluster]` table.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ClusterConfig {
    /// The workers' URLs (`http://host:port`). A host name that resolves to several
    /// addresses (a Kubernetes headless Service) stands for a worker at each, resolved
    /// again before every batch.
    pub workers: Vec<String>,
    /// The cluster token (`env:NAME` reads it from the environment); without one, the
    /// workers must have none either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Attempts of a batch's plan on the cluster before the batch fails (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_attempts: Option<u32>,
    /// How long connecting to a worker may take (default 5 s), e.g. "500ms", "5s".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
    /// How long a worker may leave the driver's keep-alive pings unanswered before its
    /// connection is dropped and the batch's attempt fails (default 20 s): a worker that
    /// freezes or is cut off without a reset is noticed within this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_timeout: Option<String>,
    /// The CA certificate (PEM file) that signed the `https://` workers' certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<String>,
    /// The name the workers' certificates carry, when it is not the host the URLs dial
    /// (one DNS name dialled at each of its addresses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_domain: Option<String>,
}

impl ClusterConfig {
    /// The workers' URLs, checked: `http://host:port`, at least one.
    pub fn urls(&self) -> Result<Vec<Url>> {
        if self.workers.is_empty() {
            return Err(config(
                "workers",
                "no worker listed: give at least one URL, e.g. \"http://10.0.0.5:7400\"",
            ));
        }
        self.workers
            .iter()
            .map(|w| {
                let url = Url::parse(w.trim())
                    .map_err(|e| config("workers", format!("'{w}' is not a URL: {e}")))?;
                if url.scheme() != "http" && url.scheme() != "https" {
                    return Err(config(
                        "workers",
                        format!("'{w}': a worker URL is http://host:port or https://host:port"),
                    ));
                }
                if url.host_str().is_none() || url.port_or_known_default().is_none() {
                    return Err(config("workers", format!("'{w}' has no host and port")));
                }
                Ok(url)
            })
            .collect::<Result<Vec<Url>>>()
            .map(|mut urls| {
                // The same worker listed twice is one worker.
                let mut seen = std::collections::HashSet::new();
                urls.retain(|u| seen.insert(u.clone()));
                urls
            })
    }

    /// The token, read from the environment for `env:NAME`.
    pub fn token(&self) -> Result<Option<String>> {
        Ok(self
            .token
            .as_deref()
            .map(|t| weir_core::connector::secret("cluster.token", t))
            .transpose()?)
    }

    /// Attempts per batch, at least 1.
    pub fn max_batch_attempts(&self) -> Result<u32> {
        match self.max_batch_attempts {
            None => Ok(3),
            Some(0) => Err(config("max-batch-attempts", "must be at least 1")),
            Some(n) => Ok(n),
        }
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Result<Duration> {
        match &self.connect_timeout {
            None => Ok(Duration::from_secs(5)),
            Some(t) => Ok(weir_core::engine::parse_duration(
                "cluster.connect-timeout",
                t,
            )?),
        }
    }

    /// The liveness timeout, at least 1 s.
    pub fn liveness_timeout(&self) -> Result<Duration> {
        match &self.liveness_timeout {
            None => Ok(DEFAULT_LIVENESS),
            Some(t) => {
                let d = weir_core::engine::parse_duration("cluster.liveness-timeout", t)?;
                if d < Duration::from_secs(1) {
                    return Err(config(
                        "liveness-timeout",
                        format!("'{t}' is too short: give at least 1s"),
                    ));
                }
                Ok(d)
            }
        }
    }

    /// How the driver checks `https://` workers (`None`: every worker is `http://`).
    pub fn tls(&self) -> Result<Option<tonic::transport::ClientTlsConfig>> {
        let urls = self.urls()?;
        let https = urls.iter().filter(|u| u.scheme() == "https").count();
        match (&self.tls_ca, https) {
            (None, 0) => {
                if self.tls_domain.is_some() {
                    return Err(config("tls-domain", "only used with https:// workers"));
                }
                Ok(None)
            }
            (None, _) => Err(config(
                "tls-ca",
                "https:// workers need the CA certificate (PEM) that signed theirs",
            )),
            (Some(_), 0) => Err(config(
                "tls-ca",
                "every worker URL is http://: list them as https:// to use TLS",
            )),
            (Some(_), n) if n < urls.len() => Err(config(
                "workers",
                "some workers are https:// and some http://: one cluster speaks one",
            )),
            (Some(ca), _) => crate::tls::client(
                "cluster.tls-ca",
                std::path::Path::new(ca),
                self.tls_domain.as_deref(),
            )
            .map(Some),
        }
    }

    /// Every setting checked, without connecting.
    pub fn check(&self) -> Result<()> {
        self.urls()?;
        self.tls()?;
        self.token()?;
        self.max_batch_attempts()?;
        self.connect_timeout()?;
        self.liveness_timeout()?;
        Ok(())
    }
}

fn config(key: &str, reason: impl Into<String>) -> Error {
    Error::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(workers: &[&str]) -> ClusterConfig {
        ClusterConfig {
            liveness_timeout: None,
            workers: workers.iter().map(|w| w.to_string()).collect(),
            token: None,
            max_batch_attempts: None,
            connect_timeout: None,
            tls_ca: None,
            tls_domain: None,
        }
    }

    #[test]
    fn workers_are_checked_naming_the_setting() {
        assert_eq!(cfg(&["http://127.0.0.1:7400"]).urls().unwrap().len(), 1);
        for (workers, says) in [
            (vec![], "no worker listed"),
            (vec!["127.0.0.1:7400"], "'127.0.0.1:7400'"),
            (
                vec!["ftp://w:7400"],
                "http://host:port or https://host:port",
            ),
            (vec!["not a url"], "is not a URL"),
        ] {
            let e = cfg(&workers).urls().unwrap_err().to_string();
            assert!(e.starts_with("cluster.workers: "), "{e}");
            assert!(e.contains(says), "{e}");
        }
    }

    /// https workers need the CA; the CA needs https workers; one cluster speaks one.
    #[test]
    fn tls_settings_are_checked_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nnot checked here\n").unwrap();
        let not_pem = dir.path().join("ca.txt");
        std::fs::write(&not_pem, "hello").unwrap();
        let with = |workers: &[&str], ca: Option<&std::path::Path>, domain: Option<&str>| {
            let mut c = cfg(workers);
            c.tls_ca = ca.map(|p| p.display().to_string());
            c.tls_domain = domain.map(String::from);
            c.tls().map(|t| t.is_some()).map_err(|e| e.to_string())
        };
        assert_eq!(with(&["http://w:1"], None, None), Ok(false));
        assert_eq!(
            with(&["https://w:1"], Some(&ca), Some("weir-workers")),
            Ok(true)
        );
        for (got, says) in [
            (with(&["https://w:1"], None, None), "cluster.tls-ca"),
            (with(&["http://w:1"], Some(&ca), None), "cluster.tls-ca"),
            (with(&["http://w:1"], None, Some("w")), "cluster.tls-domain"),
            (
                with(&["https://w:1", "http://v:1"], Some(&ca), None),
                "cluster.workers",
            ),
            (with(&["https://w:1"], Some(&not_pem), None), "is not PEM"),
            (
                with(&["https://w:1"], Some(&dir.path().join("gone.pem")), None),
                "cannot read",
            ),
        ] {
            let e = got.unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn settings_have_defaults_and_limits() {
        let mut c = cfg(&["http://w:7400"]);
        assert_eq!(c.liveness_timeout().unwrap(), DEFAULT_LIVENESS);
        c.liveness_timeout = Some("200ms".into());
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("cluster.liveness-timeout") && e.contains("at least 1s"),
            "{e}"
        );
        c.liveness_timeout = None;
        // The same worker twice (a trailing slash is the same URL) is one worker.
        let twice = cfg(&["http://w:7400", "http://w:7400/", "http://v:7400"]);
        assert_eq!(twice.urls().unwrap().len(), 2);
        assert_eq!(c.max_batch_attempts().unwrap(), 3);
        assert_eq!(c.connect_timeout().unwrap(), Duration::from_secs(5));
        c.max_batch_attempts = Some(0);
        assert!(
            c.check()
                .unwrap_err()
                .to_string()
                .contains("max-batch-attempts")
        );
        c.max_batch_attempts = Some(1);
        c.connect_timeout = Some("soon".into());
        assert!(
            c.check()
                .unwrap_err()
                .to_string()
                .contains("connect-timeout")
        );
        c.connect_timeout = Some("250ms".into());
        assert_eq!(c.connect_timeout().unwrap(), Duration::from_millis(250));
        c.token = Some("env:WEIR_TEST_TOKEN_THAT_IS_NOT_SET".into());
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("cluster.token") && e.contains("WEIR_TEST_TOKEN_THAT_IS_NOT_SET is not set"),
            "{e}"
        );
    }
}
