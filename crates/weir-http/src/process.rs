//! The standard `process_` metrics, from `/proc` (Linux).

use crate::expo::Exposition;

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;
const PAGE: f64 = 4096.0;

/// A process's figures from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time.
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    /// Seconds after boot at which the process started.
    pub started_after_boot: f64,
}

/// The figures of process `pid` (`"self"`: this one), `None` without `/proc`.
pub fn process_stats(pid: &str) -> Option<ProcessStats> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): `rest[0]` is
    // field 3 of proc(5) (state), so field n is `rest[n - 3]`.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(ProcessStats {
        cpu_seconds: (num(11)? + num(12)?) / TICKS,
        started_after_boot: num(19)? / TICKS,
        virtual_bytes: num(20)?,
        resident_bytes: num(21)? * PAGE,
    })
}

/// Adds `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_start_time_seconds` and `process_open_fds`.
pub(crate) fn render(out: &mut Exposition) {
    let Some(p) = process_stats("self") else {
        return;
    };
    out.counter(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        &[],
        p.cpu_seconds,
    );
    out.gauge(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        &[],
        p.virtual_bytes,
    );
    out.gauge(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        &[],
        p.resident_bytes,
    );
    if let Some(boot) = boot_time() {
        out.gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            &[],
            boot + p.started_after_boot,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        out.gauge(
            "process_open_fds",
            "Number of open file descriptors.",
            &[],
            fds.count() as f64,
        );
    }
}

fn boot_time() -> Option<f64> {
    std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}
