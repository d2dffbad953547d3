//! The timeout policy: a tool's own budget, armed around its dispatch (dsh's
//! `timeout-policy`).
//!
//! For a tool with a budget (its declared [`Tool::timeout_ms`], overridden by
//! `[pipeline.tool_timeouts]`), the policy fuses the caller's context with a timer
//! (`deadline(ctx.cancel, ms, Clock::Tool)`), hands the derived context to the rest of
//! the chain, awaits it (never races or drops it: the tool observes the token and reaches
//! quiescence), and then replaces the output with the exact `TOOL_TIMEOUT` shape if and only
//! if *its own* timer fired. A caller cancellation that came first stays what it is. The
//! decision is keyed off the token, not the output, because by then the tool has already
//! turned the cancellation into an error of its own. Tools without a budget pass through
//! with the caller's context untouched. A budget of 0 means none, as in dsh.
//!
//! [`Tool::timeout_ms`]: crate::pipeline::tools::Tool::timeout_ms

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use tether_protocol::ErrorCode;
use tether_provider::CallCtx;
use tether_provider::clock::timeout_of;

use super::{ExecNext, Guard, Invocation};
use crate::pipeline::tools::ToolOutput;
use crate::telemetry::Metrics;
use tether_provider::Clock;

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct TimeoutPolicy {
    overrides: BTreeMap<String, u64>,
    metrics: Metrics,
}

// === impl TimeoutPolicy ===

impl TimeoutPolicy {
    /// Build from `[pipeline.tool_timeouts]`.
    pub fn new(overrides: &BTreeMap<String, u64>, metrics: Metrics) -> Self {
        Self {
            overrides: overrides.clone(),
            metrics,
        }
    }

    /// The budget of a call, ms (`None` or `Some(0)`: no budget).
    pub fn budget(&self, inv: &Invocation) -> Option<u64> {
        match self.overrides.get(&inv.name) {
            Some(ms) => Some(*ms),
            None => inv.tool.as_ref().and_then(|t| t.timeout_ms()),
        }
        .filter(|ms| *ms > 0)
    }

    /// The exact result of a call whose budget ran out. A cancelled command's partial
    /// output is kept after the error line.
    pub fn replacement(timeout_ms: u64, partial: Option<String>) -> ToolOutput {
        let mut out = ToolOutput::error(
            ErrorCode::ToolTimeout,
            format!("tool call timed out after {timeout_ms}ms"),
        )
        .with_clock(Clock::Tool, Some(timeout_ms));
        if let Some(p) = &partial {
            out.content = format!("{}\n\n{p}", out.content);
        }
        out.partial = partial;
        out
    }
}

#[async_trait]
impl Guard for TimeoutPolicy {
    fn name(&self) -> &'static str {
        "timeout-policy"
    }

    async fn execute(&self, inv: &Invocation, ctx: &CallCtx, next: ExecNext<'_>) -> ToolOutput {
        let Some(ms) = self.budget(inv) else {
            return next.run(inv, ctx).await;
        };
        let derived = ctx.with_timeout(Duration::from_millis(ms), Clock::Tool);
        let out = next.run(inv, &derived).await;
        match timeout_of(&derived.cancel, Some(Clock::Tool)) {
            Some(t) => {
                self.metrics
                    .timeout(Clock::Tool, &inv.session.provider_kind);
                Self::replacement(t.timeout_ms, out.partial)
            }
            None => out,
        }
    }
}
