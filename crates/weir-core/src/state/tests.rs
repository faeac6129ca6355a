use std::collections::BTreeMap;

use super::*;

fn conf(snapshot_every: u64, retain: u64) -> StateConf {
    StateConf::new(snapshot_every, retain).unwrap()
}

/// Loads `b`, runs batch `b`, commits, and (as the engine does after `commits/b`) purges.
async fn batch(s: &mut StateStore, b: u64) {
    s.load(b).await.unwrap();
    run_batch(s, b);
    assert_eq!(s.commit().await.unwrap(), b + 1);
    s.purge().await.unwrap();
}

fn key(i: u64) -> Vec<u8> {
    format!("k{i:04}").into_bytes()
}

fn contents(s: &StateStore) -> BTreeMap<Vec<u8>, Vec<u8>> {
    s.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
}

/// What a new store (as after a restart) at `at` holds once it loaded `version`.
async fn load_fresh(
    at: &Location,
    c: StateConf,
    version: u64,
) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let mut fresh = StateStore::new(at.clone(), c);
    fresh.load(version).await?;
    Ok(contents(&fresh))
}

/// Batch `b`'s changes, the same on every attempt: puts key b % 7 (its value the batch),
/// removes key (b + 3) % 7 unless that is the same key.
fn run_batch(s: &mut StateStore, b: u64) {
    s.put(key(b % 7), b.to_le_bytes().to_vec());
    if (b + 3) % 7 != b % 7 {
        s.remove(key((b + 3) % 7));
    }
}

/// The reference: the same changes applied to a plain map, batches 0..n.
fn reference(n: u64) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut m = BTreeMap::new();
    for b in 0..n {
        m.insert(key(b % 7), b.to_le_bytes().to_vec());
        if (b + 3) % 7 != b % 7 {
            m.remove(&key((b + 3) % 7));
        }
    }
    m
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort_by_key(|n| files::parse_name(n));
    v
}

#[tokio::test]
async fn versions_load_from_snapshots_and_deltas_after_a_restart_and_equal_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let at = Location::local(dir.path().join("state/0/0"));
    let mut s = StateStore::new(at.clone(), conf(5, 100));
    for b in 0..23 {
        batch(&mut s, b).await;
        assert_eq!(contents(&s), reference(b + 1), "in memory after batch {b}");
    }
    let listed = names(&dir.path().join("state/0/0"));
    assert_eq!(listed.len(), 23 + 4, "{listed:?}");
    assert!(listed.contains(&"20.snapshot".to_string()));
    // A new process: every version rebuilds from the files to the reference.
    for v in [0, 1, 4, 5, 6, 19, 20, 23] {
        let mut fresh = StateStore::new(at.clone(), conf(5, 100));
        fresh.load(v).await.unwrap();
        assert_eq!(contents(&fresh), reference(v), "version {v} from files");
        assert_eq!(fresh.len(), reference(v).len());
        let bytes: usize = reference(v).iter().map(|(k, v)| k.len() + v.len()).sum();
        // The arena holds the bytes (and two length bytes per short key and value); the
        // table a few more per key.
        let memory = fresh.memory_bytes();
        assert!(memory >= bytes, "version {v}: {memory} < {bytes}");
        assert!(
            memory <= 2 * (bytes + 2 * fresh.len()) + 64 * fresh.len() + 64,
            "version {v}: {memory} for {} keys of {bytes} bytes",
            fresh.len()
        );
    }
}

/// Two writers of the same version that listed the files before either wrote (a
/// killed driver's task still running beside the replay's): the second takes the first's
/// file when it holds the same bytes, and is refused when it does not.
#[tokio::test]
async fn a_version_written_meanwhile_with_the_same_bytes_is_taken_and_other_bytes_refused() {
    let dir = tempfile::tempdir().unwrap();
    let at = Location::local(dir.path().join("state/0/0"));
    let mut first = StateStore::new(at.clone(), conf(10, 100));
    let mut second = StateStore::new(at.clone(), conf(10, 100));
    let mut third = StateStore::new(at.clone(), conf(10, 100));
    for s in [&mut first, &mut second, &mut third] {
        s.load(0).await.unwrap();
    }
    for s in [&mut first, &mut second] {
        s.put(b"k".to_vec(), b"v".to_vec());
    }
    third.put(b"k".to_vec(), b"other".to_vec());
    assert_eq!(first.commit().await.unwrap(), 1);
    assert_eq!(
        second.commit().await.unwrap(),
        1,
        "the same bytes are taken"
    );
    assert_eq!(second.get(b"k"), Some(&b"v"[..]));
    let err = third.commit().await.unwrap_err().to_string();
    assert!(
        err.contains("1.delta") && err.contains("someone else"),
        "{err}"
    );
}

#[tokio::test]
async fn a_replay_never_sees_its_first_attempts_changes_and_replaces_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let at = Location::local(dir.path().join("s"));
    let mut s = StateStore::new(at.clone(), conf(10, 100));
    for b in 0..3 {
        batch(&mut s, b).await;
    }
    // Batch 3, first attempt: changes of its own, committed as version 4, then a crash
    // before commits/3.
    s.load(3).await.unwrap();
    s.put(key(99), b"first attempt".to_vec());
    s.remove(key(0));
    s.commit().await.unwrap();
    // In this process (the engine retrying) and in a new one: version 3 is what batch 3 sees.
    for fresh in [false, true] {
        let mut r = if fresh {
            StateStore::new(at.clone(), conf(10, 100))
        } else {
            std::mem::replace(&mut s, StateStore::new(at.clone(), conf(10, 100)))
        };
        r.load(3).await.unwrap();
        assert_eq!(contents(&r), reference(3), "fresh process: {fresh}");
        assert_eq!(r.get(&key(99)), None);
        run_batch(&mut r, 3);
        assert_eq!(r.commit().await.unwrap(), 4);
    }
    let mut again = StateStore::new(at, conf(10, 100));
    again.load(4).await.unwrap();
    assert_eq!(
        contents(&again),
        reference(4),
        "the replay's version 4 replaced the first"
    );
}

#[tokio::test]
async fn uncommitted_changes_are_dropped_by_the_next_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StateStore::new(Location::local(dir.path().join("s")), StateConf::default());
    s.load(0).await.unwrap();
    s.put(key(1), b"a".to_vec());
    assert_eq!(s.get(&key(1)), Some(&b"a"[..]));
    assert_eq!(s.iter().count(), 1);
    assert!(s.is_empty(), "not committed yet");
    s.load(0).await.unwrap();
    assert_eq!(s.get(&key(1)), None);
    assert_eq!(s.iter().count(), 0);
    // A put then a remove of a new key within an attempt leaves nothing, in the delta too.
    s.put(key(2), b"b".to_vec());
    s.remove(key(2));
    s.commit().await.unwrap();
    assert!(s.is_empty());
    assert_eq!(s.memory_bytes(), 0);
    let mut rows = 0;
    let delta = std::fs::read(dir.path().join("s/1.delta")).unwrap();
    encode::decode(delta.into(), files::Kind::Delta, 1, |_, _| rows += 1).unwrap();
    assert_eq!(rows, 0);
}

#[tokio::test]
async fn retention_keeps_the_newest_versions_loadable_and_deletes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("s");
    let at = Location::local(&folder);
    let mut s = StateStore::new(at.clone(), conf(4, 6));
    for b in 0..30 {
        batch(&mut s, b).await;
    }
    // Versions 25..=30 must load: snapshot 24 and deltas 25..=30; nothing older.
    assert_eq!(
        names(&folder),
        [
            "24.snapshot",
            "25.delta",
            "26.delta",
            "27.delta",
            "28.delta",
            "28.snapshot",
            "29.delta",
            "30.delta"
        ]
    );
    for v in 25..=30 {
        assert_eq!(
            load_fresh(&at, conf(4, 6), v).await.unwrap(),
            reference(v),
            "version {v}"
        );
    }
    let mut fresh = StateStore::new(at, conf(4, 6));
    let err = fresh.load(20).await.unwrap_err().to_string();
    assert!(
        err.contains("1.delta")
            && err.contains("missing")
            && err.contains("version 20")
            && err.contains("kept versions from 24 on"),
        "{err}"
    );
}

#[tokio::test]
async fn missing_and_damaged_files_are_errors_naming_them_never_an_empty_state() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("s");
    let at = Location::local(&folder);
    let mut s = StateStore::new(at.clone(), conf(3, 100));
    for b in 0..5 {
        batch(&mut s, b).await;
    }
    let load = |v: u64| load_fresh(&at, conf(3, 100), v);
    // Cut short: the footer is gone.
    let delta5 = folder.join("5.delta");
    let whole = std::fs::read(&delta5).unwrap();
    std::fs::write(&delta5, &whole[..whole.len() / 2]).unwrap();
    let err = load(5).await.unwrap_err();
    assert!(matches!(err, Error::CorruptState { .. }), "{err}");
    let err = err.to_string();
    assert!(
        err.contains("5.delta") && err.contains("not a complete"),
        "{err}"
    );
    // Empty.
    std::fs::write(&delta5, b"").unwrap();
    assert!(load(5).await.unwrap_err().to_string().contains("5.delta"));
    // Another version's file under this name.
    std::fs::copy(folder.join("4.delta"), &delta5).unwrap();
    let err = load(5).await.unwrap_err().to_string();
    assert!(
        err.contains("5.delta") && err.contains("version 4"),
        "{err}"
    );
    std::fs::write(&delta5, &whole).unwrap();
    assert_eq!(load(5).await.unwrap(), reference(5));
    // A damaged snapshot is an error too, not a fall back to the deltas.
    std::fs::write(folder.join("3.snapshot"), b"junk").unwrap();
    let err = load(4).await.unwrap_err().to_string();
    assert!(err.contains("3.snapshot"), "{err}");
    // A delta gone.
    let four = std::fs::read(folder.join("4.delta")).unwrap();
    std::fs::remove_file(folder.join("4.delta")).unwrap();
    std::fs::remove_file(folder.join("3.snapshot")).unwrap();
    let err = load(5).await.unwrap_err().to_string();
    assert!(
        err.contains("4.delta") && err.contains("version 5"),
        "{err}"
    );
    // A version beyond the files.
    std::fs::write(folder.join("4.delta"), &four).unwrap();
    let err = load(9).await.unwrap_err().to_string();
    assert!(
        err.contains("6.delta") && err.contains("version 9"),
        "{err}"
    );
}

#[tokio::test]
async fn operator_metadata_is_written_once_in_sparks_shape_and_a_change_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = Location::local(dir.path().join("state"));
    let meta = OperatorMetadata::new(0, "stateStoreSave", 4);
    meta.ensure(&root).await.unwrap();
    meta.ensure(&root).await.unwrap();
    let written = std::fs::read_to_string(dir.path().join("state/0/_metadata/metadata")).unwrap();
    assert_eq!(
        written,
        "v1\n{\"operatorInfo\":{\"operatorId\":0,\"operatorName\":\"stateStoreSave\"},\
         \"stateStoreInfo\":[{\"storeName\":\"default\",\"numColsPrefixKey\":0,\
         \"numPartitions\":4}]}"
    );
    let err = OperatorMetadata::new(0, "stateStoreSave", 2)
        .ensure(&root)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("4 partition(s)") && err.contains("with 2") && err.contains("metadata"),
        "{err}"
    );
}

#[test]
fn a_spark_metadata_sample_parses() {
    let sample = "{\"operatorInfo\":{\"operatorId\":0,\"operatorName\":\"stateStoreSave\"},\
                  \"stateStoreInfo\":[{\"storeName\":\"default\",\"numColsPrefixKey\":0,\
                  \"numPartitions\":4}]}";
    let m: OperatorMetadata = serde_json::from_str(sample).unwrap();
    assert_eq!(m, OperatorMetadata::new(0, "stateStoreSave", 4));
}

/// The first attempt of batch 3 commits version 4 with a snapshot (every 4 versions), then
/// the process dies before `commits/3`. The replay runs with snapshots every 5: it writes no
/// snapshot of version 4, and the first attempt's must not survive to be loaded later.
#[tokio::test]
async fn a_replay_leaves_no_file_of_the_first_attempt_whatever_the_snapshot_interval() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("s");
    let at = Location::local(&folder);
    let mut s = StateStore::new(at.clone(), conf(4, 2));
    for b in 0..3 {
        batch(&mut s, b).await;
    }
    s.load(3).await.unwrap();
    s.put(key(99), b"first attempt".to_vec());
    s.commit().await.unwrap();
    assert!(folder.join("4.snapshot").exists());
    drop(s);
    let mut r = StateStore::new(at.clone(), conf(5, 2));
    r.load(3).await.unwrap();
    assert_eq!(contents(&r), reference(3));
    run_batch(&mut r, 3);
    assert_eq!(r.commit().await.unwrap(), 4);
    r.purge().await.unwrap();
    assert!(!folder.join("4.snapshot").exists());
    for v in [3, 4] {
        assert_eq!(
            load_fresh(&at, conf(4, 2), v).await.unwrap(),
            reference(v),
            "version {v}"
        );
    }
}

/// With the fewest versions kept (2), a crash after a commit and before `commits/N` still
/// leaves the version the replay loads, whichever version the snapshots fall on.
#[tokio::test]
async fn the_version_a_replay_loads_survives_retention_at_its_tightest() {
    for every in [1, 2, 3] {
        let dir = tempfile::tempdir().unwrap();
        let at = Location::local(dir.path().join("s"));
        let mut s = StateStore::new(at.clone(), conf(every, 2));
        for b in 0..12 {
            batch(&mut s, b).await;
            // Batch b + 1 commits and dies before its `commits/` entry (no purge).
            s.load(b + 1).await.unwrap();
            s.put(key(98), b"lost".to_vec());
            s.commit().await.unwrap();
            let mut fresh = StateStore::new(at.clone(), conf(every, 2));
            fresh.load(b + 1).await.unwrap();
            assert_eq!(
                contents(&fresh),
                reference(b + 1),
                "every {every}, batch {b}"
            );
            s.load(b + 1).await.unwrap();
        }
        assert!(StateConf::new(every, 1).is_err());
    }
    assert!(StateConf::new(0, 100).is_err());
}

#[tokio::test]
async fn committing_on_an_older_version_or_beside_another_writer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let at = Location::local(dir.path().join("s"));
    let mut s = StateStore::new(at.clone(), conf(10, 100));
    for b in 0..5 {
        batch(&mut s, b).await;
    }
    // Version 2 is loaded again and written on: versions 3.. were built on the old 3.
    s.load(2).await.unwrap();
    run_batch(&mut s, 2);
    let err = s.commit().await.unwrap_err().to_string();
    assert!(
        err.contains("4.delta") && err.contains("later version"),
        "{err}"
    );
    assert_eq!(s.version(), None, "a failed commit leaves nothing held");
    // Two stores on one folder, both at version 5, making different changes: the second
    // commit of 6 is refused (with the same changes it would write the same bytes, and
    // takes the file: see the test before).
    let mut a = StateStore::new(at.clone(), conf(10, 100));
    let mut b = StateStore::new(at.clone(), conf(10, 100));
    a.load(5).await.unwrap();
    b.load(5).await.unwrap();
    run_batch(&mut a, 5);
    a.commit().await.unwrap();
    run_batch(&mut b, 5);
    b.put(b"another writer".to_vec(), b"1".to_vec());
    let err = b.commit().await.unwrap_err();
    assert!(matches!(err, Error::CheckpointInUse { .. }), "{err}");
    assert!(err.to_string().contains("6.delta"), "{err}");
    assert_eq!(
        load_fresh(&at, conf(10, 100), 6).await.unwrap(),
        reference(6)
    );
}
