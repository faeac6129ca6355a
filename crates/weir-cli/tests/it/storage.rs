//! Object stores, for real: moto's S3 server and Azurite, started by the test kit.

use bytes::Bytes;
use weir_core::storage::{Location, StorageOptions, WriteOutcome};
use weir_testkit::{azurite, run_weir, s3, temp_dir};

use crate::{SCHEMA, bin, gen_orders};

pub(crate) fn s3_location(path: &str) -> Location {
    let s = s3();
    let bucket = path.split('/').next().unwrap();
    s.bucket(bucket);
    Location::parse(
        "test",
        &format!("s3://{path}"),
        None,
        &StorageOptions::new(s.options()).unwrap(),
    )
    .unwrap()
}

fn az_location(path: &str) -> Location {
    let a = azurite();
    a.container(path.split('/').next().unwrap());
    Location::parse(
        "test",
        &format!("az://{path}"),
        None,
        &StorageOptions::new(a.options()).unwrap(),
    )
    .unwrap()
}

async fn write_once_list_and_lease(loc: Location) {
    let odd = "a[1] b%20 ü*?.json";
    assert_eq!(
        loc.put_new(odd, Bytes::from_static(b"one")).await.unwrap(),
        WriteOutcome::Written
    );
    assert_eq!(
        loc.put_new(odd, Bytes::from_static(b"two")).await.unwrap(),
        WriteOutcome::AlreadyExists,
        "{loc}: a second put-if-absent must not overwrite"
    );
    assert_eq!(
        loc.get(odd).await.unwrap().unwrap(),
        Bytes::from_static(b"one")
    );
    loc.join("sub")
        .put("x", Bytes::from_static(b"x"))
        .await
        .unwrap();
    let names: Vec<String> = loc
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    assert_eq!(
        names,
        vec![odd.to_string()],
        "{loc}: files of this folder only, names literal"
    );
    let meta = loc.head(odd).await.unwrap().unwrap();
    assert_eq!(meta.size, 3);
    // Conditional updates: what the checkpoint lease is built on.
    let v1 = loc
        .put_if("_lease", Bytes::from_static(b"1"), None)
        .await
        .unwrap()
        .expect("created");
    assert!(
        loc.put_if("_lease", Bytes::from_static(b"x"), None)
            .await
            .unwrap()
            .is_none()
    );
    let (_, seen) = loc.get_versioned("_lease").await.unwrap().unwrap();
    let v2 = loc
        .put_if("_lease", Bytes::from_static(b"2"), Some(&seen))
        .await
        .unwrap()
        .expect("updated with the current version");
    assert_ne!(v1, v2);
    assert!(
        loc.put_if("_lease", Bytes::from_static(b"3"), Some(&v1))
            .await
            .unwrap()
            .is_none(),
        "{loc}: an update with a stale version must fail"
    );
    assert_eq!(
        loc.get("_lease").await.unwrap().unwrap(),
        Bytes::from_static(b"2")
    );
    loc.delete(odd).await.unwrap();
    loc.delete(odd).await.unwrap();
    assert_eq!(loc.get(odd).await.unwrap(), None);
}

#[tokio::test]
async fn s3_and_azure_locations_write_once_list_literally_and_update_conditionally() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    write_once_list_and_lease(s3_location(&format!("weir-test/{id}"))).await;
    write_once_list_and_lease(az_location(&format!("weirtest/{id}"))).await;
}

#[test]
fn an_unsupported_url_scheme_is_refused_before_anything_is_written() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 1, 5, 5);
    for (key, bad) in [("checkpoint", "hdfs://nn/chk"), ("path", "ftp://host/out")] {
        let p = dir.path().join(format!("{key}.toml"));
        let (chk, out) = if key == "checkpoint" {
            (bad, "out")
        } else {
            ("chk", bad)
        };
        std::fs::write(
            &p,
            format!(
                "[query]\nname = \"q\"\ncheckpoint = \"{chk}\"\n\n[source]\ntype = \"files\"\npath = \"in\"\n\
                 format = \"json\"\nschema = {SCHEMA}\n\n[[sink]]\ntype = \"parquet\"\npath = \"{out}\"\n"
            ),
        )
        .unwrap();
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("unsupported storage scheme"),
            "{bad}: {err}"
        );
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !names
                .iter()
                .any(|n| n.contains(':') || n == "chk" || n == "out"),
            "nothing written locally: {names:?}"
        );
    }
}

/// Writes generated order files into `input`, an object-store folder.
pub(crate) async fn upload_orders(local: &std::path::Path, input: &Location) {
    let mut names: Vec<_> = std::fs::read_dir(local)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for p in names {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        input
            .put(&name, Bytes::from(std::fs::read(&p).unwrap()))
            .await
            .unwrap();
    }
}

pub(crate) fn storage_table(options: &std::collections::BTreeMap<String, String>) -> String {
    options
        .iter()
        .map(|(k, v)| format!("{k} = \"{v}\"\n"))
        .collect()
}

/// Input, checkpoint, a Delta append table, a Delta MERGE table and a Parquet folder, all
/// on the S3 server: killed around the Delta commit and at the commit write, run again,
/// every sink holds what it must; a second query on the same checkpoint is refused while
/// the first holds its lease.
#[tokio::test]
async fn a_pipeline_entirely_on_s3_survives_kills_and_holds_its_checkpoint() {
    use weir_core::connector::{QueryIdentity, compare_append, compare_upsert};
    let dir = temp_dir();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let root = s3_location(&format!("weir-e2e/{id}"));
    let local_in = dir.path().join("in");
    gen_orders(&local_in, 6, 30, 40);
    upload_orders(&local_in, &root.join("in")).await;
    let url = |p: &str| root.join(p).url_string();
    let text = format!(
        r#"[query]
name = "on-s3"
checkpoint = "{chk}"
lease-ttl = "2s"

[storage]
{storage}
[source]
type = "files"
path = "{input}"
format = "json"
schema = {SCHEMA}
max-files-per-trigger = 2

[[sink]]
type = "delta-append"
path = "{append}"

[[sink]]
type = "delta-merge"
path = "{merge}"
keys = ["order_id"]
ordering = "updated_at"

[[sink]]
type = "parquet"
path = "{parquet}"
"#,
        chk = url("chk"),
        storage = storage_table(&s3().options()),
        input = url("in"),
        append = url("append"),
        merge = url("merge"),
        parquet = url("parquet"),
    );
    let p = dir.path().join("s3.toml");
    std::fs::write(&p, &text).unwrap();
    for fault in [
        format!("{}@1", weir_delta::POINT_AFTER_COMMIT),
        "before-commit-write@2".to_string(),
    ] {
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], Some(&fault));
        assert!(!out.status.success(), "{fault}");
    }
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Read everything back and compare with the input.
    let schema = crate::orders_schema();
    let input = crate::input_batches(&local_in).await;
    let cp = weir_core::checkpoint::Checkpoint::inspect(root.join("chk"))
        .await
        .unwrap()
        .unwrap();
    let query = QueryIdentity::of(&cp, "on-s3");
    let (_, commits) = cp.batch_ids().await.unwrap();
    assert_eq!(commits, vec![0, 1, 2], "6 files, 2 per batch");
    // `weir checkpoint show` reads it through the pipeline file, or its URL and --storage.
    let mut by_url = vec!["checkpoint".to_string(), "show".into(), url("chk")];
    for (k, v) in s3().options() {
        by_url.push("--storage".into());
        by_url.push(format!("{k}={v}"));
    }
    let by_url: Vec<&str> = by_url.iter().map(String::as_str).collect();
    for args in [vec!["checkpoint", "show", p.to_str().unwrap()], by_url] {
        let out = run_weir(&bin(), &args, None);
        let shown = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && shown.contains("batches    0..=2 in the offset log, 3 committed"),
            "{args:?}: {shown}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let append = weir_delta::DeltaReader {
        at: root.join("append"),
        app_id: None,
        strict_versions: true,
    };
    let merge = weir_delta::DeltaReader {
        at: root.join("merge"),
        app_id: None,
        strict_versions: true,
    };
    let parquet = weir_core::connector::ParquetReader {
        dir: root.join("parquet"),
    };
    use weir_core::connector::SinkVerifier;
    let mut all = compare_append(
        "append",
        &append.rows(&schema).await.unwrap(),
        &input,
        &schema,
    )
    .unwrap();
    all.merge(append.check_bookkeeping(&query, 3).await.unwrap());
    all.merge(
        compare_upsert(
            "merge",
            &merge.rows(&schema).await.unwrap(),
            &input,
            &schema,
            &["order_id".to_string()],
            "updated_at",
        )
        .unwrap(),
    );
    all.merge(merge.check_bookkeeping(&query, 3).await.unwrap());
    all.merge(
        compare_append(
            "parquet",
            &parquet.rows(&schema).await.unwrap(),
            &input,
            &schema,
        )
        .unwrap(),
    );
    all.merge(parquet.check_bookkeeping(&query, 3).await.unwrap());
    assert!(all.mismatches.is_empty(), "{:?}", all.mismatches);
    assert_eq!(
        all.rows,
        180 + 180
            + merge
                .rows(&schema)
                .await
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum::<usize>()
    );

    // A query that runs on (trigger 0) holds the checkpoint: a second one is refused, and
    // once the first is killed, its lease lapses and a third takes over.
    let forever = dir.path().join("forever.toml");
    std::fs::write(
        &forever,
        text.replace("lease-ttl = \"2s\"", "lease-ttl = \"2s\"\ntrigger = \"0\""),
    )
    .unwrap();
    let mut first = std::process::Command::new(bin())
        .args(["run", forever.to_str().unwrap(), "--quiet"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let second = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && err.contains("another query is using the checkpoint"),
        "{err}"
    );
    first.kill().unwrap();
    let _ = first.wait();
    let third = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        third.status.success(),
        "{}",
        String::from_utf8_lossy(&third.stderr)
    );
}

/// The same on Azurite: input, checkpoint, a Delta append table and a Parquet folder on
/// `az://`, killed once, run again.
#[tokio::test]
async fn a_pipeline_on_azure_blob_storage_lands_every_row_once() {
    use weir_core::connector::{SinkVerifier, compare_append};
    let dir = temp_dir();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let root = az_location(&format!("weirtest/{id}"));
    let local_in = dir.path().join("in");
    gen_orders(&local_in, 4, 20, 30);
    upload_orders(&local_in, &root.join("in")).await;
    let url = |p: &str| root.join(p).url_string();
    let text = format!(
        "[query]\nname = \"on-az\"\ncheckpoint = \"{}\"\nlease-ttl = \"2s\"\n\n[storage]\n{}\n\
         [source]\ntype = \"files\"\npath = \"{}\"\nformat = \"json\"\nschema = {SCHEMA}\nmax-files-per-trigger = 1\n\n\
         [[sink]]\ntype = \"delta-append\"\npath = \"{}\"\n\n[[sink]]\ntype = \"parquet\"\npath = \"{}\"\n",
        url("chk"),
        storage_table(&azurite().options()),
        url("in"),
        url("append"),
        url("parquet"),
    );
    let p = dir.path().join("az.toml");
    std::fs::write(&p, &text).unwrap();
    let out = run_weir(
        &bin(),
        &["run", p.to_str().unwrap()],
        Some(&format!("{}@2", weir_delta::POINT_AFTER_COMMIT)),
    );
    assert!(!out.status.success());
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let schema = crate::orders_schema();
    let input = crate::input_batches(&local_in).await;
    let append = weir_delta::DeltaReader {
        at: root.join("append"),
        app_id: None,
        strict_versions: true,
    };
    let parquet = weir_core::connector::ParquetReader {
        dir: root.join("parquet"),
    };
    let mut v = compare_append(
        "append",
        &append.rows(&schema).await.unwrap(),
        &input,
        &schema,
    )
    .unwrap();
    v.merge(
        compare_append(
            "parquet",
            &parquet.rows(&schema).await.unwrap(),
            &input,
            &schema,
        )
        .unwrap(),
    );
    assert!(v.mismatches.is_empty(), "{:?}", v.mismatches);
    assert_eq!(v.rows, 160);
}
