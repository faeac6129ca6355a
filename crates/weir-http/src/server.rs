//! The HTTP server: hyper's HTTP/1 on a tokio listener, one task per connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::error::HttpError;
use crate::expo::Exposition;
use crate::monitor::Monitor;

/// The live page: one file, no external assets.
const PAGE: &str = include_str!("page.html");

/// The running endpoint; dropping it stops the server.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Endpoint {
    /// The address it listens on (the port is known here when `:0` was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Listens on `addr` and serves `monitor`:
///
/// - `/metrics`: Prometheus text format (`weir_*` and `process_*`);
/// - `/healthz`: 200 while the process serves requests;
/// - `/readyz`: 200 while the query runs and a batch ended within the stall limit, 503 with
///   the reason otherwise;
/// - `/api/progress`: the recent `StreamingQueryProgress` reports (JSON array, oldest first);
/// - `/api/status`: the query's state, counters, Kafka lag and last error (JSON);
/// - `/`: the live page.
///
/// The listener is bound before this returns, so a bad or busy address is an error here.
pub async fn serve(addr: &str, monitor: Arc<Monitor>) -> Result<Endpoint, HttpError> {
    serve_with_token(addr, monitor, None).await
}

/// [`serve`], where every path but `/healthz` and the page itself (`/`, which holds no
/// figures and sends the token it is given in its URL's fragment, `#token=...`) answers 401
/// unless the request carries `Authorization: Bearer <token>`.
pub async fn serve_with_token(
    addr: &str,
    monitor: Arc<Monitor>,
    token: Option<String>,
) -> Result<Endpoint, HttpError> {
    let token: Option<Arc<str>> = token.map(Arc::from);
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind {
            addr: addr.to_string(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| HttpError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let task = tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the others.
                    tracing::warn!("monitoring endpoint: accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let monitor = monitor.clone();
            let token = token.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let monitor = monitor.clone();
                    let token = token.clone();
                    async move {
                        Ok::<_, Infallible>(match refused(&req, token.as_deref()) {
                            Some(r) => r,
                            None => respond(&req, &monitor),
                        })
                    }
                });
                // A client that goes away mid-request is its own business.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(Endpoint { addr: local, task })
}

fn reply(status: StatusCode, kind: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(kind));
    r.headers_mut().insert(
        CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-store"),
    );
    r
}

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";

fn json(v: &impl serde::Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(b) => reply(StatusCode::OK, JSON, b),
        Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, e.to_string()),
    }
}

/// The metrics page: the query's, then the process's.
pub fn metrics_text(monitor: &Monitor) -> String {
    let mut out = Exposition::new();
    out.gauge(
        "weir_build_info",
        "The weir version this process runs",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    monitor.render(&mut out);
    crate::process::render(&mut out);
    out.finish()
}

/// 401 for a request without the token, when one is required (not for `/healthz` nor the
/// page). The comparison takes the same time wherever the first difference is.
fn refused(req: &Request<Incoming>, token: Option<&str>) -> Option<Response<Full<Bytes>>> {
    let token = token?;
    if matches!(req.uri().path(), "/healthz" | "/" | "/index.html") {
        return None;
    }
    let given = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if same(given.as_bytes(), token.as_bytes()) {
        return None;
    }
    let mut r = reply(
        StatusCode::UNAUTHORIZED,
        TEXT,
        "a bearer token is required (Authorization: Bearer ...)\n",
    );
    r.headers_mut().insert(
        hyper::header::WWW_AUTHENTICATE,
        hyper::header::HeaderValue::from_static("Bearer"),
    );
    Some(r)
}

/// Equality in a time that does not depend on where `a` and `b` differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, y) in b.iter().enumerate() {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ y);
    }
    diff == 0
}

fn respond(req: &Request<Incoming>, monitor: &Monitor) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "only GET\n");
    }
    match req.uri().path() {
        "/metrics" => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics_text(monitor),
        ),
        "/healthz" => reply(StatusCode::OK, TEXT, "ok\n"),
        "/readyz" => {
            let s = monitor.status();
            let code = if s.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            reply(code, TEXT, format!("{}\n", s.reason))
        }
        "/api/progress" => reply(StatusCode::OK, JSON, monitor.recent_json()),
        "/api/status" => json(&monitor.status()),
        "/" | "/index.html" => reply(StatusCode::OK, "text/html; charset=utf-8", PAGE),
        _ => reply(StatusCode::NOT_FOUND, TEXT, "not found\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::same;

    #[test]
    fn tokens_are_equal_only_when_every_byte_and_the_length_are() {
        assert!(same(b"s3cret", b"s3cret"));
        assert!(!same(b"s3cre", b"s3cret"));
        assert!(!same(b"s3cretX", b"s3cret"));
        assert!(!same(b"S3cret", b"s3cret"));
        assert!(!same(b"", b"s3cret"));
        assert!(same(b"", b""));
    }
}
