//! What the builders take where a folder is expected.

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::storage::{Location, StorageOptions};

/// Something that names a folder: a local path (`&str`, `String`, `&Path`, `PathBuf`), a
/// URL string (`"s3://bucket/prefix"`), or a [`Location`].
pub trait IntoLocation {
    /// What was given, resolved later with the session's storage settings.
    fn into_spec(self) -> LocationSpec;
}

/// A folder as given to a builder, before it is checked.
#[derive(Debug, Clone)]
pub enum LocationSpec {
    /// A local path, whatever it looks like.
    Local(PathBuf),
    /// A path or URL in text (`scheme://` means an object store).
    Text(String),
    /// Already resolved.
    Ready(Location),
}

impl LocationSpec {
    /// The location, or an error naming `key` (an unsupported scheme, ...).
    pub fn resolve(self, key: &str, options: &StorageOptions) -> Result<Location> {
        match self {
            LocationSpec::Local(p) => Ok(Location::local(p)),
            LocationSpec::Text(t) => Location::parse(key, &t, None, options),
            LocationSpec::Ready(l) => Ok(l),
        }
    }
}

impl IntoLocation for Location {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Ready(self)
    }
}

impl IntoLocation for &Location {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Ready(self.clone())
    }
}

impl IntoLocation for &str {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Text(self.to_string())
    }
}

impl IntoLocation for String {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Text(self)
    }
}

impl IntoLocation for &String {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Text(self.clone())
    }
}

impl IntoLocation for &Path {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Local(self.to_path_buf())
    }
}

impl IntoLocation for PathBuf {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Local(self)
    }
}

impl IntoLocation for &PathBuf {
    fn into_spec(self) -> LocationSpec {
        LocationSpec::Local(self.clone())
    }
}
