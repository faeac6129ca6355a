//! A power cut must not leave `commits/N` durable while a sink's batch N is not: traced with
//! strace, every file of batch N in every local sink (Delta data and log files, Parquet parts)
//! and its folder entry are fsynced before `commits/N` is linked into place.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;

use weir_testkit::temp_dir;

use crate::{gen_orders, pipeline};

const SINKS: &str = "[[sink]]\ntype = \"delta-append\"\npath = \"table\"\n\n\
                     [[sink]]\ntype = \"parquet\"\npath = \"out\"\n";

/// The quoted strings of a trace line (paths).
fn quoted(line: &str) -> Vec<&str> {
    line.split('"').skip(1).step_by(2).collect()
}

/// The trace with each syscall on one line: strace -f splits a call that another thread
/// interrupts into `PID call(args <unfinished ...>` and, later, `PID <... call resumed>) = 0`.
/// The joined call takes the place of its `resumed` line (when it returned); its
/// `unfinished` line becomes empty so that line numbers keep the trace's order.
///
/// strace pads the PID column (`6801  fsync(...)`, two spaces): splitting at the first
/// space left a space before the call, so no `resumed` line was ever joined and an fsync
/// interrupted by another thread (common on a loaded machine) went missing from the trace,
/// failing the test now and then though the order was right.
fn joined(text: &str) -> Vec<String> {
    let mut open: HashMap<&str, &str> = HashMap::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let (pid, call) = line
            .split_once(char::is_whitespace)
            .map_or(("", line), |(pid, call)| (pid, call.trim_start()));
        if let Some(head) = call.strip_suffix(" <unfinished ...>") {
            open.insert(pid, head);
            out.push(String::new());
            continue;
        }
        if let Some(tail) = call
            .strip_prefix("<... ")
            .and_then(|r| r.split_once(" resumed>"))
            .map(|(_, tail)| tail)
            && let Some(head) = open.remove(pid)
        {
            out.push(format!("{pid} {head}{tail}"));
            continue;
        }
        out.push(line.to_string());
    }
    out
}

/// Line numbers of the trace at which `path`'s content (a file) or entries (a folder) were
/// durable: an fsync of it, or the link or rename onto it of a file fsynced before.
fn fsyncs(trace: &[&str], path: &Path) -> Vec<usize> {
    let synced = |p: &str| -> Vec<usize> {
        let needle = format!("<{p}>");
        trace
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                l.contains("sync(") && l.contains(&needle) && l.trim_end().ends_with("= 0")
            })
            .map(|(i, _)| i)
            .collect()
    };
    let target = path.display().to_string();
    let mut out = synced(&target);
    for (i, l) in trace.iter().enumerate() {
        if !(l.contains("link") || l.contains("rename")) || !l.trim_end().ends_with("= 0") {
            continue;
        }
        let q = quoted(l);
        if q.len() == 2 && q[1] == target && synced(q[0]).iter().any(|&s| s < i) {
            out.push(i);
        }
    }
    out.sort();
    out
}

#[test]
fn every_sink_file_of_batch_n_is_fsynced_before_commits_n() {
    let strace = std::env::var("STRACE").unwrap_or_else(|_| "strace".into());
    let dir = temp_dir();
    let root = dir.path();
    gen_orders(&root.join("in"), 3, 5, 3);
    let p = pipeline(root, SINKS);
    let trace_file = root.join("trace.txt");
    let out = Command::new(&strace)
        .args(["-f", "-y", "-qq", "-o"])
        .arg(&trace_file)
        .args([
            "-e",
            "trace=fsync,fdatasync,link,linkat,rename,renameat,renameat2",
        ])
        .arg(crate::bin())
        .args(["run", p.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {strace} (.ci/run installs it): {e}"));
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&trace_file).unwrap();
    // Kept where it outlives the test's folder until every check passed: a failing run's
    // trace is there to read (the harness prints this line only when the test fails).
    let kept = std::env::temp_dir().join(format!(
        "weir-fsync-trace-{}-{}.txt",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::write(&kept, &text).unwrap();
    eprintln!(
        "the strace output of this run is kept in {}",
        kept.display()
    );
    let lines = joined(&text);
    let trace: Vec<&str> = lines.iter().map(String::as_str).collect();
    let chk = root.join("chk");
    // The line at which commits/N was linked into place, per batch.
    let mut commit_at: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, l) in trace.iter().enumerate() {
        for n in 0..3u64 {
            if l.contains("link")
                && l.contains(&format!(
                    "\"{}\"",
                    chk.join(format!("commits/{n}")).display()
                ))
            {
                commit_at.entry(n).or_insert(i);
            }
        }
    }
    assert_eq!(commit_at.len(), 3, "commits/0..2 not all linked: {text}");
    let log = root.join("table/_delta_log");
    let durable_before = |file: &Path, folder: &Path, limit: usize, what: &str| {
        let synced = fsyncs(&trace, file);
        let first = *synced.iter().find(|&&i| i < limit).unwrap_or_else(|| {
            panic!("{what}: {} not fsynced before line {limit}", file.display())
        });
        assert!(
            fsyncs(&trace, folder)
                .iter()
                .any(|&i| i > first && i < limit),
            "{what}: {} not fsynced after {} and before commits",
            folder.display(),
            file.display()
        );
    };
    for (&n, &at) in &commit_at {
        // Batch N is table version N (a new table, one commit per batch).
        let entry = log.join(format!("{n:020}.json"));
        durable_before(&entry, &log, at, &format!("batch {n}"));
        let actions = std::fs::read_to_string(&entry).unwrap();
        let mut added = 0;
        for line in actions.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if let Some(path) = v["add"]["path"].as_str() {
                durable_before(
                    &root.join("table").join(path),
                    &root.join("table"),
                    at,
                    &format!("batch {n}"),
                );
                added += 1;
            }
        }
        assert!(added > 0, "batch {n} added no file: {actions}");
        let mut parts = 0;
        for e in std::fs::read_dir(root.join("out")).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("batch-{n:010}-part-")) {
                durable_before(
                    &root.join("out").join(&name),
                    &root.join("out"),
                    at,
                    &format!("batch {n}"),
                );
                parts += 1;
            }
        }
        assert!(parts > 0, "batch {n} wrote no Parquet part");
    }
    let _ = std::fs::remove_file(&kept);
}

/// Lines of a failing run's trace (kept by the test above): an fsync interrupted by
/// another thread is joined into one line at the place it returned, and is found.
#[test]
fn an_fsync_interrupted_by_another_thread_is_joined_where_it_returned() {
    let text = "\
6801  fsync(13</t/table/part-0.parquet> <unfinished ...>
6799  fsync(12</t/chk/sources/0> <unfinished ...>
6799  <... fsync resumed>)              = 0
6801  <... fsync resumed>)              = 0
6801  fsync(12</t/table>) = 0
6783  linkat(AT_FDCWD</w>, \"/t/chk/commits/.1.tmp\", AT_FDCWD</w>, \"/t/chk/commits/1\", 0) = 0";
    let lines = joined(text);
    assert_eq!(lines.len(), 6);
    assert_eq!(lines[0], "");
    assert_eq!(
        lines[3],
        "6801 fsync(13</t/table/part-0.parquet>)              = 0"
    );
    let trace: Vec<&str> = lines.iter().map(String::as_str).collect();
    assert_eq!(
        fsyncs(&trace, Path::new("/t/table/part-0.parquet")),
        vec![3]
    );
}
