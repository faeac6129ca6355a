//! A Kafka-protocol broker for tests: `noida-db` (PyPI) started with `--only kafka` on a free
//! port in a temp folder, one per test binary, stopped (SIGTERM) when the test process ends.
//! The binary is found at `$NOIDA_DB`, or `/opt/noida/noida_db/noida-db` where `.ci/run`
//! installs it (`pip install --no-deps --only-binary=:all: --target /opt/noida noida-db==0.2.3`).
//! `KAFKA_BOOTSTRAP` points the tests at a broker of your own instead.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::service;

/// A running broker.
#[derive(Debug, Clone)]
pub struct KafkaBroker {
    pub bootstrap: String,
}

static BROKER: OnceLock<KafkaBroker> = OnceLock::new();

/// The shared broker of this test binary, started on first use.
pub fn kafka() -> &'static KafkaBroker {
    BROKER.get_or_init(|| match std::env::var("KAFKA_BOOTSTRAP") {
        Ok(b) if !b.is_empty() => KafkaBroker { bootstrap: b },
        _ => start(),
    })
}

/// The broker binary (`$NOIDA_DB` or where `.ci/run` installs it).
pub(crate) fn binary() -> PathBuf {
    service::binary(
        "NOIDA_DB",
        "/opt/noida/noida_db/noida-db",
        "run `python3 -m pip install --no-deps --only-binary=:all: --target /opt/noida \
         noida-db==0.2.3`",
    )
}

fn start() -> KafkaBroker {
    let dir = crate::temp_dir().keep();
    let port = service::free_port();
    let mut cmd = Command::new(binary());
    cmd.args(["start", "--data-dir"])
        .arg(dir.join("data"))
        .args([
            "--host",
            "127.0.0.1",
            "--only",
            "kafka",
            "--kafka-port",
            &port.to_string(),
        ]);
    service::start(cmd, "broker", &dir, port);
    KafkaBroker {
        bootstrap: format!("127.0.0.1:{port}"),
    }
}
