//! The test broker behind TLS: noida-db speaks plaintext Kafka (and accepts SASL PLAIN and
//! OAUTHBEARER with any credentials), and advertises the address it binds. To serve it over
//! TLS it runs in its own network namespace on 127.0.0.1:PORT, and socat terminates TLS on
//! 127.0.0.1:PORT outside and forwards through a Unix socket, so the advertised address is
//! the TLS one. The certificate is a fresh self-signed one (`ca` below). Needs root, `ip`
//! (iproute2), `socat` and `openssl`; `.ci/run` installs them. Everything is stopped, and the
//! namespace deleted, when the test process ends.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// A broker reachable only over TLS.
#[derive(Debug, Clone)]
pub struct TlsBroker {
    /// `127.0.0.1:PORT`.
    pub bootstrap: String,
    /// The PEM certificate to trust (`ssl.ca.location`).
    pub ca: PathBuf,
}

static BROKER: OnceLock<TlsBroker> = OnceLock::new();

/// The shared TLS broker of this test binary, started on first use.
pub fn kafka_tls() -> &'static TlsBroker {
    BROKER.get_or_init(start)
}

fn run(cmd: &mut Command, what: &str) {
    match cmd.output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{what}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("{what}: {e}"),
    }
}

fn start() -> TlsBroker {
    let noida = crate::kafka::binary();
    let dir = crate::temp_dir().keep();
    let port = crate::service::free_port();
    let ns = format!("weir-kafka-{}-{port}", std::process::id());
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    run(
        Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .args([
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
            ]),
        "making a test certificate (openssl)",
    );
    run(
        Command::new("ip").args(["netns", "add", &ns]),
        "ip netns add",
    );
    run(
        Command::new("ip").args(["-n", &ns, "link", "set", "lo", "up"]),
        "ip link set lo up",
    );
    let sock = dir.join("kafka.sock");
    let log = |name: &str| {
        std::fs::File::create(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let spawn = |cmd: &mut Command, name: &str| -> u32 {
        let l = log(&format!("{name}.log"));
        let e = l.try_clone().unwrap_or_else(|e| panic!("{name}: {e}"));
        match cmd.stdin(Stdio::null()).stdout(l).stderr(e).spawn() {
            Ok(c) => c.id(),
            Err(e) => panic!("starting {name}: {e}"),
        }
    };
    let broker = spawn(
        Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(&noida)
            .args(["start", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--host",
                "127.0.0.1",
                "--only",
                "kafka",
                "--kafka-port",
                &port.to_string(),
            ]),
        "broker",
    );
    let inner = spawn(
        Command::new("ip")
            .args(["netns", "exec", &ns, "socat"])
            .args([
                format!("UNIX-LISTEN:{},fork", sock.display()),
                format!("TCP:127.0.0.1:{port}"),
            ]),
        "socat-inner",
    );
    let outer = spawn(
        Command::new("socat").args([
            format!(
                "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
                cert.display(),
                key.display()
            ),
            format!("UNIX-CONNECT:{}", sock.display()),
        ]),
        "socat-tls",
    );
    let watchdog = format!(
        "while [ -d /proc/{me} ]; do sleep 1; done; kill -TERM {broker} {inner} {outer} 2>/dev/null; \
         sleep 1; ip netns pids {ns} | xargs -r kill -9; ip netns del {ns}",
        me = std::process::id()
    );
    let _ = Command::new("sh")
        .args(["-c", &watchdog])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    // The TLS side is up when the broker behind it answers: wait for the socket and port.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !sock.exists() || std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if std::time::Instant::now() > deadline {
            panic!("the TLS broker did not come up; see {}", dir.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    TlsBroker {
        bootstrap: format!("127.0.0.1:{port}"),
        ca: cert,
    }
}
