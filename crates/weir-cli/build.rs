//! Link options of the release `weir` binary (x86_64 Linux with glibc, where rustc links
//! with lld):
//!
//! - `--symbol-ordering-file=link/hot-symbols.txt`: the functions the usual pipelines run
//!   (written by `bench/hot_symbols.sh`) go first and together in `.text`. The code of a
//!   batch is about 6 MB, but unordered it lies spread over some 50 MB of the binary's
//!   140 MB of text, and the kernel maps a 64 KB window around every page it faults in:
//!   that spread was half of the process's peak RSS. Names the list has that the build
//!   does not (after a rename, or with another rustc) are skipped.
//! - `-z pack-relative-relocs` (DT_RELR) when the glibc the binary is built against loads
//!   it (2.36 or later): the 8 MB of relative relocations shrink to about 100 KB, which the
//!   loader no longer reads at every start.
//!
//! `WEIR_PLAIN_LINK=1`, or any linker choice in RUSTFLAGS, links without them.

use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=link/hot-symbols.txt");
    println!("cargo:rerun-if-env-changed=WEIR_PLAIN_LINK");
    let var = |k: &str| env::var(k).unwrap_or_default();
    let rustflags = var("CARGO_ENCODED_RUSTFLAGS");
    let own_linker = ["linker", "link-self-contained", "link-arg"]
        .iter()
        .any(|f| rustflags.contains(f));
    if var("TARGET") != "x86_64-unknown-linux-gnu"
        || var("HOST") != var("TARGET")
        || var("PROFILE") != "release"
        || !var("WEIR_PLAIN_LINK").is_empty()
        || own_linker
    {
        return;
    }
    let order = format!("{}/link/hot-symbols.txt", var("CARGO_MANIFEST_DIR"));
    println!("cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={order}");
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    if glibc_loads_relr() {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Whether this machine's glibc (`getconf GNU_LIBC_VERSION`: "glibc 2.36") is 2.36 or
/// later, the first to load DT_RELR. lld marks a packed binary as needing it, so one linked
/// against an older glibc would not start.
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
