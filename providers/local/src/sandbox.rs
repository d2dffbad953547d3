//! Local sandboxes and their lifecycle: the [`LocalProvider`] and [`LocalSandbox`].
//!
//! A sandbox is a machine of its own (see [`crate::init`] and [`crate::rootfs`]):
//!
//! ```text
//! <root>/<id>/sandbox.json     what it is (survives a daemon restart: `connect` reads it)
//! <root>/<id>/store.img        its file system (ext4, as large as its disk limit)
//! <root>/<id>/store/, rootfs/  the image's mount and the overlay root over the template
//! <root>/<id>/state/           output spools of its commands, init.log, the init's
//!                              control socket init.sock (never inside)
//! <root>-templates/            built templates (`host` skeleton, `base` Debian root)
//! <root>-snapshots/<snap>/     file-system snapshots (an upper layer and its template)
//! ```
//!
//! Its processes live in namespaces held by its init, in cgroups that carry its limits.
//! A sandbox outlives a daemon that went away without ending it (a crash, `kill -9`) by
//! `orphan_grace_ms`: its init keeps its commands running and spools their output, and
//! listens on `state/init.sock`; `connect` in the next daemon takes it over there,
//! commands and all. After the grace the init ends the sandbox (the kernel kills its
//! pid namespace); files stay, and `connect` starts a new init over them. A daemon that
//! stops cleanly ends its sandboxes' processes.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_protocol::limits::ResourceLimits;
use tether_protocol::network::Egress;
use tether_provider::{
    CallCtx, Capabilities, Enforcement, Fs, PauseKind, PortStream, Process, Provider,
    ProviderError, Result, Sandbox, SandboxInfo, SandboxMetrics, SandboxSpec,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cgroup::{CgroupTree, SandboxCgroup};
use crate::client::{self, Init, Launcher, Network, find_program, network_helper};
use crate::config::{Isolation, LocalConfig, workspace_components};
use crate::error::internal;
use crate::fs::{LocalFs, Workspace};
use crate::init::InitSpec;
use crate::process::LocalProcess;
use crate::rootfs::{self, Template};

/// The provider kind.
pub const KIND: &str = "local";

/// Rounds of 2 ms a dropped sandbox waits for its processes to end.
const DROP_WAIT_ROUNDS: u32 = 100;

/// Name of the per-sandbox record.
const RECORD: &str = "sandbox.json";

/// Where a sandbox reads its boot id.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Sandbox and snapshot ids are generated here; anything else is not one of ours (and
/// must never reach a path join).
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// What `sandbox.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SandboxRecord {
    id: String,
    template: Option<String>,
    /// The template the root file system is built on (`host` or `base`).
    #[serde(default = "host_name")]
    rootfs: String,
    workspace: String,
    enforcement: Enforcement,
    created_ms: i64,
    expires_ms: Option<i64>,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    network: bool,
    #[serde(default)]
    limits: ResourceLimits,
    /// Egress rules: the sandbox's network namespace is the host's to configure (see
    /// [`InitSpec::outer_netns`](crate::init::InitSpec::outer_netns)).
    #[serde(default, skip_serializing_if = "Egress::is_empty")]
    egress: Egress,
    /// Whether the network namespace is the host's to configure, so that the egress
    /// rules can be changed while the sandbox runs. `None` (a record written before the
    /// field): exactly when it was made with rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outer_netns: Option<bool>,
    /// Paused without its memory: no init runs, only its file system is kept, and
    /// resume boots it again (a record written before the field: it is not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    stopped: bool,
}

impl SandboxRecord {
    /// [`InitSpec::outer_netns`](crate::init::InitSpec::outer_netns) of this sandbox.
    fn outer_netns(&self) -> bool {
        self.network && self.outer_netns.unwrap_or_else(|| !self.egress.is_empty())
    }
}

fn host_name() -> String {
    "host".into()
}

/// What a snapshot's `snapshot.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotRecord {
    id: String,
    sandbox: String,
    rootfs: String,
    created_ms: i64,
}

// === impl SandboxCore ===

/// What the parts of one sandbox share.
#[derive(Debug)]
pub(crate) struct SandboxCore {
    pub(crate) id: String,
    pub(crate) cfg: Arc<LocalConfig>,
    pub(crate) ws: Arc<Workspace>,
    pub(crate) dir: PathBuf,
    pub(crate) state_dir: PathBuf,
    pub(crate) init: Init,
    pub(crate) cgroup: Option<SandboxCgroup>,
    pub(crate) network: Mutex<Option<Network>>,
    pub(crate) env: BTreeMap<String, String>,
    /// uid and gid inside of commands that name no user.
    pub(crate) user: (u32, u32),
    /// The sandbox's user namespace, where it has one of its own.
    pub(crate) userns: Option<OwnedFd>,
    /// The helper binary.
    pub(crate) launcher: Launcher,
    /// Components of the workspace path.
    pub(crate) home: Vec<String>,
    pub(crate) tasks: TaskTracker,
    pub(crate) closed: CancellationToken,
}

impl Drop for SandboxCore {
    /// A sandbox dropped without `destroy` (the daemon stops cleanly, and keeps its
    /// sandboxes' files for a later daemon): its processes end now (only a daemon that
    /// dies without this keeps them, for its orphan grace), and its cgroups go with
    /// them. Bounded: a sandbox that does not die at once keeps its cgroups
    /// until `destroy` or the next `connect`.
    fn drop(&mut self) {
        self.init.kill_now();
        if let Some(cg) = &self.cgroup {
            cg.freeze(false);
            for _ in 0..DROP_WAIT_ROUNDS {
                if cg.pids().is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            cg.remove();
        }
    }
}

impl SandboxCore {
    /// The sandbox's root as the host reaches it.
    pub(crate) fn root_view(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.init.pid1))
    }
}

// === impl LocalSandbox ===

/// One local sandbox.
#[derive(Debug)]
pub struct LocalSandbox {
    core: Arc<SandboxCore>,
    record: SandboxRecord,
    expires_ms: AtomicI64,
    /// The egress rules in force (`record.egress` is the ones it was made with).
    egress: std::sync::RwLock<Egress>,
    /// One change of the egress rules at a time.
    egress_lock: Mutex<()>,
    fs: LocalFs,
    process: LocalProcess,
}

/// The init's control socket in `state/`: a daemon that starts after a crash takes the
/// sandbox over through it.
const CONTROL_SOCKET: &str = "init.sock";

/// `expires_ms` of a sandbox without expiry.
const NO_EXPIRY: i64 = i64::MIN;

impl LocalSandbox {
    fn new(core: Arc<SandboxCore>, record: SandboxRecord) -> Self {
        let fs = LocalFs::new(core.ws.clone(), core.tasks.clone(), core.closed.clone());
        let process = LocalProcess::new(core.clone());
        let expires_ms = AtomicI64::new(record.expires_ms.unwrap_or(NO_EXPIRY));
        let egress = std::sync::RwLock::new(record.egress.clone());
        Self {
            core,
            record,
            expires_ms,
            egress,
            egress_lock: Mutex::new(()),
            fs,
            process,
        }
    }

    /// Host pid of the sandbox's init (pid 1 inside).
    pub fn init_pid(&self) -> u32 {
        self.core.init.pid1
    }

    /// Whether the sandbox is paused (frozen).
    pub fn paused(&self) -> bool {
        self.core.cgroup.as_ref().is_some_and(|cg| cg.frozen())
    }

    /// The sandbox's directory on the host.
    pub fn dir(&self) -> &Path {
        &self.core.dir
    }

    fn current_record(&self) -> SandboxRecord {
        let e = self.expires_ms.load(Ordering::Acquire);
        SandboxRecord {
            expires_ms: (e != NO_EXPIRY).then_some(e),
            egress: self.egress(),
            ..self.record.clone()
        }
    }

    /// The egress rules in force.
    pub fn egress(&self) -> Egress {
        self.egress
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Kill everything, stop background tasks, release the mounts and cgroups.
    async fn shutdown(&self) {
        if let Some(cg) = &self.core.cgroup {
            // A frozen sandbox cannot die.
            cg.freeze(false);
        }
        let verify = Duration::from_millis(self.core.cfg.kill_verify_ms);
        self.process.kill_all().await;
        self.core.init.kill(verify).await;
        if let Some(mut n) = self.core.network.lock().await.take() {
            n.stop().await;
        }
        self.core.closed.cancel();
        self.core.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.core.tasks.wait()).await;
        if let Some(cg) = &self.core.cgroup {
            let deadline = tokio::time::Instant::now() + verify;
            while !cg.pids().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            cg.remove();
        }
        rootfs::unmount(&self.core.dir);
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

    fn fs_for(&self, user: &str) -> Result<Option<Arc<dyn Fs>>> {
        crate::elevated::view_for(&self.core, user).map(Some)
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

async fn write_json<T: Serialize>(dir: &Path, name: &str, record: &T) -> Result<()> {
    let json =
        serde_json::to_vec_pretty(record).map_err(|e| internal("cannot encode a record", e))?;
    let tmp = dir.join(format!("{name}.tmp"));
    tokio::fs::write(&tmp, json)
        .await
        .map_err(|e| internal(format!("cannot write {name}"), e))?;
    tokio::fs::rename(&tmp, dir.join(name))
        .await
        .map_err(|e| internal(format!("cannot write {name}"), e))
}

async fn read_record(dir: &Path) -> Option<SandboxRecord> {
    let bytes = tokio::fs::read(dir.join(RECORD)).await.ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Run blocking set-up work off the runtime.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(crate::error::join)?
}

// === impl LocalProvider ===

/// Sandboxes as machines of their own on the local host.
#[derive(Debug)]
pub struct LocalProvider {
    cfg: Arc<LocalConfig>,
    home: Vec<String>,
    launcher: Launcher,
    cgroups: Option<CgroupTree>,
    net_helper: Option<PathBuf>,
    ip: Option<PathBuf>,
    mount: PathBuf,
    losetup: Option<PathBuf>,
    live: Mutex<HashMap<String, Arc<LocalSandbox>>>,
}

impl LocalProvider {
    /// A provider with `cfg`; creates the root directory. What the host can enforce is
    /// checked by `healthcheck` and by every `create`.
    pub fn new(cfg: LocalConfig) -> Result<Self> {
        cfg.validate()?;
        let home = workspace_components(&cfg.workspace_path)?;
        std::fs::create_dir_all(&cfg.root)
            .map_err(|e| internal(format!("cannot create {}", cfg.root.display()), e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&cfg.root, std::fs::Permissions::from_mode(0o700));
        }
        let launcher = Launcher::resolve(&cfg)?;
        let machine = cfg.isolation == Isolation::Machine;
        let cgroups = if cfg.cgroups && machine {
            CgroupTree::detect(cfg.cgroup_parent.as_deref())
        } else {
            None
        };
        if let Some(t) = &cgroups {
            t.sweep();
        }
        let net_helper = if machine { network_helper(&cfg) } else { None };
        if let Some(h) = &net_helper {
            let n = crate::client::sweep_orphaned_nats(h);
            if n > 0 {
                tracing::info!(
                    count = n,
                    "Killed network helpers left by a daemon that died"
                );
            }
        }
        Ok(Self {
            cfg: Arc::new(cfg),
            home,
            launcher,
            cgroups,
            net_helper,
            ip: find_program("ip"),
            mount: find_program("mount").unwrap_or_else(|| PathBuf::from("/bin/mount")),
            losetup: find_program("losetup"),
            live: Mutex::new(HashMap::new()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LocalConfig {
        &self.cfg
    }

    /// The live sandbox `id` as the concrete type (tests and tools).
    pub async fn local(&self, id: &str) -> Result<Arc<LocalSandbox>> {
        self.connect_local(id).await
    }

    /// Egress rules need a machine-grade sandbox (its own network namespace, made by
    /// root outside its user namespace), the network helper, `nft` and `nsenter`.
    fn egress_problem(&self, machine: bool) -> Result<()> {
        let why = if !machine {
            Some("egress rules need machine-grade sandboxes (isolation = \"machine\")".to_owned())
        } else if self.net_helper.is_none() {
            Some("no userspace network helper (pasta) is installed".to_owned())
        } else {
            crate::client::egress_tools().err()
        };
        match why {
            Some(why) => Err(ProviderError::IsolationUnavailable {
                requested: "egress rules".into(),
                why,
            }),
            None => Ok(()),
        }
    }

    /// Why this host cannot run full sandboxes, if it cannot.
    fn host_problem(&self) -> Option<String> {
        if self.cfg.isolation == Isolation::None {
            return None;
        }
        if !nix::unistd::geteuid().is_root() {
            return Some(
                "the local provider maps each sandbox to an unprivileged uid range and mounts \
                 its file system: it must run as root"
                    .into(),
            );
        }
        if !self.mount.is_file() {
            return Some(format!("no mount program at {}", self.mount.display()));
        }
        if find_program("mkfs.ext4").is_none() {
            return Some("no mkfs.ext4 (e2fsprogs) to make the sandboxes' file systems".into());
        }
        None
    }

    fn template(&self, name: &str) -> Result<Template> {
        let templates = self.cfg.templates();
        std::fs::create_dir_all(&templates)
            .map_err(|e| internal("cannot create the templates dir", e))?;
        if name == "base" {
            if let Some(t) = rootfs::base_template(&templates) {
                return Ok(t);
            }
            tracing::warn!(
                "The base template is not built (`tether template build base`): using the host template"
            );
        } else if name != "host" {
            tracing::warn!(template = %name, "Unknown local template: using the host template");
        }
        rootfs::host_template(
            &templates,
            &self.cfg.read_only_paths,
            &self.cfg.workspace_path,
            self.cfg.uid_base,
        )
    }

    /// The template name a spec asks for, resolved to what exists.
    fn rootfs_name(&self, spec_template: Option<&str>) -> String {
        let want = spec_template.unwrap_or(&self.cfg.default_template);
        if want != "base" {
            return "host".into();
        }
        if rootfs::base_template(&self.cfg.templates()).is_some() {
            return "base".into();
        }
        // Said once per process: the sandbox works, but is not the Debian machine with
        // user `user` and sudo that `base` is.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(templates = %self.cfg.templates().display(), "The base template is not built here (tether template build base): sandboxes asking for it get the host template (commands as root, no sudo)");
        }
        "host".into()
    }

    /// Refuse what the config does not accept.
    fn check_enforcement(&self, enforcement: Enforcement, problems: &[String]) -> Result<()> {
        let acceptable = match enforcement {
            Enforcement::Full => true,
            Enforcement::Partial => self.cfg.allow_weaker_isolation,
            // Only where the machine itself is the sandbox, by configuration.
            Enforcement::None => self.cfg.isolation == Isolation::None,
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
            why: if problems.is_empty() {
                format!("enforcement is {}", enforcement.as_str())
            } else {
                problems.join("; ")
            },
        })
    }

    /// Bring a sandbox up over its (existing) store: mounts, cgroups, init, network.
    async fn boot(&self, record: &SandboxRecord, dir: &Path) -> Result<Arc<LocalSandbox>> {
        if self.cfg.isolation == Isolation::None {
            return self.boot_unisolated(record, dir).await;
        }
        let template = self.template(&record.rootfs)?;
        let uid_base = self.cfg.uid_base;
        let root = dir.join("rootfs");
        let mut problems = Vec::new();
        let cgroup = match &self.cgroups {
            Some(t) => {
                let (cg, applied) = t.create(&record.id, &record.limits);
                if !applied.memory {
                    problems.push("no memory limit (no memory controller)".to_owned());
                }
                if !applied.pids {
                    problems.push("no process limit (no pids controller)".to_owned());
                }
                if !applied.cpu {
                    problems.push("no CPU limit (no cpu controller)".to_owned());
                }
                Some(cg)
            }
            None => {
                problems.push("no cgroups: limits other than disk are not enforced".into());
                None
            }
        };
        let (user, creds) = if template.name == "base" {
            let u = rootfs::BASE_USER_UID;
            ((u, u), (uid_base + u, uid_base + u))
        } else {
            ((0, 0), (uid_base, uid_base))
        };
        let hostname = format!("tether-{}", &record.id[..record.id.len().min(12)]);
        // Each boot is a machine's boot: a boot id of its own, new at every boot (after
        // a pause without memory, say), never the host's.
        let mut bind_texts = template.bind_texts.clone();
        bind_texts.insert(
            PathBuf::from(BOOT_ID),
            format!("{}\n", uuid::Uuid::new_v4().hyphenated()),
        );
        let spec = InitSpec {
            isolate: true,
            root: root.clone(),
            image: dir.join("store.img"),
            store: dir.join("store"),
            lower: template.lower.clone(),
            owner: uid_base,
            mount: self.mount.clone(),
            losetup: self.losetup.clone(),
            hosts_entry: template.name == "base",
            binds: template.binds.clone(),
            bind_texts,
            devices: self.cfg.device_paths.clone(),
            shm_bytes: self.cfg.shm_bytes,
            hostname,
            home: self.cfg.workspace_path.clone(),
            home_owner: user,
            ip: self.ip.clone(),
            orphan_grace_ms: self.cfg.orphan_grace_ms,
            outer_netns: record.outer_netns(),
        };
        let state = dir.join("state");
        tokio::fs::create_dir_all(&state)
            .await
            .map_err(|e| internal("cannot create state/", e))?;
        let cg = cgroup.clone();
        let init = Init::start(
            &self.launcher,
            &spec,
            uid_base,
            self.cfg.uid_count,
            &state.join("init.log"),
            &state.join(CONTROL_SOCKET),
            move |pid| match &cg {
                Some(cg) => cg.join(pid),
                None => Ok(()),
            },
            Duration::from_millis(self.cfg.init_timeout_ms),
        )
        .await;
        let init = match init {
            Ok(i) => i,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    cg.remove();
                }
                return Err(e);
            }
        };
        let network = if record.network {
            let started = match &self.net_helper {
                Some(h) => {
                    // The rules first: the sandbox never has egress without them.
                    let ruled = if record.egress.is_empty() {
                        Ok(())
                    } else {
                        crate::client::apply_egress(
                            init.pid1,
                            &record.egress,
                            Duration::from_millis(self.cfg.network_timeout_ms),
                        )
                        .await
                    };
                    match ruled {
                        Ok(()) => {
                            Network::start(
                                h,
                                init.pid1,
                                record.outer_netns(),
                                Duration::from_millis(self.cfg.network_timeout_ms),
                            )
                            .await
                        }
                        Err(e) => Err(e),
                    }
                }
                None => Err(ProviderError::IsolationUnavailable {
                    requested: "network".into(),
                    why: "no userspace network helper (pasta) is installed".into(),
                }),
            };
            match started {
                Ok(n) => Some(n),
                Err(e) => {
                    init.kill(Duration::from_millis(self.cfg.kill_verify_ms))
                        .await;
                    if let Some(cg) = &cgroup {
                        cg.remove();
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        let enforcement = if problems.is_empty() {
            Enforcement::Full
        } else {
            Enforcement::Partial
        };
        if let Err(e) = self.check_enforcement(enforcement, &problems) {
            init.kill(Duration::from_millis(self.cfg.kill_verify_ms))
                .await;
            if let Some(cg) = &cgroup {
                cg.remove();
            }
            return Err(e);
        }
        let core = self.assemble(record, dir, init, cgroup, network, user, creds)?;
        let record = SandboxRecord {
            enforcement,
            ..record.clone()
        };
        write_json(dir, RECORD, &record).await?;
        Ok(Arc::new(LocalSandbox::new(Arc::new(core), record)))
    }

    /// [`Self::boot`] where the sandbox is this machine ([`Isolation::None`]): an init
    /// that starts commands as the machine's own users on its own root; no namespaces,
    /// no image, no cgroups, no network helper.
    async fn boot_unisolated(
        &self,
        record: &SandboxRecord,
        dir: &Path,
    ) -> Result<Arc<LocalSandbox>> {
        let user = machine_user().await;
        let spec = InitSpec {
            isolate: false,
            root: PathBuf::from("/"),
            image: PathBuf::new(),
            store: PathBuf::new(),
            lower: PathBuf::new(),
            owner: 0,
            mount: self.mount.clone(),
            losetup: None,
            hosts_entry: false,
            binds: Vec::new(),
            bind_texts: Default::default(),
            devices: Vec::new(),
            shm_bytes: 0,
            hostname: String::new(),
            home: self.cfg.workspace_path.clone(),
            home_owner: user,
            ip: None,
            orphan_grace_ms: self.cfg.orphan_grace_ms,
            outer_netns: false,
        };
        let state = dir.join("state");
        tokio::fs::create_dir_all(&state)
            .await
            .map_err(|e| internal("cannot create state/", e))?;
        let home = self.cfg.workspace_path.clone();
        blocking(move || {
            if !home.exists() {
                std::fs::create_dir_all(&home)
                    .map_err(|e| internal("cannot create the home directory", e))?;
                std::os::unix::fs::chown(&home, Some(user.0), Some(user.1))
                    .map_err(|e| internal("cannot chown the home directory", e))?;
            }
            Ok(())
        })
        .await?;
        let init = Init::start(
            &self.launcher,
            &spec,
            0,
            0,
            &state.join("init.log"),
            &state.join(CONTROL_SOCKET),
            |_| Ok(()),
            Duration::from_millis(self.cfg.init_timeout_ms),
        )
        .await?;
        let core = self.assemble(record, dir, init, None, None, user, user)?;
        let record = SandboxRecord {
            enforcement: Enforcement::None,
            ..record.clone()
        };
        write_json(dir, RECORD, &record).await?;
        Ok(Arc::new(LocalSandbox::new(Arc::new(core), record)))
    }

    /// The live sandbox `id`, booted again from its record if this provider has not
    /// seen it yet (a daemon restart).
    async fn connect_local(&self, id: &str) -> Result<Arc<LocalSandbox>> {
        let not_found = || ProviderError::SandboxNotFound { id: id.to_owned() };
        if !valid_id(id) {
            return Err(not_found());
        }
        let mut live = self.live.lock().await;
        if let Some(s) = live.get(id) {
            if s.core.init.alive() {
                return Ok(s.clone());
            }
            // Its init died (killed from outside): tear down what is left, boot again.
            let s = s.clone();
            live.remove(id);
            s.shutdown().await;
        }
        let dir = self.cfg.root.join(id);
        let record = read_record(&dir).await.ok_or_else(not_found)?;
        if record.stopped {
            return Err(ProviderError::Stopped { id: id.to_owned() });
        }
        self.start_local(&mut live, record, &dir).await
    }

    /// Bring up sandbox `record.id` that is not live here: take over its init if one
    /// outlived its daemon, boot it over its store otherwise.
    async fn start_local(
        &self,
        live: &mut HashMap<String, Arc<LocalSandbox>>,
        record: SandboxRecord,
        dir: &Path,
    ) -> Result<Arc<LocalSandbox>> {
        let (id, dir) = (record.id.clone(), dir.to_owned());
        // An init that outlived its daemon (a crash): take it over, commands and all.
        match self.take_over(&record, &dir).await {
            Ok(Some(sandbox)) => {
                live.insert(id, sandbox.clone());
                return Ok(sandbox);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(sandbox.id = %id, error = %e, "Could not take over a sandbox's running init; ending it and booting the sandbox again");
                Init::end_orphan(&dir.join("state").join(CONTROL_SOCKET));
            }
        }
        if let Some(t) = &self.cgroups {
            // What the previous init left, if anything, goes first.
            let old = t.existing(&id);
            // A frozen process cannot die: thaw first.
            old.freeze(false);
            for pid in old.pids() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let sandbox = self.boot(&record, &dir).await?;
        live.insert(id, sandbox.clone());
        Ok(sandbox)
    }

    /// A booted or taken-over sandbox's shared parts: its root opened through its init.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &self,
        record: &SandboxRecord,
        dir: &Path,
        init: Init,
        cgroup: Option<SandboxCgroup>,
        network: Option<Network>,
        user: (u32, u32),
        creds: (u32, u32),
    ) -> Result<SandboxCore> {
        let ws = Workspace::open_root(
            Path::new(&format!("/proc/{}/root", init.pid1)),
            &self.cfg.workspace_str(),
            &self.home,
            Some(creds),
        )
        .map_err(|e| internal("cannot open the sandbox's root", e))?;
        let userns = if self.cfg.isolation == Isolation::None {
            None
        } else {
            let ns = std::fs::File::open(format!("/proc/{}/ns/user", init.pid1))
                .map_err(|e| internal("cannot open the sandbox's user namespace", e))?;
            Some(OwnedFd::from(ns))
        };
        Ok(SandboxCore {
            id: record.id.clone(),
            cfg: self.cfg.clone(),
            ws: Arc::new(ws),
            dir: dir.to_owned(),
            state_dir: dir.join("state"),
            init,
            cgroup,
            network: Mutex::new(network),
            env: record.env.clone(),
            user,
            userns,
            launcher: self.launcher.clone(),
            home: self.home.clone(),
            tasks: TaskTracker::new(),
            closed: CancellationToken::new(),
        })
    }

    /// Take over the running init of a sandbox whose daemon went away without ending
    /// it: `Ok(None)` when none runs (the sandbox is booted again instead).
    async fn take_over(
        &self,
        record: &SandboxRecord,
        dir: &Path,
    ) -> Result<Option<Arc<LocalSandbox>>> {
        let state = dir.join("state");
        let timeout = Duration::from_millis(self.cfg.init_timeout_ms);
        let isolated = self.cfg.isolation != Isolation::None;
        // A paused sandbox's init is frozen with it: thawed to answer, frozen again after.
        let paused = isolated
            .then(|| self.cgroups.as_ref().map(|t| t.existing(&record.id)))
            .flatten()
            .filter(|cg| cg.frozen());
        if let Some(cg) = &paused {
            cg.freeze(false);
        }
        let reconnected = Init::reconnect(&state.join(CONTROL_SOCKET), timeout).await;
        if let Some(cg) = &paused {
            cg.freeze(true);
        }
        let Some((init, known)) = reconnected? else {
            return Ok(None);
        };
        let (user, creds) = if !isolated {
            let u = machine_user().await;
            (u, u)
        } else if self
            .template(&record.rootfs)
            .is_ok_and(|t| t.name == "base")
        {
            let u = rootfs::BASE_USER_UID;
            ((u, u), (self.cfg.uid_base + u, self.cfg.uid_base + u))
        } else {
            ((0, 0), (self.cfg.uid_base, self.cfg.uid_base))
        };
        let cgroup = if isolated {
            self.cgroups.as_ref().map(|t| t.existing(&record.id))
        } else {
            None
        };
        let network = match (&self.net_helper, record.network && isolated) {
            (Some(h), true) => match Network::adopt(h, init.pid1) {
                Some(n) => Some(n),
                None => Some(
                    Network::start(
                        h,
                        init.pid1,
                        record.outer_netns(),
                        Duration::from_millis(self.cfg.network_timeout_ms),
                    )
                    .await?,
                ),
            },
            _ => None,
        };
        let core = self.assemble(record, dir, init, cgroup, network, user, creds)?;
        let sandbox = LocalSandbox::new(Arc::new(core), record.clone());
        let n = known.len();
        sandbox.process.adopt(known).await;
        tracing::info!(sandbox.id = %record.id, commands = n, "Took over a sandbox that outlived its daemon");
        Ok(Some(Arc::new(sandbox)))
    }

    async fn create_in(
        &self,
        spec: SandboxSpec,
        id: &str,
        dir: &Path,
        from_snapshot: Option<PathBuf>,
    ) -> Result<Arc<LocalSandbox>> {
        if let Some(why) = self.host_problem() {
            return Err(ProviderError::IsolationUnavailable {
                requested: "full".into(),
                why,
            });
        }
        tokio::fs::create_dir_all(dir.join("state"))
            .await
            .map_err(|e| internal(format!("cannot create {}", dir.display()), e))?;
        let limits = spec.limits.or(self.cfg.limits);
        let disk = limits.disk_bytes.unwrap_or(rootfs_default_disk());
        let rootfs_name = match &from_snapshot {
            Some(snap) => read_snapshot(snap).await?.rootfs,
            None => self.rootfs_name(spec.template.as_deref()),
        };
        let (d, owner) = (dir.to_owned(), self.cfg.uid_base);
        let machine = self.cfg.isolation == Isolation::Machine;
        if !machine && from_snapshot.is_some() {
            return Err(ProviderError::Unsupported {
                op: "create_from_snapshot",
            });
        }
        let network = spec.network || self.cfg.default_network;
        let egress = if network {
            spec.egress.clone()
        } else {
            Egress::default()
        };
        if !egress.is_empty() {
            self.egress_problem(machine)?;
        }
        blocking(move || {
            if !machine {
                return Ok(());
            }
            rootfs::create_store(&d, disk, owner)?;
            if let Some(snap) = from_snapshot {
                // Briefly mounted here to be filled; the sandbox mounts it for itself.
                rootfs::mount_store(&d, owner)?;
                let copied = copy_tree(&snap.join("upper"), &d.join("store").join("upper"));
                rootfs::unmount(&d);
                copied?;
            }
            Ok(())
        })
        .await?;
        let created_ms = now_ms();
        let record = SandboxRecord {
            id: id.to_owned(),
            template: spec.template,
            rootfs: rootfs_name,
            workspace: self.cfg.workspace_str(),
            enforcement: Enforcement::None,
            created_ms,
            expires_ms: spec
                .ttl
                .map(|t| created_ms.saturating_add(t.as_millis() as i64)),
            metadata: spec.metadata,
            env: spec.env,
            network,
            limits,
            egress,
            // A machine's network namespace is made outside it whenever its `ip` can
            // bring the loopback up there: its rules can then change while it runs.
            outer_netns: Some(network && machine && self.ip.is_some()),
            stopped: false,
        };
        self.boot(&record, dir).await
    }

    async fn create_with(
        &self,
        ctx: &CallCtx,
        spec: SandboxSpec,
        from_snapshot: Option<PathBuf>,
    ) -> Result<Arc<LocalSandbox>> {
        ctx.check()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.cfg.root.join(&id);
        match self.create_in(spec, &id, &dir, from_snapshot).await {
            Ok(sandbox) => {
                self.live.lock().await.insert(id.clone(), sandbox.clone());
                tracing::info!(sandbox.id = %id, enforcement = sandbox.record.enforcement.as_str(), "Created a local sandbox");
                Ok(sandbox)
            }
            Err(e) => {
                rootfs::unmount(&dir);
                let _ = tokio::fs::remove_dir_all(&dir).await;
                if let Some(t) = &self.cgroups {
                    t.existing(&id).remove();
                }
                Err(e)
            }
        }
    }

    /// Pause `sandbox` without its memory: end everything in it (its init, and with it
    /// its namespaces and mounts), keep its store, and mark its record stopped. Only
    /// then, so a crash midway leaves a record that boots again as running.
    async fn stop(&self, sandbox: &Arc<LocalSandbox>) -> Result<()> {
        let id = sandbox.core.id.clone();
        let mut live = self.live.lock().await;
        live.remove(&id);
        sandbox.shutdown().await;
        let record = SandboxRecord {
            stopped: true,
            ..sandbox.current_record()
        };
        write_json(&sandbox.core.dir, RECORD, &record).await?;
        drop(live);
        tracing::info!(sandbox.id = %id, "Stopped a local sandbox (paused without memory)");
        Ok(())
    }

    /// Resume a stopped sandbox: boot it again over its store, as a machine boots.
    async fn start_stopped(&self, id: &str) -> Result<Arc<LocalSandbox>> {
        let mut live = self.live.lock().await;
        if let Some(s) = live.get(id) {
            return Ok(s.clone());
        }
        let dir = self.cfg.root.join(id);
        let record = read_record(&dir)
            .await
            .ok_or_else(|| ProviderError::SandboxNotFound { id: id.to_owned() })?;
        let record = SandboxRecord {
            stopped: false,
            ..record
        };
        let sandbox = self.start_local(&mut live, record, &dir).await?;
        tracing::info!(sandbox.id = %id, "Booted a stopped local sandbox again");
        Ok(sandbox)
    }

    fn snapshot_dir(&self, snap: &str) -> Option<PathBuf> {
        valid_id(snap).then(|| self.cfg.snapshots().join(snap))
    }
}

/// End the sandboxes under `root` (a [`LocalConfig::root`]) whose inits outlived their
/// daemon and wait for their grace ([`LocalConfig::orphan_grace_ms`]) to pass, for a
/// daemon that will not come back (an uninstall, a test), and remove the cgroups they
/// leave (under the caller's cgroup, as a daemon started by the caller makes them). A
/// sandbox a running daemon holds is not touched (its init takes one daemon at a time).
/// Returns how many were asked to end.
pub fn end_orphaned_sandboxes(root: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(root) else {
        return 0;
    };
    let dirs: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    let mut n = 0;
    for d in &dirs {
        let control = d.join("state").join(CONTROL_SOCKET);
        if control.exists() && Init::end_orphan(&control) {
            n += 1;
        }
    }
    let Some(tree) = CgroupTree::detect(None) else {
        return n;
    };
    for d in &dirs {
        let Some(id) = d
            .file_name()
            .and_then(|f| f.to_str())
            .filter(|id| valid_id(id))
        else {
            continue;
        };
        let cg = tree.existing(id);
        // Bounded: an init asked to end is gone within a few milliseconds.
        for _ in 0..100 {
            if cg.pids().is_empty() {
                cg.remove();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    n
}

/// The sandbox's user where the sandbox is this machine: the machine's `user` when it
/// has one (a `base` root), else root.
async fn machine_user() -> (u32, u32) {
    let passwd = tokio::fs::read_to_string("/etc/passwd")
        .await
        .unwrap_or_default();
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 3 && f[0] == rootfs::BASE_USER)
                .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
                .flatten()
        })
        .unwrap_or((0, 0))
}

fn rootfs_default_disk() -> u64 {
    crate::config::DEFAULT_DISK_BYTES
}

async fn read_snapshot(dir: &Path) -> Result<SnapshotRecord> {
    let bytes = tokio::fs::read(dir.join("snapshot.json"))
        .await
        .map_err(|_| ProviderError::SandboxNotFound {
            id: format!("snapshot {}", dir.display()),
        })?;
    serde_json::from_slice(&bytes).map_err(|e| internal("cannot read snapshot.json", e))
}

/// Copy a directory tree with everything an overlay layer carries (owners, modes,
/// extended attributes, whiteouts, hard links): `cp -a`, which does all of it.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(to);
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| internal("cannot run cp", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(internal(
            "cannot copy a file-system layer",
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
        ))
    }
}

#[async_trait]
impl Provider for LocalProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            pause: self.cgroups.is_some(),
            watch: true,
            pty: true,
            reattach: true,
            renew: true,
            egress: self
                .egress_problem(self.cfg.isolation == Isolation::Machine)
                .is_ok(),
            pause_filesystem: self.cgroups.is_some(),
        }
    }

    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()> {
        ctx.check()?;
        if let Some(why) = self.host_problem() {
            return Err(ProviderError::IsolationUnavailable {
                requested: "full".into(),
                why,
            });
        }
        let probe = self
            .cfg
            .root
            .join(format!(".health-{}", uuid::Uuid::new_v4().simple()));
        let r = tokio::fs::create_dir_all(&probe).await;
        let _ = tokio::fs::remove_dir_all(&probe).await;
        r.map_err(|e| ProviderError::Unavailable {
            message: format!(
                "the sandbox root {} is not writable",
                self.cfg.root.display()
            ),
            retry_after: None,
            source: Some(Box::new(e)),
        })
    }

    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>> {
        Ok(self.create_with(ctx, spec, None).await?)
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
        let dir = self.cfg.root.join(id);
        match sandbox {
            Some(s) => s.shutdown().await,
            None => {
                // Not live here (a daemon restart): its init may still run, processes
                // it left may still be in its cgroups, and its file system mounted.
                Init::end_orphan(&dir.join("state").join(CONTROL_SOCKET));
                if let Some(t) = &self.cgroups {
                    let cg = t.existing(id);
                    cg.freeze(false);
                    for pid in cg.pids() {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                    let limit = tokio::time::Instant::now()
                        + Duration::from_millis(self.cfg.kill_verify_ms);
                    while !cg.pids().is_empty() && tokio::time::Instant::now() < limit {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    cg.remove();
                }
                rootfs::unmount(&dir);
            }
        }
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
        write_json(&self.cfg.root.join(id), RECORD, &sandbox.current_record()).await
    }

    async fn pause(&self, ctx: &CallCtx, id: &str, kind: PauseKind) -> Result<()> {
        ctx.check()?;
        if self.cgroups.is_none() {
            return Err(ProviderError::Unsupported { op: "pause" });
        }
        let sandbox = match self.connect_local(id).await {
            Ok(s) => s,
            // Stopped is paused, and more.
            Err(ProviderError::Stopped { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        match kind {
            PauseKind::Memory => {
                let Some(cg) = sandbox.core.cgroup.clone() else {
                    return Err(ProviderError::Unsupported { op: "pause" });
                };
                if blocking(move || Ok(cg.freeze(true))).await? {
                    Ok(())
                } else {
                    Err(ProviderError::Unsupported { op: "pause" })
                }
            }
            PauseKind::Filesystem => self.stop(&sandbox).await,
        }
    }

    async fn resume(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        if self.cgroups.is_none() {
            return Err(ProviderError::Unsupported { op: "resume" });
        }
        match self.connect_local(id).await {
            Ok(sandbox) => match &sandbox.core.cgroup {
                Some(cg) if cg.freeze(false) => Ok(sandbox),
                _ => Err(ProviderError::Unsupported { op: "resume" }),
            },
            Err(ProviderError::Stopped { .. }) => Ok(self.start_stopped(id).await?),
            Err(e) => Err(e),
        }
    }

    async fn snapshot(&self, ctx: &CallCtx, id: &str) -> Result<String> {
        ctx.check()?;
        let sandbox = self.connect_local(id).await?;
        let Some(store) = sandbox.core.init.store.as_ref() else {
            return Err(ProviderError::Unsupported { op: "snapshot" });
        };
        let snap = uuid::Uuid::new_v4().simple().to_string();
        let Some(snap_dir) = self.snapshot_dir(&snap) else {
            return Err(internal("bad snapshot id", std::io::Error::other(snap)));
        };
        tokio::fs::create_dir_all(&snap_dir)
            .await
            .map_err(|e| internal("cannot create the snapshot dir", e))?;
        // Frozen while copied: the layer is consistent with itself. A sandbox frozen
        // already (paused) stays frozen after.
        let frozen = match sandbox.core.cgroup.clone() {
            Some(cg) => blocking(move || Ok(!cg.frozen() && cg.freeze(true))).await?,
            None => false,
        };
        // The store is mounted in the sandbox's namespace only: reach it through the
        // descriptor its init handed over.
        let from = PathBuf::from(format!(
            "/proc/{}/fd/{}/upper",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(store)
        ));
        let to = snap_dir.join("upper");
        let copied = blocking(move || {
            if let Ok(f) = std::fs::File::open(&from) {
                let _ = rustix::fs::syncfs(&f);
            }
            copy_tree(&from, &to)
        })
        .await;
        if frozen && let Some(cg) = &sandbox.core.cgroup {
            cg.freeze(false);
        }
        if let Err(e) = copied {
            let _ = tokio::fs::remove_dir_all(&snap_dir).await;
            return Err(e);
        }
        let record = SnapshotRecord {
            id: snap.clone(),
            sandbox: id.to_owned(),
            rootfs: sandbox.record.rootfs.clone(),
            created_ms: now_ms(),
        };
        write_json(&snap_dir, "snapshot.json", &record).await?;
        Ok(snap)
    }

    async fn create_from_snapshot(
        &self,
        ctx: &CallCtx,
        snapshot: &str,
        spec: SandboxSpec,
    ) -> Result<Arc<dyn Sandbox>> {
        let not_found = || ProviderError::SandboxNotFound {
            id: format!("snapshot {snapshot}"),
        };
        let dir = self.snapshot_dir(snapshot).ok_or_else(not_found)?;
        if !dir.join("snapshot.json").is_file() {
            return Err(not_found());
        }
        Ok(self.create_with(ctx, spec, Some(dir)).await?)
    }

    async fn list_snapshots(&self, ctx: &CallCtx) -> Result<Vec<String>> {
        ctx.check()?;
        tether_provider::util::entry_names(&self.cfg.snapshots(), valid_id)
            .await
            .map_err(|e| internal("cannot list the snapshots", e))
    }

    async fn delete_snapshot(&self, ctx: &CallCtx, snapshot: &str) -> Result<()> {
        ctx.check()?;
        let Some(dir) = self.snapshot_dir(snapshot) else {
            return Ok(());
        };
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(internal("cannot remove the snapshot", e)),
        }
    }

    async fn connect_port(&self, ctx: &CallCtx, id: &str, port: u16) -> Result<PortStream> {
        ctx.check()?;
        let sandbox = self.connect_local(id).await?;
        let netns = std::fs::File::open(format!("/proc/{}/ns/net", sandbox.core.init.pid1))
            .map_err(|e| internal("cannot open the sandbox's network namespace", e))?;
        // Opened while pid1 lives, the namespace is the sandbox's (its pid was not reused).
        if !sandbox.core.init.alive() {
            return Err(ProviderError::SandboxNotFound { id: id.to_owned() });
        }
        // A caller without a deadline gets the network set-up's limit.
        let limit = ctx
            .remaining()
            .unwrap_or(Duration::from_millis(self.cfg.network_timeout_ms))
            .max(Duration::from_millis(1));
        let stream = ctx
            .run(async {
                client::connect_in_netns(netns, port, limit)
                    .await
                    .map_err(|e| ProviderError::Unavailable {
                        message: format!("nothing answers on port {port} of sandbox {id}: {e}"),
                        retry_after: None,
                        source: Some(Box::new(e)),
                    })
            })
            .await?;
        Ok(Box::new(stream))
    }

    async fn set_egress(&self, ctx: &CallCtx, id: &str, egress: Egress) -> Result<()> {
        ctx.check()?;
        let sandbox = self.connect_local(id).await?;
        if !sandbox.record.network {
            return Err(ProviderError::InvalidRequest {
                message: "the sandbox has no network: there is no egress to rule".into(),
            });
        }
        let machine = self.cfg.isolation == Isolation::Machine;
        self.egress_problem(machine)?;
        if !sandbox.record.outer_netns() {
            return Err(ProviderError::IsolationUnavailable {
                requested: "egress rules changed while the sandbox runs".into(),
                why: "its network namespace is its own (made without egress rules, or \
                      where no `ip` program could configure one from outside)"
                    .into(),
            });
        }
        let _one = sandbox.egress_lock.lock().await;
        ctx.run(crate::client::apply_egress(
            sandbox.core.init.pid1,
            &egress,
            Duration::from_millis(self.cfg.network_timeout_ms),
        ))
        .await?;
        *sandbox.egress.write().unwrap_or_else(|e| e.into_inner()) = egress;
        // Recorded for `info` and for a sandbox booted again from its record.
        write_json(&self.cfg.root.join(id), RECORD, &sandbox.current_record()).await?;
        tracing::info!(sandbox.id = %id, "Changed a local sandbox's egress rules");
        Ok(())
    }

    async fn metrics(&self, ctx: &CallCtx, id: &str) -> Result<SandboxMetrics> {
        ctx.check()?;
        let sandbox = self.connect_local(id).await?;
        let mut m = SandboxMetrics::default();
        if let Some(cg) = &sandbox.core.cgroup {
            m.cpu_usage_us = cg.cpu_usage_us();
            (m.memory_bytes, m.memory_limit_bytes) = cg.memory();
            m.pids = cg.pids_current();
        }
        if let Some((used, total)) = rootfs::disk_usage(&sandbox.core.root_view()) {
            m.disk_used_bytes = used;
            m.disk_limit_bytes = Some(total);
        }
        Ok(m)
    }
}
