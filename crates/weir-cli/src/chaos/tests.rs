use std::path::Path;

use weir_core::connector::Feed;
use weir_core::sink::PARQUET_POINTS;
use weir_core::storage::Location;

use super::*;

const SCHEMA: &str =
    r#"["order_id bigint", "status string", "amount double", "updated_at timestamp"]"#;

fn pipeline(extra: &str) -> Pipeline {
    let text = format!(
        r#"[query]
name = "q"
checkpoint = "chk"

[source]
type = "files"
path = "in"
format = "json"
schema = {SCHEMA}

{extra}"#
    );
    toml::from_str(&text).unwrap()
}

#[test]
fn the_fault_points_are_the_ones_the_sinks_declare_in_batch_order() {
    let p = pipeline(
        r#"[[sink]]
type = "delta-merge"
path = "m"
keys = ["order_id"]
ordering = "updated_at"

[[sink]]
type = "postgres-upsert"
url = "host=nowhere"
table = "t"
keys = ["order_id"]
ordering = "updated_at"
staging-table = "s"

[[sink]]
type = "parquet"
path = "p"

[[sink]]
type = "delta-append"
path = "a"
"#,
    );
    let mut want: Vec<&str> = RUNNER_POINTS[..2].to_vec();
    want.extend(weir_delta::DELTA_POINTS);
    want.extend(weir_postgres::upsert_points(true));
    want.extend(PARQUET_POINTS);
    want.extend(&RUNNER_POINTS[2..]);
    assert_eq!(points(&p), want);
}

#[test]
fn retargeting_moves_every_place_and_refuses_an_append_sink_after_a_transform() {
    let dir = Path::new("/tmp/w");
    let target = |feed| Target {
        dir,
        store: Location::local(dir),
        feed,
        postgres: Some("host=pg"),
        batch_rows: 50,
        retain: Some(4),
    };
    let mut p = pipeline(
        "[[sink]]\ntype = \"parquet\"\npath = \"p\"\n\n[[sink]]\ntype = \"postgres-upsert\"\nurl = \"env:NOPE\"\ntable = \"t\"\nkeys = [\"order_id\"]\nordering = \"updated_at\"\n",
    );
    retarget(
        &mut p,
        &target(Feed::Files {
            dir: Location::local("/tmp/w/input"),
        }),
    )
    .unwrap();
    let text = p.to_toml().unwrap();
    for want in [
        "/tmp/w/checkpoint",
        "/tmp/w/input",
        "/tmp/w/parquet_0",
        "weir_chaos_orders_1",
        "weir_chaos_batches",
        "host=pg",
        "min-batches-to-retain = 4",
        "available-now",
    ] {
        assert!(text.contains(want), "{want} in:\n{text}");
    }
    // A files pipeline cannot read a Kafka feed.
    let mut k = pipeline("[[sink]]\ntype = \"parquet\"\npath = \"p\"\n");
    let err = retarget(
        &mut k,
        &target(Feed::Kafka {
            brokers: "b".into(),
            topic: "t".into(),
        }),
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("Kafka"), "{err:#}");
    let mut t = pipeline(
        "[transform]\nsql = \"SELECT * FROM batch\"\n\n[[sink]]\ntype = \"delta-append\"\npath = \"a\"\n",
    );
    let err = retarget(
        &mut t,
        &target(Feed::Files {
            dir: Location::local("/tmp/w/input"),
        }),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("an append sink after a transform has no reference to check"),
        "{err}"
    );
}
