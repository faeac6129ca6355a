//! Starting a test server: a free port, a log file in a temp folder, a watchdog that stops the
//! server when the test process ends (however it ends), and a wait for the port.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => panic!("no free port: {e}"),
    }
}

/// `$var`, or `default`; panics with `install` (how to get it) when the file is missing.
pub fn binary(var: &str, default: &str, install: &str) -> PathBuf {
    let p = std::env::var(var)
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(default));
    if !p.exists() {
        panic!(
            "no {} : {install} (.ci/run does), or set {var}",
            p.display()
        );
    }
    p
}

/// Starts `cmd` with output to `<dir>/<name>.log`, stops it (SIGTERM) when this process
/// ends, and waits up to 60 s for `port` to accept connections. Its process id.
pub fn start(mut cmd: Command, name: &str, dir: &Path, port: u16) -> u32 {
    let log_path = dir.join(format!("{name}.log"));
    let log = match std::fs::File::create(&log_path) {
        Ok(f) => f,
        Err(e) => panic!("{name} log: {e}"),
    };
    let err = log
        .try_clone()
        .unwrap_or_else(|e| panic!("{name} log: {e}"));
    let child = match cmd.stdin(Stdio::null()).stdout(log).stderr(err).spawn() {
        Ok(c) => c,
        Err(e) => panic!("starting {name}: {e}"),
    };
    let watchdog = format!(
        "while [ -d /proc/{me} ]; do sleep 1; done; kill -TERM {pid} 2>/dev/null",
        me = std::process::id(),
        pid = child.id()
    );
    let _ = Command::new("sh")
        .args(["-c", &watchdog])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            panic!(
                "{name} did not open port {port}; see {}",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.id()
}
