//! The provider and its sandboxes: one qemu microVM per sandbox, restored from a saved,
//! booted template VM, with a VM table on disk so that VMs are found again after a
//! restart and VMs of a daemon that died are stopped.
//!
//! State layout under `root`:
//!
//! - `image/<key>/`: the guest image ([`crate::image`]);
//! - `templates/<image key>-m<MiB>-c<vCPUs>-<accel>/`: a booted template VM saved once:
//!   `state` (its RAM and devices, `migrate` to `exec:cat > state`), `disk.qcow2` (its
//!   overlay at that moment), `template.json` (what it was booted with);
//! - `vms/<id>/`: one sandbox VM: `vm.json` (the stamp: [`VmStamp`], with the owner's
//!   pid and instance id, the ports and the access token; mode 0600), `owner.pid` (the
//!   process that made the directory, written first), `qemu.pid`,
//!   `qmp.sock`, `console.log`, `qemu.log`, `disk.qcow2` (its own overlay);
//! - `snapshots/<id>/`: `state`, `disk.qcow2` and `snapshot.json`.
//!
//! Create restores the template with `-incoming` over a new overlay, waits for the agent's
//! `/health` with short probes, then calls `/init` with a fresh access token, the host's
//! time and entropy (all clones start from the same RAM). Destroy is QMP `quit`, then
//! SIGKILL after the grace, then the directory goes. Pause and resume are QMP `stop` and
//! `cont`; a snapshot is a state save plus a copy of the overlay, and a fork restores it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use backon::{ConstantBuilder, Retryable};
use serde::{Deserialize, Serialize};
use tether_envd_client::{EnvdClientConfig, EnvdSandboxClient};
use tether_protocol::process::ProcessSpec;
use tether_provider::{
    CallCtx, Capabilities, Clock, Enforcement, Fs, PauseKind, PortStream, Process, Provider,
    ProviderError, Result, Sandbox, SandboxInfo, SandboxMetrics, SandboxSpec,
};

use crate::client::{
    self, Cgroup, Empty, NetBackend, QemuProcess, StatusInfo, VmLaunch, create_overlay, qmp_call,
};
use crate::config::MicrovmConfig;
use crate::error::{internal, unavailable};
use crate::fs::{VmFs, envd_client};
use crate::image::{GuestImage, GuestProgress, GuestSpec};
use crate::process::VmProcess;

/// The provider kind.
pub const KIND: &str = "microvm";
/// The stamp's format marker.
pub const STAMP: &str = "tether-microvm-sandbox/1";
/// The template's format marker.
const TEMPLATE: &str = "tether-microvm-template/1";
/// The snapshot's format marker.
const SNAPSHOT: &str = "tether-microvm-snapshot/1";
/// The workspace of every sandbox (E2B's).
pub const WORKSPACE: &str = "/home/user";
/// The cgroup file-system root.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// How often a state save is polled.
const SAVE_POLL: Duration = Duration::from_millis(50);
/// The pid of the process that made a VM directory (written first).
const OWNER_FILE: &str = "owner.pid";
/// Attempts at starting a VM when the picked host port was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;
/// The saved state of a VM paused long enough to be stopped (in its directory).
const SUSPEND_STATE: &str = "suspend.state";

/// What the VM table keeps about a sandbox VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStamp {
    /// [`STAMP`].
    pub stamp: String,
    /// The sandbox id.
    pub id: String,
    /// The provider instance that started it.
    pub owner: String,
    /// The pid of the process that started it.
    pub owner_pid: u32,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Expiry unless renewed, ms since the epoch.
    pub expires_ms: Option<i64>,
    /// The template asked for.
    #[serde(default)]
    pub template: Option<String>,
    /// Metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Environment of every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Guest network egress.
    #[serde(default)]
    pub network: bool,
    /// How its network is attached (absent in stamps older than `passt`: slirp).
    #[serde(default)]
    pub net: Option<NetBackend>,
    /// The host port forwarded to the agent.
    pub port: u16,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// The agent's access token.
    pub token: String,
    /// The guest image it runs.
    pub image: GuestImage,
    /// The kernel command line it was booted with.
    pub cmdline: String,
    /// The qemu process runs in a cgroup with a memory limit.
    #[serde(default)]
    pub cgroup: bool,
    /// Paused (QMP `stop`).
    #[serde(default)]
    pub paused: bool,
    /// Paused long enough to be saved to [`SUSPEND_STATE`] and its qemu stopped: resume
    /// restores it (same disk, port and token).
    #[serde(default)]
    pub suspended: bool,
    /// Paused without its memory: the guest synced its disks and its qemu stopped; no
    /// state was saved, so resume boots the VM's own disk.
    #[serde(default)]
    pub stopped: bool,
}

impl VmStamp {
    /// Its qemu is stopped on purpose (saved to disk, or paused without memory).
    fn parked(&self) -> bool {
        self.suspended || self.stopped
    }
}

/// A saved template VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SavedTemplate {
    format: String,
    image: GuestImage,
    cmdline: String,
    memory_mib: u64,
    vcpus: u32,
    /// Seconds the boot took until the agent answered.
    boot_seconds: f64,
    /// The network it was booted and saved with.
    #[serde(default)]
    net: NetBackend,
    #[serde(skip)]
    dir: PathBuf,
}

/// A snapshot of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotMeta {
    format: String,
    id: String,
    source: String,
    image: GuestImage,
    cmdline: String,
    memory_mib: u64,
    vcpus: u32,
    /// The source's token, which the saved guest holds.
    token: String,
    env: BTreeMap<String, String>,
    network: bool,
    /// The network its source ran with (the saved state's).
    #[serde(default)]
    net: NetBackend,
}

/// A failed start of qemu; `clash`: the host port was taken meanwhile.
struct StartFail {
    error: ProviderError,
    clash: bool,
}

/// Where a new VM starts from.
struct Origin {
    state: PathBuf,
    disk: PathBuf,
    /// Copy `disk` (a snapshot's, so the clone outlives it) instead of an overlay on it.
    copy_disk: bool,
    image: GuestImage,
    cmdline: String,
    memory_mib: u64,
    vcpus: u32,
    /// The token the saved guest holds already (a snapshot's source's).
    prev_token: Option<String>,
    /// The network the state was saved with.
    net: NetBackend,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let bytes = serde_json::to_vec_pretty(v).map_err(|e| internal("cannot encode a stamp", e))?;
    let tmp = path.with_extension("json.new");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| internal("cannot write a stamp", e))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| internal("cannot write a stamp", e))?;
    std::fs::rename(&tmp, path).map_err(|e| internal("cannot write a stamp", e))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// An exclusive `flock` on `path`, held until the guard drops.
async fn lock_file(path: PathBuf) -> Result<nix::fcntl::Flock<std::fs::File>> {
    tokio::task::spawn_blocking(move || {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| internal("cannot open the template lock", e))?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| internal("cannot lock the templates", e))
    })
    .await
    .map_err(|e| internal("the lock task panicked", e))?
}

fn random_token() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| internal("cannot read /dev/urandom", e))?;
    Ok(hex::encode(b))
}

fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

// === VmCore ===

/// What a sandbox's parts share: its stamp, directory and qemu process.
pub struct VmCore {
    /// The VM's directory in the table.
    pub dir: PathBuf,
    stamp: RwLock<VmStamp>,
    qemu: tokio::sync::Mutex<QemuProcess>,
    /// Serialises the VM's QMP operations (qemu serves one QMP client at a time).
    op: tokio::sync::Mutex<()>,
    /// Counts pauses and resumes: a save to disk armed by a pause runs only if no
    /// resume (or later pause) came since.
    pause_epoch: std::sync::atomic::AtomicU64,
    cgroup: Option<Cgroup>,
    envd: EnvdSandboxClient,
    fs: VmFs,
    process: VmProcess,
}

impl std::fmt::Debug for VmCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmCore")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl VmStamp {
    /// How its network is attached.
    pub fn net(&self) -> NetBackend {
        self.net.unwrap_or(if self.network {
            NetBackend::SlirpOpen
        } else {
            NetBackend::Slirp
        })
    }
}

impl VmCore {
    /// The stamp now.
    pub fn stamp(&self) -> VmStamp {
        self.stamp.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut VmStamp)) -> Result<()> {
        let s = {
            let mut g = self.stamp.write().unwrap_or_else(|e| e.into_inner());
            f(&mut g);
            g.clone()
        };
        write_json(&self.dir.join("vm.json"), &s)
    }

    fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }

    fn info(&self) -> SandboxInfo {
        let s = self.stamp();
        let net = s.net();
        SandboxInfo {
            id: s.id,
            provider: KIND.into(),
            template: s.template,
            workspace: WORKSPACE.into(),
            // The VM is the boundary; what may be missing is the host-side memory limit
            // of qemu itself, or (egress through slirp) the host's loopback out of reach.
            enforcement: if s.cgroup && net != NetBackend::SlirpOpen {
                Enforcement::Full
            } else {
                Enforcement::Partial
            },
            created_ms: s.created_ms,
            expires_ms: s.expires_ms,
            metadata: s.metadata,
            network: s.network,
        }
    }

    /// The host port of the agent.
    pub fn port(&self) -> u16 {
        self.stamp().port
    }

    /// The qemu pid.
    pub async fn pid(&self) -> u32 {
        self.qemu.lock().await.pid
    }
}

/// A microVM sandbox.
#[derive(Debug)]
pub struct MicrovmSandbox {
    core: Arc<VmCore>,
}

impl MicrovmSandbox {
    /// The VM behind it.
    pub fn vm(&self) -> &Arc<VmCore> {
        &self.core
    }
}

impl Sandbox for MicrovmSandbox {
    fn info(&self) -> SandboxInfo {
        self.core.info()
    }
    fn fs(&self) -> &dyn Fs {
        &self.core.fs
    }
    fn process(&self) -> &dyn Process {
        &self.core.process
    }
    fn fs_for(&self, user: &str) -> Result<Option<Arc<dyn Fs>>> {
        // The guest agent is envd: it acts with the guest root's rights.
        Ok(Some(Arc::new(self.core.fs.for_user(user))))
    }
}

// === MicrovmProvider ===

/// The microVM provider.
pub struct MicrovmProvider {
    cfg: Arc<MicrovmConfig>,
    /// This instance's id (in every stamp it writes).
    owner: String,
    /// Readiness probes and `/init` (no pooled connections: a connection to a guest that
    /// is not listening yet stalls).
    http: reqwest::Client,
    /// The envd clients of the VMs.
    envd_http: reqwest::Client,
    envd_cfg: Arc<EnvdClientConfig>,
    templates: tokio::sync::Mutex<HashMap<String, SavedTemplate>>,
    live: RwLock<HashMap<String, Arc<VmCore>>>,
    creating: RwLock<HashSet<String>>,
    /// Saves to disk armed by pauses, cancelled when the provider goes.
    tasks: tokio_util::task::TaskTracker,
    cancel: tokio_util::sync::CancellationToken,
    /// Where the agent of a VM is dialled, given the host port its forward listens on.
    route: AgentRoute,
}

/// Where the provider dials a VM's guest agent, given the host port of the VM's forward
/// (on 127.0.0.1). Every call to the agent goes there: readiness probes, `/init`, envd
/// and port tunnels. The default is the forward itself; [`MicrovmProvider::with_agent_route`]
/// puts something in between (a fault-injecting proxy, in tether's own fault matrix).
pub type AgentRoute = Arc<dyn Fn(u16) -> std::net::SocketAddr + Send + Sync>;

/// The VM's forward itself.
fn direct_route() -> AgentRoute {
    Arc::new(|port| std::net::SocketAddr::from(([127, 0, 0, 1], port)))
}

impl std::fmt::Debug for MicrovmProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicrovmProvider")
            .field("root", &self.cfg.root)
            .finish_non_exhaustive()
    }
}

/// A VM being started. The id leaves `creating` when the start ends; a start whose
/// future was dropped (a caller that went away) is undone here ([`undo_start`]).
struct Starting<'a> {
    creating: &'a RwLock<HashSet<String>>,
    tasks: &'a tokio_util::task::TaskTracker,
    dir: PathBuf,
    id: String,
    /// The start ran to its end (and undid itself if it failed).
    settled: bool,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.creating
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        if self.settled {
            return;
        }
        let (id, dir) = (self.id.clone(), self.dir.clone());
        // The removal waits for the dropped qemu (being killed) to leave its cgroup: off
        // the runtime's threads when there is one.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.tasks.spawn_blocking(move || undo_start(&id, &dir));
        } else {
            undo_start(&id, &dir);
        }
    }
}

/// Remove what a start that did not finish left: the VM's cgroup, with whatever still
/// runs in it, and its directory.
fn undo_start(id: &str, dir: &Path) {
    if let Some(cg) = Cgroup::find(Path::new(CGROUP_ROOT), id) {
        cg.remove();
    }
    let _ = std::fs::remove_dir_all(dir);
}

impl Drop for MicrovmProvider {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.tasks.close();
        // No qemu outlives the provider that started it (a daemon killed with -9 runs no
        // destructor: its VMs are found in the table by the next one).
        let live = std::mem::take(&mut *self.live.write().unwrap_or_else(|e| e.into_inner()));
        for (_, core) in live {
            core.envd.close();
            // A VM this instance only found in the table is its starter's.
            if core.stamp().owner != self.owner {
                continue;
            }
            if let Ok(q) = core.qemu.try_lock()
                && client::pid_is_vm(q.pid, &core.dir)
            {
                client::kill_pid(q.pid);
            }
            if let Some(cg) = &core.cgroup {
                cg.remove();
            }
            let _ = std::fs::remove_dir_all(&core.dir);
        }
    }
}

impl MicrovmProvider {
    /// A provider over `cfg` (validated here). Template VMs whose boot a dead process left
    /// behind are killed and VM directories whose qemu is gone are removed.
    pub fn new(cfg: MicrovmConfig) -> Result<Self> {
        cfg.validate()?;
        for d in ["vms", "templates", "snapshots"] {
            std::fs::create_dir_all(cfg.root.join(d))
                .map_err(|e| internal("cannot create the state directory", e))?;
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()
            .map_err(|e| internal("cannot build the HTTP client", e))?;
        let envd_http = reqwest::Client::builder()
            .no_proxy()
            .pool_idle_timeout(std::time::Duration::from_millis(cfg.envd.pool_idle_ms))
            .build()
            .map_err(|e| internal("cannot build the HTTP client", e))?;
        let p = Self {
            envd_cfg: Arc::new(cfg.envd.clone()),
            cfg: Arc::new(cfg),
            owner: uuid::Uuid::new_v4().simple().to_string(),
            http,
            envd_http,
            templates: tokio::sync::Mutex::new(HashMap::new()),
            live: RwLock::new(HashMap::new()),
            creating: RwLock::new(HashSet::new()),
            tasks: tokio_util::task::TaskTracker::new(),
            cancel: tokio_util::sync::CancellationToken::new(),
            route: direct_route(),
        };
        p.sweep();
        Ok(p)
    }

    /// The same provider, dialling each VM's agent where `route` says (see
    /// [`AgentRoute`]).
    #[must_use]
    pub fn with_agent_route(mut self, route: AgentRoute) -> Self {
        self.route = route;
        self
    }

    /// The address the agent behind host port `port` is dialled at.
    fn agent(&self, port: u16) -> std::net::SocketAddr {
        (self.route)(port)
    }

    /// The configuration.
    pub fn config(&self) -> &MicrovmConfig {
        &self.cfg
    }

    fn vms(&self) -> PathBuf {
        self.cfg.root.join("vms")
    }

    /// Kill unfinished template boots and remove VM dirs whose qemu is gone.
    fn sweep(&self) {
        // A boot in progress holds the templates' lock: only a dead process's is swept.
        let tdir = self.cfg.root.join("templates");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(tdir.join(".lock"))
            .ok()
            .and_then(|f| {
                nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).ok()
            });
        if lock.is_some() {
            for e in std::fs::read_dir(&tdir).into_iter().flatten().flatten() {
                let p = e.path();
                if e.file_name().to_string_lossy().contains(".building-") {
                    let boot = p.join("boot");
                    if let Some(pid) = client::read_pidfile(&boot.join("qemu.pid"))
                        && client::pid_is_vm(pid, &boot)
                    {
                        client::kill_pid(pid);
                    }
                    let _ = std::fs::remove_dir_all(&p);
                }
            }
        }
        drop(lock);
        for e in std::fs::read_dir(self.vms())
            .into_iter()
            .flatten()
            .flatten()
        {
            let dir = e.path();
            let alive = client::read_pidfile(&dir.join("qemu.pid"))
                .is_some_and(|pid| client::pid_is_vm(pid, &dir));
            // A VM being started by a live process has no running qemu yet.
            let owner_alive = match client::read_pidfile(&dir.join(OWNER_FILE)) {
                Some(pid) => client::pid_alive(pid),
                None => std::fs::metadata(&dir)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age < Duration::from_secs(60)),
            };
            // A suspended VM has no qemu on purpose: its lease decides.
            let suspended = read_json::<VmStamp>(&dir.join("vm.json")).is_some_and(|s| s.parked());
            if !alive && !owner_alive && !suspended {
                let id = e.file_name().to_string_lossy().into_owned();
                if let Some(cg) = Cgroup::find(Path::new(CGROUP_ROOT), &id) {
                    cg.remove();
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    fn guest_spec(&self) -> Result<GuestSpec> {
        let agent = self
            .cfg
            .agent_binary()
            .ok_or_else(|| unavailable("microvm: no guest agent binary (set agent_binary)"))?;
        let template = self.cfg.base_template.clone().ok_or_else(|| {
            unavailable("microvm: no base template directory (set base_template)")
        })?;
        Ok(GuestSpec {
            out_dir: self.cfg.image_dir(),
            template,
            template_uid_base: self.cfg.template_uid_base,
            agent,
            disk_mib: self.cfg.disk_mib,
        })
    }

    /// Build the guest image (cached), reporting progress.
    pub async fn build_image(
        &self,
        progress: impl FnMut(GuestProgress) + Send + 'static,
    ) -> Result<GuestImage> {
        let spec = self.guest_spec()?;
        let mut progress = progress;
        tokio::task::spawn_blocking(move || crate::image::build_guest(&spec, &mut progress))
            .await
            .map_err(|e| internal("the image build panicked", e))?
    }

    /// A sandbox with egress is refused unless weaker isolation is allowed: slirp without
    /// `restrict` also gives the guest the host's loopback (10.0.2.2).
    fn check_network(&self, spec: &SandboxSpec) -> Result<()> {
        refuse_egress(spec)?;
        self.net_for(spec.network, NetBackend::Passt).map(|_| ())
    }

    /// The network of a VM with egress or not (`network`), restored from a state saved
    /// with `saved`: `passt` for egress where it is installed and the state loads into
    /// it, slirp with egress (the host's loopback in reach) only where weaker isolation
    /// is allowed, else `ISOLATION_UNAVAILABLE`.
    fn net_for(&self, network: bool, saved: NetBackend) -> Result<NetBackend> {
        if !network {
            return Ok(NetBackend::Slirp);
        }
        let passt = client::passt_binary(&self.cfg).is_some();
        if passt && saved.restores_into(NetBackend::Passt) {
            return Ok(NetBackend::Passt);
        }
        if self.cfg.allow_weaker_isolation {
            return Ok(NetBackend::SlirpOpen);
        }
        Err(ProviderError::IsolationUnavailable {
            requested: "network egress without the host's loopback".into(),
            why: if passt {
                "the snapshot was saved under slirp, which only slirp restores, and slirp \
                 gives a guest with egress the host's loopback as 10.0.2.2 (set \
                 allow_weaker_isolation to accept it)"
            } else {
                "passt is not installed, and slirp gives a guest with egress the host's \
                 loopback as 10.0.2.2 (install passt, or set allow_weaker_isolation to \
                 accept it)"
            }
            .into(),
        })
    }

    /// Build the guest image and boot and save the template of the default size, unless
    /// they are there: later creates only restore.
    pub async fn prepare(&self, ctx: &CallCtx) -> Result<()> {
        self.template(ctx, self.cfg.memory_mib, self.cfg.vcpus)
            .await
            .map(|_| ())
    }

    /// The VM of sandbox `id` (this instance's, or a running one in the table).
    pub fn vm(&self, id: &str) -> Option<Arc<VmCore>> {
        self.core(id)
    }

    fn size_of(&self, spec: &SandboxSpec) -> Result<(u64, u32)> {
        self.check_network(spec)?;
        let mem = spec
            .limits
            .memory_bytes
            .map_or(self.cfg.memory_mib, |b| b.div_ceil(1 << 20));
        let cpus = spec
            .limits
            .cpu_millis
            .map_or(self.cfg.vcpus, |m| m.div_ceil(1000).max(1) as u32);
        if !(64..=1 << 20).contains(&mem) {
            return Err(ProviderError::InvalidRequest {
                message: format!("microvm: memory {mem} MiB is out of range (64 MiB..1 TiB)"),
            });
        }
        if !(1..=64).contains(&cpus) {
            return Err(ProviderError::InvalidRequest {
                message: format!("microvm: {cpus} vCPUs is out of range (1..64)"),
            });
        }
        if spec
            .limits
            .disk_bytes
            .is_some_and(|d| d != self.cfg.disk_mib << 20)
        {
            return Err(ProviderError::InvalidRequest {
                message: format!(
                    "microvm: the disk size is the image's ({} MiB, config disk_mib)",
                    self.cfg.disk_mib
                ),
            });
        }
        Ok((mem, cpus))
    }

    /// The saved template of this size, booted and saved now if there is none. Returns
    /// it and whether it was made by this call.
    async fn template(&self, ctx: &CallCtx, mem: u64, cpus: u32) -> Result<SavedTemplate> {
        // Found once per provider: the image check runs apt-cache and hashes the agent.
        let size = format!("m{mem}-c{cpus}");
        let mut map = self.templates.lock().await;
        if let Some(t) = map.get(&size) {
            return Ok(t.clone());
        }
        // One build and one boot per template across processes too (parallel test
        // processes, two daemons on one state directory); finding them built needs no lock.
        let lock_path = self.cfg.root.join("templates").join(".lock");
        let spec = self.guest_spec()?;
        let found = tokio::task::spawn_blocking(move || crate::image::find_guest(&spec))
            .await
            .map_err(|e| internal("the image check panicked", e))?;
        let (image, held) = match found {
            Some(image) => (image, None),
            None => {
                let lock = lock_file(lock_path.clone()).await?;
                let image = self
                    .build_image(|p| {
                        if let GuestProgress::Step(s) = p {
                            tracing::info!(step = %s, "Building the microVM guest image");
                        }
                    })
                    .await?;
                (image, Some(lock))
            }
        };
        let kvm = client::use_kvm(&self.cfg);
        // Booted under passt where it is: such a state restores under either network.
        let net = if client::passt_binary(&self.cfg).is_some() {
            NetBackend::Passt
        } else {
            NetBackend::Slirp
        };
        let key = format!(
            "{}-{size}-{}{}",
            image.key,
            if kvm { "kvm" } else { "tcg" },
            if net == NetBackend::Passt {
                "-passt"
            } else {
                ""
            }
        );
        let dir = self.cfg.root.join("templates").join(&key);
        if let Some(mut t) = read_json::<SavedTemplate>(&dir.join("template.json"))
            && t.format == TEMPLATE
            && dir.join("state").exists()
        {
            t.dir = dir;
            map.insert(size, t.clone());
            return Ok(t);
        }
        let _lock = match held {
            Some(l) => l,
            None => lock_file(lock_path).await?,
        };
        if let Some(mut t) = read_json::<SavedTemplate>(&dir.join("template.json"))
            && t.format == TEMPLATE
            && dir.join("state").exists()
        {
            t.dir = dir;
            map.insert(size, t.clone());
            return Ok(t);
        }
        ctx.check()?;
        let t = self
            .boot_template(&image, &dir, mem, cpus, kvm, net)
            .await?;
        map.insert(size, t.clone());
        Ok(t)
    }

    async fn boot_template(
        &self,
        image: &GuestImage,
        dir: &Path,
        mem: u64,
        cpus: u32,
        kvm: bool,
        net: NetBackend,
    ) -> Result<SavedTemplate> {
        let started = tokio::time::Instant::now();
        let tmp = dir.with_file_name(format!(
            "{}.building-{}",
            dir.file_name().and_then(|n| n.to_str()).unwrap_or("t"),
            uuid::Uuid::new_v4().simple()
        ));
        let boot = tmp.join("boot");
        std::fs::create_dir_all(&boot)
            .map_err(|e| internal("cannot create the template dir", e))?;
        let cmdline = client::kernel_cmdline(kvm);
        let r = async {
            let disk = boot.join("disk.qcow2");
            create_overlay(&self.cfg, &image.rootfs, "raw", &disk).await?;
            let launch = VmLaunch {
                dir: boot.clone(),
                disk: disk.clone(),
                port: client::free_port()?,
                net,
                memory_mib: mem,
                vcpus: cpus,
                incoming: None,
            };
            tracing::info!(
                memory_mib = mem,
                vcpus = cpus,
                kvm,
                "Booting the microVM template"
            );
            let mut q = QemuProcess::spawn(&self.cfg, image, &launch, &cmdline, None)?;
            let r = async {
                client::wait_ready(
                    &self.http,
                    self.agent(launch.port),
                    &mut q,
                    self.cfg.probe_timeout(),
                    self.cfg.boot_timeout(),
                    &launch.console(),
                )
                .await?;
                let boot_seconds = started.elapsed().as_secs_f64();
                client::save_state(
                    &launch.qmp(),
                    &tmp.join("state"),
                    self.cfg.save_timeout(),
                    SAVE_POLL,
                )
                .await?;
                // The VM is stopped now: its overlay is what the saved RAM expects.
                tokio::fs::copy(&disk, tmp.join("disk.qcow2"))
                    .await
                    .map_err(|e| internal("cannot copy the template disk", e))?;
                Ok::<_, ProviderError>(boot_seconds)
            }
            .await;
            q.kill(self.cfg.stop_grace()).await;
            let boot_seconds = r?;
            // The copy's backing file is the image's rootfs (absolute): the copy stands alone.
            let t = SavedTemplate {
                format: TEMPLATE.into(),
                image: image.clone(),
                cmdline: cmdline.clone(),
                memory_mib: mem,
                vcpus: cpus,
                boot_seconds,
                net,
                dir: dir.to_owned(),
            };
            write_json(&tmp.join("template.json"), &t)?;
            let _ = std::fs::remove_dir_all(&boot);
            if std::fs::rename(&tmp, dir).is_err() && !dir.join("template.json").exists() {
                return Err(unavailable("microvm: cannot move the template into place"));
            }
            tracing::info!(seconds = boot_seconds, "Saved the microVM template");
            Ok(t)
        }
        .await;
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        r
    }

    /// Start a VM from `origin`: its own dir, overlay and port; restore; wait for the
    /// agent; `/init`.
    async fn start_vm(
        &self,
        ctx: &CallCtx,
        origin: Origin,
        spec: SandboxSpec,
    ) -> Result<Arc<VmCore>> {
        ctx.check()?;
        let id = format!("vm-{}", uuid::Uuid::new_v4().simple());
        self.creating
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone());
        let mut starting = Starting {
            creating: &self.creating,
            tasks: &self.tasks,
            dir: self.vms().join(&id),
            id: id.clone(),
            settled: false,
        };
        let r = self.start_vm_inner(ctx, &id, origin, spec).await;
        if r.is_err() {
            undo_start(&id, &starting.dir);
        }
        starting.settled = true;
        r
    }

    async fn start_vm_inner(
        &self,
        ctx: &CallCtx,
        id: &str,
        origin: Origin,
        spec: SandboxSpec,
    ) -> Result<Arc<VmCore>> {
        let dir = self.vms().join(id);
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| internal("cannot create the VM dir", e))?;
        }
        std::fs::write(dir.join(OWNER_FILE), std::process::id().to_string())
            .map_err(|e| internal("cannot write the VM's owner", e))?;
        let disk = dir.join("disk.qcow2");
        if origin.copy_disk {
            tokio::fs::copy(&origin.disk, &disk)
                .await
                .map_err(|e| internal("cannot copy the snapshot's disk", e))?;
        } else {
            create_overlay(&self.cfg, &origin.disk, "qcow2", &disk).await?;
        }
        let cgroup = if self.cfg.cgroup {
            Cgroup::create(
                Path::new(CGROUP_ROOT),
                id,
                (origin.memory_mib + self.cfg.qemu_overhead_mib) << 20,
            )
        } else {
            None
        };
        let net = self.net_for(spec.network, origin.net)?;
        let token = random_token()?;
        let created = now_ms();
        let ttl = spec
            .ttl
            .unwrap_or(Duration::from_millis(self.cfg.default_ttl_ms));
        let stamp = VmStamp {
            stamp: STAMP.into(),
            id: id.to_owned(),
            owner: self.owner.clone(),
            owner_pid: std::process::id(),
            created_ms: created,
            expires_ms: Some(created + ttl.as_millis() as i64),
            template: spec.template.clone(),
            metadata: spec.metadata.clone(),
            env: spec.env.clone(),
            network: spec.network,
            net: Some(net),
            port: 0,
            memory_mib: origin.memory_mib,
            vcpus: origin.vcpus,
            token: token.clone(),
            image: origin.image.clone(),
            cmdline: origin.cmdline.clone(),
            cgroup: cgroup.is_some(),
            paused: false,
            suspended: false,
            stopped: false,
        };
        // Start, and start again on a new port if the one picked was taken meanwhile.
        let attempt = || {
            let mut stamp = stamp.clone();
            let (dir, disk, origin, cgroup) = (&dir, &disk, &origin, cgroup.as_ref());
            async move {
                let fail = |error| StartFail {
                    error,
                    clash: false,
                };
                let port = client::free_port().map_err(fail)?;
                stamp.port = port;
                write_json(&dir.join("vm.json"), &stamp).map_err(fail)?;
                let launch = VmLaunch {
                    dir: dir.clone(),
                    disk: disk.clone(),
                    port,
                    net,
                    memory_mib: origin.memory_mib,
                    vcpus: origin.vcpus,
                    incoming: Some(origin.state.clone()),
                };
                let mut q =
                    QemuProcess::spawn(&self.cfg, &origin.image, &launch, &origin.cmdline, cgroup)
                        .map_err(fail)?;
                // The caller's deadline bounds the wait too: an agent that never answers
                // looks like a guest still waking up.
                match ctx
                    .run(client::wait_ready(
                        &self.http,
                        self.agent(port),
                        &mut q,
                        self.cfg.probe_timeout(),
                        self.cfg.restore_timeout(),
                        &launch.console(),
                    ))
                    .await
                {
                    Ok(()) => Ok((q, stamp)),
                    Err(error) => {
                        // passt ends at once when it cannot bind the host port.
                        let passt_gone = q.passt_exited();
                        q.kill(self.cfg.stop_grace()).await;
                        let log = std::fs::read_to_string(launch.log()).unwrap_or_default();
                        Err(StartFail {
                            error,
                            clash: log.contains("host forwarding") || passt_gone,
                        })
                    }
                }
            }
        };
        let t0 = tokio::time::Instant::now();
        let (mut q, stamp) = attempt
            .retry(
                ConstantBuilder::default()
                    .with_delay(Duration::from_millis(10))
                    .with_max_times(PORT_ATTEMPTS - 1),
            )
            .when(|f: &StartFail| f.clash)
            .await
            .map_err(|f| f.error)?;
        let restored = t0.elapsed();
        let body = tether_protocol::e2b::InitRequest {
            env_vars: Some(stamp.env.clone()),
            access_token: Some(token),
            default_user: None,
            default_workdir: None,
            timestamp: Some(rfc3339_now()),
            tether_entropy: Some(client::entropy()?),
        };
        if let Err(e) = ctx
            .run(client::init_agent(
                &self.http,
                self.agent(stamp.port),
                &body,
                origin.prev_token.as_deref(),
                self.cfg.init_timeout(),
            ))
            .await
        {
            q.kill(self.cfg.stop_grace()).await;
            return Err(e);
        }
        tracing::debug!(
            sandbox.id = %id,
            restore_ms = restored.as_millis() as u64,
            init_ms = (t0.elapsed() - restored).as_millis() as u64,
            "Restored a microVM"
        );
        if ctx.check().is_err() {
            q.kill(self.cfg.stop_grace()).await;
            ctx.check()?;
        }
        let core = match self.vm_core(dir, stamp, q, cgroup) {
            Ok(c) => Arc::new(c),
            Err((e, mut q)) => {
                q.kill(self.cfg.stop_grace()).await;
                return Err(e);
            }
        };
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), core.clone());
        Ok(core)
    }

    fn sandbox(&self, core: Arc<VmCore>) -> Result<Arc<dyn Sandbox>> {
        Ok(Arc::new(MicrovmSandbox { core }))
    }

    /// A VM's shared parts, its envd client among them (on failure, the qemu back).
    #[allow(clippy::result_large_err)]
    fn vm_core(
        &self,
        dir: PathBuf,
        stamp: VmStamp,
        qemu: QemuProcess,
        cgroup: Option<Cgroup>,
    ) -> std::result::Result<VmCore, (ProviderError, QemuProcess)> {
        let envd = match envd_client(
            &stamp.id,
            self.agent(stamp.port),
            &stamp.token,
            self.envd_cfg.clone(),
            self.envd_http.clone(),
        ) {
            Ok(c) => c,
            Err(e) => return Err((e, qemu)),
        };
        Ok(VmCore {
            dir,
            fs: envd.fs(),
            process: envd.process(),
            envd,
            stamp: RwLock::new(stamp),
            qemu: tokio::sync::Mutex::new(qemu),
            op: tokio::sync::Mutex::new(()),
            pause_epoch: std::sync::atomic::AtomicU64::new(0),
            cgroup,
        })
    }

    /// The live VM `id`: this instance's, or one in the table whose qemu runs.
    fn core(&self, id: &str) -> Option<Arc<VmCore>> {
        if let Some(c) = self.live.read().unwrap_or_else(|e| e.into_inner()).get(id) {
            return Some(c.clone());
        }
        if id.contains('/') || id.contains("..") || id.is_empty() {
            return None;
        }
        let dir = self.vms().join(id);
        let stamp: VmStamp = read_json(&dir.join("vm.json"))?;
        if stamp.stamp != STAMP || stamp.id != id {
            return None;
        }
        let qemu = match client::read_pidfile(&dir.join("qemu.pid")) {
            Some(pid) if client::pid_is_vm(pid, &dir) => QemuProcess::adopt(pid),
            // Saved to disk or stopped: no qemu until resumed.
            _ if stamp.parked() => QemuProcess::none(),
            _ => return None,
        };
        let cgroup = Cgroup::find(Path::new(CGROUP_ROOT), id);
        let core = Arc::new(self.vm_core(dir, stamp, qemu, cgroup).ok()?);
        let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
        Some(live.entry(id.to_owned()).or_insert(core).clone())
    }

    /// Stop `core`'s qemu: QMP `quit`, SIGKILL after the grace; then its cgroup and dir.
    async fn stop(&self, core: &VmCore) {
        let _op = core.op.lock().await;
        let grace = self.cfg.stop_grace();
        core.envd.close();
        core.envd.drain(grace).await;
        let _ = qmp_call::<(), Empty>(&core.qmp(), "quit", None, grace.min(self.cfg.qmp_timeout()))
            .await;
        let mut q = core.qemu.lock().await;
        if !q.wait_exit(grace).await {
            q.kill_vm(&core.dir, grace).await;
        }
        if let Some(cg) = &core.cgroup {
            cg.remove();
        }
        let _ = tokio::fs::remove_dir_all(&core.dir).await;
    }

    /// Destroy every VM in the table whose owner process is gone and that no daemon's
    /// lease covers (`tether.daemon` metadata: those are left to that daemon's lease
    /// reconciler, which may re-attach them). Returns their ids.
    pub async fn reap_orphans(&self, ctx: &CallCtx) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for info in self.list(ctx).await? {
            let Some(core) = self.core(&info.id) else {
                continue;
            };
            let s = core.stamp();
            if s.owner != self.owner
                && !client::pid_alive(s.owner_pid)
                && !s.metadata.contains_key("tether.daemon")
            {
                self.destroy(ctx, &info.id).await?;
                out.push(info.id);
            }
        }
        Ok(out)
    }

    /// Pause `core` without its memory: the guest flushes its disks (`sync` through the
    /// agent; a VM paused in memory runs again for it, and one saved to disk is restored
    /// first, since its unwritten pages are in the saved memory), then its qemu quits.
    /// The stamp says `stopped` only once qemu is gone, so a crash midway leaves a VM
    /// that is found running (or saved) as before.
    async fn stop_guest(&self, ctx: &CallCtx, core: &Arc<VmCore>) -> Result<()> {
        let _op = core.op.lock().await;
        core.pause_epoch
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let s = core.stamp();
        if s.stopped {
            return Ok(());
        }
        if s.suspended {
            self.restore_suspended(core).await?;
            core.update(|s| s.suspended = false)?;
            let _ = std::fs::remove_file(core.dir.join(SUSPEND_STATE));
        }
        if s.paused && !s.suspended {
            qmp_call::<(), Empty>(&core.qmp(), "cont", None, self.cfg.qmp_timeout()).await?;
        }
        let sctx = ctx.with_timeout(self.cfg.qmp_timeout(), Clock::Total);
        let h = core
            .process
            .spawn(&sctx, ProcessSpec::argv(["sync"]))
            .await?;
        let status = h.wait(&sctx).await?;
        if status.code != Some(0) {
            return Err(internal(
                "the guest could not sync its disks",
                std::io::Error::other(format!("sync ended with {status:?}")),
            ));
        }
        let grace = self.cfg.stop_grace();
        let _ = qmp_call::<(), Empty>(&core.qmp(), "quit", None, grace.min(self.cfg.qmp_timeout()))
            .await;
        let mut q = core.qemu.lock().await;
        if !q.wait_exit(grace).await {
            q.kill_vm(&core.dir, grace).await;
        }
        *q = QemuProcess::none();
        core.update(|s| {
            s.stopped = true;
            s.paused = true;
        })?;
        tracing::info!(sandbox.id = %s.id, "Stopped a microVM paused without its memory");
        Ok(())
    }

    /// Boot a VM paused without its memory from its own disk (same disk, port and token,
    /// the template's kernel and command line): a new boot, its processes gone, its files
    /// kept. `/init` sets the clock and entropy. On failure it stays stopped.
    async fn boot_stopped(&self, core: &VmCore) -> Result<()> {
        self.relaunch(core, None).await?;
        tracing::info!(sandbox.id = %core.stamp().id, "Booted a microVM paused without its memory");
        Ok(())
    }

    /// Start the qemu of a VM saved to disk by a long pause, from its saved state, over
    /// its own disk, on its port, in its cgroup; continue it; wait for the agent; `/init`
    /// with its token re-sets the guest's clock. On failure it stays suspended.
    async fn restore_suspended(&self, core: &VmCore) -> Result<()> {
        let state = core.dir.join(SUSPEND_STATE);
        self.relaunch(core, Some(state.clone())).await?;
        let _ = std::fs::remove_file(&state);
        tracing::info!(sandbox.id = %core.stamp().id, "Restored a microVM saved to disk by a long pause");
        Ok(())
    }

    /// Start `core`'s qemu again over its own disk, on its port, in its cgroup: from
    /// `incoming` (a saved state, continued once loaded) or by a boot; wait for the agent
    /// and `/init` it with the VM's token, the host's time and new entropy. On failure no
    /// qemu is left.
    async fn relaunch(&self, core: &VmCore, incoming: Option<PathBuf>) -> Result<()> {
        let s = core.stamp();
        let restore = incoming.is_some();
        let launch = VmLaunch {
            dir: core.dir.clone(),
            disk: core.dir.join("disk.qcow2"),
            port: s.port,
            net: s.net(),
            memory_mib: s.memory_mib,
            vcpus: s.vcpus,
            incoming,
        };
        let mut q = core.qemu.lock().await;
        q.kill_vm(&core.dir, self.cfg.stop_grace()).await;
        *q = QemuProcess::spawn(
            &self.cfg,
            &s.image,
            &launch,
            &s.cmdline,
            core.cgroup.as_ref(),
        )?;
        let r = async {
            let ready_within = if restore {
                // The state was saved stopped, so the restored VM is stopped until `cont`.
                client::wait_incoming(&core.qmp(), self.cfg.restore_timeout(), SAVE_POLL).await?;
                qmp_call::<(), Empty>(&core.qmp(), "cont", None, self.cfg.qmp_timeout()).await?;
                self.cfg.restore_timeout()
            } else {
                self.cfg.boot_timeout()
            };
            client::wait_ready(
                &self.http,
                self.agent(s.port),
                &mut q,
                self.cfg.probe_timeout(),
                ready_within,
                &launch.console(),
            )
            .await?;
            let body = tether_protocol::e2b::InitRequest {
                env_vars: None,
                access_token: Some(s.token.clone()),
                default_user: None,
                default_workdir: None,
                timestamp: Some(rfc3339_now()),
                tether_entropy: Some(client::entropy()?),
            };
            client::init_agent(
                &self.http,
                self.agent(s.port),
                &body,
                Some(&s.token),
                self.cfg.init_timeout(),
            )
            .await
        }
        .await;
        if let Err(e) = r {
            q.kill(self.cfg.stop_grace()).await;
            *q = QemuProcess::none();
            return Err(e);
        }
        Ok(())
    }

    async fn status(&self, core: &VmCore) -> Result<StatusInfo> {
        qmp_call::<(), StatusInfo>(&core.qmp(), "query-status", None, self.cfg.qmp_timeout()).await
    }

    fn not_found(id: &str) -> ProviderError {
        ProviderError::SandboxNotFound { id: id.to_owned() }
    }

    fn snapshot_dir(&self, id: &str) -> Option<PathBuf> {
        (!id.is_empty() && !id.contains('/') && !id.contains(".."))
            .then(|| self.cfg.root.join("snapshots").join(id))
    }
}

#[async_trait]
impl Provider for MicrovmProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            pause: true,
            watch: crate::fs::WATCH,
            pty: true,
            reattach: true,
            renew: true,
            egress: false,
            // The guest syncs, its qemu stops; resume boots the VM's own disk.
            pause_filesystem: true,
        }
    }

    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()> {
        for p in [&self.cfg.qemu, &self.cfg.qemu_img] {
            if crate::image::which(p).is_none() {
                return Err(unavailable(format!(
                    "microvm: {p} is missing (apt-get install qemu-system-x86 qemu-utils)"
                )));
            }
        }
        let reaped = self.reap_orphans(ctx).await?;
        if !reaped.is_empty() {
            tracing::info!(count = reaped.len(), "Stopped orphaned microVMs");
        }
        Ok(())
    }

    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        refuse_egress(&spec)?;
        let (mem, cpus) = self.size_of(&spec)?;
        let t = self.template(ctx, mem, cpus).await?;
        let origin = Origin {
            state: t.dir.join("state"),
            disk: t.dir.join("disk.qcow2"),
            copy_disk: false,
            image: t.image.clone(),
            cmdline: t.cmdline.clone(),
            memory_mib: mem,
            vcpus: cpus,
            prev_token: None,
            net: t.net,
        };
        let core = self.start_vm(ctx, origin, spec).await?;
        tracing::info!(sandbox.id = %core.stamp().id, port = core.port(), "Created a microVM sandbox");
        self.sandbox(core)
    }

    async fn connect(&self, _ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        if core.stamp().stopped {
            return Err(ProviderError::Stopped { id: id.to_owned() });
        }
        self.sandbox(core)
    }

    async fn list(&self, _ctx: &CallCtx) -> Result<Vec<SandboxInfo>> {
        let mut out = Vec::new();
        let creating = self
            .creating
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for e in std::fs::read_dir(self.vms())
            .into_iter()
            .flatten()
            .flatten()
        {
            let id = e.file_name().to_string_lossy().into_owned();
            if creating.contains(&id) {
                continue;
            }
            if let Some(core) = self.core(&id) {
                out.push(core.info());
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn destroy(&self, _ctx: &CallCtx, id: &str) -> Result<()> {
        let core = self.core(id);
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        match core {
            Some(core) => {
                self.stop(&core).await;
                tracing::info!(sandbox.id = %id, "Destroyed a microVM sandbox");
            }
            None => {
                // A directory whose qemu is gone already.
                if !id.is_empty() && !id.contains('/') && !id.contains("..") {
                    let _ = tokio::fs::remove_dir_all(self.vms().join(id)).await;
                }
            }
        }
        Ok(())
    }

    async fn renew(&self, _ctx: &CallCtx, id: &str, ttl: Duration) -> Result<()> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        core.update(|s| s.expires_ms = Some(now_ms() + ttl.as_millis() as i64))
    }

    async fn pause(&self, ctx: &CallCtx, id: &str, kind: PauseKind) -> Result<()> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        if kind == PauseKind::Filesystem {
            return self.stop_guest(ctx, &core).await;
        }
        let _op = core.op.lock().await;
        if core.stamp().parked() {
            return Ok(());
        }
        qmp_call::<(), Empty>(&core.qmp(), "stop", None, self.cfg.qmp_timeout()).await?;
        core.update(|s| s.paused = true)?;
        let epoch = core
            .pause_epoch
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        if let Some(after) = self.cfg.pause_to_disk_after() {
            let (cfg, core, cancel) = (self.cfg.clone(), core.clone(), self.cancel.clone());
            self.tasks.spawn(async move {
                tokio::select! {
                    () = cancel.cancelled() => {}
                    () = tokio::time::sleep(after) => {
                        if let Err(e) = suspend_to_disk(&cfg, &core, epoch).await {
                            tracing::warn!(
                                sandbox.id = %core.stamp().id,
                                error = %e,
                                "Could not save a paused microVM to disk; it stays paused in memory"
                            );
                        }
                    }
                }
            });
        }
        Ok(())
    }

    async fn resume(&self, _ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        {
            let _op = core.op.lock().await;
            core.pause_epoch
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if core.stamp().stopped {
                self.boot_stopped(&core).await?;
            } else if core.stamp().suspended {
                self.restore_suspended(&core).await?;
            } else {
                qmp_call::<(), Empty>(&core.qmp(), "cont", None, self.cfg.qmp_timeout()).await?;
            }
            core.update(|s| {
                s.paused = false;
                s.suspended = false;
                s.stopped = false;
            })?;
        }
        self.sandbox(core)
    }

    async fn snapshot(&self, _ctx: &CallCtx, id: &str) -> Result<String> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        if core.stamp().stopped {
            return Err(ProviderError::Stopped { id: id.to_owned() });
        }
        let sid = format!("snap-{}", uuid::Uuid::new_v4().simple());
        let final_dir = self.cfg.root.join("snapshots").join(&sid);
        let tmp = final_dir.with_extension("tmp");
        std::fs::create_dir_all(&tmp).map_err(|e| internal("cannot create the snapshot dir", e))?;
        let _op = core.op.lock().await;
        let was_running = self.status(&core).await?.running;
        let saved = async {
            client::save_state(
                &core.qmp(),
                &tmp.join("state"),
                self.cfg.save_timeout(),
                SAVE_POLL,
            )
            .await?;
            // Stopped now (postmigrate): the overlay matches the saved RAM.
            tokio::fs::copy(core.dir.join("disk.qcow2"), tmp.join("disk.qcow2"))
                .await
                .map_err(|e| internal("cannot copy the disk", e))?;
            Ok::<_, ProviderError>(())
        }
        .await;
        if was_running {
            qmp_call::<(), Empty>(&core.qmp(), "cont", None, self.cfg.qmp_timeout()).await?;
        }
        if let Err(e) = saved {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let s = core.stamp();
        let net = s.net();
        let meta = SnapshotMeta {
            format: SNAPSHOT.into(),
            id: sid.clone(),
            source: s.id,
            image: s.image,
            cmdline: s.cmdline,
            memory_mib: s.memory_mib,
            vcpus: s.vcpus,
            token: s.token,
            net,
            env: s.env,
            network: s.network,
        };
        write_json(&tmp.join("snapshot.json"), &meta)?;
        std::fs::rename(&tmp, &final_dir).map_err(|e| internal("cannot finish the snapshot", e))?;
        Ok(sid)
    }

    async fn create_from_snapshot(
        &self,
        ctx: &CallCtx,
        snapshot: &str,
        spec: SandboxSpec,
    ) -> Result<Arc<dyn Sandbox>> {
        let not_found = || ProviderError::InvalidRequest {
            message: format!("microvm: no snapshot {snapshot:?}"),
        };
        self.check_network(&spec)?;
        let dir = self.snapshot_dir(snapshot).ok_or_else(not_found)?;
        let meta: SnapshotMeta = read_json(&dir.join("snapshot.json")).ok_or_else(not_found)?;
        if meta.format != SNAPSHOT {
            return Err(not_found());
        }
        let mut env = meta.env.clone();
        env.extend(spec.env.clone());
        let spec = SandboxSpec { env, ..spec };
        let origin = Origin {
            state: dir.join("state"),
            disk: dir.join("disk.qcow2"),
            copy_disk: true,
            image: meta.image,
            cmdline: meta.cmdline,
            memory_mib: meta.memory_mib,
            vcpus: meta.vcpus,
            prev_token: Some(meta.token),
            net: meta.net,
        };
        let core = self.start_vm(ctx, origin, spec).await?;
        self.sandbox(core)
    }

    async fn list_snapshots(&self, _ctx: &CallCtx) -> Result<Vec<String>> {
        // Finished ones and the `.tmp` of one cut short: both are this provider's alone.
        let dir = self.cfg.root.join("snapshots");
        tether_provider::util::entry_names(&dir, |n| n.starts_with("snap-"))
            .await
            .map_err(|e| internal("cannot list the snapshots", e))
    }

    async fn delete_snapshot(&self, _ctx: &CallCtx, snapshot: &str) -> Result<()> {
        if let Some(dir) = self.snapshot_dir(snapshot) {
            let _ = tokio::fs::remove_dir_all(dir).await;
        }
        Ok(())
    }

    async fn connect_port(&self, ctx: &CallCtx, id: &str, port: u16) -> Result<PortStream> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        let s = core.stamp();
        if s.stopped {
            return Err(ProviderError::Stopped { id: id.to_owned() });
        }
        if s.suspended {
            return Err(Self::not_found(id));
        }
        // The guest agent's tunnel: an upgraded connection it splices to that port on
        // the guest's loopback.
        let url = format!(
            "http://{}{}{port}",
            self.agent(s.port),
            tether_protocol::e2b::GUEST_PORT_TUNNEL_PATH
        );
        let tunnel = |e: reqwest::Error| ProviderError::Unavailable {
            message: format!("microvm: the guest agent's port tunnel: {e}"),
            retry_after: None,
            source: Some(Box::new(e)),
        };
        let upgraded = ctx
            .run(async {
                let resp = self
                    .envd_http
                    .get(url)
                    .header("x-access-token", &s.token)
                    .header(reqwest::header::CONNECTION, "upgrade")
                    .header(
                        reqwest::header::UPGRADE,
                        tether_protocol::e2b::GUEST_PORT_TUNNEL_PROTOCOL,
                    )
                    .send()
                    .await
                    .map_err(tunnel)?;
                if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
                    return Err(unavailable(format!(
                        "microvm: nothing answers on port {port} of sandbox {id} ({})",
                        resp.status()
                    )));
                }
                resp.upgrade().await.map_err(tunnel)
            })
            .await?;
        Ok(Box::new(upgraded))
    }

    async fn metrics(&self, _ctx: &CallCtx, id: &str) -> Result<SandboxMetrics> {
        let core = self.core(id).ok_or_else(|| Self::not_found(id))?;
        let s = core.stamp();
        if s.stopped {
            return Err(ProviderError::Stopped { id: id.to_owned() });
        }
        let (cpu_us, rss) = if s.suspended {
            // Saved to disk: no process, no memory.
            (0, 0)
        } else {
            client::proc_usage(core.pid().await).ok_or_else(|| Self::not_found(id))?
        };
        let disk_used = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(core.dir.join("disk.qcow2")).map_or(0, |m| m.blocks() * 512)
        };
        Ok(SandboxMetrics {
            cpu_usage_us: cpu_us,
            memory_bytes: rss,
            memory_limit_bytes: Some(s.memory_mib << 20),
            // Processes inside the guest are not visible from the host.
            pids: 0,
            disk_used_bytes: disk_used,
            disk_limit_bytes: Some(s.image.disk_bytes),
            cpus: Some(s.vcpus),
        })
    }
}

/// Save `core`, paused since pause number `epoch`, to its directory and stop its qemu
/// (its memory given back), unless it was resumed or paused again meanwhile. The stamp
/// says `suspended` only once the state is complete; a crash before qemu stops leaves a
/// stopped qemu that resume kills before it restores.
async fn suspend_to_disk(cfg: &MicrovmConfig, core: &VmCore, epoch: u64) -> Result<()> {
    let _op = core.op.lock().await;
    let s = core.stamp();
    if !s.paused
        || s.suspended
        || core.pause_epoch.load(std::sync::atomic::Ordering::SeqCst) != epoch
    {
        return Ok(());
    }
    let state = core.dir.join(SUSPEND_STATE);
    client::save_state(&core.qmp(), &state, cfg.save_timeout(), SAVE_POLL).await?;
    core.update(|s| s.suspended = true)?;
    let grace = cfg.stop_grace();
    let _ = qmp_call::<(), Empty>(&core.qmp(), "quit", None, grace.min(cfg.qmp_timeout())).await;
    let mut q = core.qemu.lock().await;
    if !q.wait_exit(grace).await {
        q.kill_vm(&core.dir, grace).await;
    }
    *q = QemuProcess::none();
    tracing::info!(sandbox.id = %s.id, "Saved a long-paused microVM to disk and stopped it");
    Ok(())
}

/// Egress rules are refused, never ignored: passt has no destination filter, and a rule
/// inside the guest is the guest's to undo.
fn refuse_egress(spec: &SandboxSpec) -> Result<()> {
    if spec.egress.is_empty() {
        Ok(())
    } else {
        Err(ProviderError::Unsupported { op: "egress rules" })
    }
}
