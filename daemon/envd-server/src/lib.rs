//! envd, E2B's in-sandbox daemon, served over tether's provider seam.
//!
//! The server speaks what the official E2B SDKs speak to a sandbox: the REST surface
//! (`/health`, `/init`, `/envs`, streaming `/files`) and the Connect services
//! `process.Process` and `filesystem.Filesystem`, over the Connect framing of
//! [`tether_protocol::connect`]. It knows nothing of sessions: a [`Host`] finds the sandbox a
//! request names and checks its credentials, and hands it over as a [`HostedSandbox`]:
//! the provider seam's [`Sandbox`] for file operations (each run through the host's
//! [`HostedSandbox::fs`], where the host applies its deadline, span, metric and log), and
//! a table of supervised commands ([`HostedSandbox::start`], [`HostedCommand`]) for
//! processes. tetherd's E2B front is one host (every E2B sandbox a session); its guest
//! agent, inside a microVM, is another use of the same server.
//!
//! What the server keeps per sandbox ([`EnvdState`]) is envd's own: the `/init`
//! defaults, the tags clients gave commands, file metadata where the provider has no
//! extended attributes, file watchers and the uploads they report.

pub mod auth;
mod connect;
mod error;
mod filesystem;
mod multipart;
mod process;
mod rest;
mod seam_host;
mod state;
pub mod util;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::response::Response;
use futures_util::stream::BoxStream;
use http::HeaderMap;
use tether_protocol::e2b::InitRequest;
use tether_protocol::process::{ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, Fs, FsOp, ProcessHandle, ProviderError, Sandbox, StreamOffsets};

pub use error::{Failure, RestError, connect_code};
pub use rest::{Reject, addressed, init_token_check, is_browser, proxy_error};
pub use seam_host::{SeamCommand, SeamHost, SeamSandbox};
pub use state::EnvdState;

/// The limits the server applies itself, from the host's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deadline of one file operation (and of the server's own: a stat of a cwd, the
    /// entries of watch events, the drain of a refused upload).
    pub fs_op: Duration,
    /// The largest file an upload may write.
    pub max_file_bytes: u64,
    /// How long a `SendSignal` of SIGKILL waits for the command to end before it
    /// answers: envd reaps its child at once, so a program that kills a process and then
    /// looks for it finds it gone.
    pub kill_wait: Duration,
}

/// Who envd is served for: finds the sandbox a request is for, and knows its credentials.
pub trait Host: Send + Sync + 'static {
    /// The host's sandbox.
    type Sandbox: HostedSandbox;

    /// The server's limits.
    fn limits(&self) -> Limits;

    /// The live sandbox `id`, ready for envd requests (not paused), with its envd state;
    /// `None`: no such sandbox (envd answers as E2B's edge does for a sandbox that does
    /// not exist).
    fn find(&self, id: &str) -> Option<Target<Self::Sandbox>>;

    /// Every sandbox [`find`](Self::find) would give: a signed `/files` link without
    /// routing names its sandbox by its signature alone.
    fn all(&self) -> Vec<Target<Self::Sandbox>>;

    /// The one sandbox this host serves whatever a request names (an agent inside the
    /// machine itself), if it is such a host.
    fn only(&self) -> Option<String>;

    /// The access token envd requests for `id` must carry; `None`: none is (an agent
    /// before its first `/init`, as envd).
    fn expected_token(&self, id: &str) -> Option<String>;

    /// `/init`'s authentication and its effects beyond envd's defaults (an agent inside a
    /// machine sets its token, its clock, entropy). `Ok`: the defaults are applied.
    fn init(
        &self,
        target: &Target<Self::Sandbox>,
        headers: &HeaderMap,
        req: &InitRequest,
    ) -> Result<(), Box<Response>>;
}

/// A sandbox as the server sees it: the provider seam, plus what its host supervises.
pub trait HostedSandbox: Send + Sync + 'static {
    /// A command the host started and supervises.
    type Command: HostedCommand;

    /// The id the server's spans carry as `session.id`.
    fn session_id(&self) -> &str;

    /// The sandbox, through the provider seam.
    fn sandbox(&self) -> Result<Arc<dyn Sandbox>, Failure>;

    /// Cancelled when the sandbox ends: streams and watchers end with it.
    fn lifetime(&self) -> &CancelToken;

    /// Note activity (an idle sandbox may be reclaimed by its host).
    fn touch(&self);

    /// The sandbox's environment, as created (`/init` adds to it).
    fn env(&self) -> &BTreeMap<String, String>;

    /// The template the sandbox was created from, as its clients name it
    /// (`E2B_TEMPLATE_ID` of its processes), where the host knows it.
    fn template(&self) -> Option<String> {
        None
    }

    /// Run `task` for the sandbox (a watcher), tracked by the host so that its end waits
    /// for it.
    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static);

    /// One file operation: `f` runs under `limit` fused with `ctx`, where the host applies
    /// its span, metric and log of changes. `bytes` tells how many bytes a result moved.
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
        Fut: Future<Output = Result<T, ProviderError>> + Send + 'a;

    /// Start a command (its id is `spec.command_id`, else the host's), supervised by the
    /// host: its output kept from the start, `total` its deadline. `ctx` bounds the start.
    fn start(
        self: &Arc<Self>,
        ctx: &CallCtx,
        spec: ProcessSpec,
        total: Option<Duration>,
    ) -> impl Future<Output = Result<Arc<Self::Command>, Failure>> + Send;

    /// A command by id.
    fn command(&self, id: &str) -> Option<Arc<Self::Command>>;

    /// Every command the host knows of (ended ones too).
    fn commands(&self) -> Vec<Arc<Self::Command>>;
}

/// A supervised command of a [`HostedSandbox`].
pub trait HostedCommand: Send + Sync + 'static {
    /// Its id.
    fn id(&self) -> &str;
    /// Its pid in the sandbox.
    fn pid(&self) -> u32;
    /// How it was started.
    fn spec(&self) -> &ProcessSpec;
    /// The provider's handle: stdin, signals, resize.
    fn handle(&self) -> &Arc<dyn ProcessHandle>;
    /// Bytes of `stream` it has printed so far.
    fn printed(&self, stream: StreamKind) -> u64;
    /// Whether it still runs.
    fn is_running(&self) -> bool;
    /// Its events from `from` on: output (each stream in order), then `Exited`. Follows
    /// live output.
    fn events(
        self: &Arc<Self>,
        from: StreamOffsets,
    ) -> BoxStream<'static, Result<ProcessEvent, Failure>>;
}

/// The sandbox an envd request is for.
#[derive(Debug)]
pub struct Target<S> {
    /// The host's sandbox.
    pub sandbox: Arc<S>,
    /// envd's state of it.
    pub state: Arc<EnvdState>,
    /// Its id.
    pub id: String,
}

impl<S> Clone for Target<S> {
    fn clone(&self) -> Self {
        Self {
            sandbox: Arc::clone(&self.sandbox),
            state: Arc::clone(&self.state),
            id: self.id.clone(),
        }
    }
}

/// The call context of a request, which the host's HTTP layer puts in the request's
/// extensions (its id, its cancellation when the client leaves, its trace context).
#[derive(Debug, Clone)]
pub struct RequestCtx(pub CallCtx);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RequestCtx {
    type Rejection = RestError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<CallCtx>()
            .cloned()
            .map(RequestCtx)
            .ok_or_else(|| {
                RestError::new(
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    "request context missing",
                )
            })
    }
}

/// Cancels a request's token when the request future is dropped (its client is gone).
#[derive(Debug)]
pub struct CancelOnDrop(pub CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel(CancelReason::Caller("client disconnected"));
    }
}

/// A request's id: its `x-request-id` when it has a usable one, else a fresh one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned)
}

/// Run a handler's work in `span` and record there whether its answer is a success.
pub(crate) async fn traced(span: tracing::Span, work: impl Future<Output = Response>) -> Response {
    use tracing::Instrument as _;
    let resp = work.instrument(span.clone()).await;
    span.record(
        "outcome",
        if resp.status().is_success() {
            "ok"
        } else {
            "error"
        },
    );
    resp
}

/// The HTTP layer of a host with none of its own (a [`SeamHost`]): each request gets a
/// [`CallCtx`] in its extensions, named by its `x-request-id` (else a fresh id) and
/// cancelled when its client leaves.
pub async fn call_ctx_layer(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let id = request_id(req.headers());
    let token = CancelToken::new();
    let _guard = CancelOnDrop(token.clone());
    req.extensions_mut().insert(CallCtx::with_cancel(id, token));
    next.run(req).await
}

/// envd's routes: REST, `process.Process` and `filesystem.Filesystem`, served for `H`.
pub fn router<H: Host>() -> Router<Arc<H>> {
    rest::routes::<H>()
        .merge(process::routes::<H>())
        .merge(filesystem::routes::<H>())
}

/// The sandbox of an envd request, with its access token checked.
pub fn authorize<H: Host>(host: &H, headers: &HeaderMap) -> Result<Target<H::Sandbox>, Reject> {
    rest::authorize(host, headers)
}

/// The file system envd serves to `user`: with the sandbox root's rights, what it creates
/// given to `user` ([`Sandbox::fs_for`]), where the provider has that view; else the
/// provider's own.
pub(crate) struct UserFs {
    sandbox: Arc<dyn Sandbox>,
    view: Option<Arc<dyn Fs>>,
}

impl UserFs {
    pub(crate) fn of(sandbox: Arc<dyn Sandbox>, user: &str) -> Result<Self, ProviderError> {
        let view = sandbox.fs_for(user)?;
        Ok(Self { sandbox, view })
    }

    pub(crate) fn get(&self) -> &dyn Fs {
        match &self.view {
            Some(v) => v.as_ref(),
            None => self.sandbox.fs(),
        }
    }
}

/// One of the server's file operations on `t`, through its host, under the sandbox's
/// file-operation deadline: `f` gets the fused context and `path`.
pub(crate) async fn fs_op<'a, S, T, F, Fut>(
    t: &'a Target<S>,
    ctx: &'a CallCtx,
    op: FsOp,
    path: &'a str,
    f: F,
) -> Result<T, ProviderError>
where
    S: HostedSandbox,
    T: Send + 'a,
    F: FnOnce(CallCtx, &'a str) -> Fut + Send + 'a,
    Fut: Future<Output = Result<T, ProviderError>> + Send + 'a,
{
    t.sandbox
        .fs(ctx, op, path, t.state.fs_op, |_| None, move |c| f(c, path))
        .await
}
