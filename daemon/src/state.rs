//! The daemon's shared state, handed to every request handler.

use std::sync::Arc;

use tether_provider::clock::CancelToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::invariants::Invariants;
use crate::pipeline::Pipeline;
use crate::session_manager::SessionManager;
use crate::telemetry::Metrics;

/// Everything a handler needs.
#[derive(Debug)]
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// Sessions and their sandboxes.
    pub sessions: Arc<SessionManager>,
    /// The tool pipeline.
    pub pipeline: Arc<Pipeline>,
    /// Metrics.
    pub metrics: Metrics,
    /// Cancelled at shutdown; every request's token is a child.
    pub shutdown: CancelToken,
    /// Every spawned task, drained at shutdown.
    pub tasks: TaskTracker,
    /// Runtime invariants.
    pub invariants: Invariants,
    /// The E2B front's state.
    pub e2b: crate::e2b_front::FrontState,
}
