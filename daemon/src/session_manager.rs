//! Sessions: each one a session log plus the sandbox leased for it.
//!
//! The [`SessionManager`] creates sessions (the log header with the session's
//! [`SessionParams`] is the durable intent, then provider create, then `sandbox/leased`),
//! finds them, closes them (commands terminated, sandbox destroyed, `sandbox/released`),
//! forks them (with the parent's parameters), expires them (TTL from activity, or an
//! explicit E2B timeout, logged as `session/expiry`), and on start-up re-opens every live
//! session on disk (crash repair), takes its parameters, expiry and sandbox id from its own
//! log, reconnects the sandbox where the provider can, and destroys this daemon's sandboxes
//! that no session owns. The session log is the only record: there is no second ledger to
//! disagree with it. Closed sessions are not held in memory; their logs are opened on
//! demand, and a retention setting removes them after a configured age.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tether_protocol::api::SessionInfo;
use tether_protocol::events::{
    EventBody, Expiry, Lifecycle, PauseKind, PortAccess, SessionHeader, SessionParams,
};
use tether_protocol::process::{ExitStatus, ProcessSpec, StreamKind};
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, ProcessSelector, Provider, ProviderError, Sandbox, SandboxSpec};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::config::Deadlines;
use crate::error::{DaemonError, Result};
use crate::exec::RunningCommand;
use crate::invariants::Invariants;
use crate::leases::{META_DAEMON, META_SESSION, now_ms};
use crate::ops::SandboxOp;
use crate::providers::ProviderRegistry;
use crate::session_log::{LogConfig, RepairReport, SessionLog};
use crate::telemetry::Metrics;
use tether_provider::Clock;

mod snapshots;
pub use snapshots::{MAX_FORKS, SnapshotRecord, Snapshots, TAG as SNAPSHOT_TAG};

/// Where a session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// It has a sandbox.
    Active,
    /// Its sandbox was lost (e.g. not reconnectable after a restart); the log is readable.
    Detached,
    /// Closed; the log is readable.
    Closed,
}

impl SessionState {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Detached => "detached",
            Self::Closed => "closed",
        }
    }
}

/// What to create.
#[derive(Debug, Clone, Default)]
pub struct NewSession {
    /// Provider name; the configured default when `None`.
    pub provider: Option<String>,
    /// Template.
    pub template: Option<String>,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
    /// Network access.
    pub network: bool,
    /// The tenant owning it (E2B front API keys); `None` for the native API.
    pub owner: Option<String>,
    /// Expiry policy.
    pub expiry: Expiry,
    /// Resource limits (the provider's defaults fill the rest).
    pub limits: tether_protocol::limits::ResourceLimits,
    /// Who reaches the sandbox's ports through the E2B front.
    pub ports: PortAccess,
    /// A snapshot (its id or name, seen by `owner`) the sandbox starts from instead of
    /// the template; its provider is the session's.
    pub snapshot: Option<String>,
    /// Pause at expiry, resume on traffic.
    pub lifecycle: Lifecycle,
    /// Egress rules (with network).
    pub egress: tether_protocol::network::Egress,
}

/// One session.
#[derive(Debug)]
pub struct Session {
    /// Session id (also the E2B sandbox id).
    pub id: String,
    /// Provider name.
    pub provider_name: String,
    /// Provider kind.
    pub provider_kind: String,
    provider: Arc<dyn Provider>,
    sandbox: RwLock<Option<Arc<dyn Sandbox>>>,
    sandbox_id: RwLock<Option<String>>,
    detached_why: RwLock<Option<String>>,
    /// The session log.
    pub log: Arc<SessionLog>,
    commands: RwLock<HashMap<String, Arc<RunningCommand>>>,
    /// What the session was created with (the log header's parameters).
    pub params: SessionParams,
    /// The owning tenant (`params.owner`, kept at hand for scope checks).
    pub owner: Option<String>,
    /// Deadlines of the daemon's own calls on the session's behalf (from config).
    pub deadlines: Deadlines,
    /// Cancelled when the session closes (or the daemon shuts down).
    pub cancel: CancelToken,
    tasks: TaskTracker,
    metrics: Metrics,
    last_activity_ms: AtomicI64,
    /// Command output journaled by this session so far, bytes.
    output_bytes: std::sync::atomic::AtomicU64,
    expires_ms: AtomicI64,
    idle_ttl_ms: AtomicI64,
    closed: AtomicBool,
    /// What the pause in force kept (`sandbox/paused` logged, no `sandbox/resumed`
    /// since), `None` while it runs. Paused without its memory, its processes ended,
    /// resume boots it again, and after a restart there is no handle to it until then.
    pause: RwLock<Option<PauseKind>>,
    /// One pause, resume or egress change at a time.
    pause_lock: tokio::sync::Mutex<()>,
    /// The egress rules in force: the header's, or the latest `sandbox/network`.
    egress: RwLock<tether_protocol::network::Egress>,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// One tool-call batch at a time (turns are sequential).
    pub batch_lock: tokio::sync::Mutex<()>,
}

impl Session {
    /// The session's provider.
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    /// The sandbox, or `SANDBOX_NOT_FOUND` when detached or closed, `CONFLICT` while it
    /// is paused (nothing runs in a paused sandbox: a call would only wait).
    pub fn sandbox(&self) -> Result<Arc<dyn Sandbox>> {
        if self.is_paused() {
            return Err(DaemonError::Conflict {
                message: format!("session {} is paused: resume it first", self.id),
            });
        }
        let guard = self
            .sandbox
            .read()
            .map_err(|_| DaemonError::internal("sandbox lock poisoned"))?;
        match guard.as_ref() {
            Some(s) => Ok(Arc::clone(s)),
            None => Err(DaemonError::Detached {
                id: self.id.clone(),
                why: self
                    .detached_why
                    .read()
                    .ok()
                    .and_then(|w| w.clone())
                    .unwrap_or_else(|| "the session is closed".into()),
            }),
        }
    }

    /// The sandbox, paused or not (recovery re-attaches commands of a paused sandbox:
    /// they go on when it is resumed).
    fn sandbox_even_paused(&self) -> Option<Arc<dyn Sandbox>> {
        self.sandbox
            .read()
            .ok()
            .and_then(|g| g.as_ref().map(Arc::clone))
    }

    /// The sandbox id, if one was leased.
    pub fn sandbox_id(&self) -> Option<String> {
        self.sandbox_id.read().ok().and_then(|g| g.clone())
    }

    /// The state.
    pub fn state(&self) -> SessionState {
        if self.closed.load(Ordering::Acquire) {
            SessionState::Closed
        } else if self.sandbox.read().map(|g| g.is_some()).unwrap_or(false) || self.is_stopped() {
            SessionState::Active
        } else {
            SessionState::Detached
        }
    }

    /// Record activity: renews an idle-based expiry.
    pub fn touch(&self) {
        let now = now_ms();
        self.last_activity_ms.store(now, Ordering::Relaxed);
        let ttl = self.idle_ttl_ms.load(Ordering::Relaxed);
        if ttl > 0 {
            self.expires_ms.store(now + ttl, Ordering::Relaxed);
        }
    }

    /// Whether the sandbox is paused.
    pub fn is_paused(&self) -> bool {
        self.pause_kind().is_some()
    }

    /// Whether it is paused without its memory (stopped).
    fn is_stopped(&self) -> bool {
        self.pause_kind() == Some(PauseKind::Filesystem)
    }

    /// The egress rules in force.
    pub fn egress(&self) -> tether_protocol::network::Egress {
        self.egress
            .read()
            .map(|g| g.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    fn put_egress(&self, egress: tether_protocol::network::Egress) {
        match self.egress.write() {
            Ok(mut g) => *g = egress,
            Err(e) => *e.into_inner() = egress,
        }
    }

    /// Replace the sandbox's egress rules through its provider. Durable on return:
    /// `sandbox/network` is in the log, so a fork and a restarted daemon keep them. A
    /// session without network is `INVALID_REQUEST`; a provider that cannot change them
    /// on a running sandbox answers `UNSUPPORTED` or `ISOLATION_UNAVAILABLE`, and the
    /// rules in force stay.
    pub async fn set_egress(
        self: &Arc<Self>,
        ctx: &CallCtx,
        egress: tether_protocol::network::Egress,
    ) -> Result<()> {
        let (me, ctx) = (Arc::clone(self), ctx.clone());
        self.detached(async move { me.set_egress_now(&ctx, egress).await })
            .await
    }

    async fn set_egress_now(
        &self,
        ctx: &CallCtx,
        egress: tether_protocol::network::Egress,
    ) -> Result<()> {
        let _one = self.pause_lock.lock().await;
        if !self.params.network {
            return Err(DaemonError::InvalidRequest {
                message: format!(
                    "session {} has no network: there is no egress to rule",
                    self.id
                ),
            });
        }
        let sandbox_id = self.sandbox_id().ok_or_else(|| DaemonError::Detached {
            id: self.id.clone(),
            why: "no sandbox leased".into(),
        })?;
        let provider = &self.provider;
        crate::ops::sandbox(self, ctx, SandboxOp::Network, &sandbox_id, |c| {
            let (id, e) = (sandbox_id.clone(), egress.clone());
            async move { provider.set_egress(&c, &id, e).await }
        })
        .await?;
        self.put_egress(egress.clone());
        self.log
            .append(EventBody::SandboxNetwork { sandbox_id, egress })
            .await?;
        Ok(())
    }

    /// Pause the sandbox through its provider, keeping what `kind` says. Durable on
    /// return: `sandbox/paused` is in the log, so a restarted daemon knows it is paused
    /// (its processes frozen, or ended for [`PauseKind::Filesystem`]). Pausing a paused
    /// sandbox is `CONFLICT`; a provider that cannot pause so answers `UNSUPPORTED`.
    pub async fn pause(self: &Arc<Self>, ctx: &CallCtx, kind: PauseKind) -> Result<()> {
        let (me, ctx) = (Arc::clone(self), ctx.clone());
        self.detached(async move { me.pause_now(&ctx, kind).await })
            .await
    }

    /// What the pause in force kept (`None`: not paused).
    pub fn pause_kind(&self) -> Option<PauseKind> {
        self.pause.read().ok().and_then(|g| *g)
    }

    /// Run a lifecycle change on a tracked task, detached from its caller: a client that
    /// leaves never cuts it between the provider's change and its record in the log.
    async fn detached<F>(&self, f: F) -> Result<()>
    where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        self.tasks
            .spawn(f.in_current_span())
            .await
            .map_err(|e| DaemonError::internal(format!("a lifecycle task failed: {e}")))?
    }

    async fn pause_now(&self, ctx: &CallCtx, kind: PauseKind) -> Result<()> {
        let _one = self.pause_lock.lock().await;
        if self.is_paused() {
            return Err(DaemonError::Conflict {
                message: format!("session {} is already paused", self.id),
            });
        }
        let sandbox_id = self.sandbox_id().unwrap_or_else(|| self.id.clone());
        let provider = &self.provider;
        crate::ops::sandbox(self, ctx, SandboxOp::Pause, &sandbox_id, |c| {
            let id = sandbox_id.clone();
            async move { provider.pause(&c, &id, kind).await }
        })
        .await?;
        set(&self.pause, Some(kind));
        self.log
            .append(EventBody::SandboxPaused { sandbox_id, kind })
            .await?;
        Ok(())
    }

    /// Resume a paused sandbox; durable on return (`sandbox/resumed`). With `reboot`, a
    /// sandbox paused with its memory is stopped first (logged as such), so it boots
    /// again. Resuming a running sandbox is `CONFLICT`.
    pub async fn resume(self: &Arc<Self>, ctx: &CallCtx, reboot: bool) -> Result<()> {
        let (me, ctx) = (Arc::clone(self), ctx.clone());
        self.detached(async move { me.resume_now(&ctx, reboot).await })
            .await
    }

    async fn resume_now(&self, ctx: &CallCtx, reboot: bool) -> Result<()> {
        let _one = self.pause_lock.lock().await;
        if !self.is_paused() {
            return Err(DaemonError::Conflict {
                message: format!("session {} is not paused", self.id),
            });
        }
        let sandbox_id = self.sandbox_id().unwrap_or_else(|| self.id.clone());
        let provider = &self.provider;
        if reboot && !self.is_stopped() {
            let kind = PauseKind::Filesystem;
            crate::ops::sandbox(self, ctx, SandboxOp::Pause, &sandbox_id, |c| {
                let id = sandbox_id.clone();
                async move { provider.pause(&c, &id, kind).await }
            })
            .await?;
            set(&self.pause, Some(kind));
            self.log
                .append(EventBody::SandboxPaused {
                    sandbox_id: sandbox_id.clone(),
                    kind,
                })
                .await?;
        }
        // The provider may hand out a new handle; the sandbox id stays.
        let sandbox = crate::ops::sandbox(self, ctx, SandboxOp::Resume, &sandbox_id, |c| {
            let id = sandbox_id.clone();
            async move { provider.resume(&c, &id).await }
        })
        .await?;
        let stopped = self.is_stopped();
        if let Ok(mut g) = self.sandbox.write()
            && (g.is_some() || stopped)
        {
            if g.is_none() {
                // Recovered stopped: no handle was counted live.
                self.metrics.sandboxes_live(1, &self.provider_kind);
            }
            *g = Some(sandbox);
        }
        set(&self.pause, None);
        self.log
            .append(EventBody::SandboxResumed { sandbox_id })
            .await?;
        Ok(())
    }

    /// The sandbox's resource use now, through its provider (`UNSUPPORTED` where it
    /// cannot tell).
    pub async fn resource_use(&self, ctx: &CallCtx) -> Result<tether_provider::SandboxMetrics> {
        let sandbox_id = self.sandbox_id().unwrap_or_else(|| self.id.clone());
        let provider = &self.provider;
        Ok(
            crate::ops::sandbox(self, ctx, SandboxOp::Metrics, &sandbox_id, |c| {
                let id = sandbox_id.clone();
                async move { provider.metrics(&c, &id).await }
            })
            .await?,
        )
    }

    /// Set a fixed expiry (E2B `set_timeout`): `at_ms` since the epoch. Durable on
    /// return: the change is logged as `session/expiry`, which recovery reads back.
    pub async fn set_expiry(&self, at_ms: i64) -> Result<()> {
        self.log
            .append(EventBody::ExpirySet {
                expiry: Expiry::At { at_ms },
            })
            .await?;
        self.apply_expiry(Expiry::At { at_ms }, now_ms());
        Ok(())
    }

    fn apply_expiry(&self, expiry: Expiry, last_activity_ms: i64) {
        match expiry {
            Expiry::Never => {
                self.idle_ttl_ms.store(0, Ordering::Relaxed);
                self.expires_ms.store(0, Ordering::Relaxed);
            }
            Expiry::Idle { ttl_ms } => {
                let ttl = i64::try_from(ttl_ms).unwrap_or(i64::MAX);
                self.idle_ttl_ms.store(ttl, Ordering::Relaxed);
                self.last_activity_ms
                    .store(last_activity_ms, Ordering::Relaxed);
                self.expires_ms
                    .store(last_activity_ms.saturating_add(ttl), Ordering::Relaxed);
            }
            Expiry::At { at_ms } => {
                self.idle_ttl_ms.store(0, Ordering::Relaxed);
                self.expires_ms.store(at_ms, Ordering::Relaxed);
            }
        }
    }

    /// The expiry as it stands now (what a fork inherits).
    pub fn expiry(&self) -> Expiry {
        let ttl = self.idle_ttl_ms.load(Ordering::Relaxed);
        let at = self.expires_ms.load(Ordering::Relaxed);
        if ttl > 0 {
            Expiry::Idle {
                ttl_ms: u64::try_from(ttl).unwrap_or(0),
            }
        } else if at > 0 {
            Expiry::At { at_ms: at }
        } else {
            Expiry::Never
        }
    }

    /// Expiry time, ms since the epoch (0 = none).
    pub fn expires_ms(&self) -> i64 {
        self.expires_ms.load(Ordering::Relaxed)
    }

    /// Count `n` more journaled output bytes; `false` once the session's output cap
    /// (`limits.session_output_max_bytes`) is passed.
    pub fn add_output(&self, n: u64) -> bool {
        let total = self
            .output_bytes
            .fetch_add(n, Ordering::Relaxed)
            .saturating_add(n);
        self.output_within_cap(total)
    }

    /// Whether the session may still journal output.
    pub fn output_allowed(&self) -> bool {
        self.output_within_cap(self.output_bytes.load(Ordering::Relaxed))
    }

    fn output_within_cap(&self, total: u64) -> bool {
        let cap = self.deadlines.session_output_max_bytes;
        cap == 0 || total <= cap
    }

    /// Tracked tasks of the session.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Metrics handle.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A command by id.
    pub fn command(&self, id: &str) -> Option<Arc<RunningCommand>> {
        self.commands.read().ok().and_then(|m| m.get(id).cloned())
    }

    /// A command by pid.
    pub fn command_by_pid(&self, pid: u32) -> Option<Arc<RunningCommand>> {
        self.commands
            .read()
            .ok()
            .and_then(|m| m.values().find(|c| c.pid == pid).cloned())
    }

    /// All commands.
    pub fn commands(&self) -> Vec<Arc<RunningCommand>> {
        self.commands
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    pub(crate) fn insert_command(&self, cmd: Arc<RunningCommand>) {
        if let Ok(mut m) = self.commands.write() {
            m.insert(cmd.command_id.clone(), cmd);
        }
    }

    /// The API view.
    pub fn info(&self) -> SessionInfo {
        let enforcement = self
            .sandbox
            .read()
            .ok()
            .and_then(|g| g.as_ref().map(|s| s.info().enforcement.as_str().to_owned()));
        SessionInfo {
            id: self.id.clone(),
            provider: self.provider_name.clone(),
            sandbox_id: self.sandbox_id(),
            state: self.state().as_str().to_owned(),
            created_ms: self.created_ms,
            events: self.log.next_seq(),
            parent_session: self.log.header().parent_session.clone(),
            enforcement,
            metadata: self.params.metadata.clone(),
            paused: self.is_paused(),
            egress: self.egress(),
        }
    }
}

/// All sessions of the daemon.
#[derive(Debug)]
pub struct SessionManager {
    state_dir: PathBuf,
    providers: Arc<ProviderRegistry>,
    /// Live (active or detached) sessions.
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    /// Closed sessions: a summary each; the log is opened on demand.
    closed: RwLock<BTreeMap<String, ClosedSession>>,
    /// Sessions whose log could not be opened at start: their sandboxes are never
    /// treated as orphans (an unreadable record must not destroy what it may own).
    unreadable: RwLock<std::collections::BTreeSet<String>>,
    /// Opening a closed log takes its writer lock for a moment: one at a time, so two
    /// readers of the same closed session never meet as two writers.
    closed_opens: tokio::sync::Mutex<()>,
    shutdown: CancelToken,
    tasks: TaskTracker,
    metrics: Metrics,
    invariants: Invariants,
    daemon_id: String,
    deadlines: Deadlines,
    log_config: LogConfig,
    snapshots: Snapshots,
}

/// What is kept in memory of a closed session.
#[derive(Debug, Clone)]
struct ClosedSession {
    header: SessionHeader,
    events: u64,
    closed_ms: i64,
}

fn new_id() -> String {
    // Lowercase letters and digits only: the id is also a DNS label (`49983-<id>.<domain>`).
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("i{}", &u[..19])
}

impl SessionManager {
    /// Open the manager over `state_dir`; call [`SessionManager::recover`] next.
    pub async fn new(
        state_dir: PathBuf,
        providers: Arc<ProviderRegistry>,
        shutdown: CancelToken,
        tasks: TaskTracker,
        metrics: Metrics,
        invariants: Invariants,
        deadlines: Deadlines,
    ) -> Result<Self> {
        tokio::fs::create_dir_all(state_dir.join("sessions"))
            .await
            .map_err(|e| DaemonError::internal(format!("cannot create the state dir: {e}")))?;
        let id_path = state_dir.join("daemon-id");
        let daemon_id = match tokio::fs::read_to_string(&id_path).await {
            Ok(s) if !s.trim().is_empty() => s.trim().to_owned(),
            _ => {
                let id = uuid::Uuid::new_v4().simple().to_string();
                tokio::fs::write(&id_path, &id).await.map_err(|e| {
                    DaemonError::internal(format!("cannot write the daemon id: {e}"))
                })?;
                id
            }
        };
        let snapshots = Snapshots::open(state_dir.join("snapshots")).await?;
        Ok(Self {
            snapshots,
            state_dir,
            providers,
            sessions: RwLock::new(HashMap::new()),
            closed: RwLock::new(BTreeMap::new()),
            unreadable: RwLock::new(Default::default()),
            closed_opens: tokio::sync::Mutex::new(()),
            shutdown,
            tasks,
            metrics,
            invariants: invariants.clone(),
            daemon_id,
            deadlines,
            log_config: LogConfig {
                invariants: invariants.clone(),
                ..LogConfig::default()
            },
        })
    }

    /// After a restart, supervise again each command the log says was running: one its
    /// provider finds again (`attach` by command id) gets a pump from the journal's end
    /// under what is left of its deadline; one it cannot find (the provider lost it, or
    /// the sandbox is gone) is logged as ended with no status, so no command stays
    /// started forever in the log.
    async fn resume_commands(
        &self,
        session: &Arc<Session>,
        unfinished: BTreeMap<String, (ProcessSpec, Option<i64>, Option<u64>)>,
    ) {
        for (command_id, (spec, deadline_ms, idle_ms)) in unfinished {
            let found = match session.sandbox_even_paused() {
                Some(sb) => {
                    let ctx = CallCtx::new(format!("recover-{command_id}"))
                        .with_timeout(self.deadlines.sandbox_op, Clock::Total);
                    sb.process()
                        .attach(&ctx, ProcessSelector::CommandId(command_id.clone()))
                        .await
                        .map_err(|e| e.code().as_str())
                }
                None => Err("no sandbox"),
            };
            let resumed = match found {
                Ok(handle) => crate::exec::resume(session, handle, spec, deadline_ms, idle_ms)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.code().as_str()),
                Err(why) => Err(why),
            };
            match resumed {
                Ok(()) => {
                    tracing::info!(session.id = %session.id, command.id = %command_id, "Supervising a command again after a restart");
                }
                Err(why) => {
                    tracing::warn!(session.id = %session.id, command.id = %command_id, reason = why, "A command running before the restart was not found again; logging it as ended");
                    let (out, err) = match session.log.journal(&command_id).await {
                        Ok(j) => {
                            j.finish().await;
                            (
                                j.len(StreamKind::Stdout) + j.len(StreamKind::Pty),
                                j.len(StreamKind::Stderr),
                            )
                        }
                        Err(_) => (0, 0),
                    };
                    let ended = EventBody::ProcessExited {
                        command_id: command_id.clone(),
                        status: ExitStatus {
                            code: None,
                            signal: None,
                        },
                        stdout_bytes: out,
                        stderr_bytes: err,
                        clock: None,
                        limit: None,
                    };
                    if let Err(e) = session.log.append(ended).await {
                        tracing::error!(session.id = %session.id, command.id = %command_id, error = %e, "Could not log the end of a lost command");
                    }
                }
            }
        }
    }

    /// Keep at most `bytes` of each live session's newest events in memory (see
    /// `server.session_log_memory_bytes`).
    pub fn with_log_memory(mut self, bytes: u64) -> Self {
        self.log_config.held_bytes = bytes;
        self
    }

    /// The daemon's persistent id (stamped on every sandbox).
    pub fn daemon_id(&self) -> &str {
        &self.daemon_id
    }

    /// The providers.
    pub fn providers(&self) -> &ProviderRegistry {
        &self.providers
    }

    fn session_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("sessions").join(id)
    }

    /// Create a session and lease its sandbox.
    pub async fn create(&self, ctx: &CallCtx, req: NewSession) -> Result<Arc<Session>> {
        if self.shutdown.is_cancelled() {
            return Err(DaemonError::ShuttingDown);
        }
        // A snapshot is seen by its owner (the native API's admin sees all).
        let snapshot = match &req.snapshot {
            Some(r) => {
                let scope = match &req.owner {
                    Some(o) => Scope::Owner(Some(o)),
                    None => Scope::Any,
                };
                let rec = self
                    .snapshots
                    .find(r, scope)
                    .ok_or_else(|| DaemonError::SnapshotNotFound { id: r.clone() })?;
                if req.provider.as_ref().is_some_and(|p| *p != rec.provider) {
                    return Err(DaemonError::invalid(format!(
                        "snapshot {} is kept by the {:?} provider",
                        rec.id, rec.provider
                    )));
                }
                Some(rec)
            }
            None => None,
        };
        let provider_name = match (&snapshot, &req.provider) {
            (Some(rec), _) => rec.provider.clone(),
            (None, Some(p)) => p.clone(),
            (None, None) => self.providers.default_name().to_owned(),
        };
        let provider = self
            .providers
            .get(&provider_name)
            .ok_or_else(|| DaemonError::invalid(format!("unknown provider {provider_name:?}")))?;
        let params = SessionParams {
            provider: provider_name,
            template: req.template,
            env: req.env,
            network: req.network,
            metadata: req.metadata,
            owner: req.owner,
            expiry: req.expiry,
            limits: req.limits,
            ports: req.ports,
            snapshot: snapshot.as_ref().map(|r| r.id.clone()),
            lifecycle: req.lifecycle,
            egress: req.egress,
        };
        let id = new_id();
        // The header is the durable intent: a sandbox created for this id and not yet
        // recorded as leased is found by its stamp and destroyed after a crash.
        let header = SessionLog::new_header(&id, params);
        let created_ms = header.created_ms;
        let log =
            SessionLog::create(&self.session_dir(&id), header, self.log_config.clone()).await?;
        let session = self.build_session(id, provider, log, &LogFacts::default(), created_ms);
        let from = snapshot.map(|r| r.provider_snapshot);
        self.lease(ctx, &session, from.as_deref()).await?;
        self.insert(Arc::clone(&session))?;
        self.metrics.sessions_live(1);
        Ok(session)
    }

    /// [`SessionManager::create`] on a tracked task, under a context detached from the
    /// caller's cancellation (with its request id and trace): a create owns remote work,
    /// so it runs to completion and is recorded even when the caller leaves mid-flight.
    pub async fn create_owned(
        self: &Arc<Self>,
        ctx: &CallCtx,
        req: NewSession,
    ) -> Result<Arc<Session>> {
        let me = Arc::clone(self);
        let cctx = CallCtx::with_cancel(ctx.request_id.clone(), self.shutdown.child())
            .with_trace(ctx.trace.clone());
        self.tasks
            .spawn(async move { me.create(&cctx, req).await }.in_current_span())
            .await
            .map_err(|e| DaemonError::internal(format!("the create task failed: {e}")))?
    }

    /// A session over an open log; its parameters are the log header's, its expiry the
    /// header's or the latest `session/expiry`, counted from `last_activity_ms`.
    fn build_session(
        &self,
        id: String,
        provider: Arc<dyn Provider>,
        log: Arc<SessionLog>,
        facts: &LogFacts,
        last_activity_ms: i64,
    ) -> Arc<Session> {
        let params = log.header().params.clone();
        let journaled = facts.journaled;
        let expiry = facts.expiry.unwrap_or(params.expiry);
        let egress = facts
            .egress
            .clone()
            .unwrap_or_else(|| params.egress.clone());
        let s = Session {
            id,
            provider_kind: provider.kind().to_owned(),
            provider_name: params.provider.clone(),
            provider,
            sandbox: RwLock::new(None),
            sandbox_id: RwLock::new(None),
            detached_why: RwLock::new(Some("no sandbox leased yet".into())),
            created_ms: log.header().created_ms,
            log,
            commands: RwLock::new(HashMap::new()),
            owner: params.owner.clone(),
            params,
            deadlines: self.deadlines,
            cancel: self.shutdown.child(),
            tasks: self.tasks.clone(),
            metrics: self.metrics.clone(),
            last_activity_ms: AtomicI64::new(last_activity_ms),
            output_bytes: std::sync::atomic::AtomicU64::new(journaled),
            expires_ms: AtomicI64::new(0),
            idle_ttl_ms: AtomicI64::new(0),
            closed: AtomicBool::new(false),
            pause: RwLock::new(facts.paused),
            pause_lock: tokio::sync::Mutex::new(()),
            egress: RwLock::new(egress),
            batch_lock: tokio::sync::Mutex::new(()),
        };
        s.apply_expiry(expiry, last_activity_ms);
        Arc::new(s)
    }

    /// Create the session's sandbox (from the provider's snapshot `from` when given) and
    /// record it as leased; on failure the session is closed.
    async fn lease(&self, ctx: &CallCtx, session: &Arc<Session>, from: Option<&str>) -> Result<()> {
        let id = &session.id;
        let p = &session.params;
        let mut metadata = p.metadata.clone();
        metadata.insert(META_SESSION.into(), id.clone());
        metadata.insert(META_DAEMON.into(), self.daemon_id.clone());
        let spec = SandboxSpec {
            template: p.template.clone(),
            ttl: None,
            env: p.env.clone(),
            metadata,
            network: p.network,
            limits: p.limits,
            egress: session.egress(),
        };
        macro_rules! span {
            ($name:literal) => {
                tracing::info_span!(
                    $name,
                    session.id = %id,
                    provider.kind = %session.provider_kind,
                    sandbox.id = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                    error.code = tracing::field::Empty,
                )
            };
        }
        let (span, name) = match from {
            None => (
                span!("sandbox.create"),
                crate::telemetry::names::SANDBOX_CREATE,
            ),
            Some(_) => (
                span!("sandbox.restore"),
                crate::telemetry::names::SANDBOX_RESTORE,
            ),
        };
        let started = tokio::time::Instant::now();
        let cctx = ctx.with_timeout(self.deadlines.sandbox_create, Clock::Total);
        let created = match from {
            None => {
                session
                    .provider
                    .create(&cctx, spec)
                    .instrument(span.clone())
                    .await
            }
            Some(snap) => {
                session
                    .provider
                    .create_from_snapshot(&cctx, snap, spec)
                    .instrument(span.clone())
                    .await
            }
        };
        let outcome = created
            .as_ref()
            .map_or_else(|e| e.code().as_str(), |_| "ok");
        self.metrics
            .remote_op(name, &session.provider_kind, outcome, started.elapsed());
        span.record("outcome", outcome);
        match created {
            Ok(sandbox) => {
                let sandbox_id = sandbox.info().id;
                span.record("sandbox.id", sandbox_id.as_str());
                let leased = session
                    .log
                    .append(EventBody::SandboxLeased {
                        provider: session.provider_name.clone(),
                        sandbox_id: sandbox_id.clone(),
                    })
                    .await;
                if let Err(e) = leased {
                    // Not recorded: the sandbox would be an orphan. Destroy it now (the
                    // reconciler finds it by its stamp if this fails too).
                    self.destroy_sandbox(session, &sandbox_id).await;
                    session.log.close().await;
                    return Err(e.into());
                }
                set(&session.sandbox, Some(sandbox));
                set(&session.sandbox_id, Some(sandbox_id));
                set(&session.detached_why, None);
                self.metrics.sandboxes_live(1, &session.provider_kind);
                Ok(())
            }
            Err(e) => {
                span.record("error.code", e.code().as_str());
                crate::ops::count_provider_clock(&self.metrics, &e, &session.provider_kind);
                let _ = session
                    .log
                    .append(EventBody::SessionClosed {
                        reason: format!("sandbox create failed: {}", e.code()),
                    })
                    .await;
                session.log.close().await;
                self.remember_closed(session);
                Err(e.into())
            }
        }
    }

    /// Destroy a sandbox at the session's provider under the configured deadline, with the
    /// span and metric of every remote op. Errors are logged (the reconciler retries).
    async fn destroy_sandbox(&self, s: &Session, sid: &str) -> bool {
        let span = tracing::info_span!("sandbox.destroy", session.id = %s.id, sandbox.id = %sid, provider.kind = %s.provider_kind, outcome = tracing::field::Empty);
        let ctx = CallCtx::new(format!("close-{}", s.id))
            .with_timeout(self.deadlines.sandbox_op, Clock::Total);
        let started = tokio::time::Instant::now();
        let r = s.provider.destroy(&ctx, sid).instrument(span.clone()).await;
        let outcome = r.as_ref().map_or_else(|e| e.code().as_str(), |_| "ok");
        span.record("outcome", outcome);
        self.metrics.remote_op(
            "sandbox.destroy",
            &s.provider_kind,
            outcome,
            started.elapsed(),
        );
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(session.id = %s.id, sandbox.id = %sid, error = %e, "Destroying the sandbox failed; the reconciler will retry");
                false
            }
        }
    }

    fn insert(&self, s: Arc<Session>) -> Result<()> {
        let mut m = self
            .sessions
            .write()
            .map_err(|_| DaemonError::internal("sessions lock poisoned"))?;
        // Invariant: a sandbox belongs to exactly one live session.
        if let Some(sid) = s.sandbox_id() {
            let dup = m.values().any(|o| {
                o.state() == SessionState::Active && o.sandbox_id().as_deref() == Some(sid.as_str())
            });
            self.invariants
                .check("lease", "sandbox_owned_once", || {
                    if dup {
                        Err(format!(
                            "sandbox {sid} is already leased by another live session"
                        ))
                    } else {
                        Ok(())
                    }
                })
                .map_err(|v| DaemonError::Invariant {
                    module: v.module,
                    check: v.check,
                    message: v.message,
                })?;
        }
        m.insert(s.id.clone(), s);
        Ok(())
    }

    /// Move a closed session out of the live map into the summaries.
    fn remember_closed(&self, s: &Session) {
        if let Ok(mut m) = self.sessions.write() {
            m.remove(&s.id);
        }
        if let Ok(mut c) = self.closed.write() {
            c.insert(
                s.id.clone(),
                ClosedSession {
                    header: s.log.header().clone(),
                    events: s.log.next_seq(),
                    closed_ms: now_ms(),
                },
            );
        }
    }

    /// A live (active or detached) session by id, visible to `owner` (`None` sees only
    /// sessions without an owner, except for the native API which passes `Scope::Any`).
    pub fn get(&self, id: &str, scope: Scope<'_>) -> Result<Arc<Session>> {
        match self.get_live(id) {
            Some(s) if scope.sees(&s) => Ok(s),
            _ => Err(DaemonError::SessionNotFound { id: id.to_owned() }),
        }
    }

    /// A session by id, live or closed, visible in `scope`. A closed session's log is
    /// opened from disk for the caller and not kept.
    pub async fn lookup(&self, id: &str, scope: Scope<'_>) -> Result<Arc<Session>> {
        if let Some(s) = self.get_live(id) {
            return if scope.sees(&s) {
                Ok(s)
            } else {
                Err(DaemonError::SessionNotFound { id: id.to_owned() })
            };
        }
        let known = self
            .closed
            .read()
            .map(|c| c.get(id).map(|c| c.header.params.owner.clone()))
            .ok()
            .flatten();
        let Some(owner) = known else {
            return Err(DaemonError::SessionNotFound { id: id.to_owned() });
        };
        if !scope.sees_owner(owner.as_deref()) {
            return Err(DaemonError::SessionNotFound { id: id.to_owned() });
        }
        self.open_closed(id).await
    }

    /// A live (active or detached) session, without a scope check.
    pub fn get_live(&self, id: &str) -> Option<Arc<Session>> {
        self.sessions.read().ok().and_then(|m| m.get(id).cloned())
    }

    async fn open_closed(&self, id: &str) -> Result<Arc<Session>> {
        let (log, facts) = {
            let _one = self.closed_opens.lock().await;
            let (log, _, facts) =
                LogFacts::open(&self.session_dir(id), self.log_config.clone()).await?;
            log.close().await;
            (log, facts)
        };
        let provider_name = log.header().params.provider.clone();
        let provider = self.providers.get(&provider_name).ok_or_else(|| {
            DaemonError::internal(format!(
                "session {id}: provider {provider_name:?} is not configured"
            ))
        })?;
        let last = last_time(&log);
        let s = self.build_session(id.to_owned(), provider, log, &facts, last);
        s.closed.store(true, Ordering::Release);
        set(&s.detached_why, Some("the session is closed".into()));
        Ok(s)
    }

    /// Live sessions visible in `scope`, oldest first.
    pub fn list(&self, scope: Scope<'_>) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = self
            .sessions
            .read()
            .map(|m| m.values().filter(|s| scope.sees(s)).cloned().collect())
            .unwrap_or_default();
        v.sort_by(|a: &Arc<Session>, b| {
            a.created_ms
                .cmp(&b.created_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        v
    }

    /// Every session visible in `scope`, live and closed, oldest first, as the API shows it.
    pub fn infos(&self, scope: Scope<'_>) -> Vec<SessionInfo> {
        let mut v: Vec<SessionInfo> = self.list(scope).iter().map(|s| s.info()).collect();
        if let Ok(c) = self.closed.read() {
            v.extend(
                c.iter()
                    .filter(|(_, c)| scope.sees_owner(c.header.params.owner.as_deref()))
                    .map(|(id, c)| SessionInfo {
                        id: id.clone(),
                        provider: c.header.params.provider.clone(),
                        sandbox_id: None,
                        state: SessionState::Closed.as_str().to_owned(),
                        created_ms: c.header.created_ms,
                        events: c.events,
                        parent_session: c.header.parent_session.clone(),
                        enforcement: None,
                        metadata: c.header.params.metadata.clone(),
                        paused: false,
                        egress: Default::default(),
                    }),
            );
        }
        v.sort_by(|a, b| {
            a.created_ms
                .cmp(&b.created_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        v
    }

    /// Close a session: terminate its commands, destroy its sandbox, log why.
    pub async fn close(&self, id: &str, scope: Scope<'_>, reason: &str) -> Result<()> {
        let Some(s) = self.get_live(id).filter(|s| scope.sees(s)) else {
            // Closing a closed session is a no-op; an unknown one is not found.
            self.lookup(id, scope).await?;
            return Ok(());
        };
        self.close_session(&s, reason, true).await
    }

    async fn close_session(&self, s: &Arc<Session>, reason: &str, destroy: bool) -> Result<()> {
        if s.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        s.cancel.cancel(CancelReason::SessionClosed);
        // Wait (bounded) for the pumps to record their commands' ends.
        for cmd in s.commands() {
            let _ = tokio::time::timeout(self.deadlines.command_drain, cmd.wait()).await;
        }
        let sandbox = s.sandbox.write().ok().and_then(|mut g| g.take());
        let live = sandbox.is_some();
        // A stopped sandbox recovered after a restart has no handle, only its id.
        let sid = match sandbox {
            Some(sb) => Some(sb.info().id),
            None if s.is_stopped() => s.sandbox_id(),
            None => None,
        };
        if let (Some(sid), true) = (sid, destroy) {
            let destroyed = self.destroy_sandbox(s, &sid).await;
            if live {
                self.metrics.sandboxes_live(-1, &s.provider_kind);
            }
            if destroyed {
                let _ = s
                    .log
                    .append(EventBody::SandboxReleased {
                        sandbox_id: sid,
                        reason: reason.to_owned(),
                    })
                    .await;
            }
        }
        let _ = s
            .log
            .append(EventBody::SessionClosed {
                reason: reason.to_owned(),
            })
            .await;
        s.log.close().await;
        self.remember_closed(s);
        self.metrics.sessions_live(-1);
        Ok(())
    }

    /// Fork a session at a boundary: the new session gets a copy of the log prefix and a
    /// sandbox from the same provider whose file system is a copy of the parent's (a
    /// snapshot taken for the fork and deleted after; a fresh sandbox where the parent
    /// has none or its provider takes no snapshots), with the parent's parameters as they
    /// stand now (network, template, environment, metadata, owner and expiry included).
    /// `CONFLICT` while the parent is paused.
    pub async fn fork(
        self: &Arc<Self>,
        ctx: &CallCtx,
        id: &str,
        at_seq: Option<u64>,
        scope: Scope<'_>,
    ) -> Result<Arc<Session>> {
        if self.shutdown.is_cancelled() {
            return Err(DaemonError::ShuttingDown);
        }
        let parent = self.lookup(id, scope).await?;
        let from = self.fork_source(ctx, &parent, false).await?;
        let made = self
            .fork_one(ctx, &parent, at_seq, parent.expiry(), from.as_deref())
            .await;
        if let Some(snap) = from {
            self.drop_provider_snapshot(&parent.provider_name, &snap)
                .await;
        }
        made
    }

    /// One fork of `parent` (see [`SessionManager::fork`]) expiring by `expiry`, its
    /// sandbox from the provider's snapshot `from` when given.
    async fn fork_one(
        &self,
        ctx: &CallCtx,
        parent: &Session,
        at_seq: Option<u64>,
        expiry: Expiry,
        from: Option<&str>,
    ) -> Result<Arc<Session>> {
        let new = new_id();
        // The fork's sandbox is the parent's as it is now: so are its egress rules.
        let egress = parent.egress();
        let params = SessionParams {
            expiry,
            snapshot: None,
            egress: egress.clone(),
            ..parent.params.clone()
        };
        let log = parent
            .log
            .fork(&self.session_dir(&new), &new, at_seq, params)
            .await?;
        let facts = LogFacts::of(&log).await?;
        let session = self.build_session(new, Arc::clone(&parent.provider), log, &facts, now_ms());
        if session.egress() != egress {
            // The copied prefix ends with older rules than the parent's now.
            session.put_egress(egress.clone());
            session
                .log
                .append(EventBody::SandboxNetwork {
                    sandbox_id: session.id.clone(),
                    egress,
                })
                .await?;
        }
        self.lease(ctx, &session, from).await?;
        self.insert(Arc::clone(&session))?;
        self.metrics.sessions_live(1);
        Ok(session)
    }

    /// Re-open every session on disk after a start: repair the live logs, take each
    /// session's parameters, expiry and sandbox id from its own log, reconnect the
    /// sandboxes where the provider can, and destroy this daemon's orphaned sandboxes.
    /// Closed sessions are only indexed (their header and length), and those older than
    /// the retention are removed.
    pub async fn recover(&self, retention: Option<Duration>) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let sessions_dir = self.state_dir.join("sessions");
        let ids = crate::session_log::list_sessions(&sessions_dir).await?;
        for id in ids {
            let dir = self.session_dir(&id);
            match crate::session_log::closed_summary(&dir).await {
                Ok(Some(c)) => {
                    if retention.is_some_and(|r| expired_for(c.closed_ms, r)) {
                        remove_session_dir(&dir, &id).await;
                        report.removed.push(id);
                    } else if let Ok(mut m) = self.closed.write() {
                        m.insert(
                            id,
                            ClosedSession {
                                header: c.header,
                                events: c.events,
                                closed_ms: c.closed_ms,
                            },
                        );
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(session.id = %id, error = %e, "Cannot read a session log; leaving it and its sandbox alone");
                    self.mark_unreadable(&id);
                    report.failed.push(id);
                    continue;
                }
            }
            let (log, repair, facts) = match LogFacts::open(&dir, self.log_config.clone()).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::error!(session.id = %id, error = %e, "Cannot open a session log; leaving it and its sandbox alone");
                    self.mark_unreadable(&id);
                    report.failed.push(id);
                    continue;
                }
            };
            if repair.changed() {
                report.repaired.push(id.clone());
            }
            let provider_name = log.header().params.provider.clone();
            let Some(provider) = self.providers.get(&provider_name) else {
                tracing::error!(session.id = %id, provider = %provider_name, "A session's provider is not configured; leaving it alone");
                log.close().await;
                self.mark_unreadable(&id);
                report.failed.push(id);
                continue;
            };
            let session = self.build_session(
                id.clone(),
                provider,
                Arc::clone(&log),
                &facts,
                last_time(&log),
            );
            match facts.leased.clone() {
                // Stopped: nothing runs to connect to; its resume boots it.
                Some(sid) if facts.paused == Some(PauseKind::Filesystem) => {
                    set(&session.sandbox_id, Some(sid));
                    set(&session.detached_why, None);
                    report.reconnected.push(id.clone());
                }
                Some(sid) => {
                    let ctx = CallCtx::new(format!("recover-{id}"))
                        .with_timeout(self.deadlines.sandbox_op, Clock::Total);
                    let mut connected = session.provider.connect(&ctx, &sid).await;
                    if matches!(connected, Err(ProviderError::Stopped { .. }))
                        && facts.paused.is_none()
                    {
                        // Stopped by a pause that a crash kept out of the log: the log
                        // says it runs, so it runs.
                        tracing::warn!(session.id = %id, sandbox.id = %sid, "A sandbox stopped by an unlogged pause; booting it again");
                        connected = session.provider.resume(&ctx, &sid).await;
                    }
                    match connected {
                        Ok(sb) => {
                            set(&session.sandbox, Some(sb));
                            set(&session.sandbox_id, Some(sid));
                            set(&session.detached_why, None);
                            self.metrics.sandboxes_live(1, &session.provider_kind);
                            report.reconnected.push(id.clone());
                        }
                        Err(e) => {
                            set(&session.sandbox_id, Some(sid));
                            set(
                                &session.detached_why,
                                Some(format!(
                                    "the sandbox could not be reconnected after a restart ({})",
                                    e.code()
                                )),
                            );
                            report.detached.push(id.clone());
                        }
                    }
                }
                None => {
                    set(&session.detached_why, Some("no sandbox was leased".into()));
                    report.detached.push(id.clone());
                }
            }
            self.resume_commands(&session, facts.unfinished).await;
            self.insert(session)?;
            self.metrics.sessions_live(1);
        }
        report.orphans_destroyed = self.reconcile().await;
        report.snapshots_deleted = self.sweep_snapshots().await;
        Ok(report)
    }

    fn mark_unreadable(&self, id: &str) {
        if let Ok(mut u) = self.unreadable.write() {
            u.insert(id.to_owned());
        }
    }

    /// Remove closed sessions' logs older than `retention`. Returns their ids.
    pub async fn sweep_retention(&self, retention: Duration) -> Vec<String> {
        let old: Vec<String> = self
            .closed
            .read()
            .map(|c| {
                c.iter()
                    .filter(|(_, c)| expired_for(c.closed_ms, retention))
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default();
        for id in &old {
            if let Ok(mut c) = self.closed.write() {
                c.remove(id);
            }
            remove_session_dir(&self.session_dir(id), id).await;
        }
        old
    }

    /// Destroy sandboxes stamped with this daemon's id that no live session owns. A
    /// sandbox whose session log could not be read is left alone.
    pub async fn reconcile(&self) -> Vec<String> {
        let mut destroyed = Vec::new();
        for (name, provider) in self.providers.iter() {
            let ctx =
                CallCtx::new("reconcile").with_timeout(self.deadlines.sandbox_op, Clock::Total);
            let Ok(list) = provider.list(&ctx).await else {
                tracing::warn!(provider = %name, "Reconcile: listing the provider's sandboxes failed");
                continue;
            };
            for info in list {
                if info.metadata.get(META_DAEMON).map(String::as_str)
                    != Some(self.daemon_id.as_str())
                {
                    continue;
                }
                let owner = info.metadata.get(META_SESSION).cloned().unwrap_or_default();
                let unreadable = self
                    .unreadable
                    .read()
                    .map(|u| u.contains(&owner))
                    .unwrap_or(true);
                if unreadable {
                    continue;
                }
                let owned = self.get_live(&owner).is_some_and(|s| {
                    s.state() == SessionState::Active
                        && s.sandbox_id().as_deref() == Some(info.id.as_str())
                });
                if owned {
                    continue;
                }
                let ctx =
                    CallCtx::new("reconcile").with_timeout(self.deadlines.sandbox_op, Clock::Total);
                match provider.destroy(&ctx, &info.id).await {
                    Ok(()) => {
                        tracing::info!(provider = %name, sandbox.id = %info.id, session.id = %owner, "Destroyed an orphaned sandbox");
                        destroyed.push(info.id);
                    }
                    Err(e) => {
                        tracing::warn!(sandbox.id = %info.id, error = %e, "Could not destroy an orphaned sandbox")
                    }
                }
            }
        }
        destroyed
    }

    /// Renew the sandbox of every live session at its provider (for providers with a TTL
    /// of their own): the session's own activity keeps it alive (agent think-time counts,
    /// since the session's idle expiry is what ends it), and a daemon that stops renewing
    /// leaves its sandboxes to die within `ttl`. Returns how many renewals failed.
    pub async fn renew_all(&self, ttl: Duration) -> usize {
        let mut failed = 0;
        for s in self.list(Scope::Any) {
            if s.state() != SessionState::Active || !s.provider.capabilities().renew {
                continue;
            }
            let Some(sid) = s.sandbox_id() else { continue };
            let ctx = CallCtx::new(format!("renew-{}", s.id))
                .with_timeout(self.deadlines.sandbox_op, Clock::Total);
            let span = tracing::info_span!("sandbox.renew", session.id = %s.id, sandbox.id = %sid, provider.kind = %s.provider_kind, outcome = tracing::field::Empty);
            let started = tokio::time::Instant::now();
            let r = s
                .provider
                .renew(&ctx, &sid, ttl)
                .instrument(span.clone())
                .await;
            let outcome = r.as_ref().map_or_else(|e| e.code().as_str(), |_| "ok");
            span.record("outcome", outcome);
            self.metrics.remote_op(
                "sandbox.renew",
                &s.provider_kind,
                outcome,
                started.elapsed(),
            );
            if let Err(e) = r {
                failed += 1;
                tracing::warn!(session.id = %s.id, sandbox.id = %sid, code = %e.code(), error = %e, "Renewing a sandbox failed");
            }
        }
        failed
    }

    /// End every expired session: pause its sandbox where its lifecycle says so (a
    /// paused sandbox does not expire), close it otherwise (also when the pause fails).
    /// Returns the ids of those closed.
    pub async fn expire(&self) -> Vec<String> {
        let now = now_ms();
        let expired: Vec<_> = self
            .list(Scope::Any)
            .into_iter()
            .filter(|s| {
                s.state() != SessionState::Closed
                    && !s.is_paused()
                    && s.expires_ms() > 0
                    && s.expires_ms() <= now
            })
            .collect();
        let mut ids = Vec::new();
        for s in expired {
            if s.params.lifecycle.pause_on_expiry && s.state() == SessionState::Active {
                let ctx = CallCtx::new(format!("expire-{}", s.id));
                match s.pause(&ctx, s.params.lifecycle.pause_kind).await {
                    Ok(()) | Err(DaemonError::Conflict { .. }) => {
                        tracing::info!(session.id = %s.id, "Paused at its expiry");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(session.id = %s.id, code = %e.code(), error = %e, "Could not pause an expired session's sandbox; closing it");
                    }
                }
            }
            if self.close_session(&s, "expired", true).await.is_ok() {
                ids.push(s.id.clone());
            }
        }
        ids
    }

    /// At shutdown: close sessions (destroying sandboxes when `release`), or just stop
    /// their commands and keep the sandboxes for the next start.
    pub async fn shutdown(&self, release: bool) {
        for s in self.list(Scope::Any) {
            if s.state() == SessionState::Closed {
                continue;
            }
            if release {
                let _ = self.close_session(&s, "shutdown", true).await;
            } else {
                s.cancel.cancel(CancelReason::Shutdown);
                for cmd in s.commands() {
                    let _ = tokio::time::timeout(self.deadlines.command_drain, cmd.wait()).await;
                }
                s.log.close_for_shutdown().await;
            }
        }
    }
}

/// What a session is rebuilt from, read from its log in one pass (events stream from the
/// file; the log is never all in memory).
#[derive(Debug, Default)]
struct LogFacts {
    /// The sandbox leased now: the last `sandbox/leased` not followed by a
    /// `sandbox/released`.
    leased: Option<String>,
    /// The latest `session/expiry`.
    expiry: Option<Expiry>,
    /// The latest `sandbox/network`.
    egress: Option<tether_protocol::network::Egress>,
    /// What the last pause kept, when it was not followed by a resume or a new lease.
    paused: Option<PauseKind>,
    /// Output bytes journaled by finished commands.
    journaled: u64,
    /// Commands started and never logged as ended: spec, deadline and idle limit.
    unfinished: BTreeMap<String, (ProcessSpec, Option<i64>, Option<u64>)>,
}

impl LogFacts {
    /// The facts of a log already open (a fork's), read back from it.
    async fn of(log: &SessionLog) -> Result<Self> {
        let mut facts = Self::default();
        let mut events = log.replay(None);
        while let Some(e) = futures_util::StreamExt::next(&mut events).await {
            facts.see(&e?.body);
        }
        Ok(facts)
    }

    /// Open a session's log and take its facts in the same pass.
    async fn open(dir: &Path, cfg: LogConfig) -> Result<(Arc<SessionLog>, RepairReport, Self)> {
        let mut facts = Self::default();
        let (log, repair) = SessionLog::open_seeing(dir, cfg, |e| facts.see(&e.body)).await?;
        Ok((log, repair, facts))
    }

    fn see(&mut self, body: &EventBody) {
        match body {
            EventBody::SandboxLeased { sandbox_id, .. } => {
                self.leased = Some(sandbox_id.clone());
                self.paused = None;
            }
            EventBody::SandboxReleased { .. } => self.leased = None,
            EventBody::ExpirySet { expiry } => self.expiry = Some(*expiry),
            EventBody::SandboxNetwork { egress, .. } => self.egress = Some(egress.clone()),
            EventBody::SandboxPaused { kind, .. } => self.paused = Some(*kind),
            EventBody::SandboxResumed { .. } => self.paused = None,
            EventBody::ProcessStarted {
                command_id,
                spec,
                deadline_ms,
                output_idle_ms,
                ..
            } => {
                self.unfinished.insert(
                    command_id.clone(),
                    (spec.clone(), *deadline_ms, *output_idle_ms),
                );
            }
            EventBody::ProcessExited {
                command_id,
                stdout_bytes,
                stderr_bytes,
                ..
            } => {
                self.unfinished.remove(command_id);
                self.journaled = self
                    .journaled
                    .saturating_add(stdout_bytes.saturating_add(*stderr_bytes));
            }
            _ => {}
        }
    }
}

/// The time of a log's last event (its creation time when empty): the last activity.
fn last_time(log: &SessionLog) -> i64 {
    log.last_event_time().unwrap_or(log.header().created_ms)
}

fn expired_for(closed_ms: i64, retention: Duration) -> bool {
    let age = now_ms().saturating_sub(closed_ms);
    u128::try_from(age).unwrap_or(0) >= retention.as_millis()
}

async fn remove_session_dir(dir: &std::path::Path, id: &str) {
    match tokio::fs::remove_dir_all(dir).await {
        Ok(()) => {
            tracing::info!(session.id = %id, "Removed a closed session's log past its retention")
        }
        Err(e) => {
            tracing::warn!(session.id = %id, error = %e, "Could not remove a closed session's log")
        }
    }
}

/// Who is asking: any session (native API, admin) or a tenant's own.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    /// Every session.
    Any,
    /// Sessions of this owner only.
    Owner(Option<&'a str>),
}

impl Scope<'_> {
    fn sees(&self, s: &Session) -> bool {
        self.sees_owner(s.owner.as_deref())
    }

    fn sees_owner(&self, owner: Option<&str>) -> bool {
        match self {
            Scope::Any => true,
            Scope::Owner(o) => owner == *o,
        }
    }
}

/// What [`SessionManager::recover`] did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    /// Sessions whose log needed repair.
    pub repaired: Vec<String>,
    /// Sessions reconnected to their sandbox.
    pub reconnected: Vec<String>,
    /// Sessions left without a sandbox.
    pub detached: Vec<String>,
    /// Sessions whose log could not be opened.
    pub failed: Vec<String>,
    /// Orphaned sandboxes destroyed.
    pub orphans_destroyed: Vec<String>,
    /// Providers' snapshots no record named, deleted (`provider/snapshot`).
    pub snapshots_deleted: Vec<String>,
    /// Closed sessions removed past their retention.
    pub removed: Vec<String>,
}

fn set<T>(lock: &RwLock<T>, v: T) {
    if let Ok(mut g) = lock.write() {
        *g = v;
    }
}
