//! Local sandboxes and their lifecycle: the [`LocalProvider`] and [`LocalSandbox`].
//!
//! A sandbox is a directory under the provider's root:
//!
//! ```text
//! <root>/<id>/sandbox.json     what it is (survives a daemon restart: `connect` reads it)
//! <root>/<id>/workspace/       the workspace, mounted at /home/user inside
//! <root>/<id>/state/cmd/<key>/ output spools of its commands (never visible inside)
//! ```
//!
//! A local sandbox has no templates: `SandboxSpec::template` is recorded and reported,
//! nothing more. The TTL is recorded too (`renew` extends it); expiry is enforced by the
//! daemon's lease reconciliation, not here.
//!
//! Where cgroups are available, a cgroup `<parent>/tether/<id>` holds one child
//! cgroup per command. Processes do not survive a daemon restart as far as tether is
//! concerned (they are no longer attachable), but the sandbox cgroup still holds them,
//! so `destroy` kills them too.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_provider::{
    CallCtx, Capabilities, Enforcement, Fs, Process, Provider, ProviderError, Result, Sandbox,
    SandboxInfo, SandboxSpec,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::client::{Cgroup, CgroupTree, Launcher};
use crate::config::{LocalConfig, PRIVATE_TMPFS_PATHS, workspace_components};
use crate::confine::{ConfineSpec, ProbeReport};
use crate::error::internal;
use crate::fs::{LocalFs, Workspace};
use crate::process::LocalProcess;

/// The provider kind.
pub const KIND: &str = "local";

/// Name of the per-sandbox record.
const RECORD: &str = "sandbox.json";

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Sandbox ids are generated here; anything else is not one of ours (and must never
/// reach a path join).
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// What `sandbox.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SandboxRecord {
    id: String,
    template: Option<String>,
    workspace: String,
    enforcement: Enforcement,
    created_ms: i64,
    expires_ms: Option<i64>,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    network: bool,
}

// === impl SandboxCore ===

/// What the parts of one sandbox share.
#[derive(Debug)]
pub(crate) struct SandboxCore {
    pub(crate) id: String,
    pub(crate) cfg: Arc<LocalConfig>,
    pub(crate) launcher: Launcher,
    pub(crate) ws: Arc<Workspace>,
    pub(crate) workspace_host: PathBuf,
    pub(crate) state_dir: PathBuf,
    pub(crate) cgroup: Option<Cgroup>,
    pub(crate) network: bool,
    pub(crate) enforcement: Enforcement,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) tasks: TaskTracker,
    pub(crate) closed: CancellationToken,
}

impl SandboxCore {
    /// The trampoline spec of a command of this sandbox.
    pub(crate) fn confine_spec(
        &self,
        cgroup: Option<PathBuf>,
        pty: bool,
        cwd: PathBuf,
        env: Vec<(String, String)>,
        argv: Vec<String>,
    ) -> ConfineSpec {
        base_spec(
            &self.cfg,
            &self.workspace_host,
            self.network,
            self.enforcement,
            cgroup,
            pty,
            cwd,
            env,
            argv,
        )
    }
}

#[allow(clippy::too_many_arguments)]
fn base_spec(
    cfg: &LocalConfig,
    workspace_host: &Path,
    network: bool,
    require: Enforcement,
    cgroup: Option<PathBuf>,
    pty: bool,
    cwd: PathBuf,
    env: Vec<(String, String)>,
    argv: Vec<String>,
) -> ConfineSpec {
    // The workspace's first component (`/home`) is always hidden: the host's homes
    // must not show through around the workspace mount.
    let mut hidden: Vec<PathBuf> = Vec::new();
    if let Some(first) = cfg.workspace_path.iter().nth(1) {
        hidden.push(Path::new("/").join(first));
    }
    hidden.extend(cfg.hidden_paths.iter().cloned());
    ConfineSpec {
        workspace_host: workspace_host.to_owned(),
        workspace_path: cfg.workspace_path.clone(),
        hidden,
        private_tmpfs: PRIVATE_TMPFS_PATHS.iter().map(PathBuf::from).collect(),
        read_only: cfg.read_only_paths.clone(),
        devices: cfg.device_paths.clone(),
        network,
        landlock: cfg.landlock,
        cgroup,
        require,
        pty,
        cwd,
        env,
        argv,
    }
}

// === impl LocalSandbox ===

/// One local sandbox.
#[derive(Debug)]
pub struct LocalSandbox {
    core: Arc<SandboxCore>,
    record: SandboxRecord,
    expires_ms: AtomicI64,
    fs: LocalFs,
    process: LocalProcess,
}

/// `expires_ms` of a sandbox without expiry.
const NO_EXPIRY: i64 = i64::MIN;

impl LocalSandbox {
    fn new(core: Arc<SandboxCore>, record: SandboxRecord) -> Self {
        let fs = LocalFs::new(core.ws.clone(), core.tasks.clone(), core.closed.clone());
        let process = LocalProcess::new(core.clone());
        let expires_ms = AtomicI64::new(record.expires_ms.unwrap_or(NO_EXPIRY));
        Self {
            core,
            record,
            expires_ms,
            fs,
            process,
        }
    }

    /// The sandbox's workspace directory on the host.
    pub fn workspace_dir(&self) -> &Path {
        &self.core.workspace_host
    }

    fn current_record(&self) -> SandboxRecord {
        let e = self.expires_ms.load(Ordering::Acquire);
        SandboxRecord {
            expires_ms: (e != NO_EXPIRY).then_some(e),
            ..self.record.clone()
        }
    }

    /// Kill everything, stop background tasks.
    async fn shutdown(&self) {
        self.process.kill_all().await;
        self.core.closed.cancel();
        self.core.tasks.close();
        // Pumps end once their pipes close; the processes are dead, so this is quick.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.core.tasks.wait()).await;
        if let Some(cg) = &self.core.cgroup {
            cg.remove();
        }
    }
}

impl Sandbox for LocalSandbox {
    fn info(&self) -> SandboxInfo {
        info_of(&self.current_record())
    }

    fn fs(&self) -> &dyn Fs {
        &self.fs
    }

    fn process(&self) -> &dyn Process {
        &self.process
    }
}

fn info_of(r: &SandboxRecord) -> SandboxInfo {
    SandboxInfo {
        id: r.id.clone(),
        provider: KIND.into(),
        template: r.template.clone(),
        workspace: r.workspace.clone(),
        enforcement: r.enforcement,
        created_ms: r.created_ms,
        expires_ms: r.expires_ms,
        metadata: r.metadata.clone(),
        network: r.network,
    }
}

async fn write_record(dir: &Path, record: &SandboxRecord) -> Result<()> {
    let json =
        serde_json::to_vec_pretty(record).map_err(|e| internal("cannot encode sandbox.json", e))?;
    let tmp = dir.join(format!("{RECORD}.tmp"));
    tokio::fs::write(&tmp, json)
        .await
        .map_err(|e| internal("cannot write sandbox.json", e))?;
    tokio::fs::rename(&tmp, dir.join(RECORD))
        .await
        .map_err(|e| internal("cannot write sandbox.json", e))
}

async fn read_record(dir: &Path) -> Option<SandboxRecord> {
    let bytes = tokio::fs::read(dir.join(RECORD)).await.ok()?;
    serde_json::from_slice(&bytes).ok()
}

// === impl LocalProvider ===

/// Sandboxes as confined local processes.
#[derive(Debug)]
pub struct LocalProvider {
    cfg: Arc<LocalConfig>,
    prefix: Vec<String>,
    launcher: Launcher,
    cgroups: Option<CgroupTree>,
    live: Mutex<HashMap<String, Arc<LocalSandbox>>>,
}

impl LocalProvider {
    /// A provider with `cfg`; creates the root directory. Isolation is probed by
    /// `healthcheck` and by every `create`.
    pub fn new(cfg: LocalConfig) -> Result<Self> {
        cfg.validate()?;
        let prefix = workspace_components(&cfg.workspace_path)?;
        std::fs::create_dir_all(&cfg.root)
            .map_err(|e| internal(format!("cannot create {}", cfg.root.display()), e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&cfg.root, std::fs::Permissions::from_mode(0o700));
        }
        let launcher = Launcher::resolve(&cfg)?;
        let cgroups = CgroupTree::detect(&cfg);
        Ok(Self {
            cfg: Arc::new(cfg),
            prefix,
            launcher,
            cgroups,
            live: Mutex::new(HashMap::new()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LocalConfig {
        &self.cfg
    }

    /// Whether commands are tracked by cgroup (else by process group and session).
    pub fn tracks_by_cgroup(&self) -> bool {
        self.cgroups.is_some()
    }

    /// The cgroup directory of sandbox `id`, when commands are tracked by cgroup.
    pub fn sandbox_cgroup(&self, id: &str) -> Option<PathBuf> {
        if !valid_id(id) {
            return None;
        }
        self.cgroups.as_ref().map(|t| t.path_of(id))
    }

    /// Run the trampoline's probe for a workspace at `workspace`.
    async fn probe(
        &self,
        ctx: &CallCtx,
        workspace: &Path,
        state: &Path,
        network: bool,
        cgroup: Option<&Cgroup>,
    ) -> Result<ProbeReport> {
        let probe_cg = cgroup.and_then(|cg| {
            cg.child(&format!("probe-{}", uuid::Uuid::new_v4().simple()))
                .ok()
        });
        let spec = base_spec(
            &self.cfg,
            workspace,
            network,
            Enforcement::None,
            probe_cg.as_ref().map(|c| c.path().to_owned()),
            false,
            self.cfg.workspace_path.clone(),
            Vec::new(),
            Vec::new(),
        );
        let path = state.join(format!("probe-{}.json", uuid::Uuid::new_v4().simple()));
        let report = self.launcher.probe(ctx, &spec, &path).await;
        if let Some(cg) = probe_cg {
            cg.remove();
        }
        report
    }

    /// Refuse what the config does not accept.
    fn check_enforcement(&self, report: &ProbeReport) -> Result<()> {
        let acceptable = match report.enforcement {
            Enforcement::Full => true,
            Enforcement::Partial => self.cfg.allow_weaker_isolation,
            Enforcement::None => false,
        };
        if acceptable {
            return Ok(());
        }
        Err(ProviderError::IsolationUnavailable {
            requested: if self.cfg.allow_weaker_isolation {
                "partial".into()
            } else {
                "full".into()
            },
            why: if report.problems.is_empty() {
                format!("enforcement is {}", report.enforcement.as_str())
            } else {
                report.problems.join("; ")
            },
        })
    }

    fn sandbox_from(
        &self,
        record: SandboxRecord,
        dir: &Path,
        cgroup: Option<Cgroup>,
    ) -> Result<Arc<LocalSandbox>> {
        let workspace_host = dir.join("workspace");
        let ws = Workspace::open(&workspace_host, &self.cfg.workspace_str(), &self.prefix)
            .map_err(|e| {
                internal(
                    format!("cannot open the workspace {}", workspace_host.display()),
                    e,
                )
            })?;
        let core = SandboxCore {
            id: record.id.clone(),
            cfg: self.cfg.clone(),
            launcher: self.launcher.clone(),
            ws: Arc::new(ws),
            workspace_host,
            state_dir: dir.join("state"),
            cgroup,
            network: record.network,
            enforcement: record.enforcement,
            env: record.env.clone(),
            tasks: TaskTracker::new(),
            closed: CancellationToken::new(),
        };
        Ok(Arc::new(LocalSandbox::new(Arc::new(core), record)))
    }

    /// The live sandbox `id`, loaded from its record if this provider has not seen it yet.
    async fn connect_local(&self, id: &str) -> Result<Arc<LocalSandbox>> {
        let not_found = || ProviderError::SandboxNotFound { id: id.to_owned() };
        if !valid_id(id) {
            return Err(not_found());
        }
        let mut live = self.live.lock().await;
        if let Some(s) = live.get(id) {
            return Ok(s.clone());
        }
        let dir = self.cfg.root.join(id);
        let record = read_record(&dir).await.ok_or_else(not_found)?;
        let cgroup = self.cgroups.as_ref().and_then(|t| t.sandbox(id));
        let sandbox = self.sandbox_from(record, &dir, cgroup)?;
        live.insert(id.to_owned(), sandbox.clone());
        Ok(sandbox)
    }

    async fn create_in(
        &self,
        ctx: &CallCtx,
        spec: SandboxSpec,
        id: &str,
        dir: &Path,
    ) -> Result<Arc<LocalSandbox>> {
        let workspace = dir.join("workspace");
        let state = dir.join("state");
        for d in [&workspace, &state] {
            tokio::fs::create_dir_all(d)
                .await
                .map_err(|e| internal(format!("cannot create {}", d.display()), e))?;
        }
        let network = spec.network || self.cfg.default_network;
        let cgroup = self.cgroups.as_ref().and_then(|t| t.sandbox(id));
        let report = self
            .probe(ctx, &workspace, &state, network, cgroup.as_ref())
            .await?;
        tracing::debug!(sandbox.id = %id, enforcement = report.enforcement.as_str(), problems = ?report.problems, "Probed isolation");
        self.check_enforcement(&report)?;
        // A cgroup the probe could not join is useless: track by process group.
        let cgroup = match cgroup {
            Some(cg) if report.cgroup => Some(cg),
            Some(cg) => {
                cg.remove();
                None
            }
            None => None,
        };
        let created_ms = now_ms();
        let record = SandboxRecord {
            id: id.to_owned(),
            template: spec.template,
            workspace: self.cfg.workspace_str(),
            enforcement: report.enforcement,
            created_ms,
            expires_ms: spec
                .ttl
                .map(|t| created_ms.saturating_add(t.as_millis() as i64)),
            metadata: spec.metadata,
            env: spec.env,
            network,
        };
        write_record(dir, &record).await?;
        self.sandbox_from(record, dir, cgroup)
    }
}

#[async_trait]
impl Provider for LocalProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            pause: false,
            watch: true,
            pty: true,
            reattach: true,
            renew: true,
        }
    }

    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()> {
        let dir = self
            .cfg
            .root
            .join(format!(".health-{}", uuid::Uuid::new_v4().simple()));
        let workspace = dir.join("workspace");
        tokio::fs::create_dir_all(&workspace)
            .await
            .map_err(|e| ProviderError::Unavailable {
                message: format!(
                    "the sandbox root {} is not writable",
                    self.cfg.root.display()
                ),
                retry_after: None,
                source: Some(Box::new(e)),
            })?;
        let report = self.probe(ctx, &workspace, &dir, false, None).await;
        let _ = tokio::fs::remove_dir_all(&dir).await;
        self.check_enforcement(&report?)
    }

    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.cfg.root.join(&id);
        match self.create_in(ctx, spec, &id, &dir).await {
            Ok(sandbox) => {
                self.live.lock().await.insert(id.clone(), sandbox.clone());
                tracing::info!(sandbox.id = %id, enforcement = sandbox.record.enforcement.as_str(), "Created a local sandbox");
                Ok(sandbox)
            }
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                if let Some(cg) = self.cgroups.as_ref().and_then(|t| t.existing(&id)) {
                    cg.remove();
                }
                Err(e)
            }
        }
    }

    async fn connect(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        Ok(self.connect_local(id).await?)
    }

    async fn list(&self, ctx: &CallCtx) -> Result<Vec<SandboxInfo>> {
        ctx.check()?;
        let live = self.live.lock().await;
        let mut out = Vec::new();
        let mut rd = match tokio::fs::read_dir(&self.cfg.root).await {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(internal("cannot list the sandbox root", e)),
        };
        while let Ok(Some(entry)) = rd.next_entry().await {
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if !valid_id(&id) {
                continue;
            }
            match live.get(&id) {
                Some(s) => out.push(s.info()),
                None => {
                    if let Some(r) = read_record(&entry.path()).await {
                        out.push(info_of(&r));
                    }
                }
            }
        }
        out.sort_by(|a, b| {
            a.created_ms
                .cmp(&b.created_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    async fn destroy(&self, ctx: &CallCtx, id: &str) -> Result<()> {
        ctx.check()?;
        if !valid_id(id) {
            return Ok(());
        }
        let sandbox = self.live.lock().await.remove(id);
        match sandbox {
            Some(s) => s.shutdown().await,
            None => {
                // Not live here (a daemon restart): processes it left may still be in
                // its cgroup.
                if let Some(cg) = self.cgroups.as_ref().and_then(|t| t.existing(id)) {
                    cg.kill_all();
                    let limit = tokio::time::Instant::now()
                        + Duration::from_millis(self.cfg.kill_verify_ms);
                    while cg.populated() && tokio::time::Instant::now() < limit {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    cg.remove();
                }
            }
        }
        let dir = self.cfg.root.join(id);
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal(format!("cannot remove {}", dir.display()), e)),
        }
        tracing::info!(sandbox.id = %id, "Destroyed a local sandbox");
        Ok(())
    }

    async fn renew(&self, ctx: &CallCtx, id: &str, ttl: Duration) -> Result<()> {
        ctx.check()?;
        let sandbox = self.connect_local(id).await?;
        let expires = now_ms().saturating_add(ttl.as_millis() as i64);
        sandbox.expires_ms.store(expires, Ordering::Release);
        write_record(&self.cfg.root.join(id), &sandbox.current_record()).await
    }
}
