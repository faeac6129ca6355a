//! Before the first batch: a refused first start writes nothing, and `weir check
//! --connect` reaches every place a pipeline uses.

use weir_testkit::{run_weir, temp_dir};

use crate::{bin, gen_orders, pipeline, run_to_end};

/// A first start refused by a sink (here a Parquet folder another query owns) leaves no
/// checkpoint behind: not the folders it made, and in a folder that was there, nothing.
#[test]
fn a_refused_first_start_writes_nothing() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 2, 5, 5);
    let sink = "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n";
    let p = pipeline(dir.path(), sink);
    run_to_end(&p, &dir.path().join("progress.jsonl"));
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::create_dir(dir.path().join("was there")).unwrap();
    for (checkpoint, made) in [("new [1]/chk", "new [1]"), ("was there", "")] {
        let moved = text.replace(
            "checkpoint = \"chk\"",
            &format!("checkpoint = \"{checkpoint}\""),
        );
        std::fs::write(&p, moved).unwrap();
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("belongs to another query"), "{err}");
        if made.is_empty() {
            let left: Vec<_> = std::fs::read_dir(dir.path().join(checkpoint))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(left.is_empty(), "{checkpoint} holds {left:?}: {err}");
        } else {
            assert!(!dir.path().join(made).exists(), "{made} is left: {err}");
        }
    }
    // The query that owns the folder goes on from its checkpoint.
    std::fs::write(&p, &text).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Refused by the source (a folder that is not there): no sink folder is claimed either,
    // so the run once the folder exists is not refused as another query's.
    let other = text
        .replace("checkpoint = \"chk\"", "checkpoint = \"chk2\"")
        .replace("path = \"in\"", "path = \"not yet\"")
        .replace("path = \"out\"", "path = \"out2\"");
    std::fs::write(&p, &other).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(!out.status.success());
    assert!(!dir.path().join("chk2").exists());
    assert!(!dir.path().join("out2/_weir_query").exists());
    gen_orders(&dir.path().join("not yet"), 1, 5, 5);
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `weir check --connect` reaches every place a pipeline uses, writes nothing, and names
/// each one it cannot reach: here a PostgreSQL port nobody listens on and an S3 bucket that
/// does not exist, beside a real server, a real bucket and local folders.
#[test]
fn check_connect_names_each_place_it_cannot_reach() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 1, 5, 5);
    let s3 = weir_testkit::s3();
    let bucket = format!("probe-{}", uuid::Uuid::new_v4().simple());
    s3.bucket(&bucket);
    let pg = &weir_testkit::postgres().url;
    let dead = format!(
        "postgresql://weir@127.0.0.1:{}/db",
        weir_testkit::service::free_port()
    );
    let sinks = format!(
        "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{pg}\"\ntable = \"probe_t\"\n\
         keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{dead}\"\ntable = \"probe_t\"\n\
         keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
         [[sink]]\ntype = \"delta-append\"\npath = \"s3://{bucket}/t\"\n\n\
         [[sink]]\ntype = \"delta-append\"\npath = \"s3://no-{bucket}/t\"\n\n\
         [storage]\n{}",
        crate::storage::storage_table(&s3.options())
    );
    let p = pipeline(dir.path(), &sinks);
    let out = run_weir(&bin(), &["check", "--connect", p.to_str().unwrap()], None);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}{err}");
    assert!(
        err.contains("2 of 7 places cannot be reached"),
        "{text}{err}"
    );
    let line = |start: &str| {
        text.lines()
            .find(|l| l.contains(start))
            .unwrap_or_else(|| panic!("no line with {start}: {text}"))
            .to_string()
    };
    assert!(
        line("checkpoint").contains("reached") && line("checkpoint").contains("no checkpoint yet"),
        "{text}"
    );
    assert!(line("source (files)").contains("reached"), "{text}");
    assert!(
        line("sink[0] parquet").contains("does not exist yet"),
        "{text}"
    );
    assert!(
        line("sink[1] postgres-upsert").contains("reached  sink[1]"),
        "{text}"
    );
    assert!(
        line("sink[1] postgres-upsert").contains("is created at the first batch"),
        "{text}"
    );
    assert!(
        line("sink[2] postgres-upsert").contains("FAILED")
            && line("sink[2]").contains("Connection refused"),
        "{text}"
    );
    assert!(
        line("sink[3] delta-append").contains("reached  sink[3]"),
        "{text}"
    );
    assert!(line("sink[4] delta-append").contains("FAILED"), "{text}");
    // Nothing was written: no checkpoint, no output folder.
    assert!(!dir.path().join("chk").exists() && !dir.path().join("out").exists());
    // A source folder that is not there is what `weir run` refuses: not reached.
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("path = \"in\"", "path = \"nope\"");
    std::fs::write(&p, text).unwrap();
    let out = run_weir(&bin(), &["check", "--connect", p.to_str().unwrap()], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("FAILED   source (files)") && text.contains("Path does not exist"),
        "{text}"
    );
}

/// `weir check --connect` on a Kafka source: the subscribed topics' partitions, or the
/// topic the brokers do not list.
#[tokio::test]
async fn check_connect_asks_the_brokers_for_the_topics() {
    let dir = temp_dir();
    let bootstrap = &weir_testkit::kafka().bootstrap;
    let topic = format!("probe_{}", uuid::Uuid::new_v4().simple());
    weir_kafka::create_topic(bootstrap, &topic, 3)
        .await
        .unwrap();
    for (subscribe, reached) in [(topic.clone(), true), (format!("no_{topic}"), false)] {
        let p = dir.path().join("kafka.toml");
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"k\"\ncheckpoint = \"chk\"\n\n[source]\ntype = \"kafka\"\n\
                 bootstrap-servers = \"{bootstrap}\"\nsubscribe = [\"{subscribe}\"]\n\
                 value-format = \"json\"\nschema = {}\n\n[[sink]]\ntype = \"parquet\"\npath = \"out\"\n",
                crate::SCHEMA
            ),
        )
        .unwrap();
        let out = run_weir(&bin(), &["check", "--connect", p.to_str().unwrap()], None);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.success(), reached, "{text}");
        if reached {
            assert!(text.contains(&format!("{topic} (3 partitions)")), "{text}");
        } else {
            assert!(
                text.contains("FAILED   source (kafka)")
                    && text.contains("does not list the topic"),
                "{text}"
            );
        }
    }
}
