//! Link options of the release `weir` binary on x86_64 Linux with glibc:
//!
//! - `--symbol-ordering-file=link/hot-symbols.txt`: the functions the usual pipelines run
//!   (written by `bench/hot_symbols.sh`) go first and together in `.text`. The code of a
//!   batch is about 6 MB, but unordered it lies spread over some 50 MB of the binary's
//!   140 MB of text, and the kernel maps a 64 KB window around every page it faults in:
//!   that spread was half of the process's peak RSS. Names the list has that the build
//!   does not (after a rename, another rustc, other dependencies) are skipped.
//! - With `WEIR_LINK_RELR=1`, also `-z pack-relative-relocs` (DT_RELR): the 8 MB of
//!   relative relocations shrink to about 100 KB, which the loader no longer reads at every
//!   start. Opt-in because the binary then needs glibc 2.36 or later to start, wherever it
//!   runs; only offered when the glibc here is 2.36 or later.
//!
//! The options are used only if a one-line program links with them through the same rustc,
//! flags and linker (rustup's rustc links with its own lld by default; GNU ld does not know
//! the ordering option). `WEIR_PLAIN_LINK=1` links without any of them.

use std::env;
use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=link/hot-symbols.txt");
    for var in [
        "WEIR_PLAIN_LINK",
        "WEIR_LINK_RELR",
        "RUSTC_LINKER",
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if var("TARGET") != "x86_64-unknown-linux-gnu"
        || var("HOST") != var("TARGET")
        || var("PROFILE") != "release"
        || !var("WEIR_PLAIN_LINK").is_empty()
    {
        return;
    }
    let order = Path::new(&var("CARGO_MANIFEST_DIR")).join("link/hot-symbols.txt");
    let mut args = vec![
        "-Xlinker".to_string(),
        format!("--symbol-ordering-file={}", order.display()),
        "-Xlinker".to_string(),
        "--no-warn-symbol-ordering".to_string(),
    ];
    if var("WEIR_LINK_RELR") == "1" && glibc_loads_relr() {
        args.extend(["-Xlinker".into(), "-z".into(), "-Xlinker".into()]);
        args.push("pack-relative-relocs".into());
    }
    if !links_with(&args) {
        println!(
            "cargo:warning=weir: this rustc/linker does not take lld's --symbol-ordering-file; \
             linking the usual way (hot code not placed together)"
        );
        return;
    }
    for a in args {
        println!("cargo:rustc-link-arg-bins={a}");
    }
}

/// A build variable, empty when unset.
fn var(k: &str) -> String {
    env::var(k).unwrap_or_default()
}

/// Whether an empty program links with `args` passed to the linker driver, through the
/// rustc, flags and linker this build uses.
fn links_with(args: &[String]) -> bool {
    let out = Path::new(&var("OUT_DIR")).to_path_buf();
    let src = out.join("probe.rs");
    if std::fs::write(&src, "fn main() {}\n").is_err() {
        return false;
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.arg("--edition=2021")
        .arg("--crate-type=bin")
        .arg("-o")
        .arg(out.join("probe"))
        .arg(&src);
    for f in var("CARGO_ENCODED_RUSTFLAGS")
        .split('\x1f')
        .filter(|f| !f.is_empty())
    {
        cmd.arg(f);
    }
    if let Ok(linker) = env::var("RUSTC_LINKER") {
        cmd.arg(format!("-Clinker={linker}"));
    }
    for a in args {
        cmd.arg(format!("-Clink-arg={a}"));
    }
    cmd.output().map(|o| o.status.success()).unwrap_or(false)
}

/// Whether this machine's glibc (`getconf GNU_LIBC_VERSION`: "glibc 2.36") is 2.36 or
/// later, the first to load DT_RELR: lld marks a packed binary as needing it.
fn glibc_loads_relr() -> bool {
    let Ok(out) = Command::new("getconf").arg("GNU_LIBC_VERSION").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = text.split_whitespace().nth(1) else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (2, 36)
}
