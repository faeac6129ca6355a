//! Log files: `v1`, then JSON lines, written once; and what retention deletes of them.
//!
//! The bottom of the engine with [`crate::error`]: the offset and commit logs, a source's
//! own log and the state metadata all use this format.
//!
//! Parsing works on bytes already read, naming the file in every error, in Spark's words
//! where Spark has some. Writing goes through [`crate::storage::Location::put_new`]: atomic,
//! durable, never overwritten.

pub mod retention;

use crate::error::{Error, Result};

/// Splits a `v<N>` log file into its lines after the version line.
///
/// `path` names the file in errors; `log` names the log in the message for an empty file
/// ("offset commit log", ...).
pub fn parse_versioned(
    bytes: &[u8],
    path: &str,
    max_version: u32,
    log: &str,
) -> Result<Vec<String>> {
    let corrupt = |reason: String| Error::CorruptLog {
        path: path.to_string(),
        reason,
    };
    if bytes.is_empty() {
        return Err(corrupt(format!("Incomplete log file in the {log}")));
    }
    let text =
        std::str::from_utf8(bytes).map_err(|_| corrupt("The file is not UTF-8 text".into()))?;
    let mut lines = text.split('\n');
    let first = lines.next().unwrap_or_default();
    let version = first
        .strip_prefix('v')
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or_else(|| {
            corrupt(format!(
                "Log file was malformed: failed to read correct log version from {first:.40?}"
            ))
        })?;
    if version == 0 || version > max_version {
        return Err(corrupt(format!(
            "UnsupportedLogVersion: maximum supported log version is v{max_version}, but \
             encountered v{version}. The log file was produced by a newer version of weir \
             and cannot be read by this version. Please upgrade."
        )));
    }
    Ok(lines.map(str::to_owned).collect())
}

/// Parses line `index` (1-based, counting the version line) of a log file as JSON.
pub fn parse_line<T: serde::de::DeserializeOwned>(
    path: &str,
    index: usize,
    line: &str,
) -> Result<T> {
    serde_json::from_str(line).map_err(|e| Error::CorruptLog {
        path: path.to_string(),
        reason: format!("Line {index} is not valid: {e}"),
    })
}

/// `v1` and the lines, joined by newlines, no final newline (Spark's shape).
pub fn render(lines: impl IntoIterator<Item = String>) -> bytes::Bytes {
    let mut out = String::from("v1");
    for l in lines {
        out.push('\n');
        out.push_str(&l);
    }
    bytes::Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_versioned_names_the_file_and_the_fault() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "Incomplete log file"),
            (b"garbage", "failed to read correct log version"),
            (b"v9\n{}", "encountered v9"),
            (b"\xff\xfe", "not UTF-8"),
        ];
        for (bytes, want) in cases {
            let err = parse_versioned(bytes, "/chk/offsets/7", 1, "offset log")
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
            assert!(err.contains("/chk/offsets/7"), "{err}");
        }
        assert_eq!(
            parse_versioned(b"v1\na\nb", "x", 1, "log").unwrap(),
            vec!["a".to_string(), "b".to_string()]
        );
    }
}
