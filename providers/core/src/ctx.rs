//! The context every provider call carries: request id, deadline, cancellation, trace.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::{CancelReason, CancelToken, Clock, Deadline, deadline, timeout_of};
use crate::error::{ProviderError, Result};

/// The W3C trace context of the call, injected as `TRACEPARENT` / `TRACESTATE` into the
/// environment of remote commands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext {
    /// The `traceparent` value.
    pub traceparent: Option<String>,
    /// The `tracestate` value.
    pub tracestate: Option<String>,
}

/// Per-call context: deadlines are data.
///
/// `deadline` is the instant the call must be over by (the enforced value), `budget` the
/// original allowance (the reported value). `cancel` fuses the caller's cancellation with
/// the deadline's timer: an operation watches it and reaches quiescence when it fires.
#[derive(Debug, Clone)]
pub struct CallCtx {
    /// The request id, for logs and traces.
    pub request_id: String,
    /// Cancellation, with a typed reason.
    pub cancel: CancelToken,
    /// When the call must end, if bounded.
    pub deadline: Option<Instant>,
    /// The original time budget, if bounded.
    pub budget: Option<Duration>,
    /// The trace context to propagate.
    pub trace: TraceContext,
    timer: Option<Arc<Deadline>>,
}

impl CallCtx {
    /// An unbounded context with a fresh token.
    pub fn new(request_id: impl Into<String>) -> Self {
        Self {
            request_id: request_id.into(),
            cancel: CancelToken::new(),
            deadline: None,
            budget: None,
            trace: TraceContext::default(),
            timer: None,
        }
    }

    /// An unbounded context under an existing token (e.g. the daemon's shutdown token).
    pub fn with_cancel(request_id: impl Into<String>, cancel: CancelToken) -> Self {
        Self {
            cancel,
            ..Self::new(request_id)
        }
    }

    /// Set the trace context.
    pub fn with_trace(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
    }

    /// A child context bounded by `limit` (and by this context's own deadline): the
    /// child's token fires with `TimeoutReason { code, .. }` when `limit` elapses.
    ///
    /// A zero `limit` means no extra bound.
    pub fn with_timeout(&self, limit: Duration, clock: Clock) -> Self {
        if limit.is_zero() {
            return self.child();
        }
        let ms = limit.as_secs_f64() * 1000.0;
        match deadline(
            Some(&self.cancel),
            ms.min(crate::clock::MAX_TIMER_DELAY_MS),
            clock,
        ) {
            Ok(d) => {
                let expires = d.expires_at();
                let deadline = match (self.deadline, expires) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                Self {
                    request_id: self.request_id.clone(),
                    cancel: d.token().clone(),
                    deadline,
                    budget: Some(limit),
                    trace: self.trace.clone(),
                    timer: Some(Arc::new(d)),
                }
            }
            // Outside a runtime no timer can run; keep the parent's bounds.
            Err(_) => self.child(),
        }
    }

    /// A child context: cancelled with this one, cancellable on its own.
    pub fn child(&self) -> Self {
        Self {
            request_id: self.request_id.clone(),
            cancel: self.cancel.child(),
            deadline: self.deadline,
            budget: self.budget,
            trace: self.trace.clone(),
            timer: self.timer.clone(),
        }
    }

    /// Time left before the deadline (`None`: unbounded).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// `Err` with the cancellation's error if the context is already cancelled.
    pub fn check(&self) -> Result<()> {
        match self.cancel.reason() {
            Some(r) => Err(ProviderError::from_reason(r)),
            None => Ok(()),
        }
    }

    /// Whether the cancellation is a timer's (of `clock`, when given).
    pub fn timed_out(&self, clock: Option<Clock>) -> bool {
        timeout_of(&self.cancel, clock).is_some()
    }

    /// Run an abortable operation (one whose future may be dropped mid-flight without
    /// leaving work behind: a request/response round trip, a stat): the first of its
    /// result and the context's cancellation wins.
    ///
    /// Operations that own remote work (a running command) must not use this: they
    /// watch `cancel` themselves and terminate their work before returning.
    pub async fn run<T, F>(&self, op: F) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        self.check()?;
        tokio::select! {
            biased;
            out = op => out,
            _ = self.cancel.cancelled() => Err(ProviderError::from_reason(
                self.cancel.reason().unwrap_or(CancelReason::Caller("unknown")),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_protocol::ErrorCode;

    #[tokio::test(start_paused = true)]
    async fn run_returns_the_clock_that_fired() {
        let root = CallCtx::new("r1");
        let ctx = root.with_timeout(Duration::from_millis(50), Clock::Total);
        assert_eq!(ctx.budget, Some(Duration::from_millis(50)));
        let e = ctx
            .run(std::future::pending::<Result<()>>())
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::DeadlineExceeded);
        assert_eq!(e.clock(), Some(Clock::Total));
        assert!(!root.cancel.is_cancelled());
        let inner = root.with_timeout(Duration::from_secs(10), Clock::Total);
        root.cancel.cancel(CancelReason::Shutdown);
        assert_eq!(inner.check().unwrap_err().code(), ErrorCode::ShuttingDown);
    }

    #[tokio::test(start_paused = true)]
    async fn nested_deadline_is_the_earliest() {
        let a = CallCtx::new("r").with_timeout(Duration::from_millis(100), Clock::Total);
        let b = a.with_timeout(Duration::from_secs(5), Clock::OutputIdle);
        assert_eq!(b.deadline, a.deadline);
        assert!(b.remaining().unwrap() <= Duration::from_millis(100));
    }
}
