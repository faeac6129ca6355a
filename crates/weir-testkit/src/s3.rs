//! An S3-compatible server for tests: moto's server mode (PyPI `moto[s3]`), which honours
//! `If-None-Match: *` and `If-Match` on PutObject as S3 does. One per test binary, on a free
//! port, stopped when the test process ends. The binary is `$MOTO_SERVER`, or
//! `/opt/moto/bin/moto_server` where `.ci/run` installs it. `S3_ENDPOINT` points the tests
//! at a server of your own (path-style, any credentials).

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::OnceLock;

/// A running S3 server.
#[derive(Debug, Clone)]
pub struct S3Server {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

static SERVER: OnceLock<S3Server> = OnceLock::new();

/// The shared S3 server of this test binary, started on first use.
pub fn s3() -> &'static S3Server {
    SERVER.get_or_init(|| match std::env::var("S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => S3Server { endpoint: e },
        _ => start(),
    })
}

fn start() -> S3Server {
    let bin = crate::service::binary(
        "MOTO_SERVER",
        "/opt/moto/bin/moto_server",
        "python3 -m venv /opt/moto && /opt/moto/bin/pip install 'moto[s3]' flask flask-cors",
    );
    let dir = crate::temp_dir().keep();
    let port = crate::service::free_port();
    let mut cmd = Command::new(bin);
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
    crate::service::start(cmd, "moto", &dir, port);
    S3Server {
        endpoint: format!("http://127.0.0.1:{port}"),
    }
}

impl S3Server {
    /// The object-store settings for this server (`[storage]` in a pipeline).
    pub fn options(&self) -> BTreeMap<String, String> {
        [
            ("aws_endpoint", self.endpoint.as_str()),
            ("aws_access_key_id", "test"),
            ("aws_secret_access_key", "test"),
            ("aws_region", "us-east-1"),
            ("aws_allow_http", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// Creates `bucket` (a signed PUT with curl; an existing bucket is fine).
    pub fn bucket(&self, bucket: &str) {
        let out = Command::new("curl")
            .args([
                "-s",
                "-f",
                "-X",
                "PUT",
                "--aws-sigv4",
                "aws:amz:us-east-1:s3",
                "--user",
                "test:test",
                "-H",
                "x-amz-content-sha256:UNSIGNED-PAYLOAD",
            ])
            .arg(format!("{}/{bucket}", self.endpoint))
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => panic!(
                "creating bucket {bucket}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => panic!("creating bucket {bucket} with curl: {e}"),
        }
    }
}
