//! One sandbox's envd client and the seam objects built from it.
//!
//! [`EnvdSandboxClient`] holds what every part of one sandbox shares: the envd client,
//! the configuration, and the token and task tracker that end its background work when
//! the sandbox goes away ([`EnvdSandboxClient::close`]). Its [`EnvdFs`] and
//! [`EnvdProcess`] are the sandbox's `Fs` and `Process`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tether_protocol::e2b::{
    EndEvent, InitRequest, ProcessConfig, ProcessEventMsg, ProcessEventResponse, StartRequest,
};
use tether_protocol::process::ExitStatus;
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, Clock, Result};
use tokio_util::task::TaskTracker;

use crate::client::{Envd, EnvdEndpoint, EnvdVersion, Http, StreamItem};
use crate::config::EnvdClientConfig;
use crate::error::{Op, malformed};
use crate::fs::EnvdFs;
use crate::process::{EnvdProcess, exit_status};

/// Milliseconds since the epoch of an RFC 3339 time.
pub fn parse_time_ms(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s.trim(), &time::format_description::well_known::Rfc3339)
        .ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

// === impl SandboxCore ===

/// What every part of one sandbox shares: its envd client, its configuration, and the
/// token and task tracker that end its background work when it is destroyed.
#[derive(Debug)]
pub(crate) struct SandboxCore {
    pub(crate) id: String,
    pub(crate) cfg: Arc<EnvdClientConfig>,
    /// The provider kind, recorded as `provider.kind` on spans.
    pub(crate) kind: &'static str,
    pub(crate) envd: Envd,
    pub(crate) closed: CancelToken,
    pub(crate) tasks: TaskTracker,
}

/// What a small control command printed and how it ended.
#[derive(Debug)]
pub(crate) struct ControlOutcome {
    pub(crate) status: ExitStatus,
    pub(crate) stdout: Vec<u8>,
}

impl SandboxCore {
    /// The user of file operations.
    pub(crate) fn user(&self) -> Option<&str> {
        self.cfg.user.as_deref()
    }

    /// One filesystem RPC on `path` (`filesystem.Filesystem/{method}`) made off any
    /// caller's path (cleanups, directories made ahead): bounded by the total limit of a
    /// call, cancelled when the sandbox closes, not retried.
    pub(crate) async fn background_fs_call(
        &self,
        method: &'static str,
        op: &'static str,
        path: &str,
        user: Option<&str>,
    ) -> Result<()> {
        let ctx = CallCtx::with_cancel(op, self.closed.clone())
            .with_timeout(self.cfg.request_timeout(), Clock::Total);
        let req = tether_protocol::e2b::PathRequest {
            path: path.to_owned(),
        };
        let _: serde_json::Value = self
            .envd
            .unary(&ctx, method, &req, user, Op::Fs { op, path })
            .await?;
        Ok(())
    }

    /// Run a short control command (`sh -c script tether args...`) to completion, bounded
    /// by the total limit of a call.
    pub(crate) async fn control(
        &self,
        ctx: &CallCtx,
        user: Option<&str>,
        script: &str,
        args: &[&str],
    ) -> Result<ControlOutcome> {
        let tctx = ctx.with_timeout(self.cfg.request_timeout(), Clock::Total);
        let mut argv = vec!["-c".to_owned(), script.to_owned(), "tether".to_owned()];
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let req = StartRequest {
            process: Some(ProcessConfig {
                cmd: "/bin/sh".into(),
                args: argv,
                envs: BTreeMap::new(),
                cwd: Some(self.cfg.workspace.clone()),
            }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let op = Op::Process {
            op: "control",
            id: "control",
        };
        let mut stream = self
            .envd
            .server_stream(
                &tctx,
                &tctx.cancel,
                "process.Process/Start",
                &req,
                user.or(self.user()),
                op,
            )
            .await?;
        let mut stdout = Vec::new();
        let mut end: Option<EndEvent> = None;
        while let StreamItem::Message(m) = tctx.run(stream.next::<ProcessEventResponse>()).await? {
            match m.event {
                ProcessEventMsg::Data(tether_protocol::e2b::DataEvent::Stdout(b)) => {
                    stdout.extend_from_slice(&b)
                }
                ProcessEventMsg::End(e) => end = Some(e),
                _ => {}
            }
        }
        let end = end.ok_or_else(|| malformed("a control command ended without an end event"))?;
        Ok(ControlOutcome {
            status: exit_status(&end),
            stdout,
        })
    }
}

// === impl EnvdSandboxClient ===

/// The envd client of one sandbox: its file system and processes, its readiness probe
/// and `POST /init`. Cloning shares it (the same command table, the same close token).
#[derive(Debug, Clone)]
pub struct EnvdSandboxClient {
    core: Arc<SandboxCore>,
}

impl EnvdSandboxClient {
    /// The client of the sandbox `sandbox_id` whose envd is at `endpoint`, over `http`
    /// (one client shared by a provider, or one of this sandbox's own). `kind` is the
    /// provider kind its spans record. Fails with `BACKEND_ERROR` on an access token that
    /// is not a header value.
    pub fn new(
        kind: &'static str,
        sandbox_id: &str,
        endpoint: EnvdEndpoint,
        cfg: &EnvdClientConfig,
        http: reqwest::Client,
    ) -> Result<Self> {
        Self::with_config(kind, sandbox_id, endpoint, Arc::new(cfg.clone()), http)
    }

    /// [`Self::new`] with a configuration shared by many sandboxes.
    pub fn with_config(
        kind: &'static str,
        sandbox_id: &str,
        endpoint: EnvdEndpoint,
        cfg: Arc<EnvdClientConfig>,
        http: reqwest::Client,
    ) -> Result<Self> {
        let envd = Envd::new(Http::new(&cfg, http), endpoint, cfg.keepalive_interval_s)?;
        Ok(Self {
            core: Arc::new(SandboxCore {
                id: sandbox_id.to_owned(),
                cfg,
                kind,
                envd,
                closed: CancelToken::new(),
                tasks: TaskTracker::new(),
            }),
        })
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.core.id
    }

    /// The configuration.
    pub fn config(&self) -> &EnvdClientConfig {
        &self.core.cfg
    }

    /// The envd version this client gates features on.
    pub fn version(&self) -> EnvdVersion {
        self.core.envd.version
    }

    /// The sandbox's file system (the seam's `Fs`).
    pub fn fs(&self) -> EnvdFs {
        EnvdFs::new(self.core.clone())
    }

    /// The sandbox's processes (the seam's `Process`). Build it once per sandbox: it holds
    /// the table of the sandbox's commands.
    pub fn process(&self) -> EnvdProcess {
        EnvdProcess::new(self.core.clone())
    }

    /// `GET /health`, retried as an idempotent call within `ctx` (each attempt bounded by
    /// the total limit of a call).
    pub async fn health(&self, ctx: &CallCtx) -> Result<()> {
        let envd = &self.core.envd;
        crate::client::retry(ctx, envd.http.retry, "health", || envd.health(ctx)).await
    }

    /// The readiness probe: one `GET /health`, bounded by the configured
    /// `health_timeout_ms`, not retried (the caller polls). `Ok` once envd answers 2xx.
    pub async fn probe_health(&self, ctx: &CallCtx) -> Result<()> {
        self.core
            .envd
            .health_within(ctx, self.core.cfg.health_timeout())
            .await
    }

    /// `POST /init` (sandbox-wide environment, access token, default user and working
    /// directory), one attempt bounded by the total limit of a call.
    pub async fn init(&self, ctx: &CallCtx, req: &InitRequest) -> Result<()> {
        self.core.envd.init(ctx, req).await
    }

    /// Whether [`Self::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.core.closed.is_cancelled()
    }

    /// End the sandbox's background work: its streams and command pumps stop.
    pub fn close(&self) {
        self.core.closed.cancel(CancelReason::SessionClosed);
    }

    /// Wait (bounded by `limit`) for the sandbox's background tasks to end.
    pub async fn drain(&self, limit: Duration) {
        self.core.tasks.close();
        let _ = tokio::time::timeout(limit, self.core.tasks.wait()).await;
        self.core.tasks.reopen();
    }
}
