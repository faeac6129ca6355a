//! Moving a Spark job to weir without reprocessing: a checkpoint written by PySpark 4.3
//! (from PyPI, `.ci/run` installs it in /opt/pyspark) is continued by `weir run` from the
//! next batch; what cannot be continued is refused naming what to do.

use std::path::{Path, PathBuf};
use std::process::Command;

use weir_testkit::{parquet_rows, run_weir, temp_dir};

use crate::{SCHEMA, bin, gen_orders_from};

fn python() -> PathBuf {
    let p = std::env::var("PYSPARK_PYTHON_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("/opt/pyspark/bin/python"));
    assert!(
        p.exists(),
        "{}: install PySpark (python3 -m venv /opt/pyspark && /opt/pyspark/bin/pip install pyspark==4.3.0; .ci/run does) or set PYSPARK_PYTHON_BIN",
        p.display()
    );
    p
}

/// Runs the Spark query of tests/spark/file_query.py; returns its exit code.
fn spark(dir: &Path, extra: &[&str]) -> i32 {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/spark/file_query.py");
    let out = Command::new(python())
        .arg(script)
        .arg(dir.join("in"))
        .arg(dir.join("chk"))
        .arg(dir.join("spark_out"))
        .args(extra)
        .output()
        .unwrap();
    if !out.status.success() && out.status.code() != Some(3) {
        panic!(
            "spark: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.status.code().unwrap_or(-1)
}

fn pipeline(dir: &Path) -> PathBuf {
    let p = dir.join("weir.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"migrated\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"files\"\npath = \"in\"\n\
             format = \"json\"\nschema = {SCHEMA}\nmax-files-per-trigger = 1\n\n[[sink]]\ntype = \"parquet\"\npath = \"weir_out\"\n"
        ),
    )
    .unwrap();
    p
}

#[tokio::test]
async fn a_spark_file_checkpoint_is_continued_and_unfinished_ones_are_refused() {
    // Spark takes 3 files in 3 batches; weir continues with the 2 that come after.
    let dir = temp_dir();
    gen_orders_from(&dir.path().join("in"), 0, 3, 7, 20);
    assert_eq!(spark(dir.path(), &[]), 0);
    gen_orders_from(&dir.path().join("in"), 3, 2, 7, 20);
    let out = run_weir(
        &bin(),
        &["run", pipeline(dir.path()).to_str().unwrap()],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("starts at batch 3"), "{stdout}");
    let got = parquet_rows(&dir.path().join("weir_out"), &["order_id"]).await;
    assert_eq!(got.len(), 14, "only the 2 new files' rows: {got:?}");

    // A batch Spark planned but did not commit is Spark's to finish.
    let dir = temp_dir();
    gen_orders_from(&dir.path().join("in"), 0, 3, 7, 20);
    assert_eq!(spark(dir.path(), &["--fail-at", "1"]), 3);
    let out = run_weir(
        &bin(),
        &["run", pipeline(dir.path()).to_str().unwrap()],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("written by Spark")
            && err.contains("Spark planned batch 1"),
        "{err}"
    );
    assert!(!dir.path().join("weir_out").exists(), "nothing written");

    // A stateful Spark query's state cannot be read.
    let dir = temp_dir();
    gen_orders_from(&dir.path().join("in"), 0, 2, 7, 20);
    assert_eq!(spark(dir.path(), &["--stateful"]), 0);
    let out = run_weir(
        &bin(),
        &["run", pipeline(dir.path()).to_str().unwrap()],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("holds state"),
        "{err}"
    );
}

/// A checkpoint in Spark's Kafka shape (written here byte for byte as Spark writes it:
/// the Kafka connector jar cannot be installed on these machines) is continued from its
/// last committed offsets.
#[tokio::test]
async fn a_spark_kafka_checkpoint_is_continued_from_its_committed_offsets() {
    use weir_kafka::rdkafka::ClientConfig;
    use weir_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    let bootstrap = &weir_testkit::kafka().bootstrap;
    weir_kafka::create_topic(bootstrap, "spark_orders", 1)
        .await
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    for i in 0..12 {
        let v = format!(
            r#"{{"order_id":{i},"status":"s","amount":1.0,"updated_at":"2026-01-01T00:00:00Z"}}"#
        );
        producer
            .send(
                FutureRecord::<(), _>::to("spark_orders")
                    .partition(0)
                    .payload(&v),
                std::time::Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
    let dir = temp_dir();
    let chk = dir.path().join("chk");
    let conf = r#"{"batchWatermarkMs":0,"batchTimestampMs":1796213408634,"conf":{"spark.sql.shuffle.partitions":"200","spark.sql.streaming.multipleWatermarkPolicy":"min"}}"#;
    for (path, body) in [
        (
            "metadata",
            r#"{"id":"fedf53f5-707a-4dfe-8a80-5ebb911a689a"}"#.to_string(),
        ),
        (
            "sources/0/0",
            r#"v1
{"spark_orders":{"0":0}}"#
                .to_string(),
        ),
        (
            "offsets/0",
            format!("v1\n{conf}\n{{\"spark_orders\":{{\"0\":4}}}}"),
        ),
        (
            "offsets/1",
            format!("v1\n{conf}\n{{\"spark_orders\":{{\"0\":8}}}}"),
        ),
        ("commits/0", "v1\n{\"nextBatchWatermarkMs\":0}".to_string()),
        ("commits/1", "v1\n{\"nextBatchWatermarkMs\":0}".to_string()),
    ] {
        let p = chk.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
    let p = dir.path().join("kafka.toml");
    std::fs::write(
        &p,
        format!(
            "[query]\nname = \"migrated\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"kafka\"\n\
             bootstrap-servers = \"{bootstrap}\"\nsubscribe = [\"spark_orders\"]\nvalue-format = \"json\"\n\
             schema = {SCHEMA}\n\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
        ),
    )
    .unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = parquet_rows(&dir.path().join("out"), &["order_id"]).await;
    assert_eq!(got, vec!["10", "11", "8", "9"], "offsets 8..12 only");
}
