//! The standard `process_` metrics, from `/proc/self` (Linux).

use crate::expo::Exposition;

/// Clock ticks per second of `/proc/self/stat` (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;
const PAGE: f64 = 4096.0;

/// Adds `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_start_time_seconds` and `process_open_fds`.
pub fn render(out: &mut Exposition) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name (which may hold spaces and parentheses).
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    // `rest[0]` is field 3 of proc(5) (state): field n is `rest[n - 3]`.
    if let (Some(u), Some(s)) = (num(11), num(12)) {
        out.counter(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            &[],
            (u + s) / TICKS,
        );
    }
    if let Some(v) = num(20) {
        out.gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            &[],
            v,
        );
    }
    if let Some(r) = num(21) {
        out.gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            &[],
            r * PAGE,
        );
    }
    if let (Some(start), Some(boot)) = (num(19), boot_time()) {
        out.gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            &[],
            boot + start / TICKS,
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
