//! The README's Rust example runs as written, and is the one in the README.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

fn example_bin() -> PathBuf {
    // target/debug/deps/it-<hash> -> target/debug/examples/readme
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("examples").join("readme"))
        .unwrap()
}

fn block(text: &str, begin: &str, end: &str) -> String {
    let start = text.find(begin).unwrap() + begin.len();
    let stop = start + text[start..].find(end).unwrap();
    text[start..stop].trim().to_string()
}

#[test]
fn the_readme_rust_example_is_the_example_that_is_built() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/readme.rs"
    ))
    .unwrap();
    assert_eq!(
        block(&readme, "```rust\n", "```"),
        block(&example, "// README-BEGIN\n", "// README-END"),
        "the README's Rust block must equal examples/readme.rs between its markers"
    );
}

#[test]
fn the_readme_rust_example_runs_as_written() {
    let bin = example_bin();
    assert!(bin.exists(), "{} (built by cargo test)", bin.display());
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    std::fs::write(
        input.join("a.json"),
        concat!(
            r#"{"order_id":1,"status":"created","amount":5.0,"updated_at":"2026-01-01T00:00:00Z"}"#,
            "\n",
            r#"{"order_id":1,"status":"paid","amount":5.0,"updated_at":"2026-01-01T00:01:00Z"}"#,
            "\n",
            r#"{"order_id":2,"status":"created","amount":7.5,"updated_at":"2026-01-01T00:00:00Z"}"#,
            "\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(&bin)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("batch 0: 3 rows"), "{stdout}");
    assert!(dir.path().join("lake/orders/_delta_log").exists());
    assert!(dir.path().join("chk/orders-upsert/commits/0").exists());
}
