//! The endpoint's errors.

/// What can go wrong starting the endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The address could not be bound (in use, not local, malformed).
    #[error("monitoring endpoint: cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}
