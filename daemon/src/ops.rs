//! The operation layer: the native API's file routes, the file tools, the E2B front and
//! anything else that touches a sandbox's files goes through [`fs`], and every pause and
//! resume of a session's sandbox (native API, E2B front) through [`sandbox`]. Each applies
//! to every operation the same things in the same order:
//!
//! 1. the operation's deadline, from config (`limits.fs_op_timeout_ms`, or the transfer
//!    deadline for streamed bodies; `limits.sandbox_op_timeout_ms` for a pause,
//!    `limits.sandbox_create_timeout_ms` for a resume, which may restore a saved machine),
//!    fused with the caller's context;
//! 2. its span (`fs.stat`, `fs.read`, ..., `sandbox.pause`, `sandbox.resume`, with
//!    `session.id`, `provider.kind`, `outcome`, `error.code`, `timeout.clock`);
//! 3. its metric (`tether.remote_op.duration` by op, provider and outcome; a timeout of
//!    its own clock counted in `tether.timeouts`);
//! 4. its event in the session log: `fs/op` for a file change made outside a tool call (a
//!    tool call is recorded by its own `tool/call` and `tool/result`); `sandbox/paused` and
//!    `sandbox/resumed` by the session, which the caller of [`sandbox`] is.

use std::future::Future;
use std::time::Duration;

use tether_protocol::events::EventBody;
use tether_provider::{CallCtx, ProviderError};
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

use crate::session_manager::Session;
use tether_provider::Clock;

/// An operation's span: `name` (`tracing` needs each span name as a literal), the
/// session's id and provider kind, the fields every operation records, and `extra`.
macro_rules! op_span {
    ($name:literal, $session:expr, $($extra:tt)*) => {
        tracing::info_span!(
            $name,
            session.id = %$session.id,
            provider.kind = %$session.provider_kind,
            outcome = Empty,
            error.code = Empty,
            timeout.clock = Empty,
            $($extra)*
        )
    };
}

pub use tether_provider::FsOp;

/// A file operation's span.
pub fn fs_span(op: FsOp, session: &Session, path: &str) -> tracing::Span {
    macro_rules! span {
        ($name:literal) => {
            op_span!($name, session, fs.path = %path, bytes.in = Empty, bytes.out = Empty)
        };
    }
    match op {
        FsOp::Stat => span!("fs.stat"),
        FsOp::Read => span!("fs.read"),
        FsOp::Write => span!("fs.write"),
        FsOp::List => span!("fs.list"),
        FsOp::Mkdir => span!("fs.mkdir"),
        FsOp::Rename => span!("fs.rename"),
        FsOp::Remove => span!("fs.remove"),
    }
}
/// A lifecycle operation on a session's sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxOp {
    /// Pause (freeze, or stop the machine).
    Pause,
    /// Resume a paused sandbox.
    Resume,
    /// Read its resource use.
    Metrics,
    /// Take a snapshot of it (for a snapshot or a fork).
    Snapshot,
    /// Replace its egress rules.
    Network,
}

impl SandboxOp {
    /// The span and metric name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => crate::telemetry::names::SANDBOX_PAUSE,
            Self::Resume => crate::telemetry::names::SANDBOX_RESUME,
            Self::Metrics => crate::telemetry::names::SANDBOX_METRICS,
            Self::Snapshot => crate::telemetry::names::SANDBOX_SNAPSHOT,
            Self::Network => crate::telemetry::names::SANDBOX_NETWORK,
        }
    }

    /// Its deadline, from config.
    pub fn limit(self, d: &crate::config::Deadlines) -> Duration {
        match self {
            Self::Pause | Self::Metrics | Self::Network => d.sandbox_op,
            // Both may copy a whole file system or save a machine's memory.
            Self::Resume | Self::Snapshot => d.sandbox_create,
        }
    }

    fn span(self, session: &Session, sandbox_id: &str) -> tracing::Span {
        macro_rules! span {
            ($name:literal) => {
                op_span!($name, session, sandbox.id = %sandbox_id)
            };
        }
        match self {
            Self::Pause => span!("sandbox.pause"),
            Self::Resume => span!("sandbox.resume"),
            Self::Metrics => span!("sandbox.metrics"),
            Self::Snapshot => span!("sandbox.snapshot"),
            Self::Network => span!("sandbox.network"),
        }
    }
}

/// One lifecycle operation on `session`'s sandbox `sandbox_id` under its deadline from
/// config, in its span, with its metric.
pub async fn sandbox<T, F, Fut>(
    session: &Session,
    ctx: &CallCtx,
    op: SandboxOp,
    sandbox_id: &str,
    f: F,
) -> Result<T, ProviderError>
where
    F: FnOnce(CallCtx) -> Fut,
    Fut: Future<Output = Result<T, ProviderError>>,
{
    let span = op.span(session, sandbox_id);
    let limit = op.limit(&session.deadlines);
    measured(session, ctx, op.name(), limit, span, f).await.0
}

/// Which surface asked: a tool call is logged by the pipeline, anything else here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// A tool call (`read_file`, `write_file`, ...).
    Tool,
    /// The native API or the E2B front.
    Api,
}

/// One file operation on `session`'s sandbox under `limit`, in `span` (see
/// [`FsOp::span`]), with its metric and, for a change from [`Surface::Api`], its `fs/op`
/// event. `bytes` tells how many bytes a successful result moved (for the event).
#[allow(clippy::too_many_arguments)]
pub async fn fs<T, F, Fut>(
    session: &Session,
    ctx: &CallCtx,
    op: FsOp,
    path: &str,
    surface: Surface,
    limit: Duration,
    span: tracing::Span,
    bytes: fn(&T) -> Option<u64>,
    f: F,
) -> Result<T, ProviderError>
where
    F: FnOnce(CallCtx) -> Fut,
    Fut: Future<Output = Result<T, ProviderError>>,
{
    let (out, outcome) = measured(session, ctx, op.name(), limit, span, f).await;
    if let (Surface::Api, Some(logged)) = (surface, op.change()) {
        let event = EventBody::FsOp {
            op: logged.into(),
            path: path.to_owned(),
            outcome: outcome.to_owned(),
            bytes: out.as_ref().ok().and_then(bytes),
        };
        if let Err(e) = session.log.append(event).await {
            // The operation's own outcome is what the caller gets (reporting a change that
            // took effect as failed would invite a retry); the lost record is loud here.
            tracing::error!(session.id = %session.id, code = %e.code(), error = %e, "Could not log a file operation");
        }
    }
    out
}

/// [`fs`] for the API surfaces (the native API, the E2B front): the configured
/// file-operation deadline, the operation's span, and for a change its `fs/op` event.
pub async fn api<'a, T, F, Fut>(
    session: &'a Session,
    ctx: &CallCtx,
    op: FsOp,
    path: &'a str,
    f: F,
) -> Result<T, ProviderError>
where
    F: FnOnce(CallCtx, &'a str) -> Fut,
    Fut: Future<Output = Result<T, ProviderError>>,
{
    let span = fs_span(op, session, path);
    let limit = session.deadlines.fs_op;
    fs(
        session,
        ctx,
        op,
        path,
        Surface::Api,
        limit,
        span,
        no_bytes,
        |c| f(c, path),
    )
    .await
}

/// Run `f` under `limit` fused with `ctx`, in `span`, and record its outcome there and in
/// the `name` metric: the part every operation shares. Returns the result and its
/// outcome (`ok` or the error code).
async fn measured<T, F, Fut>(
    session: &Session,
    ctx: &CallCtx,
    name: &'static str,
    limit: Duration,
    span: tracing::Span,
    f: F,
) -> (Result<T, ProviderError>, &'static str)
where
    F: FnOnce(CallCtx) -> Fut,
    Fut: Future<Output = Result<T, ProviderError>>,
{
    let fctx = ctx.with_timeout(limit, Clock::Total);
    let started = Instant::now();
    let out = fctx.run(f(fctx.clone())).instrument(span.clone()).await;
    let outcome = match &out {
        Ok(_) => "ok",
        Err(e) => {
            span.record("error.code", e.code().as_str());
            if let Some(clock) = e.clock() {
                span.record("timeout.clock", clock.name());
                // This operation's own deadline is counted here; a tool deadline or a
                // command clock where it is armed.
                if fctx.timed_out(Some(Clock::Total)) {
                    session.metrics().timeout(clock, &session.provider_kind);
                }
                count_provider_clock(session.metrics(), e, &session.provider_kind);
            }
            e.code().as_str()
        }
    };
    span.record("outcome", outcome);
    session
        .metrics()
        .remote_op(name, &session.provider_kind, outcome, started.elapsed());
    (out, outcome)
}

/// Count a provider's own clock (connect, transport idle: armed inside the provider) in
/// `tether.timeouts`, where the daemon sees the call end with it. The daemon's own clocks
/// are counted where they are armed.
pub fn count_provider_clock(metrics: &crate::telemetry::Metrics, e: &ProviderError, kind: &str) {
    if let Some(clock @ (Clock::Connect | Clock::TransportIdle)) = e.clock() {
        metrics.timeout(clock, kind);
    }
}

/// No byte count.
pub fn no_bytes<T>(_: &T) -> Option<u64> {
    None
}
