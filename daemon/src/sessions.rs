//! Sessions: each one a session log plus the sandbox leased for it.
//!
//! The [`SessionManager`] creates sessions (lease intent, provider create, `sandbox/leased`),
//! finds them, closes them (commands terminated, sandbox destroyed, `sandbox/released`),
//! forks them, expires them (TTL from activity, or an explicit E2B timeout), and on start-up
//! re-opens every session on disk (crash repair), reconnects their sandboxes where the
//! provider can, and reconciles the lease ledger with each provider.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tether_protocol::api::SessionInfo;
use tether_protocol::events::{EventBody, SessionHeader};
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, Provider, Sandbox, SandboxSpec};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::error::{DaemonError, Result};
use crate::exec::RunningCommand;
use crate::invariants::Invariants;
use crate::leases::{LeaseLedger, LeaseRecord, META_DAEMON, META_SESSION, now_ms};
use crate::providers::ProviderRegistry;
use crate::session::{LogConfig, SessionLog};
use crate::telemetry::Metrics;

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
}

/// When a session expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Expiry {
    /// Never by itself.
    #[default]
    Never,
    /// This long after the last activity (renewed by every call).
    Idle(Duration),
    /// At a fixed time, ms since the epoch (moved only explicitly: E2B `set_timeout`).
    At(i64),
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
    /// The owning tenant.
    pub owner: Option<String>,
    /// Cancelled when the session closes (or the daemon shuts down).
    pub cancel: CancelToken,
    tasks: TaskTracker,
    metrics: Metrics,
    last_activity_ms: AtomicI64,
    expires_ms: AtomicI64,
    idle_ttl_ms: AtomicI64,
    closed: AtomicBool,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Template.
    pub template: Option<String>,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// One tool-call batch at a time (turns are sequential).
    pub batch_lock: tokio::sync::Mutex<()>,
}

impl Session {
    /// The sandbox, or `SANDBOX_NOT_FOUND` when detached or closed.
    pub fn sandbox(&self) -> Result<Arc<dyn Sandbox>> {
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

    /// The sandbox id, if one was leased.
    pub fn sandbox_id(&self) -> Option<String> {
        self.sandbox_id.read().ok().and_then(|g| g.clone())
    }

    /// The state.
    pub fn state(&self) -> SessionState {
        if self.closed.load(Ordering::Acquire) {
            SessionState::Closed
        } else if self.sandbox.read().map(|g| g.is_some()).unwrap_or(false) {
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

    /// Set a fixed expiry (E2B `set_timeout`): `at_ms` since the epoch.
    pub fn set_expiry(&self, at_ms: i64) {
        self.idle_ttl_ms.store(0, Ordering::Relaxed);
        self.expires_ms.store(at_ms, Ordering::Relaxed);
    }

    /// Expiry time, ms since the epoch (0 = none).
    pub fn expires_ms(&self) -> i64 {
        self.expires_ms.load(Ordering::Relaxed)
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
            .sandbox()
            .ok()
            .map(|s| s.info().enforcement.as_str().to_owned());
        SessionInfo {
            id: self.id.clone(),
            provider: self.provider_name.clone(),
            sandbox_id: self.sandbox_id(),
            state: self.state().as_str().to_owned(),
            created_ms: self.created_ms,
            events: self.log.next_seq(),
            parent_session: self.log.header().parent_session.clone(),
            enforcement,
            metadata: self.metadata.clone(),
        }
    }
}

/// All sessions of the daemon.
#[derive(Debug)]
pub struct SessionManager {
    state_dir: PathBuf,
    providers: Arc<ProviderRegistry>,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    ledger: LeaseLedger,
    shutdown: CancelToken,
    tasks: TaskTracker,
    metrics: Metrics,
    invariants: Invariants,
    daemon_id: String,
    create_timeout: Duration,
    log_config: LogConfig,
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
        create_timeout: Duration,
    ) -> Result<Self> {
        tokio::fs::create_dir_all(state_dir.join("sessions"))
            .await
            .map_err(|e| DaemonError::internal(format!("cannot create the state dir: {e}")))?;
        let ledger = LeaseLedger::open(&state_dir)
            .await
            .map_err(|e| DaemonError::internal(format!("cannot open the lease ledger: {e}")))?;
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
        Ok(Self {
            state_dir,
            providers,
            sessions: RwLock::new(HashMap::new()),
            ledger,
            shutdown,
            tasks,
            metrics,
            invariants: invariants.clone(),
            daemon_id,
            create_timeout,
            log_config: LogConfig {
                invariants: invariants.clone(),
                ..LogConfig::default()
            },
        })
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
        let provider_name = req
            .provider
            .clone()
            .unwrap_or_else(|| self.providers.default_name().to_owned());
        let provider = self
            .providers
            .get(&provider_name)
            .ok_or_else(|| DaemonError::invalid(format!("unknown provider {provider_name:?}")))?;
        let id = new_id();
        let created_ms = now_ms();
        let header = SessionHeader {
            kind: "session".into(),
            version: tether_protocol::SESSION_LOG_VERSION,
            id: id.clone(),
            created_ms,
            parent_session: None,
            seed_length: None,
            meta: serde_json::json!({
                "provider": provider_name,
                "template": req.template,
                "metadata": req.metadata,
                "owner": req.owner,
                "network": req.network,
            }),
        };
        let log =
            SessionLog::create(&self.session_dir(&id), header, self.log_config.clone()).await?;
        let session = self.build_session(
            id.clone(),
            provider_name.clone(),
            Arc::clone(&provider),
            log,
            &req,
            created_ms,
        );
        self.lease(ctx, &session, &req).await?;
        self.insert(Arc::clone(&session))?;
        self.metrics.sessions_live(1);
        Ok(session)
    }

    fn build_session(
        &self,
        id: String,
        provider_name: String,
        provider: Arc<dyn Provider>,
        log: Arc<SessionLog>,
        req: &NewSession,
        created_ms: i64,
    ) -> Arc<Session> {
        let s = Session {
            id,
            provider_kind: provider.kind().to_owned(),
            provider_name,
            provider,
            sandbox: RwLock::new(None),
            sandbox_id: RwLock::new(None),
            detached_why: RwLock::new(Some("no sandbox leased yet".into())),
            log,
            commands: RwLock::new(HashMap::new()),
            owner: req.owner.clone(),
            cancel: self.shutdown.child(),
            tasks: self.tasks.clone(),
            metrics: self.metrics.clone(),
            last_activity_ms: AtomicI64::new(created_ms),
            expires_ms: AtomicI64::new(0),
            idle_ttl_ms: AtomicI64::new(0),
            closed: AtomicBool::new(false),
            created_ms,
            template: req.template.clone(),
            metadata: req.metadata.clone(),
            env: req.env.clone(),
            batch_lock: tokio::sync::Mutex::new(()),
        };
        match req.expiry {
            Expiry::Never => {}
            Expiry::Idle(d) => {
                s.idle_ttl_ms.store(d.as_millis() as i64, Ordering::Relaxed);
                s.touch();
            }
            Expiry::At(t) => s.set_expiry(t),
        }
        Arc::new(s)
    }

    async fn lease(&self, ctx: &CallCtx, session: &Arc<Session>, req: &NewSession) -> Result<()> {
        let id = &session.id;
        self.ledger
            .record(&LeaseRecord::Intent {
                session: id.clone(),
                provider: session.provider_name.clone(),
                time: now_ms(),
            })
            .await
            .map_err(|e| DaemonError::internal(format!("lease ledger: {e}")))?;
        let mut metadata = req.metadata.clone();
        metadata.insert(META_SESSION.into(), id.clone());
        metadata.insert(META_DAEMON.into(), self.daemon_id.clone());
        let spec = SandboxSpec {
            template: req.template.clone(),
            ttl: None,
            env: req.env.clone(),
            metadata,
            network: req.network,
            limits: Default::default(),
        };
        let span = tracing::info_span!(
            "sandbox.create",
            session.id = %id,
            provider.kind = %session.provider_kind,
            sandbox.id = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error.code = tracing::field::Empty,
        );
        let started = tokio::time::Instant::now();
        let cctx = ctx.with_timeout(self.create_timeout, "DEADLINE_EXCEEDED");
        let created = session
            .provider
            .create(&cctx, spec)
            .instrument(span.clone())
            .await;
        let outcome = created
            .as_ref()
            .map_or_else(|e| e.code().as_str(), |_| "ok");
        self.metrics.remote_op(
            "sandbox.create",
            &session.provider_kind,
            outcome,
            started.elapsed(),
        );
        span.record("outcome", outcome);
        match created {
            Ok(sandbox) => {
                let sandbox_id = sandbox.info().id;
                span.record("sandbox.id", sandbox_id.as_str());
                self.ledger
                    .record(&LeaseRecord::Created {
                        session: id.clone(),
                        sandbox_id: sandbox_id.clone(),
                        time: now_ms(),
                    })
                    .await
                    .map_err(|e| DaemonError::internal(format!("lease ledger: {e}")))?;
                session
                    .log
                    .append(EventBody::SandboxLeased {
                        provider: session.provider_name.clone(),
                        sandbox_id: sandbox_id.clone(),
                    })
                    .await?;
                set(&session.sandbox, Some(sandbox));
                set(&session.sandbox_id, Some(sandbox_id));
                set(&session.detached_why, None);
                self.metrics.sandboxes_live(1, &session.provider_kind);
                Ok(())
            }
            Err(e) => {
                span.record("error.code", e.code().as_str());
                let _ = self
                    .ledger
                    .record(&LeaseRecord::Released {
                        session: id.clone(),
                        reason: format!("create failed: {}", e.code()),
                        time: now_ms(),
                    })
                    .await;
                let _ = session
                    .log
                    .append(EventBody::SessionClosed {
                        reason: format!("sandbox create failed: {}", e.code()),
                    })
                    .await;
                session.log.close().await;
                Err(e.into())
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

    /// A session by id, visible to `owner` (`None` sees only sessions without an owner,
    /// except for the native API which passes `Scope::Any`).
    pub fn get(&self, id: &str, scope: Scope<'_>) -> Result<Arc<Session>> {
        let m = self
            .sessions
            .read()
            .map_err(|_| DaemonError::internal("sessions lock poisoned"))?;
        match m.get(id) {
            Some(s) if scope.sees(s) => Ok(Arc::clone(s)),
            _ => Err(DaemonError::SessionNotFound { id: id.to_owned() }),
        }
    }

    /// Sessions visible in `scope`, oldest first.
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

    /// Close a session: terminate its commands, destroy its sandbox, log why.
    pub async fn close(&self, id: &str, scope: Scope<'_>, reason: &str) -> Result<()> {
        let s = self.get(id, scope)?;
        self.close_session(&s, reason, true).await
    }

    async fn close_session(&self, s: &Arc<Session>, reason: &str, destroy: bool) -> Result<()> {
        if s.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        s.cancel.cancel(CancelReason::SessionClosed);
        // Wait (bounded) for the pumps to record their commands' ends.
        for cmd in s.commands() {
            let _ = tokio::time::timeout(Duration::from_secs(15), cmd.wait()).await;
        }
        let sandbox = s.sandbox.write().ok().and_then(|mut g| g.take());
        if let (Some(sandbox), true) = (sandbox, destroy) {
            let sid = sandbox.info().id;
            let span = tracing::info_span!("sandbox.destroy", session.id = %s.id, sandbox.id = %sid, provider.kind = %s.provider_kind, outcome = tracing::field::Empty);
            let ctx = CallCtx::new(format!("close-{}", s.id))
                .with_timeout(Duration::from_secs(30), "DEADLINE_EXCEEDED");
            let started = tokio::time::Instant::now();
            let r = s
                .provider
                .destroy(&ctx, &sid)
                .instrument(span.clone())
                .await;
            let outcome = r.as_ref().map_or_else(|e| e.code().as_str(), |_| "ok");
            span.record("outcome", outcome);
            self.metrics.remote_op(
                "sandbox.destroy",
                &s.provider_kind,
                outcome,
                started.elapsed(),
            );
            self.metrics.sandboxes_live(-1, &s.provider_kind);
            if let Err(e) = r {
                tracing::warn!(session.id = %s.id, error = %e, "Destroying the sandbox failed; the reconciler will retry");
            } else {
                let _ = self
                    .ledger
                    .record(&LeaseRecord::Released {
                        session: s.id.clone(),
                        reason: reason.to_owned(),
                        time: now_ms(),
                    })
                    .await;
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
        self.metrics.sessions_live(-1);
        Ok(())
    }

    /// Fork a session at a boundary: the new session gets a copy of the log prefix and a
    /// fresh sandbox from the same provider.
    pub async fn fork(
        &self,
        ctx: &CallCtx,
        id: &str,
        at_seq: Option<u64>,
        scope: Scope<'_>,
    ) -> Result<Arc<Session>> {
        let parent = self.get(id, scope)?;
        let new = new_id();
        let log = parent
            .log
            .fork(&self.session_dir(&new), &new, at_seq)
            .await?;
        let req = NewSession {
            provider: Some(parent.provider_name.clone()),
            template: parent.template.clone(),
            env: parent.env.clone(),
            metadata: parent.metadata.clone(),
            network: false,
            owner: parent.owner.clone(),
            expiry: Expiry::Never,
        };
        let provider = Arc::clone(&parent.provider);
        let session = self.build_session(
            new,
            parent.provider_name.clone(),
            provider,
            log,
            &req,
            now_ms(),
        );
        self.lease(ctx, &session, &req).await?;
        self.insert(Arc::clone(&session))?;
        self.metrics.sessions_live(1);
        Ok(session)
    }

    /// Re-open every session on disk after a start: repair the logs, reconnect the
    /// sandboxes where the provider can, and destroy this daemon's orphaned sandboxes.
    pub async fn recover(&self) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let ids = crate::session::list_sessions(&self.state_dir.join("sessions")).await?;
        let leases = self.ledger.load().await.unwrap_or_default();
        for id in ids {
            let dir = self.session_dir(&id);
            let (log, repair) = match SessionLog::open(&dir, self.log_config.clone()).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::error!(session.id = %id, error = %e, "Cannot open a session log; leaving it alone");
                    report.failed.push(id);
                    continue;
                }
            };
            if repair.changed() {
                report.repaired.push(id.clone());
            }
            let meta = &log.header().meta;
            let provider_name = meta
                .get("provider")
                .and_then(|v| v.as_str())
                .unwrap_or("local")
                .to_owned();
            let owner = meta
                .get("owner")
                .and_then(|v| v.as_str())
                .map(str::to_owned);
            let metadata: BTreeMap<String, String> = meta
                .get("metadata")
                .and_then(|v| serde_json::from_value(v.clone()).ok())
                .unwrap_or_default();
            let template = meta
                .get("template")
                .and_then(|v| v.as_str())
                .map(str::to_owned);
            let closed = log
                .events_after(None)
                .iter()
                .any(|e| matches!(e.body, EventBody::SessionClosed { .. }));
            let Some(provider) = self.providers.get(&provider_name) else {
                report.failed.push(id);
                continue;
            };
            let req = NewSession {
                provider: Some(provider_name.clone()),
                template,
                owner,
                metadata,
                ..Default::default()
            };
            let session = self.build_session(
                id.clone(),
                provider_name.clone(),
                Arc::clone(&provider),
                Arc::clone(&log),
                &req,
                log.header().created_ms,
            );
            if closed {
                session.closed.store(true, Ordering::Release);
                log.close().await;
                self.insert(session)?;
                continue;
            }
            let sandbox_id = leases
                .get(&id)
                .filter(|l| !l.released)
                .and_then(|l| l.sandbox_id.clone());
            match sandbox_id {
                Some(sid) => {
                    let ctx = CallCtx::new(format!("recover-{id}"))
                        .with_timeout(self.create_timeout, "DEADLINE_EXCEEDED");
                    match provider.connect(&ctx, &sid).await {
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
            self.insert(session)?;
            self.metrics.sessions_live(1);
        }
        report.orphans_destroyed = self.reconcile().await;
        Ok(report)
    }

    /// Destroy sandboxes stamped with this daemon's id that no live session owns.
    pub async fn reconcile(&self) -> Vec<String> {
        let mut destroyed = Vec::new();
        for (name, provider) in self.providers.iter() {
            let ctx = CallCtx::new("reconcile")
                .with_timeout(Duration::from_secs(30), "DEADLINE_EXCEEDED");
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
                let owned = self
                    .get(&owner, Scope::Any)
                    .map(|s| {
                        s.state() == SessionState::Active
                            && s.sandbox_id().as_deref() == Some(info.id.as_str())
                    })
                    .unwrap_or(false);
                if owned {
                    continue;
                }
                let ctx = CallCtx::new("reconcile")
                    .with_timeout(Duration::from_secs(30), "DEADLINE_EXCEEDED");
                match provider.destroy(&ctx, &info.id).await {
                    Ok(()) => {
                        tracing::info!(provider = %name, sandbox.id = %info.id, session.id = %owner, "Destroyed an orphaned sandbox");
                        let _ = self
                            .ledger
                            .record(&LeaseRecord::Released {
                                session: owner,
                                reason: "orphan".into(),
                                time: now_ms(),
                            })
                            .await;
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
                .with_timeout(Duration::from_secs(30), "DEADLINE_EXCEEDED");
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

    /// Close every expired session. Returns their ids.
    pub async fn expire(&self) -> Vec<String> {
        let now = now_ms();
        let expired: Vec<_> = self
            .list(Scope::Any)
            .into_iter()
            .filter(|s| {
                s.state() != SessionState::Closed && s.expires_ms() > 0 && s.expires_ms() <= now
            })
            .collect();
        let mut ids = Vec::new();
        for s in expired {
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
                    let _ = tokio::time::timeout(Duration::from_secs(15), cmd.wait()).await;
                }
                s.log.close().await;
            }
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
        match self {
            Scope::Any => true,
            Scope::Owner(o) => s.owner.as_deref() == *o,
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
}

fn set<T>(lock: &RwLock<T>, v: T) {
    if let Ok(mut g) = lock.write() {
        *g = v;
    }
}
