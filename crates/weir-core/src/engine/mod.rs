//! The micro-batch engine: triggers, the run loop, progress and the query handle.

mod prepared;
pub(crate) use prepared::WeirQueryPlanner;
pub mod progress;
mod query;
mod runner;
mod stateful;
pub mod top_one;
pub(crate) use stateful::check_at_start;
pub mod trigger;

pub use progress::{
    BehindDetector, DURATION_PHASES, FallingBehind, QueryIdle, QueryListener, QueryStarted,
    QueryTerminated, SinkProgress, SourceProgress, StreamingQueryProgress,
};
pub(crate) use query::Shared;
pub use query::StreamingQuery;
pub use runner::{BATCH_VIEW, Transform, TransformOutput, sql_over_batch};
pub(crate) use runner::{QuerySpec, check_transforms, run};
pub use stateful::{Aggregation, OutputMode, check_steps};
pub use trigger::{Trigger, parse_duration};
