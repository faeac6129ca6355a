//! Azure's emulator Azurite (npm `azurite`), blob service only, for tests. One per test
//! binary, on a free port, stopped when the test process ends. Clients reach it through
//! `azure_storage_endpoint` (the account in the path, as the emulator serves it), not
//! object_store's emulator mode, which only knows port 10000 (or a process-wide
//! environment variable). Azurite ignores a listing's `startFrom`; weir's stores filter
//! such listings themselves, so the non-emulator mode lists correctly against it. The
//! binary is `$AZURITE_BLOB`, or `/opt/azurite/node_modules/.bin/azurite-blob` where
//! `.ci/run` installs it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::Command;
use std::sync::OnceLock;

use base64::Engine;

/// The emulator's well-known development account.
pub(crate) const ACCOUNT: &str = "devstoreaccount1";
const KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A running Azurite blob service.
#[derive(Debug, Clone)]
pub struct Azurite {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    port: u16,
}

static SERVER: OnceLock<Azurite> = OnceLock::new();

/// The shared Azurite of this test binary, started on first use.
pub fn azurite() -> &'static Azurite {
    SERVER.get_or_init(start)
}

fn start() -> Azurite {
    let bin = crate::service::binary(
        "AZURITE_BLOB",
        "/opt/azurite/node_modules/.bin/azurite-blob",
        "npm install --prefix /opt/azurite azurite",
    );
    let dir = crate::temp_dir().keep();
    let port = crate::service::free_port();
    let mut cmd = Command::new(bin);
    cmd.args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
        .arg("--location")
        .arg(dir.join("data"))
        .args([
            "--skipApiVersionCheck",
            "--loose",
            "--disableTelemetry",
            "--silent",
        ]);
    crate::service::start(cmd, "azurite", &dir, port);
    Azurite {
        endpoint: format!("http://127.0.0.1:{port}"),
        port,
    }
}

impl Azurite {
    /// The object-store settings for this emulator (`[storage]` in a pipeline).
    pub fn options(&self) -> BTreeMap<String, String> {
        [
            ("azure_storage_account_name", ACCOUNT),
            ("azure_storage_account_key", KEY),
            ("azure_allow_http", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain([(
            "azure_storage_endpoint".to_string(),
            format!("{}/{ACCOUNT}", self.endpoint),
        )])
        .collect()
    }

    /// Creates `container` (a SharedKey-signed PUT; an existing one is fine).
    pub fn container(&self, container: &str) {
        let date = chrono::Utc::now()
            .format("%a, %d %b %Y %H:%M:%S GMT")
            .to_string();
        let version = "2021-08-06";
        let to_sign = format!(
            "PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
        );
        let key = base64::engine::general_purpose::STANDARD
            .decode(KEY)
            .unwrap_or_else(|e| panic!("the Azurite key: {e}"));
        let tag = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key),
            to_sign.as_bytes(),
        );
        let sig = base64::engine::general_purpose::STANDARD.encode(tag.as_ref());
        let request = format!(
            "PUT /{ACCOUNT}/{container}?restype=container HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
             x-ms-date: {date}\r\nx-ms-version: {version}\r\nAuthorization: SharedKey {ACCOUNT}:{sig}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n",
            port = self.port
        );
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))
            .unwrap_or_else(|e| panic!("connecting to Azurite: {e}"));
        s.write_all(request.as_bytes())
            .unwrap_or_else(|e| panic!("creating container {container}: {e}"));
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        let status = answer.split_whitespace().nth(1).unwrap_or_default();
        if status != "201" && status != "409" {
            panic!("creating container {container}: {answer}");
        }
    }
}
