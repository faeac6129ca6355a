//! Bad input records: a poison file under FAILFAST and its way out, and the files source's
//! dead letter, each checked in every sink through kills.

use weir_core::datafusion::prelude::SessionContext;
use weir_core::fault::RUNNER_POINTS;
use weir_testkit::{parquet_rows, rows, run_weir, temp_dir};

use crate::kills::killed_in_batch_2_then_rerun;
use crate::{bin, gen_orders, gen_orders_from, input_rows, pipeline, pipeline_with, run_to_end};

/// A cut JSON line in a file of a batch stops the query under FAILFAST; the file may not be
/// repaired (its batch replays it as it was taken), and the error says the way out: run
/// once with `mode = "DROPMALFORMED"`, which replays that batch without the record, then go
/// back to FAILFAST. Every sink ends with every good row once.
#[tokio::test]
async fn a_poison_file_is_passed_by_one_run_with_dropmalformed_and_every_sink_is_exact() {
    use weir_core::datafusion::prelude::SessionContext;
    let dir = temp_dir();
    let input = dir.path().join("in");
    gen_orders(&input, 3, 10, 30);
    let mut want = crate::input_rows(&input).await;
    // The second file gets a cut last line (written last, it is the third batch's).
    let mut names: Vec<_> = std::fs::read_dir(&input)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    let poisoned = &names[1];
    let mut text = std::fs::read_to_string(poisoned).unwrap();
    text.push_str("{\"order_id\": 999999, \"status\": \"cut");
    std::fs::write(poisoned, &text).unwrap();
    let taken = std::fs::metadata(poisoned).unwrap().modified().unwrap();
    let table = "poison_orders";
    let pg = &weir_testkit::postgres().url;
    let sinks = format!(
        "[[sink]]\ntype = \"delta-append\"\npath = \"delta\"\n\n\
         [[sink]]\ntype = \"postgres-upsert\"\nurl = \"{pg}\"\ntable = \"{table}\"\n\
         keys = [\"order_id\"]\nordering = \"updated_at\"\ncreate-table = true\n\n\
         [[sink]]\ntype = \"parquet\"\npath = \"out\"\n"
    );
    let p = pipeline(dir.path(), &sinks);
    let failfast = std::fs::read_to_string(&p).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("batch 2") && err.contains("at line 11") && err.contains("DROPMALFORMED"),
        "the error names the batch, the line and the way out: {err}"
    );
    // Repairing the file is refused: the batch must replay what it took.
    let repaired = text.replace("{\"order_id\": 999999, \"status\": \"cut", "");
    std::fs::write(poisoned, &repaired).unwrap();
    let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("DROPMALFORMED"),
        "{err}"
    );
    // Put back as it was: its bytes and its modification time.
    std::fs::write(poisoned, &text).unwrap();
    std::fs::File::options()
        .write(true)
        .open(poisoned)
        .unwrap()
        .set_modified(taken)
        .unwrap();
    // The way out: one run with DROPMALFORMED and trigger = "once" (only the pending
    // batch), then FAILFAST again for new files.
    std::fs::write(
        &p,
        failfast
            .replace(
                "max-files-per-trigger",
                "mode = \"DROPMALFORMED\"\nmax-files-per-trigger",
            )
            .replace("trigger = \"available-now\"", "trigger = \"once\""),
    )
    .unwrap();
    let progress = dir.path().join("progress.jsonl");
    run_to_end(&p, &progress);
    std::fs::write(&p, &failfast).unwrap();
    let more = dir.path().join("more");
    gen_orders_from(&more, 3, 1, 10, 30);
    want.extend(crate::input_rows(&more).await);
    want.sort();
    for f in std::fs::read_dir(&more).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), input.join(f.file_name())).unwrap();
    }
    run_to_end(&p, &progress);
    // Every good row once in every sink (the cut line in none).
    let cols = ["order_id", "status", "amount", "updated_at"];
    assert_eq!(
        weir_testkit::parquet_rows(&dir.path().join("out"), &cols).await,
        want
    );
    let ctx = SessionContext::new();
    let delta = weir_delta::read_table(&ctx, &dir.path().join("delta").into())
        .await
        .unwrap();
    assert_eq!(
        weir_testkit::rows(delta.select_columns(&cols).unwrap()).await,
        want
    );
    let keys: std::collections::BTreeSet<&str> =
        want.iter().map(|r| r.split('|').next().unwrap()).collect();
    let stored = weir_testkit::pg_rows(pg, &format!("SELECT order_id::text FROM {table}")).await;
    assert_eq!(stored.len(), keys.len());
}

/// `dead-letter`: the malformed lines of every file go to a Parquet folder with their file,
/// line, error and batch id, each once, through a kill at every point of the batch (and a
/// kill in the middle of a run); the sinks get every sound line once.
#[tokio::test]
async fn a_dead_letter_holds_each_bad_line_once_with_its_position_through_kills() {
    for point in RUNNER_POINTS {
        let dir = temp_dir();
        let input = dir.path().join("in");
        let clean = dir.path().join("clean");
        gen_orders(&clean, 5, 20, 50);
        let want = input_rows(&clean).await;
        // Two bad lines in each file, at lines 3 and 21 of 22: a cut record and a number
        // in quotes.
        std::fs::create_dir_all(&input).unwrap();
        let mut names: Vec<_> = std::fs::read_dir(&clean)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        let mut bad = Vec::new();
        for f in &names {
            let mut lines: Vec<String> = std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .map(String::from)
                .collect();
            lines.insert(2, "{\"order_id\": 5, \"status\": \"cut".into());
            lines.push("{\"order_id\": 6, \"amount\": \"7.25\"}".into());
            lines.push(lines[3].clone());
            lines.remove(3);
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            std::fs::write(input.join(&name), lines.join("\n") + "\n").unwrap();
            bad.push(format!("{name}|3"));
            bad.push(format!("{name}|21"));
        }
        bad.sort();
        let p = pipeline_with(
            dir.path(),
            1,
            "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n\n\
             [[sink]]\ntype = \"delta-append\"\npath = \"delta\"\n",
        );
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "max-files-per-trigger",
            "dead-letter = \"dead\"\nmax-files-per-trigger",
        );
        std::fs::write(&p, text).unwrap();
        let prog1 = dir.path().join("progress1.jsonl");
        let prog2 = dir.path().join("progress2.jsonl");
        killed_in_batch_2_then_rerun(&p, point, &prog1, &prog2);
        let cols = ["order_id", "status", "amount", "updated_at"];
        let mut got = parquet_rows(&dir.path().join("out"), &cols).await;
        got.sort();
        assert_eq!(got, want, "{point}: every sound line once");
        let delta =
            weir_delta::read_table(&SessionContext::new(), &dir.path().join("delta").into())
                .await
                .unwrap();
        assert_eq!(
            rows(delta.select_columns(&cols).unwrap()).await,
            want,
            "{point}"
        );
        let dead = parquet_rows(&dir.path().join("dead"), &["file", "line"]).await;
        let mut dead: Vec<String> = dead
            .iter()
            .map(|r| {
                let (file, line) = r.rsplit_once('|').unwrap();
                let name = std::path::Path::new(file)
                    .file_name()
                    .unwrap()
                    .to_string_lossy();
                format!("{name}|{line}")
            })
            .collect();
        dead.sort();
        assert_eq!(dead, bad, "{point}: each bad line once in the dead letter");
        let errors = parquet_rows(&dir.path().join("dead"), &["line", "error", "record"]).await;
        for r in &errors {
            let (line, rest) = r.split_once('|').unwrap();
            if line == "21" {
                assert!(rest.contains("cannot hold the string \"7.25\""), "{r}");
            } else {
                assert!(rest.ends_with("{\"order_id\": 5, \"status\": \"cut"), "{r}");
            }
        }
        let ids = parquet_rows(&dir.path().join("dead"), &["batch_id"]).await;
        let batches: std::collections::BTreeSet<&String> = ids.iter().collect();
        assert_eq!(batches.len(), 5, "{point}: a batch id per file: {ids:?}");
    }
}
