use super::*;

#[tokio::test]
async fn put_new_refuses_to_overwrite_and_leaves_no_temp_file() {
    let dir = tempfile::tempdir().unwrap();
    let loc = Location::local(dir.path().join("logs"));
    assert_eq!(
        loc.put_new("0", Bytes::from_static(b"v1\na"))
            .await
            .unwrap(),
        WriteOutcome::Written
    );
    assert_eq!(
        loc.put_new("0", Bytes::from_static(b"v1\nb"))
            .await
            .unwrap(),
        WriteOutcome::AlreadyExists
    );
    assert_eq!(
        loc.get("0").await.unwrap().unwrap(),
        Bytes::from_static(b"v1\na")
    );
    assert_eq!(loc.list_names().await.unwrap(), vec!["0".to_string()]);
    assert_eq!(loc.get("missing").await.unwrap(), None);
    loc.put("0", Bytes::from_static(b"x")).await.unwrap();
    assert_eq!(loc.head("0").await.unwrap().unwrap().size, 1);
    loc.delete("0").await.unwrap();
    loc.delete("0").await.unwrap();
    assert!(loc.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_prepared_write_is_invisible_until_finished_and_leaves_nothing_when_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("commits");
    let loc = Location::local(&logs);
    let every_file = || {
        let mut v: Vec<String> = std::fs::read_dir(&logs)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let ready = loc
        .prepare_new(
            "0",
            Bytes::from_static(
                b"v1
{}",
            ),
        )
        .await
        .unwrap();
    // Durable under a hidden name only, which the logs' readers skip; "0" is not there.
    let names = loc.list_names().await.unwrap();
    assert!(names.len() == 1 && is_hidden(&names[0]), "{names:?}");
    assert_eq!(loc.get("0").await.unwrap(), None);
    assert_eq!(ready.finish().await.unwrap(), WriteOutcome::Written);
    assert_eq!(every_file(), vec!["0".to_string()]);
    assert_eq!(
        loc.get("0").await.unwrap().unwrap(),
        Bytes::from_static(
            b"v1
{}"
        )
    );
    // A second writer of the same name finds it taken, and its temp file goes.
    let again = loc
        .prepare_new(
            "0",
            Bytes::from_static(
                b"v1
other",
            ),
        )
        .await
        .unwrap();
    assert_eq!(again.finish().await.unwrap(), WriteOutcome::AlreadyExists);
    assert_eq!(every_file(), vec!["0".to_string()]);
    // Dropped unfinished (the function failed): no entry and no temp file.
    drop(
        loc.prepare_new(
            "1",
            Bytes::from_static(
                b"v1
{}",
            ),
        )
        .await
        .unwrap(),
    );
    assert_eq!(every_file(), vec!["0".to_string()]);
}

#[test]
fn urls_are_parsed_and_unknown_schemes_refused() {
    let o = StorageOptions::default();
    let l = Location::parse("path", "rel/dir", Some(Path::new("/base")), &o).unwrap();
    assert_eq!(l.local_path(), Some(Path::new("/base/rel/dir")));
    let l = Location::parse("path", "file:///tmp/x", None, &o).unwrap();
    assert_eq!(l.local_path(), Some(Path::new("/tmp/x")));
    for bad in ["hdfs://nn/x", "ftp://h/x", "http://h/x"] {
        let e = Location::parse("sink.path", bad, None, &o)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sink.path") && e.contains("unsupported storage scheme"),
            "{e}"
        );
    }
    let e = Location::parse("query.checkpoint", "s3:/bucket/chk", None, &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("did you mean s3://"), "{e}");
    // Not a scheme: a local name with a colon.
    let l = Location::parse("path", "a:b", Some(Path::new("/base")), &o).unwrap();
    assert_eq!(l.local_path(), Some(Path::new("/base/a:b")));
    assert!(has_scheme("s3://b/k") && !has_scheme("s3:/b") && !has_scheme("./s3://x"));
}

#[test]
fn object_store_settings_unknown_to_every_store_are_refused() {
    let mut m = std::collections::BTreeMap::new();
    m.insert(
        "aws_endpoint".to_string(),
        "http://127.0.0.1:9000".to_string(),
    );
    m.insert("allow_http".to_string(), "true".to_string());
    assert!(StorageOptions::new(m.clone()).is_ok());
    m.insert("aws_endpont".to_string(), "typo".to_string());
    let e = StorageOptions::new(m).unwrap_err().to_string();
    assert!(e.contains("storage.aws_endpont"), "{e}");
    let shown = format!(
        "{:?}",
        StorageOptions::new([("aws_secret_access_key".to_string(), "hunter2".to_string())].into())
            .unwrap()
    );
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[test]
fn joined_locations_and_file_urls_keep_names_literal() {
    let l = Location::local("/in");
    assert_eq!(l.join("a/b").local_path(), Some(Path::new("/in/a/b")));
    assert_eq!(
        l.file_url_encoded("a[1] b%.json"),
        "file:///in/a[1]%20b%25.json"
    );
    assert_eq!(l.describe("x.json"), "/in/x.json");
}

/// An object store nobody answers for is an error that may pass (the store's own retries
/// spent); a missing local file is not.
#[tokio::test]
async fn an_unreachable_object_store_is_a_transient_error() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let options = StorageOptions::new(
        [
            ("aws_endpoint", format!("http://127.0.0.1:{port}")),
            ("aws_allow_http", "true".into()),
            ("aws_access_key_id", "x".into()),
            ("aws_secret_access_key", "y".into()),
            ("aws_region", "us-east-1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
    )
    .unwrap();
    let loc = Location::parse("test", "s3://nobody/x", None, &options).unwrap();
    let err = loc.list().await.unwrap_err();
    assert!(crate::error::is_transient(&err), "{err:?}");
    let local = Location::local("/proc/definitely/not/here");
    let err = local.put("f", Bytes::from_static(b"x")).await.unwrap_err();
    assert!(!crate::error::is_transient(&err), "{err:?}");
}

/// The stable hash that names files and places keys gives FNV-1a's reference value.
#[test]
fn fnv1a_gives_the_reference_value() {
    assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
}
