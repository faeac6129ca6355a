//! glibc malloc settings for a process that runs for months.
//!
//! A query with a short trigger frees and allocates the same few megabytes in every batch
//! (reading a Delta log file, writing a Parquet part), about 63,000 allocations per one-row
//! batch. Measured with the release binary (rate source, 10 rows per batch, Delta append):
//! heaptrack saw the live heap flat at 3.6 MB minimum / 5 MB median from batch 1,500 to 6,000,
//! yet RSS grew from 124 to 162 MB in 6,000 batches. The memory was glibc's, not weir's:
//! glibc raises its mmap threshold (up to 32 MiB) each time it frees a large mmapped block,
//! so those buffers move into the arenas, and with up to 8 arenas per core (one per busy
//! thread) the freed space is scattered where it cannot be returned to the system.
//!
//! So the binary fixes the threshold at 128 KiB (large buffers are mapped and unmapped,
//! given back at once) and uses one arena per core. With both, the same pipeline stayed at
//! 100-103 MB over 15,000 batches with the same batch time. A user who sets glibc's malloc
//! tunables (`GLIBC_TUNABLES=glibc.malloc.…`, or the older `MALLOC_*_` variables) keeps them:
//! nothing is changed then. A program that embeds weir as a library chooses its own
//! allocator; the same `GLIBC_TUNABLES` settings apply to it.

/// Large allocations from this size are mapped on their own and returned when freed.
pub(crate) const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Whether the environment already tunes glibc's malloc (`GLIBC_TUNABLES=glibc.malloc.…`
/// or one of glibc's older `MALLOC_*` variables), in which case weir leaves it be.
fn tuned_by_user(mut vars: impl Iterator<Item = (String, String)>) -> bool {
    vars.any(|(k, v)| {
        (k == "GLIBC_TUNABLES" && v.contains("glibc.malloc.")) || k.starts_with("MALLOC_")
    })
}

/// The number of arenas: one per core, at least two.
fn arenas(cores: usize) -> i32 {
    i32::try_from(cores.max(2)).unwrap_or(i32::MAX)
}

/// Applies the settings; returns what was done, for the debug log. Call it first in `main`,
/// before any other thread starts.
pub(crate) fn limit_retention() -> &'static str {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return "malloc defaults (not glibc)";
    }
    let env = std::env::vars_os().map(|(k, v)| {
        (
            k.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    });
    if tuned_by_user(env) {
        return "glibc malloc tunables set in the environment: kept";
    }
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    if mallopt(MMAP_THRESHOLD, arenas(cores)) {
        "glibc malloc: fixed 128 KiB mmap threshold, one arena per core"
    } else {
        "glibc malloc: mallopt refused the settings; glibc's defaults apply"
    }
}

/// Sets the mmap threshold and the arena limit; whether glibc took both.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn mallopt(mmap_threshold: i32, arenas: i32) -> bool {
    // SAFETY: mallopt only changes the allocator's parameters; glibc documents both
    // parameters as settable at any time, and this runs before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap_threshold) == 1
            && libc::mallopt(libc::M_ARENA_MAX, arenas) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn mallopt(_mmap_threshold: i32, _arenas: i32) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string()))
    }

    #[test]
    fn settings_made_by_the_user_are_kept() {
        assert!(!tuned_by_user(vars(&[("PATH", "/bin"), ("HOME", "/root")])));
        assert!(!tuned_by_user(vars(&[(
            "GLIBC_TUNABLES",
            "glibc.rtld.optional_static_tls=2048"
        )])));
        assert!(tuned_by_user(vars(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.arena_max=4"
        )])));
        assert!(tuned_by_user(vars(&[("MALLOC_ARENA_MAX", "4")])));
        assert!(tuned_by_user(vars(&[("MALLOC_MMAP_THRESHOLD_", "65536")])));
        assert!(tuned_by_user(vars(&[("MALLOC_TRIM_THRESHOLD_", "0")])));
    }

    #[test]
    fn one_arena_per_core_and_never_fewer_than_two() {
        assert_eq!(arenas(1), 2);
        assert_eq!(arenas(2), 2);
        assert_eq!(arenas(16), 16);
    }
}
