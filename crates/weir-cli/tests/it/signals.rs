//! SIGTERM and Ctrl-C: the batch in progress is finished and committed; a second signal,
//! or the grace period running out, stops at once and leaves the batch to run again.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir_testkit::{parquet_rows, temp_dir};

use crate::{bin, gen_orders, input_rows, pipeline};

const SINK: &str = "[[sink]]\ntype = \"parquet\"\npath = \"out\"\n";

/// Starts `weir run` on a pipeline that runs one file per 100 ms, with batch 1 held for
/// `hold_ms` before the user function.
fn start(p: &Path, hold_ms: u64, extra: &[&str]) -> Child {
    let text = std::fs::read_to_string(p)
        .unwrap()
        .replace("\"available-now\"", "\"100ms\"");
    std::fs::write(p, text).unwrap();
    let mut args = vec!["run", p.to_str().unwrap(), "--quiet"];
    args.extend_from_slice(extra);
    Command::new(bin())
        .args(&args)
        .env("WEIR_FAULT", format!("before-user-fn@1:sleep={hold_ms}"))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

fn finish(child: Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn sigterm_finishes_and_commits_the_batch_in_progress_then_exits_0() {
    let dir = temp_dir();
    gen_orders(&dir.path().join("in"), 4, 5, 3);
    let p = pipeline(dir.path(), SINK);
    let child = start(&p, 1500, &[]);
    wait_for(&dir.path().join("chk/offsets/1"));
    signal(&child, "-TERM");
    let (code, err) = finish(child);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("SIGTERM: stopping after the current batch"),
        "{err}"
    );
    let chk = dir.path().join("chk");
    assert!(chk.join("commits/1").exists(), "{err}");
    assert!(!chk.join("offsets/2").exists(), "{err}");
    // Two of four files were read, each once; a restart without the hold reads the rest.
    assert_eq!(
        parquet_rows(&dir.path().join("out"), &["order_id"])
            .await
            .len(),
        10
    );
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"100ms\"", "\"available-now\"");
    std::fs::write(&p, text).unwrap();
    let out = weir_testkit::run_weir(&bin(), &["run", p.to_str().unwrap(), "--quiet"], None);
    assert!(out.status.success(), "{out:?}");
    let cols = ["order_id", "status", "amount", "updated_at"];
    assert_eq!(
        parquet_rows(&dir.path().join("out"), &cols).await,
        input_rows(&dir.path().join("in")).await
    );
}

#[tokio::test]
async fn a_second_signal_or_the_grace_period_stops_at_once_and_the_batch_runs_again() {
    for (extra, second) in [(&[][..], true), (&["--stop-grace", "300ms"][..], false)] {
        let dir = temp_dir();
        gen_orders(&dir.path().join("in"), 3, 5, 3);
        let p = pipeline(dir.path(), SINK);
        let child = start(&p, 30_000, extra);
        let chk = dir.path().join("chk");
        wait_for(&chk.join("offsets/1"));
        let t = Instant::now();
        signal(&child, "-INT");
        if second {
            std::thread::sleep(Duration::from_millis(200));
            signal(&child, "-TERM");
        }
        let (code, err) = finish(child);
        assert!(t.elapsed() < Duration::from_secs(20), "{err}");
        assert_eq!(code, Some(130), "{err}");
        let why = if second {
            "SIGTERM again"
        } else {
            "did not finish within 300ms"
        };
        assert!(err.contains(why) && err.contains("runs again"), "{err}");
        assert!(!chk.join("commits/1").exists(), "{err}");
        // The next start runs batch 1 again with the same file, and nothing is doubled.
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"100ms\"", "\"available-now\"");
        std::fs::write(&p, text).unwrap();
        let out = weir_testkit::run_weir(&bin(), &["run", p.to_str().unwrap(), "--quiet"], None);
        assert!(out.status.success(), "{out:?}");
        let cols = ["order_id", "status", "amount", "updated_at"];
        assert_eq!(
            parquet_rows(&dir.path().join("out"), &cols).await,
            input_rows(&dir.path().join("in")).await
        );
    }
}
