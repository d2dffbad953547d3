//! The provider and its sandboxes: a private workspace directory per sandbox on a host,
//! stamped so that sandboxes (and their processes) left behind by a crash are found again.
//!
//! Host layout under the host's `workspace_root` (`R`, resolved to a canonical path on
//! first contact):
//!
//! - `R/<sandbox id>/`: the workspace, the sandbox's home and default working directory;
//! - `R/.tether/<sandbox id>/meta.json`: the stamp ([`SandboxStamp`]): id, creation and
//!   expiry times, metadata, environment;
//! - `R/.tether/<sandbox id>/cmd/<command id>.*`: the files of each command (`.pid`,
//!   `.meta`, the `.out` and `.err` journals, for a piped stdin its `.stdin` journal,
//!   `.in` FIFO, `.inhold` and `.inend`, and `.exit`).
//!
//! `list` reads the stamps, so the daemon's lease reconciliation finds orphaned sandboxes
//! at start and destroys them; `destroy` kills every process group of the sandbox's
//! commands and every process carrying the sandbox's `TETHER_SSH_SANDBOX` variable (a
//! daemon restart loses nothing it needs to find them), then removes both directories.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether_provider::{
    CallCtx, Capabilities, Enforcement, Fs, PortStream, Process, Provider, ProviderError, Result,
    Sandbox, SandboxInfo, SandboxSpec,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::client::{Forwarded, HostPool};
use crate::config::SshConfig;
use crate::fs::SshFs;
use crate::process::{SshCommand, SshProcess};

/// The provider kind.
pub const KIND: &str = "ssh";
/// The stamp's format marker.
pub const STAMP: &str = "tether-ssh-sandbox/1";

/// Resolves the workspace root (`ROOT`): made if missing, printed canonical.
const ROOT: &str = r#"cd || exit 1
mkdir -p -- "$1/.tether" && cd -- "$1" && pwd -P"#;

/// Creates a sandbox's directories and stamp (`CREATE ROOT ID STAMP_JSON`).
const CREATE: &str = r#"r=$1 s=$2
mkdir -p -m 700 -- "$r/.tether/$s/cmd" && mkdir -m 700 -- "$r/$s" || exit 1
printf '%s\n' "$3" >"$r/.tether/$s/meta.json.new" && mv -f -- "$r/.tether/$s/meta.json.new" "$r/.tether/$s/meta.json""#;

/// Prints every stamp, one per line (`STAMPS ROOT [ID]`).
const STAMPS: &str = r#"for f in "$1"/.tether/*/meta.json; do
  [ -f "$f" ] || continue
  if [ -n "$2" ] && [ "$f" != "$1/.tether/$2/meta.json" ]; then continue; fi
  read -r m <"$f" && printf '%s\n' "$m"
done"#;

/// Rewrites a stamp (`RESTAMP ROOT ID STAMP_JSON`); status 4 if the sandbox is gone.
const RESTAMP: &str = r#"f="$1/.tether/$2/meta.json"
[ -f "$f" ] || exit 4
printf '%s\n' "$3" >"$f.new" && mv -f -- "$f.new" "$f""#;

/// Kills everything of a sandbox and removes it (`DESTROY ROOT ID`).
const DESTROY: &str = r#"r=$1 s=$2 st="$1/.tether/$2"
[ -d "$st" ] || [ -d "$r/$s" ] || exit 0
for round in 1 2; do
  for p in "$st"/cmd/*.pid; do
    [ -s "$p" ] && read -r g <"$p" && kill -KILL -- "-$g" 2>/dev/null
  done
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    while IFS= read -r -d '' v; do
      if [ "$v" = "TETHER_SSH_SANDBOX=$s" ]; then kill -KILL "$p" 2>/dev/null; break; fi
    done <"$e" 2>/dev/null
  done
done
chmod -R u+rwx -- "$r/$s" 2>/dev/null
rm -rf -- "$r/$s" "$st""#;

/// What the host keeps about a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStamp {
    /// [`STAMP`].
    pub stamp: String,
    /// The sandbox id.
    pub id: String,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Expiry unless renewed, ms since the epoch.
    pub expires_ms: Option<i64>,
    /// The template asked for (recorded; a plain host has none).
    #[serde(default)]
    pub template: Option<String>,
    /// Metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Environment of every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Network access asked for (a plain host has whatever the host has).
    #[serde(default)]
    pub network: bool,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn encode<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| ProviderError::Internal {
        message: format!("encoding a stamp: {e}"),
        source: Some(Box::new(e)),
    })
}

/// What a sandbox's parts share.
pub struct SandboxCore {
    pub(crate) info: SandboxInfo,
    pub(crate) host: Arc<HostPool>,
    /// The workspace (canonical host path).
    pub(crate) workspace: String,
    /// The state directory (`R/.tether/<id>`).
    pub(crate) state: String,
    pub(crate) env: BTreeMap<String, String>,
    /// The current expiry (renew moves it; 0: none).
    expires_ms: AtomicI64,
    pub(crate) cancel: CancellationToken,
    pub(crate) tasks: TaskTracker,
    commands: RwLock<HashMap<String, Arc<SshCommand>>>,
}

impl std::fmt::Debug for SandboxCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCore")
            .field("id", &self.info.id)
            .field("workspace", &self.workspace)
            .finish_non_exhaustive()
    }
}

impl SandboxCore {
    /// What the sandbox is, with its current expiry.
    pub(crate) fn current_info(&self) -> SandboxInfo {
        let mut info = self.info.clone();
        let e = self.expires_ms.load(Ordering::Acquire);
        info.expires_ms = (e != 0).then_some(e);
        info
    }

    pub(crate) fn cmd_dir(&self, id: &str) -> String {
        format!("{}/cmd/{id}", self.state)
    }

    pub(crate) fn command(&self, id: &str) -> Option<Arc<SshCommand>> {
        self.commands
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    pub(crate) fn command_by_pid(&self, pid: u32) -> Option<Arc<SshCommand>> {
        use tether_provider::ProcessHandle;
        self.commands
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|c| c.pid() == pid)
            .cloned()
    }

    pub(crate) fn register(&self, cmd: Arc<SshCommand>) {
        use tether_provider::ProcessHandle;
        self.commands
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(cmd.command_id().to_owned(), cmd);
    }
}

/// An SSH sandbox.
#[derive(Debug)]
pub struct SshSandbox {
    core: Arc<SandboxCore>,
    fs: SshFs,
    process: SshProcess,
}

impl Sandbox for SshSandbox {
    fn info(&self) -> SandboxInfo {
        self.core.current_info()
    }
    fn fs(&self) -> &dyn Fs {
        &self.fs
    }
    fn process(&self) -> &dyn Process {
        &self.process
    }
}

/// The SSH provider.
pub struct SshProvider {
    cfg: Arc<SshConfig>,
    hosts: Vec<Arc<HostPool>>,
    roots: Vec<tokio::sync::OnceCell<String>>,
    next: AtomicUsize,
    live: RwLock<HashMap<String, Arc<SandboxCore>>>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl std::fmt::Debug for SshProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshProvider")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl SshProvider {
    /// A provider over `cfg`'s hosts (validated here; nothing is contacted yet).
    pub fn new(cfg: SshConfig) -> Result<Self> {
        cfg.validate()?;
        let cfg = Arc::new(cfg);
        let hosts = cfg
            .hosts
            .iter()
            .enumerate()
            .map(|(i, h)| Arc::new(HostPool::new(cfg.host_name(i), h.clone(), cfg.clone())))
            .collect::<Vec<_>>();
        let roots = hosts.iter().map(|_| tokio::sync::OnceCell::new()).collect();
        Ok(Self {
            cfg,
            hosts,
            roots,
            next: AtomicUsize::new(0),
            live: RwLock::new(HashMap::new()),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
        })
    }

    /// Stop every background task and close the connections.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tasks.wait()).await;
        for h in &self.hosts {
            h.close().await;
        }
    }

    async fn root(&self, ctx: &CallCtx, i: usize) -> Result<String> {
        let host = &self.hosts[i];
        self.roots[i]
            .get_or_try_init(|| async {
                let out = host
                    .exec_ok(ctx, &host.line(ROOT, &[&host.host.workspace_root]))
                    .await?;
                let root = out.out().trim().to_owned();
                if !root.starts_with('/') || root == "/" {
                    return Err(ProviderError::InvalidRequest {
                        message: format!(
                            "ssh: host {}: workspace_root resolves to {root:?}",
                            host.name
                        ),
                    });
                }
                Ok(root)
            })
            .await
            .cloned()
    }

    fn host_of(&self, id: &str) -> Option<usize> {
        let (name, rest) = id.rsplit_once('-')?;
        if rest.is_empty() || !rest.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        self.hosts.iter().position(|h| h.name == name)
    }

    fn core(&self, i: usize, root: &str, stamp: SandboxStamp) -> Arc<SandboxCore> {
        let id = stamp.id.clone();
        if let Some(c) = self.live.read().unwrap_or_else(|e| e.into_inner()).get(&id) {
            return c.clone();
        }
        let workspace = format!("{root}/{id}");
        let core = Arc::new(SandboxCore {
            info: SandboxInfo {
                id: id.clone(),
                provider: KIND.into(),
                template: stamp.template,
                workspace: workspace.clone(),
                enforcement: Enforcement::None,
                created_ms: stamp.created_ms,
                expires_ms: stamp.expires_ms,
                metadata: stamp.metadata,
                network: stamp.network,
            },
            host: self.hosts[i].clone(),
            workspace,
            state: format!("{root}/.tether/{id}"),
            env: stamp.env,
            expires_ms: AtomicI64::new(stamp.expires_ms.unwrap_or(0)),
            cancel: self.cancel.child_token(),
            tasks: self.tasks.clone(),
            commands: RwLock::new(HashMap::new()),
        });
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, core.clone());
        core
    }

    fn sandbox(core: Arc<SandboxCore>) -> Arc<dyn Sandbox> {
        Arc::new(SshSandbox {
            fs: SshFs { core: core.clone() },
            process: SshProcess { core: core.clone() },
            core,
        })
    }

    async fn stamps(
        &self,
        ctx: &CallCtx,
        i: usize,
        only: Option<&str>,
    ) -> Result<Vec<SandboxStamp>> {
        let root = self.root(ctx, i).await?;
        let out = self.hosts[i]
            .exec_ok(
                ctx,
                &self.hosts[i].line(STAMPS, &[&root, only.unwrap_or("")]),
            )
            .await?;
        Ok(out
            .out()
            .lines()
            .filter_map(|l| serde_json::from_str::<SandboxStamp>(l).ok())
            .filter(|s| s.stamp == STAMP)
            .collect())
    }
}

#[async_trait]
impl Provider for SshProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            pause: false,
            watch: false,
            pty: true,
            reattach: true,
            renew: true,
            // A plain VM's network is its own: rules there would be the commands' to undo.
            egress: false,
            pause_filesystem: false,
        }
    }

    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()> {
        for i in 0..self.hosts.len() {
            self.root(ctx, i).await?;
        }
        Ok(())
    }

    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        if !spec.egress.is_empty() {
            // A plain VM's network is its own: rules there would be the commands' to undo.
            return Err(ProviderError::Unsupported { op: "egress rules" });
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.hosts.len();
        let root = self.root(ctx, i).await?;
        let id = format!("{}-{}", self.hosts[i].name, uuid::Uuid::new_v4().simple());
        let created = now_ms();
        let ttl = spec
            .ttl
            .unwrap_or(Duration::from_millis(self.cfg.default_ttl_ms));
        let stamp = SandboxStamp {
            stamp: STAMP.into(),
            id: id.clone(),
            created_ms: created,
            expires_ms: Some(created + ttl.as_millis() as i64),
            template: spec.template,
            metadata: spec.metadata,
            env: spec.env,
            network: spec.network,
        };
        let json = encode(&stamp)?;
        self.hosts[i]
            .exec_ok(ctx, &self.hosts[i].line(CREATE, &[&root, &id, &json]))
            .await?;
        tracing::info!(sandbox.id = %id, host = %self.hosts[i].name, "Created an SSH sandbox");
        Ok(Self::sandbox(self.core(i, &root, stamp)))
    }

    async fn connect(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        let not_found = || ProviderError::SandboxNotFound { id: id.to_owned() };
        let i = self.host_of(id).ok_or_else(not_found)?;
        let root = self.root(ctx, i).await?;
        let stamp = self
            .stamps(ctx, i, Some(id))
            .await?
            .into_iter()
            .find(|s| s.id == id)
            .ok_or_else(not_found)?;
        Ok(Self::sandbox(self.core(i, &root, stamp)))
    }

    /// A port of the sandbox is a port of its host's loopback (sandboxes on one host share
    /// its network), reached through a `direct-tcpip` channel as `ssh -L` reaches it. The
    /// sandbox must exist.
    async fn connect_port(&self, ctx: &CallCtx, id: &str, port: u16) -> Result<PortStream> {
        self.connect(ctx, id).await?;
        let i = self
            .host_of(id)
            .ok_or_else(|| ProviderError::SandboxNotFound { id: id.to_owned() })?;
        let (ch, lease) = self.hosts[i].forward(ctx, port).await?;
        Ok(Box::new(Forwarded::new(ch, lease)))
    }

    async fn list(&self, ctx: &CallCtx) -> Result<Vec<SandboxInfo>> {
        let mut out = Vec::new();
        for i in 0..self.hosts.len() {
            let root = self.root(ctx, i).await?;
            for stamp in self.stamps(ctx, i, None).await? {
                if self.host_of(&stamp.id) == Some(i) {
                    out.push(self.core(i, &root, stamp).current_info());
                }
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    async fn destroy(&self, ctx: &CallCtx, id: &str) -> Result<()> {
        let Some(i) = self.host_of(id) else {
            return Ok(());
        };
        let root = self.root(ctx, i).await?;
        if let Some(core) = self
            .live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
        {
            core.cancel.cancel();
        }
        self.hosts[i]
            .exec_ok(ctx, &self.hosts[i].line(DESTROY, &[&root, id]))
            .await?;
        tracing::info!(sandbox.id = %id, "Destroyed an SSH sandbox");
        Ok(())
    }

    async fn renew(&self, ctx: &CallCtx, id: &str, ttl: Duration) -> Result<()> {
        let not_found = || ProviderError::SandboxNotFound { id: id.to_owned() };
        let i = self.host_of(id).ok_or_else(not_found)?;
        let root = self.root(ctx, i).await?;
        let mut stamp = self
            .stamps(ctx, i, Some(id))
            .await?
            .into_iter()
            .find(|s| s.id == id)
            .ok_or_else(not_found)?;
        stamp.expires_ms = Some(now_ms() + ttl.as_millis() as i64);
        let json = encode(&stamp)?;
        let out = self.hosts[i]
            .exec(ctx, &self.hosts[i].line(RESTAMP, &[&root, id, &json]), None)
            .await?;
        if out.code == Some(4) {
            return Err(not_found());
        }
        if let Some(core) = self.live.read().unwrap_or_else(|e| e.into_inner()).get(id) {
            core.expires_ms
                .store(stamp.expires_ms.unwrap_or(0), Ordering::Release);
        }
        Ok(())
    }
}
