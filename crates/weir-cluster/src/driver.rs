//! The driver's side: a [`Cluster`] for weir-core on datafusion-distributed.
//!
//! - **Workers**: the `[cluster] workers` list, resolved again before every attempt of a
//!   batch. A single host name stands for every address it resolves to (a Kubernetes
//!   headless Service). Each address is probed (connect within `connect-timeout`, ask the
//!   worker's version through the token check); plans go only to the workers that answered.
//!   None answering is an error naming each worker and why.
//! - **Channels**: one gRPC channel per worker, kept; every request on it carries the weir
//!   version and the cluster token as headers (the worker's gate checks them).
//! - **Tasks**: a batch's scan ([`weir_core::source::leaf::WorkerScan`]) asks for as many tasks as it can use (one
//!   per file, one per Kafka partition with records), at most one per worker (the
//!   planner's cap), and each task gets its share (`WorkerScan::per_task`). Tasks go to
//!   the workers round robin, and which worker ran which scan task is kept for the
//!   progress report's `cluster.workers`.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::MetricValue;
use datafusion::prelude::DataFrame;
use datafusion_distributed::grpc::{BoxCloneSyncChannel, create_worker_client};
use datafusion_distributed::{
    ChannelResolver, DISTRIBUTED_DATAFUSION_TASK_ID_LABEL, DesiredTaskCountEvent,
    DesiredTaskCountEventResponse, DistributedExt, DistributedLeafExec, DistributedMetricsFormat,
    GetWorkerInfoRequest, NetworkBoundaryExt, RouteTasksEvent, RouteTasksEventResponse,
    ScaleUpLeafNodeEvent, ScaleUpLeafNodeEventResponse, SessionStateBuilderExt, WorkerChannel,
    WorkerResolver, rewrite_distributed_plan_with_metrics,
};
use http::{HeaderMap, HeaderName, HeaderValue};
use tonic::transport::{ClientTlsConfig, Endpoint};
use url::Url;
use weir_core::engine::state_nodes::is_state_exec;
use weir_core::engine::{Cluster, ClusterRun, WorkerTasks};
use weir_core::error::error_chain;
use weir_core::source::leaf::find_scan;

use weir_core::sink::PlanNodes;

use crate::codec::WeirCodec;

/// The scans a driver knows, in the order the binary lists them.
type ScanKinds = &'static [&'static weir_core::source::leaf::ScanKind];
use crate::config::ClusterConfig;
use crate::{Error, Result, TOKEN_HEADER, VERSION, VERSION_HEADER};

/// A cluster of `weir worker`s, as the driver sees it.
pub struct WeirCluster {
    /// The workers as configured.
    configured: Vec<Url>,
    attempts: u32,
    channels: Channels,
    /// The workers that answered the last probe: where plans go.
    live: Arc<RwLock<Vec<Url>>>,
    /// The worker of each scan task of the plan that ran last.
    scan_routes: Arc<Mutex<Vec<Url>>>,
    /// The scans and writes the codec carries.
    nodes: PlanNodes,
}

impl WeirCluster {
    /// The cluster of `config`, checked but not yet contacted; its plans carry the scans
    /// and writes of `nodes`.
    pub fn new(config: &ClusterConfig, nodes: PlanNodes) -> Result<WeirCluster> {
        let configured = config.urls()?;
        Ok(WeirCluster {
            configured,
            attempts: config.max_batch_attempts()?,
            channels: Channels::new(
                config.connect_timeout()?,
                config.liveness_timeout()?,
                config.token()?.as_deref(),
                config.tls()?,
            )?,
            live: Arc::new(RwLock::new(Vec::new())),
            scan_routes: Arc::new(Mutex::new(Vec::new())),
            nodes,
        })
    }

    /// The addresses the configured workers stand for now: a single host name is every
    /// address it resolves to; otherwise the URLs as given.
    async fn resolve(&self) -> Vec<(Url, Option<String>)> {
        if let [one] = self.configured.as_slice()
            && let Some(host) = one.host_str()
            && host.parse::<IpAddr>().is_err()
            && !host.starts_with('[')
        {
            let port = one.port_or_known_default().unwrap_or(80);
            return match tokio::net::lookup_host((host, port)).await {
                Ok(addrs) => {
                    let mut urls: Vec<Url> = addrs
                        .filter_map(|a| {
                            let mut u = one.clone();
                            let ip = match a.ip() {
                                IpAddr::V4(v4) => v4.to_string(),
                                IpAddr::V6(v6) => format!("[{v6}]"),
                            };
                            u.set_host(Some(&ip)).ok()?;
                            Some(u)
                        })
                        .collect();
                    urls.sort();
                    urls.dedup();
                    urls.into_iter().map(|u| (u, None)).collect()
                }
                Err(e) => vec![(one.clone(), Some(format!("resolving {host}: {e}")))],
            };
        }
        self.configured.iter().map(|u| (u.clone(), None)).collect()
    }

    /// Asks `url` for its version through the gate: `Err` says why it is not usable.
    async fn probe(&self, url: &Url) -> Result<(), String> {
        let channel = self.channels.get(url).await.map_err(|e| e.to_string())?;
        let mut client = create_worker_client(channel);
        let asked = tokio::time::timeout(
            self.channels.timeout.max(Duration::from_secs(1)),
            client.get_worker_info(GetWorkerInfoRequest {}),
        )
        .await;
        let answer = match asked {
            Err(_) => Err(format!(
                "no answer within {} ms",
                self.channels.timeout.as_millis()
            )),
            Ok(Err(e)) => Err(refusal(&e)),
            Ok(Ok(info)) if info.version != VERSION => Err(format!(
                "runs weir {} and this driver weir {VERSION}",
                info.version
            )),
            Ok(Ok(_)) => Ok(()),
        };
        if answer.is_err() {
            self.channels.forget(url);
        }
        answer
    }
}

impl WeirCluster {
    /// The workers plans went to that do not answer a probe now, each with why.
    async fn unanswering(&self) -> Vec<String> {
        let live = self.live.read().map(|l| l.clone()).unwrap_or_default();
        let probes = live.iter().map(|url| async move {
            self.probe(url)
                .await
                .err()
                .map(|why| format!("{url} ({why})"))
        });
        futures::future::join_all(probes)
            .await
            .into_iter()
            .flatten()
            .collect()
    }
}

/// Why a worker did not answer: a refusal's own message (the gate's status, which
/// datafusion-distributed hands back as an external error), else the whole error.
fn refusal(e: &DataFusionError) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(status) = c.downcast_ref::<tonic::Status>() {
            return status.message().to_string();
        }
        if let Some(DataFusionError::External(inner)) = c.downcast_ref::<DataFusionError>()
            && let Some(status) = inner.downcast_ref::<tonic::Status>()
        {
            return status.message().to_string();
        }
        cause = c.source();
    }
    error_chain(e)
}

#[async_trait]
impl Cluster for WeirCluster {
    fn describe(&self) -> String {
        let urls: Vec<String> = self.configured.iter().map(Url::to_string).collect();
        format!("[{}]", urls.join(", "))
    }

    fn distribute(&self, builder: SessionStateBuilder) -> SessionStateBuilder {
        let live = self.live.clone();
        let routes = self.scan_routes.clone();
        let turn = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let kinds = self.nodes.scans;
        builder
            .with_distributed_worker_resolver(LiveWorkers(self.live.clone()))
            .with_distributed_channel_resolver(self.channels.clone())
            .with_distributed_planner()
            .with_distributed_user_codec(WeirCodec::new(self.nodes))
            .with_distributed_desired_task_count_handler({
                let live = self.live.clone();
                move |ev: DesiredTaskCountEvent<'_>| task_count(kinds, &live, ev)
            })
            .with_distributed_scale_up_leaf_node_handler(move |ev: ScaleUpLeafNodeEvent<'_>| {
                scale_up(kinds, ev)
            })
            .with_distributed_route_tasks_handler(move |ev: RouteTasksEvent<'_>| {
                route(kinds, &live, &routes, &turn, ev)
            })
    }

    async fn prepare(&self) -> weir_core::Result<Vec<String>> {
        let candidates = self.resolve().await;
        let probes = candidates.iter().map(|(url, unresolved)| async move {
            match unresolved {
                Some(why) => Err(why.clone()),
                None => self.probe(url).await,
            }
        });
        let answers = futures::future::join_all(probes).await;
        let mut usable = Vec::new();
        let mut refused = Vec::new();
        for ((url, _), answer) in candidates.iter().zip(answers) {
            match answer {
                Ok(()) => usable.push(url.clone()),
                Err(why) => refused.push(format!("{url} ({why})")),
            }
        }
        if !refused.is_empty() && !usable.is_empty() {
            tracing::warn!(
                "{} of {} worker(s) not usable, running on the others: {}",
                refused.len(),
                candidates.len(),
                refused.join("; ")
            );
        }
        if usable.is_empty() {
            return Err(cluster_error(Error::NoWorker(refused.join("; "))));
        }
        let names = usable.iter().map(Url::to_string).collect();
        if let Ok(mut live) = self.live.write() {
            *live = usable;
        }
        Ok(names)
    }

    async fn collect(&self, df: DataFrame) -> weir_core::Result<ClusterRun> {
        let failed = |what: &str, e: DataFusionError| weir_core::Error::Cluster {
            reason: format!("{what}: {}", error_chain(&e)),
        };
        // The routing recorded is this plan's, never an earlier batch's.
        if let Ok(mut r) = self.scan_routes.lock() {
            r.clear();
        }
        let task_ctx = Arc::new(df.task_ctx());
        let plan = df
            .create_physical_plan()
            .await
            .map_err(|e| failed("planning the batch", e))?;
        // Partition by partition, in partition order: each task's share comes back in the
        // order it read it, and the tasks in their order, so the rows' order is the same on
        // every run of the plan with the same tasks (a deduplication's first row of a key).
        let batches =
            match datafusion::physical_plan::collect_partitioned(plan.clone(), task_ctx).await {
                Ok(parts) => parts.into_iter().flatten().collect::<Vec<_>>(),
                Err(e) => {
                    // Say which workers went away: a transport error names none.
                    let gone = self.unanswering().await;
                    let what = if gone.is_empty() {
                        "running the batch's plan on the workers".to_string()
                    } else {
                        format!(
                            "running the batch's plan on the workers ({} not answering now)",
                            gone.join(", ")
                        )
                    };
                    return Err(failed(&what, e));
                }
            };
        let with_metrics =
            rewrite_distributed_plan_with_metrics(plan, DistributedMetricsFormat::PerTask)
                .await
                .map_err(|e| failed("collecting the workers' metrics", e))?;
        let per_task = scan_rows_per_task(self.nodes.scans, &with_metrics);
        let routes = self
            .scan_routes
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        let input_rows = per_task.values().sum();
        Ok(ClusterRun {
            batches,
            input_rows,
            workers: per_worker(&routes, &per_task),
        })
    }

    fn max_attempts(&self) -> u32 {
        self.attempts
    }
}

fn cluster_error(e: Error) -> weir_core::Error {
    weir_core::Error::Cluster {
        reason: e.to_string(),
    }
}

/// The workers that answered the last probe.
struct LiveWorkers(Arc<RwLock<Vec<Url>>>);

impl WorkerResolver for LiveWorkers {
    fn get_urls(&self) -> Result<Vec<Url>, DataFusionError> {
        let live = self
            .0
            .read()
            .map_err(|_| DataFusionError::Internal("the worker list's lock is poisoned".into()))?;
        if live.is_empty() {
            return Err(DataFusionError::Execution(
                "no usable worker (none answered the last probe)".into(),
            ));
        }
        Ok(live.clone())
    }
}

/// One kept gRPC channel per worker, each request carrying the weir version and the
/// cluster token. The driver's, and each worker's for the shuffles it reads from others.
#[derive(Clone)]
pub(crate) struct Channels {
    cache: Arc<Mutex<HashMap<Url, BoxCloneSyncChannel>>>,
    timeout: Duration,
    /// HTTP/2 keep-alive: a peer that leaves pings unanswered this long (frozen, or cut off
    /// without a reset) has its connection dropped, which fails the streams on it.
    liveness: Duration,
    headers: HeaderMap,
    /// How `https://` workers' certificates are checked.
    tls: Option<ClientTlsConfig>,
}

impl Channels {
    /// Channels whose requests carry this weir's version and `token`.
    pub(crate) fn new(
        timeout: Duration,
        liveness: Duration,
        token: Option<&str>,
        tls: Option<ClientTlsConfig>,
    ) -> Result<Channels> {
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_static(VERSION_HEADER),
            HeaderValue::from_static(VERSION),
        );
        if let Some(token) = token {
            let value = HeaderValue::from_str(token).map_err(|_| Error::Config {
                key: "token".into(),
                reason: "the token must be visible ASCII (it travels as an HTTP header)".into(),
            })?;
            headers.insert(HeaderName::from_static(TOKEN_HEADER), value);
        }
        Ok(Channels {
            cache: Arc::new(Mutex::new(HashMap::new())),
            timeout,
            liveness,
            headers,
            tls,
        })
    }

    async fn get(&self, url: &Url) -> Result<BoxCloneSyncChannel, DataFusionError> {
        if let Some(c) = self.cache.lock().ok().and_then(|c| c.get(url).cloned()) {
            return Ok(c);
        }
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| DataFusionError::Configuration(format!("worker URL {url}: {e}")))?
            .connect_timeout(self.timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(self.liveness / 2)
            .keep_alive_timeout(self.liveness / 2)
            .keep_alive_while_idle(true);
        let endpoint = match (url.scheme(), &self.tls) {
            ("https", Some(tls)) => endpoint.tls_config(tls.clone()).map_err(|e| {
                DataFusionError::Configuration(format!("worker {url}: TLS: {}", error_chain(&e)))
            })?,
            ("https", None) => {
                return Err(DataFusionError::Configuration(format!(
                    "worker {url} is https:// and no CA certificate was given to check it \
                     (cluster.tls-ca, or --tls-ca on a worker)"
                )));
            }
            _ => endpoint,
        };
        let channel = endpoint.connect().await.map_err(|e| {
            DataFusionError::Execution(format!("connecting to worker {url}: {}", error_chain(&e)))
        })?;
        let headers = self.headers.clone();
        let with_headers = tower::ServiceExt::map_request(
            channel,
            move |mut req: http::Request<tonic::body::Body>| {
                for (k, v) in &headers {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                req
            },
        );
        let boxed = BoxCloneSyncChannel::new(with_headers);
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(url.clone(), boxed.clone());
        }
        Ok(boxed)
    }

    fn forget(&self, url: &Url) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.remove(url);
        }
    }
}

#[async_trait]
impl ChannelResolver for Channels {
    async fn get_worker_client_for_url(
        &self,
        url: &Url,
    ) -> Result<Box<dyn WorkerChannel>, DataFusionError> {
        self.get(url).await.map(create_worker_client)
    }
}

/// As many tasks as the scan can use (the planner caps it at the workers); a stateful
/// step's state partitions one task per live worker, so they run on the workers
/// and spread over all of them even when the batch's read is one task (or none).
fn task_count(
    kinds: ScanKinds,
    live: &RwLock<Vec<Url>>,
    ev: DesiredTaskCountEvent<'_>,
) -> Option<datafusion::error::Result<DesiredTaskCountEventResponse>> {
    if is_state_exec(ev.plan) {
        let workers = live.read().map(|l| l.len()).unwrap_or(1);
        return Some(Ok(DesiredTaskCountEventResponse::desired(workers.max(1))));
    }
    let scan = find_scan(kinds, ev.plan)?;
    Some(Ok(DesiredTaskCountEventResponse::desired(
        scan.tasks_wanted().max(1),
    )))
}

/// Each task its share of the scan.
fn scale_up(
    kinds: ScanKinds,
    ev: ScaleUpLeafNodeEvent<'_>,
) -> Option<datafusion::error::Result<ScaleUpLeafNodeEventResponse>> {
    let scan = find_scan(kinds, ev.plan)?;
    Some((|| {
        let variants = scan.per_task(ev.task_count)?;
        let leaf = DistributedLeafExec::try_new(ev.plan.clone(), variants)?;
        Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(leaf)))
    })())
}

/// Whether `node` is a scan, or a scan scaled up into one variant per task.
fn is_scan(kinds: ScanKinds, node: &Arc<dyn ExecutionPlan>) -> bool {
    find_scan(kinds, node).is_some()
        || node
            .downcast_ref::<DistributedLeafExec>()
            .is_some_and(|l| find_scan(kinds, l.original()).is_some())
}

/// Whether the stage headed by `plan` holds a scan (the stages below its network
/// boundaries are not looked at).
fn holds_scan(kinds: ScanKinds, plan: &Arc<dyn ExecutionPlan>) -> bool {
    stage_holds(plan, |node| is_scan(kinds, node))
}

/// Whether the stage headed by `plan` holds a stateful step's state partitions.
fn holds_state(plan: &Arc<dyn ExecutionPlan>) -> bool {
    stage_holds(plan, is_state_exec)
}

/// Whether a node of the stage headed by `plan` is `wanted`.
fn stage_holds(
    plan: &Arc<dyn ExecutionPlan>,
    wanted: impl Fn(&Arc<dyn ExecutionPlan>) -> bool,
) -> bool {
    let mut found = false;
    let _ = plan.apply(|node| {
        if !Arc::ptr_eq(node, plan) && node.as_network_boundary().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        if wanted(node) {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// Round robin over the live workers, from a turning start; the scan stage's routing is
/// kept for the report. A stage of state partitions starts at the first worker every
/// batch: its task `i` owns the same partitions while the workers stay the same, so it
/// lands where they are kept in memory.
fn route(
    kinds: ScanKinds,
    live: &RwLock<Vec<Url>>,
    routes: &Mutex<Vec<Url>>,
    turn: &std::sync::atomic::AtomicUsize,
    ev: RouteTasksEvent<'_>,
) -> Option<datafusion::error::Result<RouteTasksEventResponse>> {
    let urls = live.read().ok()?.clone();
    if urls.is_empty() {
        return None;
    }
    let start = match holds_state(ev.plan) {
        true => 0,
        false => turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    };
    let picked: Vec<Url> = (0..ev.task_count)
        .map(|i| urls[(start + i) % urls.len()].clone())
        .collect();
    if holds_scan(kinds, ev.plan)
        && let Ok(mut r) = routes.lock()
    {
        *r = picked.clone();
    }
    Some(Ok(RouteTasksEventResponse::new(picked)))
}

/// Rows each task's scan gave, from the plan's metrics after it ran.
fn scan_rows_per_task(kinds: ScanKinds, plan: &Arc<dyn ExecutionPlan>) -> BTreeMap<usize, u64> {
    let mut rows = BTreeMap::new();
    let _ = plan.apply(|node| {
        if is_scan(kinds, node)
            && let Some(metrics) = node.metrics()
        {
            for m in metrics.iter() {
                if let MetricValue::OutputRows(count) = m.value() {
                    let task = m
                        .labels()
                        .iter()
                        .find(|l| l.name() == DISTRIBUTED_DATAFUSION_TASK_ID_LABEL)
                        .and_then(|l| l.value().parse::<usize>().ok())
                        .unwrap_or(0);
                    *rows.entry(task).or_insert(0) += count.value() as u64;
                }
            }
            return Ok(TreeNodeRecursion::Jump);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    rows
}

/// Tasks and input rows per worker, from the scan's routing and its rows per task.
fn per_worker(routes: &[Url], rows: &BTreeMap<usize, u64>) -> Vec<WorkerTasks> {
    let mut by: BTreeMap<String, WorkerTasks> = BTreeMap::new();
    for (i, url) in routes.iter().enumerate() {
        let w = by.entry(url.to_string()).or_insert_with(|| WorkerTasks {
            url: url.to_string(),
            tasks: 0,
            input_rows: 0,
        });
        w.tasks += 1;
        w.input_rows += rows.get(&i).copied().unwrap_or(0);
    }
    by.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_counted_per_worker() {
        let a = Url::parse("http://10.0.0.1:7400").unwrap();
        let b = Url::parse("http://10.0.0.2:7400").unwrap();
        let routes = vec![a.clone(), b.clone(), a.clone()];
        let rows: BTreeMap<usize, u64> = [(0, 5), (1, 7), (2, 11)].into_iter().collect();
        assert_eq!(
            per_worker(&routes, &rows),
            vec![
                WorkerTasks {
                    url: a.to_string(),
                    tasks: 2,
                    input_rows: 16
                },
                WorkerTasks {
                    url: b.to_string(),
                    tasks: 1,
                    input_rows: 7
                },
            ]
        );
        assert!(per_worker(&[], &rows).is_empty());
    }

    #[test]
    fn a_refusal_is_shown_by_its_message() {
        let e = DataFusionError::External(Box::new(tonic::Status::permission_denied(
            "the cluster token does not match this worker's",
        )));
        assert_eq!(
            refusal(&e),
            "the cluster token does not match this worker's"
        );
    }
}
