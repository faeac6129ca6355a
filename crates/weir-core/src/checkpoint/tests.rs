use std::fs;
use std::path::Path;

use super::*;

async fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open(Location::local(dir), "orders", LeaseSettings::default())
        .await
        .unwrap()
}

fn seq(offset: serde_json::Value) -> OffsetSeq {
    OffsetSeq {
        metadata: OffsetSeqMetadata {
            batch_watermark_ms: 0,
            batch_timestamp_ms: 1_796_213_408_634,
            conf: [(
                "datafusion.execution.target_partitions".to_string(),
                "2".to_string(),
            )]
            .into_iter()
            .collect(),
        },
        offsets: vec![Some(SourceOffset::new(offset))],
    }
}

#[tokio::test]
async fn files_have_the_shapes_of_sparks_samples() {
    let dir = tempfile::tempdir().unwrap();
    let cp = open(&dir.path().join("chk")).await;
    assert!(cp.is_new());
    cp.write_offsets(5, &seq(serde_json::json!({"logOffset": 5})))
        .await
        .unwrap();
    cp.write_commit(5, &CommitMetadata::default())
        .await
        .unwrap();
    let offsets = fs::read_to_string(dir.path().join("chk/offsets/5")).unwrap();
    assert_eq!(
        offsets,
        "v1\n{\"batchWatermarkMs\":0,\"batchTimestampMs\":1796213408634,\"conf\":{\"datafusion.execution.target_partitions\":\"2\"}}\n{\"logOffset\":5}"
    );
    let commit = fs::read_to_string(dir.path().join("chk/commits/5")).unwrap();
    assert_eq!(commit, "v1\n{\"nextBatchWatermarkMs\":0}");
    let meta = fs::read_to_string(dir.path().join("chk/metadata")).unwrap();
    assert!(
        meta.starts_with("{\"id\":\"") && meta.ends_with("\"}") && !meta.ends_with('\n'),
        "{meta}"
    );
    // Spark's own sample parses.
    let sample = "v1\n{\"batchWatermarkMs\":0,\"batchTimestampMs\":1796213408634,\"conf\":{\"spark.sql.shuffle.partitions\":\"4\"}}\n{\"logOffset\":5}";
    let parsed = OffsetSeq::parse(sample.as_bytes(), "spark-offsets-5").unwrap();
    assert_eq!(parsed.offsets[0].as_ref().unwrap().json()["logOffset"], 5);
    // A second open while the first holds the checkpoint is refused; after release,
    // reopening keeps the query id and is not new.
    let err = Checkpoint::open(
        Location::local(dir.path().join("chk")),
        "orders",
        LeaseSettings::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::CheckpointInUse { .. }), "{err}");
    cp.release().await;
    let again = open(&dir.path().join("chk")).await;
    assert_eq!(again.query_id(), cp.query_id());
    assert!(!again.is_new());
}

#[tokio::test]
async fn recover_reads_the_right_entries() {
    let dir = tempfile::tempdir().unwrap();
    let cp = open(dir.path()).await;
    assert_eq!(cp.recover().await.unwrap(), StartPoint::Fresh);
    cp.write_offsets(0, &seq(serde_json::json!({"logOffset": 0})))
        .await
        .unwrap();
    match cp.recover().await.unwrap() {
        StartPoint::Replay {
            batch_id: 0,
            start: None,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    cp.write_commit(0, &CommitMetadata::default())
        .await
        .unwrap();
    cp.write_offsets(1, &seq(serde_json::json!({"logOffset": 1})))
        .await
        .unwrap();
    match cp.recover().await.unwrap() {
        StartPoint::Replay {
            batch_id: 1,
            start: Some(s),
            batch,
        } => {
            assert_eq!(s.offsets[0].as_ref().unwrap().json()["logOffset"], 0);
            assert_eq!(batch.metadata.batch_timestamp_ms, 1_796_213_408_634);
        }
        other => panic!("{other:?}"),
    }
    cp.write_commit(1, &CommitMetadata::default())
        .await
        .unwrap();
    match cp.recover().await.unwrap() {
        StartPoint::Next {
            batch_id: 2,
            previous,
            ..
        } => {
            assert_eq!(previous.offsets[0].as_ref().unwrap().json()["logOffset"], 1)
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn corrupt_or_inconsistent_logs_are_errors_naming_the_file() {
    type Setup = fn(&Path);
    let cases: &[(&str, Setup, &str)] = &[
        (
            "zero-byte commit",
            |d| fs::write(d.join("commits/0"), b"").unwrap(),
            "commits/0. Incomplete log file in the offset commit log",
        ),
        (
            "garbage offsets",
            |d| fs::write(d.join("offsets/1"), b"hello").unwrap(),
            "offsets/1",
        ),
        (
            "bad json",
            |d| fs::write(d.join("offsets/1"), b"v1\n{oops\n{}").unwrap(),
            "Line 2 is not valid",
        ),
        (
            "unknown version",
            |d| fs::write(d.join("offsets/1"), b"v7\n{}\n{}").unwrap(),
            "encountered v7",
        ),
        (
            "gap",
            |d| {
                fs::write(d.join("offsets/3"), b"v1\n{}\n{}").unwrap();
                fs::write(d.join("commits/3"), b"v1\n{}").unwrap();
            },
            "offsets/1 is missing",
        ),
        (
            "behind by more than one",
            |d| {
                fs::write(d.join("offsets/1"), b"v1\n{}\n{}").unwrap();
                fs::write(d.join("offsets/2"), b"v1\n{}\n{}").unwrap();
            },
            "more than one batch is uncommitted",
        ),
        (
            "stray file",
            |d| fs::write(d.join("offsets/notes.txt"), b"x").unwrap(),
            "Unexpected file",
        ),
    ];
    for (name, setup, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let cp = open(dir.path()).await;
        fs::create_dir_all(dir.path().join("offsets")).unwrap();
        fs::create_dir_all(dir.path().join("commits")).unwrap();
        fs::write(dir.path().join("offsets/0"), b"v1\n{}\n{\"logOffset\":0}").unwrap();
        if *name != "zero-byte commit" {
            fs::write(
                dir.path().join("commits/0"),
                b"v1\n{\"nextBatchWatermarkMs\":0}",
            )
            .unwrap();
        }
        if *name == "garbage offsets" || *name == "bad json" || *name == "unknown version" {
            // offsets/1 pending after a committed 0: recovery must read it.
        }
        setup(dir.path());
        let err = cp.recover().await.unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
    }
}

#[tokio::test]
async fn writing_an_existing_entry_means_another_query_owns_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cp = open(dir.path()).await;
    cp.write_offsets(0, &seq(serde_json::json!({"logOffset": 0})))
        .await
        .unwrap();
    let err = cp
        .write_offsets(0, &seq(serde_json::json!({"logOffset": 9})))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::CheckpointInUse { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("another query is using the checkpoint")
    );
    let kept = fs::read_to_string(dir.path().join("offsets/0")).unwrap();
    assert!(
        kept.ends_with("{\"logOffset\":0}"),
        "the first write is kept: {kept}"
    );
}

#[tokio::test]
async fn purge_keeps_the_newest_entries() {
    let dir = tempfile::tempdir().unwrap();
    let cp = open(dir.path()).await;
    for i in 0..5 {
        cp.write_offsets(i, &seq(serde_json::json!({"logOffset": i})))
            .await
            .unwrap();
        cp.write_commit(i, &CommitMetadata::default())
            .await
            .unwrap();
    }
    cp.purge(3).await.unwrap();
    assert_eq!(cp.batch_ids().await.unwrap(), (vec![3, 4], vec![3, 4]));
    assert!(matches!(
        cp.recover().await.unwrap(),
        StartPoint::Next { batch_id: 5, .. }
    ));
}

/// A kill while batch 1's function ran leaves `commits/1`'s temp file; the next holder of the
/// checkpoint removes it (and only weir's log temp files) before it runs anything.
#[tokio::test]
async fn a_reopened_checkpoint_removes_the_temp_files_a_kill_left_in_its_logs() {
    let dir = tempfile::tempdir().unwrap();
    let hidden = |log: &str| -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir.path().join(log))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        names.sort();
        names
    };
    {
        let cp = open(dir.path()).await;
        cp.write_offsets(0, &seq(serde_json::json!({"logOffset": 0})))
            .await
            .unwrap();
        cp.write_commit(0, &CommitMetadata::default())
            .await
            .unwrap();
        cp.write_offsets(1, &seq(serde_json::json!({"logOffset": 1})))
            .await
            .unwrap();
        // The process dies before the function returns: nothing removes the temp file.
        let prepared = cp
            .prepare_commit(1, &CommitMetadata::default())
            .await
            .unwrap();
        std::mem::forget(prepared);
        cp.release().await;
    }
    assert_eq!(hidden("commits").len(), 1, "{:?}", hidden("commits"));
    let stray = format!(".2.{}.tmp", uuid::Uuid::new_v4().simple());
    fs::write(dir.path().join("offsets").join(&stray), "v1\n").unwrap();
    fs::write(dir.path().join("offsets/.0.crc"), "crc").unwrap();

    let cp = open(dir.path()).await;
    assert!(hidden("commits").is_empty(), "{:?}", hidden("commits"));
    assert_eq!(hidden("offsets"), vec![".0.crc".to_string()]);
    match cp.recover().await.unwrap() {
        StartPoint::Replay { batch_id: 1, .. } => {}
        other => panic!("batch 1 must run again: {other:?}"),
    }
}
