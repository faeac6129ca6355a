//! A server down under a running query: the query stays up and says why it is not ready
//! (`/readyz`, `/api/status`, `/metrics`), runs the failed batch again from its checkpoint
//! after pauses, and once the server is back every row lands once (`[query] retry`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir_testkit::service::free_port;
use weir_testkit::{start_postgres, temp_dir};

use crate::cluster_pg::{newest_per_key, same_form};
use crate::monitor::{get, wait_until};
use crate::{bin, gen_orders, pipeline, progress_batches};

/// The driver, killed if the test ends before it does.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `weir run p` with progress to `dir/progress.jsonl`, stderr to `dir/stderr.txt` and the
/// HTTP endpoint on a free port: the driver, the progress file, the stderr file and the
/// endpoint's base URL.
fn start_monitored(
    p: &std::path::Path,
    dir: &std::path::Path,
) -> (Driver, std::path::PathBuf, std::path::PathBuf, String) {
    let progress = dir.join("progress.jsonl");
    let stderr_path = dir.join("stderr.txt");
    let port = free_port();
    let child = Command::new(bin())
        .args(["run", p.to_str().unwrap(), "--progress"])
        .arg(&progress)
        .arg("--http")
        .arg(format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    (
        Driver(child),
        progress,
        stderr_path,
        format!("http://127.0.0.1:{port}"),
    )
}

/// What happens to the server under the running query.
#[derive(Clone, Copy, PartialEq)]
enum Outage {
    /// `pg_ctl stop -m fast`, later `pg_ctl start`.
    Down,
    /// SIGSTOP to every server process, later SIGCONT: nothing answers, nothing fails.
    Frozen,
}

/// `pg_ctl stop` for several seconds under a running query (files into a PostgreSQL
/// upsert): the process stays up, `/readyz` is 503 naming the batch and the error, the
/// status names the next run, the retries are counted; with the server started again the
/// query finishes by itself, every batch committed once, the table equal to the newest row
/// per key over all input and the ledger holding each batch once.
#[tokio::test]
async fn a_postgres_outage_under_a_running_query_is_waited_out_and_every_row_lands_once() {
    through_an_outage(Outage::Down).await;
}

/// The same with the server frozen (SIGSTOP) instead: the sink's `timeout` cancels the
/// write that hangs (its transaction never commits), the batch runs again after a pause
/// until the server answers, and every row lands once.
#[tokio::test]
async fn a_frozen_postgres_times_the_write_out_and_every_row_lands_once_after_it_thaws() {
    through_an_outage(Outage::Frozen).await;
}

async fn through_an_outage(outage: Outage) {
    // A server of this test's own: stopping it touches no other test.
    let pg = start_postgres("127.0.0.1", free_port());
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 200, 40, 50);
    let table = match outage {
        Outage::Down => "outage_orders",
        Outage::Frozen => "frozen_orders",
    };
    let sinks = format!(
        "[[sink]]\ntype = \"postgres-upsert\"\nurl = \"{}\"\ntable = \"{table}\"\n\
         keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n{}",
        pg.url,
        if outage == Outage::Frozen {
            "timeout = \"2s\"\n"
        } else {
            ""
        }
    );
    let p = pipeline(dir.path(), &sinks);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "trigger = \"available-now\"",
        "trigger = \"available-now\"\nretry = { attempts = 100, initial = \"200ms\", max = \"1s\" }",
    );
    std::fs::write(&p, text).unwrap();
    let (mut driver, progress, stderr_path, base) = start_monitored(&p, dir.path());
    let stderr = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    wait_until("3 batches", Duration::from_secs(120), || {
        progress_batches(&progress).len() >= 3
    });
    match outage {
        Outage::Down => pg.stop(),
        Outage::Frozen => pg.freeze(),
    }
    // The outage, seen from outside.
    let mut ready = String::new();
    wait_until(
        "/readyz to say the query retries",
        Duration::from_secs(60),
        || {
            let (code, body) = get(&format!("{base}/readyz"));
            ready = body;
            code == 503 && ready.contains("retrying")
        },
    );
    assert!(ready.contains("batch "), "{ready}");
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        driver.0.try_wait().unwrap().is_none(),
        "the query ended during the outage:\n{}",
        stderr()
    );
    let (code, body) = get(&format!("{base}/api/status"));
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["phase"], "retrying", "{status}");
    assert_eq!(status["ready"], false, "{status}");
    let failing = status["nextAttempt"]["batchId"].as_u64().unwrap();
    assert!(failing >= 3, "{status}");
    assert!(
        status["nextAttempt"]["failed"].as_u64().unwrap() >= 2,
        "{status}"
    );
    let last_error = status["lastError"].as_str().unwrap();
    assert!(last_error.contains(&format!("batch {failing}")), "{status}");
    match outage {
        Outage::Down => assert!(last_error.contains(table), "{status}"),
        Outage::Frozen => assert!(
            last_error.contains("took longer than its timeout of 2000 ms"),
            "{status}"
        ),
    }
    let (_, metrics) = get(&format!("{base}/metrics"));
    let retries: f64 = metrics
        .lines()
        .find(|l| l.starts_with("weir_query_retries_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(retries >= 2.0, "{metrics}");
    let before = progress_batches(&progress);
    assert_eq!(
        before,
        (0..failing).collect::<Vec<u64>>(),
        "no batch committed during the outage"
    );

    match outage {
        Outage::Down => pg.start(),
        Outage::Frozen => pg.thaw(),
    }
    let t = Instant::now();
    let status = loop {
        if let Some(s) = driver.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the query did not finish after the outage:\n{}",
            stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{}", stderr());
    assert!(
        stderr().contains("may pass"),
        "the retries are logged:\n{}",
        stderr()
    );
    assert!(
        !stderr().contains('\x1b'),
        "no colour codes in logs that go to a file:\n{}",
        stderr()
    );
    assert_eq!(
        progress_batches(&progress),
        (0..200).collect::<Vec<u64>>(),
        "each batch committed once"
    );
    let got = weir_testkit::pg_rows(
        &pg.url,
        &format!("SELECT order_id::text, status, amount::text FROM {table}"),
    )
    .await;
    let got = same_form(got);
    let want = newest_per_key(&input, None).await;
    assert_eq!(got.len(), want.len());
    assert_eq!(
        got, want,
        "the table is the newest row per key over all input"
    );
    let ledger = weir_testkit::pg_rows(
        &pg.url,
        &format!(
            "SELECT batch_id::text FROM {}",
            weir_postgres::DEFAULT_LEDGER
        ),
    )
    .await;
    let mut want_ledger: Vec<String> = (0..200).map(|b: u64| b.to_string()).collect();
    want_ledger.sort();
    assert_eq!(ledger, want_ledger, "the ledger holds each batch once");
}

/// Sends `ids` as JSON orders to `topic` (partition `id % 3`); their `order_id|status`.
async fn produce_orders(bootstrap: &str, topic: &str, ids: std::ops::Range<i64>) -> Vec<String> {
    use weir_kafka::rdkafka::ClientConfig;
    use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let mut sent = Vec::new();
    for id in ids {
        let v = format!(
            "{{\"order_id\":{id},\"status\":\"s{id}\",\"amount\":1.5,\"updated_at\":\"2026-01-01T00:00:00Z\"}}"
        );
        producer
            .send(
                FutureRecord::<(), _>::to(topic)
                    .partition((id % 3) as i32)
                    .payload(&v),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        sent.push(format!("{id}|s{id}"));
    }
    sent
}

/// The Kafka broker stopped under a running query: the query stays up and says it is
/// retrying (the broker's errors are ones that pass), and once the broker is back it reads
/// on from its checkpoint: every record, the ones sent before and after, once.
#[tokio::test]
async fn a_kafka_broker_outage_is_waited_out_and_every_record_lands_once() {
    through_a_broker_outage(Outage::Down).await;
}

/// The broker frozen (SIGSTOP) instead: the source's `timeout` cancels the call that
/// hangs, the query runs again after pauses until the broker answers, every record once.
#[tokio::test]
async fn a_frozen_kafka_broker_times_the_source_out_and_every_record_lands_once() {
    through_a_broker_outage(Outage::Frozen).await;
}

async fn through_a_broker_outage(outage: Outage) {
    let broker = weir_testkit::start_kafka();
    weir_kafka::create_topic(&broker.bootstrap, "outage", 3)
        .await
        .unwrap();
    let mut sent = produce_orders(&broker.bootstrap, "outage", 0..90).await;
    let dir = temp_dir();
    let p = dir.path().join("pipeline.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"kafka-outage\"\ncheckpoint = \"chk\"\ntrigger = \"200ms\"\n\
             retry = {{ attempts = 100, initial = \"200ms\", max = \"1s\" }}\n\n\
             [source]\ntype = \"kafka\"\nbootstrap-servers = \"{}\"\nsubscribe = [\"outage\"]\n\
             max-offsets-per-trigger = 15\nvalue-format = \"json\"\nschema = {}\n{}\n\
             [source.kafka]\n\"socket.timeout.ms\" = \"3000\"\n\n\
             [[sink]]\ntype = \"parquet\"\npath = \"out\"\n",
            broker.bootstrap,
            crate::SCHEMA,
            if outage == Outage::Frozen {
                "timeout = \"2s\""
            } else {
                ""
            }
        ),
    )
    .unwrap();
    let (mut driver, progress, stderr_path, base) = start_monitored(&p, dir.path());
    let stderr = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    wait_until("2 batches", Duration::from_secs(120), || {
        progress_batches(&progress).len() >= 2
    });
    match outage {
        Outage::Down => broker.stop(),
        Outage::Frozen => broker.freeze(),
    }
    let mut ready = String::new();
    wait_until(
        "/readyz to say the query retries",
        Duration::from_secs(120),
        || {
            let (code, body) = get(&format!("{base}/readyz"));
            ready = body;
            code == 503 && ready.contains("retrying")
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        driver.0.try_wait().unwrap().is_none(),
        "the query ended during the outage:\n{}",
        stderr()
    );
    if outage == Outage::Frozen {
        let (_, body) = get(&format!("{base}/api/status"));
        let status: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            status["lastError"]
                .as_str()
                .unwrap_or_default()
                .contains("took longer than its timeout of 2000 ms"),
            "{status}"
        );
    }
    match outage {
        Outage::Down => broker.start(),
        Outage::Frozen => broker.thaw(),
    }
    sent.extend(produce_orders(&broker.bootstrap, "outage", 1000..1060).await);
    sent.sort();
    let cols = ["order_id", "status"];
    let out = dir.path().join("out");
    let t = Instant::now();
    loop {
        let got = weir_testkit::parquet_rows(&out, &cols).await;
        if got.len() >= sent.len() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120) && driver.0.try_wait().unwrap().is_none(),
            "{} of {} records after the outage:\n{}",
            got.len(),
            sent.len(),
            stderr()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &driver.0.id().to_string()])
        .status();
    let status = driver.0.wait().unwrap();
    assert!(status.success(), "{}", stderr());
    let mut got = weir_testkit::parquet_rows(&out, &cols).await;
    got.sort();
    assert_eq!(got, sent, "every record once");
    assert!(stderr().contains("may pass"), "{}", stderr());
}
