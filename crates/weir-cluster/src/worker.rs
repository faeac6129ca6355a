//! `weir worker`: a process that runs the plan stages drivers send, with no durable state.
//!
//! Every request is checked before datafusion-distributed sees it: it must carry the
//! driver's weir version ([`crate::VERSION_HEADER`]) equal to this worker's, and the
//! cluster token ([`crate::TOKEN_HEADER`]) when the worker has one. A mismatch is refused
//! with a status that names what differs, which the driver shows.

use std::future::Future;

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionState;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext, WorkerSessionBuilder};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Status};

use weir_core::sink::PlanNodes;

use crate::codec::WeirCodec;
use crate::driver::Channels;
use crate::tls::WorkerTls;
use crate::{Error, Result, TOKEN_HEADER, VERSION, VERSION_HEADER};

/// How long a worker waits to connect to another worker (a shuffle's producer).
const PEER_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The session each task of a worker runs in: weir's codec registered, and channels to the
/// other workers (a shuffle reads from them) that carry the version and token as the
/// driver's do.
#[derive(Clone)]
struct WeirWorkerSession {
    channels: Channels,
    codec: WeirCodec,
}

#[async_trait]
impl WorkerSessionBuilder for WeirWorkerSession {
    async fn build_session_state(
        &self,
        ctx: WorkerQueryContext,
    ) -> Result<SessionState, DataFusionError> {
        Ok(ctx
            .builder
            .with_distributed_user_codec(self.codec)
            .with_distributed_channel_resolver(self.channels.clone())
            .build())
    }
}

/// The check on every request: same weir version, the cluster's token.
#[derive(Clone)]
pub struct Gate {
    token: Option<String>,
}

impl Gate {
    /// A gate that wants `token` (none: requests must not need one).
    pub fn new(token: Option<String>) -> Self {
        Gate { token }
    }

    /// Whether a request with these header values may pass; the refusal says why.
    pub fn check(&self, version: Option<&str>, token: Option<&str>) -> Result<(), Status> {
        match version {
            Some(v) if v == VERSION => {}
            Some(v) => {
                return Err(Status::failed_precondition(format!(
                    "this worker runs weir {VERSION} and the driver weir {v}: driver and \
                     workers must run the same weir"
                )));
            }
            None => {
                return Err(Status::failed_precondition(format!(
                    "the request carries no weir version (this worker runs weir {VERSION}): \
                     is the driver a weir driver?"
                )));
            }
        }
        match (&self.token, token) {
            (None, _) => Ok(()),
            (Some(want), Some(got)) if constant_time_eq(want.as_bytes(), got.as_bytes()) => Ok(()),
            (Some(_), Some(_)) => Err(Status::permission_denied(
                "the cluster token does not match this worker's",
            )),
            (Some(_), None) => Err(Status::unauthenticated(
                "this worker wants a cluster token and the request has none (set [cluster] \
                 token on the driver)",
            )),
        }
    }
}

impl tonic::service::Interceptor for Gate {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let meta = req.metadata();
        let version = meta.get(VERSION_HEADER).and_then(|v| v.to_str().ok());
        let token = meta.get(TOKEN_HEADER).and_then(|v| v.to_str().ok());
        self.check(version, token)?;
        Ok(req)
    }
}

/// Equal without telling how much of it matched by the time taken.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves a worker on `listener` until `shutdown` resolves; it runs the scans and writes of
/// `nodes`. With `tls`, it serves TLS and checks the other workers' certificates.
pub async fn serve(
    listener: TcpListener,
    token: Option<String>,
    nodes: PlanNodes,
    tls: Option<WorkerTls>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let channels = Channels::new(
        PEER_CONNECT_TIMEOUT,
        crate::config::DEFAULT_LIVENESS,
        token.as_deref(),
        tls.as_ref().map(|t| t.peers.clone()),
    )?;
    let session = WeirWorkerSession {
        channels,
        codec: WeirCodec::new(nodes),
    };
    let worker = Worker::from_session_builder(session).with_version(VERSION);
    let service = InterceptedService::new(worker.into_worker_server(), Gate::new(token));
    let mut server = Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls.server).map_err(|e| Error::Serve {
            addr: addr.clone(),
            reason: format!(
                "the TLS certificate and key: {}",
                weir_core::error::error_chain(&e)
            ),
        })?;
    }
    server
        .add_service(service)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
        .map_err(|e| Error::Serve {
            addr,
            reason: weir_core::error::error_chain(&e),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_names_what_differs() {
        let open = Gate::new(None);
        let closed = Gate::new(Some("s3cret".into()));
        // gate, version sent, token sent, what the refusal says (None: passes)
        type Case<'a> = (&'a Gate, Option<&'a str>, Option<&'a str>, Option<&'a str>);
        let cases: [Case; 7] = [
            (&open, Some(VERSION), None, None),
            (&open, Some(VERSION), Some("anything"), None),
            (&closed, Some(VERSION), Some("s3cret"), None),
            (
                &closed,
                Some(VERSION),
                Some("s3cre"),
                Some("does not match"),
            ),
            (&closed, Some(VERSION), None, Some("has none")),
            (
                &open,
                Some("0.0.0-other"),
                None,
                Some("driver weir 0.0.0-other"),
            ),
            (&closed, None, Some("s3cret"), Some("no weir version")),
        ];
        for (gate, version, token, refused) in cases {
            match (gate.check(version, token), refused) {
                (Ok(()), None) => {}
                (Err(s), Some(says)) => assert!(s.message().contains(says), "{}", s.message()),
                (got, want) => panic!("{version:?} {token:?}: got {got:?}, want {want:?}"),
            }
        }
    }
}
