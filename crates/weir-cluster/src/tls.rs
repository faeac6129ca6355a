//! TLS between a driver and its workers, and between workers (a shuffle reads from
//! another worker): workers listed as `https://` serve with a certificate and key (PEM,
//! `weir worker --tls-cert --tls-key`), and whoever connects to them checks the certificate
//! against a CA certificate (PEM, `[cluster] tls-ca` on the driver, `--tls-ca` on a worker).
//! The certificate must name the host the URL dials (a DNS name or an IP address), or the
//! name given as `tls-domain` (workers dialled by the addresses of one DNS name, a
//! Kubernetes headless Service, whose certificate names the Service).

use std::path::Path;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::{Error, Result};

/// Names aws-lc-rs as the process's rustls provider, once (rustls is built with ring as
/// well, for other crates, and then takes neither by itself). A provider installed before
/// stays.
fn provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err: another provider was installed first, which serves as well.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    });
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| Error::Tls {
        what: key.into(),
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    if !String::from_utf8_lossy(&bytes).contains("-----BEGIN") {
        return Err(Error::Tls {
            what: key.into(),
            reason: format!("{} is not PEM (no -----BEGIN line)", path.display()),
        });
    }
    Ok(bytes)
}

/// What a client (driver, or a worker dialling another) checks workers' certificates with:
/// the CA certificate at `ca` (setting `key`), and the name to expect when it is not the
/// dialled host.
pub fn client(key: &str, ca: &Path, domain: Option<&str>) -> Result<ClientTlsConfig> {
    provider();
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(key, ca)?));
    Ok(match domain {
        Some(d) => tls.domain_name(d),
        None => tls,
    })
}

/// A worker's TLS: its certificate and key (PEM files), and how it checks the other
/// workers it reads shuffles from.
#[derive(Debug, Clone)]
pub struct WorkerTls {
    pub server: ServerTlsConfig,
    pub peers: ClientTlsConfig,
}

impl WorkerTls {
    /// From `weir worker`'s `--tls-cert`, `--tls-key`, `--tls-ca` (the other workers' CA;
    /// without it, this worker's own certificate is taken as that CA, as for a
    /// self-signed certificate shared by all workers) and `--tls-domain`.
    pub fn from_files(
        cert: &Path,
        key: &Path,
        ca: Option<&Path>,
        domain: Option<&str>,
    ) -> Result<WorkerTls> {
        provider();
        let identity = Identity::from_pem(read("--tls-cert", cert)?, read("--tls-key", key)?);
        let peers = match ca {
            Some(ca) => client("--tls-ca", ca, domain)?,
            None => client("--tls-cert", cert, domain)?,
        };
        Ok(WorkerTls {
            server: ServerTlsConfig::new().identity(identity),
            peers,
        })
    }
}
