//! Reads the binary's own file ahead at start.
//!
//! The release binary is about 240 MB (DataFusion, delta-rs, the object stores, librdkafka)
//! and a run touches about 66 MB of its code, scattered over it. Started with the file out of
//! the page cache (a fresh container, a machine that reclaimed it while other work ran),
//! every first touch of a code page is a small random read: the first 200,000-row batch of
//! the Spark comparison took 360-470 ms instead of 240, and the whole run 12-20% longer.
//! Asking the kernel to read the file ahead, on a thread of its own, turns those reads into
//! one sequential read that overlaps the start; with the file already cached it only checks
//! the cache. The pages read are cache, not the process's memory (they count in RSS only as
//! far as the code runs, as before).

/// Starts the read-ahead in the background; never fails the run (it is only a hint).
pub fn own_binary() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return;
    }
    let started = std::thread::Builder::new()
        .name("weir-readahead".into())
        .spawn(|| {
            if let Ok(file) = std::env::current_exe().and_then(std::fs::File::open) {
                will_need(&file);
            }
        });
    if let Err(e) = started {
        tracing::debug!("no read-ahead of the binary: {e}");
    }
}

/// `posix_fadvise(WILLNEED)` over the whole file.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn will_need(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the call (borrowed from `file`); posix_fadvise only
    // reads its arguments and returns an error code, which is ignored: it is a hint.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
    if rc != 0 {
        tracing::debug!("posix_fadvise on the binary: error {rc}");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn will_need(_file: &std::fs::File) {}
