//! tetherd as envd's host: every E2B sandbox is a session, its file operations go
//! through the operation layer ([`crate::ops`]) and its processes through the daemon's
//! command machinery ([`crate::exec`]), so they are journaled, bounded, traced and logged
//! like any other of the session's.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::{HeaderMap, StatusCode};
use tether_envd_server::{
    Failure, Host, HostedCommand, HostedSandbox, Limits, Reject, RestError, Target, auth,
    init_token_check,
};
use tether_protocol::e2b::InitRequest;
use tether_protocol::process::{ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::clock::CancelToken;
use tether_provider::{CallCtx, FsOp, ProcessHandle, ProviderError, Sandbox, StreamOffsets};

use super::GuestSlot;
use crate::error::DaemonError;
use crate::exec::{self, ExecLimits, RunningCommand};
use crate::ops::{self, Surface};
use crate::session_manager::{Scope, Session, SessionState};
use crate::state::AppState;

impl From<DaemonError> for Failure {
    fn from(e: DaemonError) -> Self {
        Failure::new(e.code(), e.to_string())
    }
}

/// The live E2B sandbox named by `id`, without checking credentials.
pub(super) fn find(state: &AppState, id: &str) -> Option<Target<Session>> {
    let session = state.sessions.get(id, Scope::Any).ok()?;
    // Only sessions created through the front (owned by a tenant) are E2B sandboxes.
    if session.owner.is_none() || session.state() != SessionState::Active {
        state.e2b.forget(id);
        return None;
    }
    if session.is_paused() {
        return None;
    }
    let extra = state.e2b.extra(id, session.params.template.as_deref());
    Some(Target {
        sandbox: session,
        state: Arc::clone(&extra.envd),
        id: id.to_owned(),
    })
}

impl Host for AppState {
    type Sandbox = Session;

    fn limits(&self) -> Limits {
        Limits {
            fs_op: self.e2b.fs_op,
            max_file_bytes: self.config.server.max_file_bytes,
            kill_wait: Duration::from_millis(self.config.limits.drain_after_terminate_ms),
        }
    }

    fn find(&self, id: &str) -> Option<Target<Session>> {
        find(self, id)
    }

    fn all(&self) -> Vec<Target<Session>> {
        self.sessions
            .list(Scope::Any)
            .into_iter()
            .filter(|s| s.owner.is_some() && s.state() == SessionState::Active)
            .filter_map(|s| find(self, &s.id))
            .collect()
    }

    fn only(&self) -> Option<String> {
        self.e2b.guest_id().map(str::to_owned)
    }

    fn expected_token(&self, id: &str) -> Option<String> {
        self.e2b.expected_token(id)
    }

    fn init(
        &self,
        target: &Target<Session>,
        headers: &HeaderMap,
        req: &InitRequest,
    ) -> Result<(), Box<Response>> {
        match &self.e2b.guest {
            Some(slot) => guest_init(slot, headers, req),
            None => init_token_check(&self.e2b.access_token(&target.id), headers, req),
        }
    }
}

impl HostedSandbox for Session {
    type Command = RunningCommand;

    fn session_id(&self) -> &str {
        &self.id
    }

    fn sandbox(&self) -> Result<Arc<dyn Sandbox>, Failure> {
        Session::sandbox(self).map_err(Failure::from)
    }

    fn lifetime(&self) -> &CancelToken {
        &self.cancel
    }

    fn touch(&self) {
        Session::touch(self);
    }

    fn env(&self) -> &BTreeMap<String, String> {
        &self.params.env
    }

    fn template(&self) -> Option<String> {
        self.params.template.clone()
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks().spawn(task);
    }

    fn fs<'a, T, F, Fut>(
        &'a self,
        ctx: &'a CallCtx,
        op: FsOp,
        path: &'a str,
        limit: Duration,
        bytes: fn(&T) -> Option<u64>,
        f: F,
    ) -> impl Future<Output = Result<T, ProviderError>> + Send + 'a
    where
        T: Send + 'a,
        F: FnOnce(CallCtx) -> Fut + Send + 'a,
        Fut: Future<Output = Result<T, ProviderError>> + Send + 'a,
    {
        let span = ops::fs_span(op, self, path);
        ops::fs(self, ctx, op, path, Surface::Api, limit, span, bytes, f)
    }

    async fn start(
        self: &Arc<Self>,
        ctx: &CallCtx,
        spec: ProcessSpec,
        total: Option<Duration>,
    ) -> Result<Arc<RunningCommand>, Failure> {
        let limits = ExecLimits {
            total,
            output_idle: None,
        };
        Ok(exec::start(self, ctx, spec, limits).await?)
    }

    fn command(&self, id: &str) -> Option<Arc<RunningCommand>> {
        Session::command(self, id)
    }

    fn commands(&self) -> Vec<Arc<RunningCommand>> {
        Session::commands(self)
    }
}

impl HostedCommand for RunningCommand {
    fn id(&self) -> &str {
        &self.command_id
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn spec(&self) -> &ProcessSpec {
        &self.spec
    }

    fn handle(&self) -> &Arc<dyn ProcessHandle> {
        &self.handle
    }

    fn printed(&self, stream: StreamKind) -> u64 {
        self.journal.len(stream)
    }

    fn is_running(&self) -> bool {
        RunningCommand::is_running(self)
    }

    fn events(
        self: &Arc<Self>,
        from: StreamOffsets,
    ) -> BoxStream<'static, Result<ProcessEvent, Failure>> {
        RunningCommand::events(self, from)
            .map(|r| r.map_err(Failure::from))
            .boxed()
    }
}

/// A guest agent's `/init`: the access token (the first one set stays, as envd's, except
/// that the holder of the current token may change it: every VM restored from one saved
/// state gets its own), the clock and fresh entropy.
fn guest_init(
    slot: &GuestSlot,
    headers: &HeaderMap,
    req: &InitRequest,
) -> Result<(), Box<Response>> {
    {
        let Ok(mut current) = slot.token.write() else {
            return Err(
                RestError::new(StatusCode::INTERNAL_SERVER_ERROR, "token lock")
                    .into_response()
                    .into(),
            );
        };
        let holds_current = |c: &str| auth::access_token_matches(headers, c) == Some(true);
        match (current.as_deref(), req.access_token.as_deref()) {
            (None, Some(new)) => *current = Some(new.to_owned()),
            (None, None) => {}
            (Some(c), Some(new)) if auth::constant_time_eq(c.as_bytes(), new.as_bytes()) => {}
            (Some(c), Some(new)) if holds_current(c) => *current = Some(new.to_owned()),
            (Some(_), Some(_)) => {
                return Err(RestError::new(
                    StatusCode::CONFLICT,
                    "access token is already set and cannot be changed",
                )
                .into_response()
                .into());
            }
            (Some(c), None) if holds_current(c) => {}
            (Some(_), None) => return Err(Reject::Unauthorized.into_response().into()),
        }
    }
    if slot.cfg.set_clock
        && let Some(ms) = req
            .timestamp
            .as_deref()
            .and_then(tether_envd_server::util::parse_rfc3339)
    {
        let ts =
            nix::sys::time::TimeSpec::new(ms.div_euclid(1000), ms.rem_euclid(1000) * 1_000_000);
        if let Err(e) = nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts) {
            tracing::warn!(error = %e, "Could not set the clock");
        }
    }
    if let Some(seed) = &req.tether_entropy {
        use base64::Engine as _;
        let bytes = match base64::engine::general_purpose::STANDARD.decode(seed) {
            Ok(b) if b.len() >= MIN_ENTROPY_BYTES => b,
            _ => {
                return Err(RestError::bad_request(format!(
                    "tetherEntropy must be base64 of at least {MIN_ENTROPY_BYTES} bytes"
                ))
                .into_response()
                .into());
            }
        };
        // Written to the pool (mixed in, not credited): enough for clones to diverge.
        if let Err(e) = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/urandom")
            .and_then(|mut f| f.write_all(&bytes))
        {
            tracing::warn!(error = %e, "Could not add entropy");
        }
    }
    Ok(())
}

/// Least entropy a guest agent's `/init` takes.
const MIN_ENTROPY_BYTES: usize = 32;
