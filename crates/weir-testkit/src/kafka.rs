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
    let own = start_kafka();
    KafkaBroker {
        bootstrap: own.bootstrap.clone(),
    }
}

/// A broker of a test's own, which the test may stop and start again (on the same port
/// and data), touching no other test.
#[derive(Debug)]
pub struct OwnBroker {
    pub bootstrap: String,
    dir: PathBuf,
    port: u16,
    pid: std::sync::Mutex<u32>,
}

/// Starts a broker of the caller's own on a free port.
pub fn start_kafka() -> OwnBroker {
    let dir = crate::temp_dir().keep();
    let port = service::free_port();
    let pid = launch(&dir, port);
    OwnBroker {
        bootstrap: format!("127.0.0.1:{port}"),
        dir,
        port,
        pid: std::sync::Mutex::new(pid),
    }
}

fn launch(dir: &std::path::Path, port: u16) -> u32 {
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
    service::start(cmd, "broker", dir, port)
}

impl OwnBroker {
    /// Stops the broker (SIGTERM) and waits until its port is closed.
    pub fn stop(&self) {
        let pid = *self.pid.lock().unwrap_or_else(|e| e.into_inner());
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // The port is what counts (an exited child stays a zombie until reaped).
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            if std::time::Instant::now() > deadline {
                panic!("the broker on port {} did not stop", self.port);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Freezes the broker (SIGSTOP): connections stay open, nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen broker go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = *self.pid.lock().unwrap_or_else(|e| e.into_inner());
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            panic!("kill {sig} {pid} (the broker) failed");
        }
    }

    /// Starts the stopped broker again, on the same port and data.
    pub fn start(&self) {
        let pid = launch(&self.dir, self.port);
        *self.pid.lock().unwrap_or_else(|e| e.into_inner()) = pid;
    }
}
