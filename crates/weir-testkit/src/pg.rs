//! An ephemeral PostgreSQL server: `initdb` and `pg_ctl` from the installed server binaries
//! (`/usr/lib/postgresql/<ver>/bin`, run as user `postgres` when we are root), in a temp
//! folder under /tmp, on a free port. One per test binary; a watchdog stops it when the test
//! process exits. `DATABASE_URL` points the tests at an existing server instead.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// A running server's connection string (libpq key=value form).
#[derive(Debug, Clone)]
pub struct PgServer {
    pub url: String,
    /// How to stop and start it again (`None`: a server given by `DATABASE_URL`).
    ctl: Option<Ctl>,
}

/// `pg_ctl` and what it needs to start the same server again.
#[derive(Debug, Clone)]
struct Ctl {
    pg_ctl: PathBuf,
    data: String,
    log: String,
    opts: String,
}

impl PgServer {
    fn ctl(&self) -> &Ctl {
        match &self.ctl {
            Some(c) => c,
            None => panic!("a server given by DATABASE_URL cannot be stopped by a test"),
        }
    }

    /// Stops the server as an administrator does (`pg_ctl stop -m fast`: open sessions are
    /// ended with SQLSTATE 57P01, new connections refused).
    pub fn stop(&self) {
        let c = self.ctl();
        run(
            as_postgres(
                &c.pg_ctl.to_string_lossy(),
                &["-D", &c.data, "-m", "fast", "-w", "stop"],
            ),
            "pg_ctl stop",
        );
    }

    /// Freezes the server (SIGSTOP to the postmaster and every backend): connections stay
    /// open and new ones are accepted by the kernel, but nothing answers.
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        let pid_file = std::path::Path::new(&self.ctl().data).join("postmaster.pid");
        let text = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()));
        let pid = text.lines().next().unwrap_or_default().trim().to_string();
        // The backends first, so that the postmaster cannot notice them stop.
        let _ = Command::new("pkill")
            .args([&format!("-{sig}"), "-P", &pid])
            .status();
        run(
            {
                let mut c = Command::new("kill");
                c.args([&format!("-{sig}"), &pid]);
                c
            },
            "kill",
        );
    }

    /// Starts the stopped server again, on the same address and data.
    pub fn start(&self) {
        let c = self.ctl();
        run(
            as_postgres(
                &c.pg_ctl.to_string_lossy(),
                &["-D", &c.data, "-l", &c.log, "-w", "-o", &c.opts, "start"],
            ),
            "pg_ctl start",
        );
    }
}

static SERVER: OnceLock<PgServer> = OnceLock::new();

/// The shared server of this test binary, started on first use.
pub fn postgres() -> &'static PgServer {
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => PgServer { url, ctl: None },
        _ => start(),
    })
}

fn bin_dir() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|it| {
            it.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .filter(|p| p.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    match versions.pop() {
        Some(v) => v,
        None => panic!(
            "no PostgreSQL server binaries under /usr/lib/postgresql: install the `postgresql` package \
             (.ci/run does) or set DATABASE_URL"
        ),
    }
}

fn free_port() -> u16 {
    match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => panic!("no free port: {e}"),
    }
}

fn as_postgres(cmd: &str, args: &[&str]) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", cmd]).args(args);
        c
    } else {
        let mut c = Command::new(cmd);
        c.args(args);
        c
    }
}

fn run(mut c: Command, what: &str) {
    match c.output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("{what}: {e}"),
    }
}

fn start() -> PgServer {
    start_postgres("127.0.0.1", free_port())
}

/// Another throw-away server, listening on `addr` (a loopback address: `127.0.0.2` is free
/// on Linux) and `port`, stopped when the test process ends. Two servers on one port and
/// different addresses stand for "the same URL reaches another server on another machine".
pub fn start_postgres(addr: &str, port: u16) -> PgServer {
    let bin = bin_dir();
    let dir = crate::temp_dir().keep();
    let data = dir.join("data");
    let _ = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&dir)
        .status();
    let initdb = bin.join("initdb");
    let pg_ctl = bin.join("pg_ctl");
    let d = data.to_string_lossy().to_string();
    run(
        as_postgres(
            &initdb.to_string_lossy(),
            &[
                "-D",
                &d,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ],
        ),
        "initdb",
    );
    let opts = format!(
        "-p {port} -k {} -c listen_addresses={addr} -c fsync=off -c max_connections=200",
        dir.display()
    );
    let log = dir.join("pg.log").to_string_lossy().to_string();
    run(
        as_postgres(
            &pg_ctl.to_string_lossy(),
            &["-D", &d, "-l", &log, "-w", "-o", &opts, "start"],
        ),
        "pg_ctl start",
    );
    // Stop the server when this test process ends, however it ends.
    let watchdog = format!(
        "while [ -d /proc/{pid} ]; do sleep 1; done; {pg_ctl} -D {d} -m immediate -w stop >/dev/null 2>&1",
        pid = std::process::id(),
        pg_ctl = pg_ctl.display()
    );
    let _ = as_postgres("sh", &["-c", &watchdog])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    PgServer {
        url: format!("host={addr} port={port} user=postgres dbname=postgres"),
        ctl: Some(Ctl {
            pg_ctl,
            data: d,
            log,
            opts,
        }),
    }
}
