//! The micro-batch engine: triggers, the run loop, progress and the query handle.

mod batch;
pub mod cluster;
mod kept_plan;
pub(crate) use kept_plan::WeirQueryPlanner;
pub mod progress;
mod query;
mod report;
pub mod retry;
mod runner;
mod start;
mod stateful;
mod step;
pub mod top_one;
mod transform;
pub mod trigger;

pub use cluster::{Cluster, ClusterRun, WorkerTasks};
pub use progress::{
    BatchStarted, BehindDetector, ClusterProgress, DURATION_PHASES, FallingBehind, Phase,
    QueryIdle, QueryListener, QueryRetrying, QueryStarted, QueryTerminated, SinkProgress,
    SourceProgress, StreamingQueryProgress,
};
pub use query::StreamingQuery;
pub use retry::RetryPolicy;
pub use start::PIN_TARGET_PARTITIONS;
pub(crate) use start::{StartRequest, start};
pub use stateful::{Aggregation, DEFAULT_STATE_PARTITIONS, OutputMode, check_state_partitions};
/// The plan nodes of a deduplication whose state partitions run on a cluster's workers,
/// for the cluster's codec.
pub mod state_nodes {
    pub use super::stateful::on_workers::{
        AGG_KIND, AGG_TAG_KIND, AggStateExec, AggTagExec, DEDUPE_KIND, DedupeStateExec,
        PartitionTagExec, StateShuffle, TAG_KIND, decode_node, encode_node, is_state_exec,
    };
}
pub(crate) use transform::check_transforms;
pub use transform::{BATCH_VIEW, Transform, TransformOutput, check_steps, sql_over_batch};
pub use trigger::{Trigger, parse_duration};
