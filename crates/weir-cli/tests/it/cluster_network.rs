//! Workers as machines of their own: in network namespaces behind added latency, and a
//! worker frozen mid-run; every row lands once.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use weir_testkit::{DelayProxy, parquet_rows, temp_dir};

use crate::cluster::*;
use crate::{bin, gen_orders, input_rows, last_progress, progress_batches};

/// Network namespaces joined by a bridge: one network stack per worker, as on machines of
/// their own. Removed when dropped.
struct Netns {
    bridge: String,
    names: Vec<String>,
    /// The bridge's address (the driver's side) and each namespace's.
    addrs: Vec<String>,
}

impl Netns {
    fn ip(args: &[&str]) -> std::process::Output {
        Command::new("ip").args(args).output().expect("running ip")
    }

    fn must(args: &[&str]) {
        let out = Netns::ip(args);
        assert!(
            out.status.success(),
            "ip {}: {} (the cluster tests need `ip netns` as root; .ci/run installs iproute2)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `n` namespaces on a fresh /24, each with a veth on the bridge.
    fn new(n: usize) -> Netns {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = std::process::id() % 10_000;
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let net = format!("10.{}.{}", 100 + id % 100, (id / 100 + k * 37) % 250);
        let tag = format!("{id}{k}");
        let bridge = format!("wb{tag}");
        let mut me = Netns {
            bridge: bridge.clone(),
            names: Vec::new(),
            addrs: vec![format!("{net}.1")],
        };
        Netns::must(&["link", "add", &bridge, "type", "bridge"]);
        Netns::must(&["addr", "add", &format!("{net}.1/24"), "dev", &bridge]);
        Netns::must(&["link", "set", &bridge, "up"]);
        for i in 0..n {
            let ns = format!("wn{tag}x{i}");
            let (host, inner) = (format!("wv{tag}x{i}"), format!("wp{tag}x{i}"));
            let addr = format!("{net}.{}", 10 + i);
            Netns::must(&["netns", "add", &ns]);
            me.names.push(ns.clone());
            Netns::must(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
            Netns::must(&["link", "set", &inner, "netns", &ns]);
            Netns::must(&["link", "set", &host, "master", &bridge]);
            Netns::must(&["link", "set", &host, "up"]);
            for args in [
                vec!["addr", "add", &*format!("{addr}/24"), "dev", &*inner],
                vec!["link", "set", &*inner, "up"],
                vec!["link", "set", "lo", "up"],
            ] {
                let mut all = vec!["-n", ns.as_str()];
                all.extend(args.iter().copied());
                Netns::must(&all);
            }
            // Added latency where the kernel has netem (not every kernel does).
            let tc = Command::new("tc")
                .args([
                    "qdisc", "add", "dev", &host, "root", "netem", "delay", "2ms",
                ])
                .output();
            if !tc.is_ok_and(|o| o.status.success()) {
                eprintln!("netns test: no netem on this kernel, no added latency on {host}");
            }
            me.addrs.push(addr);
        }
        me
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Netns::ip(&["netns", "del", ns]);
        }
        let _ = Netns::ip(&["link", "del", &self.bridge]);
    }
}

/// Workers in network namespaces of their own (a bridge between them and the driver),
/// each reached through a proxy that adds 10 ms each way (the kernel here has no netem):
/// the shuffle of a grouping crosses their network stacks at a data centre's latency, a
/// worker SIGKILLed mid-run and started again in its namespace loses and repeats nothing,
/// and the groups equal a single process's.
#[tokio::test]
async fn workers_in_network_namespaces_of_their_own_shuffle_and_survive_a_kill() {
    let net = Netns::new(3);
    let mut ws: Vec<Worker> = (0..3)
        .map(|i| {
            Worker::start_in(
                Some(&net.names[i]),
                &format!("{}:0", net.addrs[i + 1]),
                Some("n3t"),
            )
        })
        .collect();
    // The driver and the workers (fetching each other's shuffle output) reach a worker
    // only through its proxy, on the bridge's address.
    let proxies: Vec<DelayProxy> = ws
        .iter()
        .map(|w| {
            DelayProxy::start(
                &format!("{}:0", net.addrs[0]),
                &w.addr(),
                Duration::from_millis(10),
            )
            .unwrap()
        })
        .collect();
    let sql = "SELECT status, count(*) AS n, sum(order_id) AS s FROM batch GROUP BY status";
    let mut outputs = Vec::new();
    for cluster in [true, false] {
        let dir = temp_dir();
        let input = dir.path().join("in");
        gen_orders(&input, 45, 400, 100);
        let extra = "token = \"n3t\"\nmax-batch-attempts = 4";
        let p = sql_pipeline(dir.path(), &refs(&ws), extra, 3, sql, cluster);
        let mut text = std::fs::read_to_string(&p).unwrap();
        for (w, proxy) in ws.iter().zip(&proxies) {
            text = text.replace(&w.url, &format!("http://{}", proxy.addr));
        }
        std::fs::write(&p, text).unwrap();
        let progress = dir.path().join("progress.jsonl");
        let first_ns = net.names[0].clone();
        let restart = move |a: &str| Worker::start_in(Some(&first_ns), a, Some("n3t"));
        let kill = cluster.then_some(WorkerKill {
            workers: ws.as_mut_slice(),
            index: 0,
            after: 3,
            restart: &restart,
        });
        let stderr = run_killing_a_worker(&p, &progress, &[], kill);
        assert_eq!(
            progress_batches(&progress),
            (0..15).collect::<Vec<u64>>(),
            "{stderr}"
        );
        let text = std::fs::read_to_string(&progress).unwrap();
        let rows: u64 = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["numInputRows"]
                    .as_u64()
                    .unwrap()
            })
            .sum();
        assert_eq!(rows, 18_000, "{stderr}");
        if cluster {
            // The workers' addresses are the namespaces', not this machine's loopback.
            let last = last_progress(&progress);
            for w in last["cluster"]["workers"].as_array().unwrap() {
                assert!(!w["url"].as_str().unwrap().contains("127.0.0.1"), "{last}");
            }
            for (i, proxy) in proxies.iter().enumerate() {
                assert!(proxy.bytes() > 0, "nothing went through worker {i}'s proxy");
            }
        }
        outputs.push(parquet_rows(&dir.path().join("out"), &["status", "n", "s"]).await);
    }
    assert!(!outputs[0].is_empty());
    assert_eq!(
        outputs[0], outputs[1],
        "the cluster's groups are the single process's"
    );
}

/// A worker that freezes mid-run (SIGSTOP: its connections stay open, nothing answers) is
/// noticed by the keep-alive within `liveness-timeout`: the attempt fails and runs again on
/// the others, and every row lands once.
#[tokio::test]
async fn a_frozen_worker_fails_the_attempt_within_the_liveness_timeout() {
    let ws = Worker::three(None);
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 30, 2000, 500);
    let p = cluster_pipeline(
        dir.path(),
        &refs(&ws),
        "liveness-timeout = \"2s\"\nmax-batch-attempts = 4",
        3,
    );
    let progress = dir.path().join("progress.jsonl");
    let driver = Command::new(bin())
        .args([
            "run",
            p.to_str().unwrap(),
            "--progress",
            progress.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while progress_batches(&progress).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let frozen = ws[0].child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &frozen])
            .status()
            .unwrap()
            .success()
    );
    let began = Instant::now();
    let out = driver.wait_with_output().unwrap();
    let _ = Command::new("kill").args(["-CONT", &frozen]).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(began.elapsed() < Duration::from_secs(90), "{stderr}");
    assert_eq!(
        progress_batches(&progress),
        (0..10).collect::<Vec<u64>>(),
        "{stderr}"
    );
    let got = parquet_rows(&dir.path().join("out"), &COLS).await;
    assert_eq!(
        got,
        input_rows(&input).await,
        "every input row exactly once"
    );
}
