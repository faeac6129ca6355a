//! A Kafka-protocol broker for tests: `noida-db` (PyPI) started with `--only kafka` on a free
//! port in a temp folder, one per test binary, stopped (SIGTERM) when the test process ends.
//! The binary is found at `$NOIDA_DB`, or `/opt/noida/noida_db/noida-db` where `.ci/run`
//! installs it (`pip install --no-deps --only-binary=:all: --target /opt/noida noida-db==0.2.3`).
//! `KAFKA_BOOTSTRAP` points the tests at a broker of your own instead.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

fn binary() -> PathBuf {
    let p = std::env::var("NOIDA_DB")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("/opt/noida/noida_db/noida-db"));
    if !p.exists() {
        panic!(
            "no Kafka-protocol broker at {}: run `python3 -m pip install --no-deps --only-binary=:all: \
             --target /opt/noida noida-db==0.2.3` (.ci/run does), or set NOIDA_DB or KAFKA_BOOTSTRAP",
            p.display()
        );
    }
    p
}

fn start() -> KafkaBroker {
    let bin = binary();
    let dir = crate::temp_dir().keep();
    let port = match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => panic!("no free port: {e}"),
    };
    let log = match std::fs::File::create(dir.join("broker.log")) {
        Ok(f) => f,
        Err(e) => panic!("broker log: {e}"),
    };
    let child = Command::new(&bin)
        .args(["start", "--data-dir"])
        .arg(dir.join("data"))
        .args([
            "--host",
            "127.0.0.1",
            "--only",
            "kafka",
            "--kafka-port",
            &port.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(
            log.try_clone()
                .unwrap_or_else(|e| panic!("broker log: {e}")),
        )
        .stderr(log)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => panic!("starting {}: {e}", bin.display()),
    };
    let watchdog = format!(
        "while [ -d /proc/{me} ]; do sleep 1; done; kill -TERM {broker} 2>/dev/null",
        me = std::process::id(),
        broker = child.id()
    );
    let _ = Command::new("sh")
        .args(["-c", &watchdog])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            panic!(
                "the broker did not open port {port}; see {}",
                dir.join("broker.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    KafkaBroker {
        bootstrap: format!("127.0.0.1:{port}"),
    }
}
