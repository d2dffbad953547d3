//! A host of sandboxes handed over directly: envd over the provider seam and nothing else.
//!
//! [`SeamHost`] serves the sandboxes a program adds to it ([`SeamHost::add`]), each by
//! its id and access token. File operations go straight to the seam under the server's
//! deadline; a process is the provider's own ([`Process::spawn`](tether_provider::Process)),
//! its output replayed from the provider's spool, its `Connect-Timeout-Ms` enforced by a
//! task of the host that terminates it. There is no session log and no journal: what a
//! program gets that holds a `Sandbox` and wants the official E2B SDKs to drive it (an
//! agent inside a machine, a test), where tetherd's E2B front adds sessions, recovery
//! and its log.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::response::Response;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::HeaderMap;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::InitRequest;
use tether_protocol::process::{ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, Clock, FsOp, ProcessHandle, ProviderError, Sandbox, StreamOffsets};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::{
    EnvdState, Failure, Host, HostedCommand, HostedSandbox, Limits, Target, init_token_check,
};

/// Sandboxes served by id, over the seam alone.
#[derive(Debug)]
pub struct SeamHost {
    limits: Limits,
    sandboxes: RwLock<HashMap<String, Target<SeamSandbox>>>,
}

impl SeamHost {
    /// A host with no sandbox yet, applying `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            sandboxes: RwLock::new(HashMap::new()),
        }
    }

    /// Serve `sandbox` as `id`: envd requests for it must carry `access_token` (`None`:
    /// none is, as envd before its first `/init`); `env` is the environment it was
    /// created with (what `/envs` reports).
    pub fn add(
        &self,
        id: &str,
        sandbox: Arc<dyn Sandbox>,
        access_token: Option<String>,
        env: BTreeMap<String, String>,
    ) {
        let target = Target {
            sandbox: Arc::new(SeamSandbox {
                id: id.to_owned(),
                sandbox,
                token: access_token,
                env,
                lifetime: CancelToken::new(),
                tasks: TaskTracker::new(),
                commands: RwLock::new(HashMap::new()),
                fs_op: self.limits.fs_op,
            }),
            state: Arc::new(EnvdState::new(self.limits.fs_op)),
            id: id.to_owned(),
        };
        if let Ok(mut m) = self.sandboxes.write() {
            m.insert(id.to_owned(), target);
        }
    }

    /// Stop serving `id`: its streams, watchers and deadline tasks end, and are waited
    /// for. Its processes are the provider's, and live on with the sandbox.
    pub async fn remove(&self, id: &str) {
        let gone = self.sandboxes.write().ok().and_then(|mut m| m.remove(id));
        if let Some(t) = gone {
            t.state.stop_watchers();
            t.sandbox.lifetime.cancel(CancelReason::Shutdown);
            t.sandbox.tasks.close();
            t.sandbox.tasks.wait().await;
        }
    }
}

impl Host for SeamHost {
    type Sandbox = SeamSandbox;

    fn limits(&self) -> Limits {
        self.limits
    }

    fn find(&self, id: &str) -> Option<Target<SeamSandbox>> {
        self.sandboxes.read().ok()?.get(id).cloned()
    }

    fn all(&self) -> Vec<Target<SeamSandbox>> {
        self.sandboxes
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    fn only(&self) -> Option<String> {
        None
    }

    fn expected_token(&self, id: &str) -> Option<String> {
        self.find(id).and_then(|t| t.sandbox.token.clone())
    }

    fn init(
        &self,
        target: &Target<SeamSandbox>,
        headers: &HeaderMap,
        req: &InitRequest,
    ) -> Result<(), Box<Response>> {
        match &target.sandbox.token {
            Some(token) => init_token_check(token, headers, req),
            None => Ok(()),
        }
    }
}

/// A sandbox of a [`SeamHost`].
#[derive(Debug)]
pub struct SeamSandbox {
    id: String,
    sandbox: Arc<dyn Sandbox>,
    token: Option<String>,
    env: BTreeMap<String, String>,
    lifetime: CancelToken,
    tasks: TaskTracker,
    commands: RwLock<HashMap<String, Arc<SeamCommand>>>,
    /// Bounds the host's own calls (ending a process at its deadline).
    fs_op: Duration,
}

impl HostedSandbox for SeamSandbox {
    type Command = SeamCommand;

    fn session_id(&self) -> &str {
        &self.id
    }

    fn sandbox(&self) -> Result<Arc<dyn Sandbox>, Failure> {
        Ok(Arc::clone(&self.sandbox))
    }

    fn lifetime(&self) -> &CancelToken {
        &self.lifetime
    }

    fn touch(&self) {}

    fn env(&self) -> &BTreeMap<String, String> {
        &self.env
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    async fn fs<'a, T, F, Fut>(
        &'a self,
        ctx: &'a CallCtx,
        op: FsOp,
        path: &'a str,
        limit: Duration,
        _bytes: fn(&T) -> Option<u64>,
        f: F,
    ) -> Result<T, ProviderError>
    where
        T: Send + 'a,
        F: FnOnce(CallCtx) -> Fut + Send + 'a,
        Fut: Future<Output = Result<T, ProviderError>> + Send + 'a,
    {
        let fctx = ctx.with_timeout(limit, Clock::Total);
        let span = tracing::debug_span!("envd.fs", op = op.name(), fs.path = %path);
        fctx.run(f(fctx.clone())).instrument(span).await
    }

    async fn start(
        self: &Arc<Self>,
        ctx: &CallCtx,
        spec: ProcessSpec,
        total: Option<Duration>,
    ) -> Result<Arc<SeamCommand>, Failure> {
        if let Some(id) = &spec.command_id
            && self.command(id).is_some_and(|c| c.is_running())
        {
            return Err(Failure::new(
                ErrorCode::Conflict,
                format!("a process with tag {id} is running"),
            ));
        }
        let handle = ctx
            .run(self.sandbox.process().spawn(ctx, spec.clone()))
            .await?;
        let cmd = Arc::new(SeamCommand {
            spec,
            handle: Arc::clone(&handle),
            printed: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        // Counts what the command prints (a `Connect` streams only what comes after it),
        // and ends it at its deadline.
        let (counter, stop, limit) = (Arc::clone(&cmd), self.lifetime.child(), self.fs_op);
        self.tasks.spawn(async move {
            let mut events = counter.handle.events(StreamOffsets::default());
            let deadline = async {
                match total {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    ev = events.next() => match ev {
                        Some(Ok(ProcessEvent::Output { stream, data, .. })) => {
                            counter.printed[slot(stream)]
                                .fetch_add(data.len() as u64, Ordering::Relaxed);
                        }
                        Some(Ok(ProcessEvent::Exited { .. })) | Some(Err(_)) | None => break,
                        Some(Ok(_)) => {}
                    },
                    () = &mut deadline => {
                        let end = CallCtx::new("envd-deadline")
                            .with_timeout(limit, Clock::Total);
                        if let Err(e) = counter.handle.terminate(&end).await {
                            tracing::warn!(error = %e, "Could not end a process at its deadline");
                        }
                        break;
                    }
                    () = stop.cancelled() => break,
                }
            }
        });
        if let Ok(mut m) = self.commands.write() {
            m.insert(handle.command_id().to_owned(), Arc::clone(&cmd));
        }
        Ok(cmd)
    }

    fn command(&self, id: &str) -> Option<Arc<SeamCommand>> {
        self.commands.read().ok()?.get(id).cloned()
    }

    fn commands(&self) -> Vec<Arc<SeamCommand>> {
        self.commands
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }
}

/// The counter of a stream: a pty's output counts as stdout.
fn slot(stream: StreamKind) -> usize {
    match stream {
        StreamKind::Stdout | StreamKind::Pty => 0,
        StreamKind::Stderr => 1,
    }
}

/// A process of a [`SeamSandbox`]: the provider's handle.
#[derive(Debug)]
pub struct SeamCommand {
    spec: ProcessSpec,
    handle: Arc<dyn ProcessHandle>,
    printed: [AtomicU64; 2],
}

impl HostedCommand for SeamCommand {
    fn id(&self) -> &str {
        self.handle.command_id()
    }

    fn pid(&self) -> u32 {
        self.handle.pid()
    }

    fn spec(&self) -> &ProcessSpec {
        &self.spec
    }

    fn handle(&self) -> &Arc<dyn ProcessHandle> {
        &self.handle
    }

    fn printed(&self, stream: StreamKind) -> u64 {
        self.printed[slot(stream)].load(Ordering::Relaxed)
    }

    fn is_running(&self) -> bool {
        self.handle.try_status().is_none()
    }

    fn events(
        self: &Arc<Self>,
        from: StreamOffsets,
    ) -> BoxStream<'static, Result<ProcessEvent, Failure>> {
        self.handle
            .events(from)
            .map(|r| r.map_err(Failure::from))
            .boxed()
    }
}
