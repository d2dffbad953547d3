//! The tool pipeline: one model reply's tool calls, run through the guards against the
//! session's sandbox, logged in model order.
//!
//! [`Pipeline::run_batch`] takes the session's batch lock, refuses a batch whose call ids
//! repeat (within it or in the session) before logging anything, logs `turn/start` with
//! every call id, runs the calls with dsh's scheduler (a barrier for exclusive calls, a
//! bounded rolling pool for concurrency-safe ones, see [`batch`]), and logs `turn/end`.
//! Each call flows through the guards' waterfalls ([`guards`]): `pre_execute` (permission
//! and path policies), `execute` around the dispatch (the timeout policy), `post_execute`
//! (the repeat-tool-reminder). The tools are a registry ([`tools`]) holding the five
//! built-in tools; a deployment or a test may register more tools and guards.
//!
//! The batch runs in a task of its own: if the caller's future is dropped (a client that
//! went away), the batch is cancelled, not dropped, so started calls still reach
//! quiescence and their results are still logged.

pub mod batch;
pub mod config;
pub mod guards;
pub mod tools;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use tether_protocol::api::ToolCallRequest;
use tether_protocol::events::ToolResult;
use tether_provider::CallCtx;
use tether_provider::clock::{CancelReason, CancelToken};
use tracing::Instrument;

pub use config::{
    PathPolicyConfig, PermissionConfig, PipelineConfig, PipelineConfigError, RepeatReminderConfig,
};
pub use guards::{ExecNext, Guard, Invocation, PostDecision, PostNext, PreDecision};
pub use tools::{Access, PathAccess, Tool, ToolOutput, ToolRegistry};

use crate::config::LimitsConfig;
use crate::error::DaemonError;
use crate::session_manager::Session;
use crate::telemetry::Metrics;
use batch::{Batch, CallBooks};
use guards::permission::{PathPolicy, PermissionPolicy};
use guards::repeat_reminder::RepeatReminder;
use guards::timeout_policy::TimeoutPolicy;

/// The tool pipeline of the daemon (one for all sessions).
#[derive(Debug)]
pub struct Pipeline {
    tools: Arc<ToolRegistry>,
    guards: Arc<Vec<Arc<dyn Guard>>>,
    max_parallel: usize,
    metrics: Metrics,
    books: Arc<CallBooks>,
}

// === impl Pipeline ===

impl Pipeline {
    /// Build the pipeline: the built-in tools, and the built-in guards in waterfall order
    /// (permission policy, path policy, timeout policy, repeat-tool-reminder). Fails on an
    /// invalid section.
    pub fn new(
        cfg: &PipelineConfig,
        limits: &LimitsConfig,
        metrics: Metrics,
    ) -> Result<Self, PipelineConfigError> {
        cfg.validate()?;
        let mut guards: Vec<Arc<dyn Guard>> = Vec::new();
        let permission = PermissionPolicy::new(&cfg.permission);
        if !permission.is_empty() {
            guards.push(Arc::new(permission));
        }
        let paths = PathPolicy::new(&cfg.path_policy);
        if !paths.is_empty() {
            guards.push(Arc::new(paths));
        }
        guards.push(Arc::new(TimeoutPolicy::new(
            &cfg.tool_timeouts,
            metrics.clone(),
        )));
        // Validated even when disabled (in `cfg.validate`), so enabling it cannot surprise.
        let reminder = RepeatReminder::new(&cfg.repeat_tool_reminder)?;
        if cfg.repeat_tool_reminder.enabled {
            guards.push(Arc::new(reminder));
        }
        Ok(Self {
            tools: Arc::new(ToolRegistry::builtin(limits)),
            guards: Arc::new(guards),
            max_parallel: cfg.max_parallel()?,
            metrics,
            books: Arc::new(CallBooks::default()),
        })
    }

    /// Add (or replace) a tool.
    pub fn register_tool(&mut self, tool: Arc<dyn Tool>) {
        Arc::make_mut(&mut self.tools).register(tool);
    }

    /// Add a guard after (downstream of) the registered ones.
    pub fn register_guard(&mut self, guard: Arc<dyn Guard>) {
        Arc::make_mut(&mut self.guards).push(guard);
    }

    /// The tools.
    pub fn tools(&self) -> &ToolRegistry {
        &self.tools
    }

    /// The guards' names, in waterfall order.
    pub fn guard_names(&self) -> Vec<&'static str> {
        self.guards.iter().map(|g| g.name()).collect()
    }

    /// Run one model reply's calls. Logs `turn/start`, a `tool/call` per call right before
    /// its dispatch (or its refusal), a `tool/result` per call in model order, then
    /// `turn/end`. Returns the results in model order.
    ///
    /// Unknown tools, invalid arguments, denials, timeouts and cancellations are results,
    /// not errors: the batch still completes. It is refused with `INVALID_REQUEST` before
    /// anything is logged when a call id is empty, repeats within the batch, or was already
    /// used in the session. If `ctx` is cancelled, started calls are drained and logged and
    /// the others get `CANCELLED` ("tool call aborted before dispatch") results.
    pub async fn run_batch(
        &self,
        session: &Arc<Session>,
        ctx: &CallCtx,
        calls: Vec<ToolCallRequest>,
    ) -> Result<Vec<ToolResult>, DaemonError> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        batch::check_ids(&calls)?;
        let batch = Batch {
            tools: Arc::clone(&self.tools),
            guards: Arc::clone(&self.guards),
            max_parallel: self.max_parallel,
            metrics: self.metrics.clone(),
            books: Arc::clone(&self.books),
        };
        let span = tracing::info_span!(
            "tool.batch",
            session.id = %session.id,
            provider.kind = %session.provider_kind,
            tool.calls = calls.len(),
            turn = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let bctx = ctx.child();
        let cancel_on_drop = CancelOnDrop(bctx.cancel.clone());
        let task = session
            .tasks()
            .spawn(batch.run(Arc::clone(session), bctx, calls).instrument(span));
        let out = task.await;
        drop(cancel_on_drop);
        out.map_err(|e| DaemonError::internal(format!("the tool batch task failed: {e}")))?
    }

    /// A user message arrived in the session (resets the repeat-reminder chains).
    pub fn on_user_message(&self, session_id: &str) {
        for g in self.guards.iter() {
            g.on_user_message(session_id);
        }
    }

    /// The session was closed: drop what the pipeline and its guards keep for it.
    pub fn on_session_closed(&self, session_id: &str) {
        self.books.forget(session_id);
        for g in self.guards.iter() {
            g.on_session_closed(session_id);
        }
    }
}

/// Cancels the batch if the caller stops waiting for it (its future was dropped).
#[derive(Debug)]
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        // Harmless once the batch is over: nothing watches the token any more.
        self.0.cancel(CancelReason::Caller(
            "the caller stopped waiting for the tool batch",
        ));
    }
}
