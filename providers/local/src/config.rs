//! The local provider's configuration section (`kind = "local"`).
//!
//! Every field has a documented default, so an empty section is a working provider.
//! Durations are integer milliseconds, as everywhere else in tether's configuration.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use tether_protocol::limits::ResourceLimits;
use tether_provider::ProviderError;

/// Default sandbox path of the workspace.
pub const DEFAULT_WORKSPACE_PATH: &str = "/home/user";

/// Default capture cap per output stream (bytes delivered and spooled; the pipe keeps
/// being drained past it).
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 64 * 1024 * 1024;

/// Default time to keep draining a command's pipes after its leader exited, before the
/// command is reported as exited (a background child may hold the pipes open).
pub const DEFAULT_DRAIN_AFTER_EXIT_MS: u64 = 500;

/// Default upper bound on a command's `grace_ms`.
pub const DEFAULT_MAX_GRACE_MS: u64 = 60_000;

/// Default number of finished commands remembered per sandbox (for `attach` and `list`).
pub const DEFAULT_FINISHED_COMMANDS_KEPT: usize = 256;
/// Default [`LocalConfig::orphan_grace_ms`]: ten minutes.
pub const DEFAULT_ORPHAN_GRACE_MS: u64 = 600_000;

/// Default limit on how long `terminate()` waits for the kernel to reap a killed
/// command before it reports survivors.
pub const DEFAULT_KILL_VERIFY_MS: u64 = 5_000;

/// Host paths the `host` template shows inside a sandbox, read-only (bind mounts over
/// the template's skeleton). `/etc` is narrowed to what programs need to resolve users,
/// hosts, locales, certificates and shell start-up files: `/etc/shadow`, `/etc/ssh` and
/// other credentials stay out. Paths that do not exist on the host are skipped; the
/// host's homes, `/root`, `/run`, `/var` and the daemon's state are never among them.
pub const DEFAULT_READ_ONLY_PATHS: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/etc/alternatives",
    "/etc/bash.bashrc",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/debian_version",
    "/etc/environment",
    "/etc/gai.conf",
    "/etc/gitconfig",
    "/etc/group",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/inputrc",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/locale.alias",
    "/etc/localtime",
    "/etc/login.defs",
    "/etc/lsb-release",
    "/etc/magic",
    "/etc/mime.types",
    "/etc/nsswitch.conf",
    "/etc/os-release",
    "/etc/passwd",
    "/etc/perl",
    "/etc/pki",
    "/etc/profile",
    "/etc/profile.d",
    "/etc/protocols",
    "/etc/python3",
    "/etc/resolv.conf",
    "/etc/services",
    "/etc/shells",
    "/etc/ssl",
    "/etc/terminfo",
    "/etc/timezone",
    "/etc/vim",
];

/// Device nodes of the host shown in every sandbox's `/dev` (bind mounts); a sandbox
/// also gets its own `/dev/pts` instance and a size-limited `/dev/shm`.
pub const DEFAULT_DEVICE_PATHS: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// The template of a sandbox whose spec names none.
pub const DEFAULT_TEMPLATE: &str = "host";

/// First host uid (and gid) of the range a sandbox's ids map to: root inside is this
/// uid outside, an unprivileged one.
pub const DEFAULT_UID_BASE: u32 = 100_000;

/// Number of ids mapped into a sandbox.
pub const DEFAULT_UID_COUNT: u32 = 65_536;

/// Default memory limit of a sandbox (2 GiB).
pub const DEFAULT_MEMORY_BYTES: u64 = 2 << 30;

/// Default process limit of a sandbox.
pub const DEFAULT_PIDS: u64 = 1024;

/// Default size of a sandbox's own file system (4 GiB, sparse on the host).
pub const DEFAULT_DISK_BYTES: u64 = 4 << 30;

/// Default size of a sandbox's `/dev/shm` (64 MiB, charged to its memory limit).
pub const DEFAULT_SHM_BYTES: u64 = 64 << 20;

/// Default time a sandbox's init has to set the sandbox up.
pub const DEFAULT_INIT_TIMEOUT_MS: u64 = 20_000;

/// Default time the network helper has to configure a sandbox's interface.
pub const DEFAULT_NETWORK_TIMEOUT_MS: u64 = 5_000;

/// Default time a file operation with the sandbox root's rights has when its call sets
/// no deadline.
pub const DEFAULT_FS_HELPER_TIMEOUT_MS: u64 = 600_000;

/// How a sandbox is set apart from the machine it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// Every sandbox a machine of its own: namespaces held by an init, its own root
    /// file system, cgroup limits, its own network. The default.
    #[default]
    Machine,
    /// The sandbox is this machine itself: its commands run unconfined, as the
    /// machine's own users, on its own root, with its own network. Only for a machine
    /// that is itself the boundary: the guest of a microVM, whose agent serves exactly
    /// one sandbox. `SandboxInfo::enforcement` says `none`; pause, snapshots and limits
    /// belong to whoever runs the machine.
    None,
}

/// Configuration of the local provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    /// How sandboxes are isolated: `machine` (the default) or `none` (a microVM guest).
    #[serde(default)]
    pub isolation: Isolation,
    /// Directory holding one subdirectory per sandbox (its file-system image, record and
    /// output spools). Empty: the daemon fills in `<state_dir>/sandboxes/<provider name>`.
    #[serde(default)]
    pub root: PathBuf,
    /// The home directory and default working directory inside (`/home/user`).
    /// Absolute, at least two components.
    #[serde(default = "default_workspace_path")]
    pub workspace_path: PathBuf,
    /// Create sandboxes even when the full isolation is not available;
    /// `SandboxInfo::enforcement` then says what is. Default false: `create()` fails
    /// with `ISOLATION_UNAVAILABLE`.
    #[serde(default)]
    pub allow_weaker_isolation: bool,
    /// Give every sandbox network access, even when its spec does not ask for it.
    /// Default false: a sandbox without network has a network namespace with only
    /// its own loopback.
    #[serde(default)]
    pub default_network: bool,
    /// The helper binary that becomes each sandbox's init. Default: `tether-confine`
    /// next to the running executable (or one directory up), else the running
    /// executable itself, called with the hidden `__confine` subcommand.
    #[serde(default)]
    pub confine_helper: Option<PathBuf>,
    /// Where built templates (`base`) are cached. Default: `<root>-templates`, next to
    /// the root (the root holds sandboxes only).
    #[serde(default)]
    pub templates_dir: Option<PathBuf>,
    /// The template of a sandbox whose spec names none (`host` or `base`).
    #[serde(default = "default_template")]
    pub default_template: String,
    /// Host paths the `host` template shows read-only. Default: [`DEFAULT_READ_ONLY_PATHS`].
    #[serde(default = "default_read_only_paths")]
    pub read_only_paths: Vec<PathBuf>,
    /// Host device nodes shown in `/dev`. Default: [`DEFAULT_DEVICE_PATHS`].
    #[serde(default = "default_device_paths")]
    pub device_paths: Vec<PathBuf>,
    /// First host id of the range sandbox ids map to.
    #[serde(default = "default_uid_base")]
    pub uid_base: u32,
    /// Number of ids mapped.
    #[serde(default = "default_uid_count")]
    pub uid_count: u32,
    /// Default limits of a sandbox; a sandbox's spec overrides each.
    #[serde(default = "default_limits")]
    pub limits: ResourceLimits,
    /// Size of `/dev/shm`, in bytes.
    #[serde(default = "default_shm_bytes")]
    pub shm_bytes: u64,
    /// Apply the limits with cgroups (v1 controllers or a v2 hierarchy, whichever the
    /// host has). Without, limits other than disk are not enforced (`partial`).
    #[serde(default = "yes")]
    pub cgroups: bool,
    /// The cgroup under which tether creates its sandbox cgroups, relative to each
    /// hierarchy's mount point. Default: the daemon's own cgroup in each hierarchy.
    #[serde(default)]
    pub cgroup_parent: Option<PathBuf>,
    /// The userspace network helper (`pasta`). Default: `pasta` on `PATH`.
    #[serde(default)]
    pub network_helper: Option<PathBuf>,
    /// Time a sandbox's init has to set the sandbox up, in ms.
    #[serde(default = "default_init_timeout_ms")]
    pub init_timeout_ms: u64,
    /// Time the network helper has to configure a sandbox's interface, in ms.
    #[serde(default = "default_network_timeout_ms")]
    pub network_timeout_ms: u64,
    /// Time a file operation with the sandbox root's rights (E2B's file API, run by a
    /// helper in the sandbox's user namespace) has when its call sets no deadline, in ms.
    #[serde(default = "default_fs_helper_timeout_ms")]
    pub fs_helper_timeout_ms: u64,
    /// Capture cap per output stream when a command's spec sets none, in bytes.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: u64,
    /// How long to keep collecting output after a command's leader exited, in ms.
    #[serde(default = "default_drain_after_exit_ms")]
    pub drain_after_exit_ms: u64,
    /// Upper bound on a command's grace period (SIGTERM to SIGKILL), in ms.
    #[serde(default = "default_max_grace_ms")]
    pub max_grace_ms: u64,
    /// How long `terminate()` waits for killed processes to disappear, in ms.
    #[serde(default = "default_kill_verify_ms")]
    pub kill_verify_ms: u64,
    /// Finished commands remembered per sandbox.
    #[serde(default = "default_finished_commands_kept")]
    pub finished_commands_kept: usize,
    /// How long a sandbox outlives a daemon that went away without destroying it (a
    /// crash, `kill -9`), in ms: its commands run on, their output is spooled, and a
    /// daemon that starts within this time takes the sandbox over again, commands and
    /// all. After it the sandbox ends (its files stay). 0 ends it at once.
    #[serde(default = "default_orphan_grace_ms")]
    pub orphan_grace_ms: u64,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            isolation: Isolation::Machine,
            root: PathBuf::new(),
            workspace_path: default_workspace_path(),
            allow_weaker_isolation: false,
            default_network: false,
            confine_helper: None,
            templates_dir: None,
            default_template: default_template(),
            read_only_paths: default_read_only_paths(),
            device_paths: default_device_paths(),
            uid_base: DEFAULT_UID_BASE,
            uid_count: DEFAULT_UID_COUNT,
            limits: default_limits(),
            shm_bytes: DEFAULT_SHM_BYTES,
            cgroups: true,
            cgroup_parent: None,
            network_helper: None,
            init_timeout_ms: DEFAULT_INIT_TIMEOUT_MS,
            network_timeout_ms: DEFAULT_NETWORK_TIMEOUT_MS,
            fs_helper_timeout_ms: DEFAULT_FS_HELPER_TIMEOUT_MS,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            drain_after_exit_ms: DEFAULT_DRAIN_AFTER_EXIT_MS,
            max_grace_ms: DEFAULT_MAX_GRACE_MS,
            kill_verify_ms: DEFAULT_KILL_VERIFY_MS,
            finished_commands_kept: DEFAULT_FINISHED_COMMANDS_KEPT,
            orphan_grace_ms: DEFAULT_ORPHAN_GRACE_MS,
        }
    }
}

impl LocalConfig {
    /// A default configuration with sandboxes under `root`.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            ..Self::default()
        }
    }

    /// Check the configuration. Called by `LocalProvider::new`.
    pub fn validate(&self) -> Result<(), ProviderError> {
        let invalid = |message: String| ProviderError::InvalidRequest { message };
        if !self.root.is_absolute() {
            return Err(invalid(format!(
                "local provider root {} must be an absolute path",
                self.root.display()
            )));
        }
        workspace_components(&self.workspace_path)?;
        for p in self.read_only_paths.iter().chain(&self.device_paths) {
            if !is_clean_absolute(p) {
                return Err(invalid(format!(
                    "{} must be a normalized absolute path",
                    p.display()
                )));
            }
        }
        // Sandboxes must not see each other's file systems or output spools.
        if let Some(p) = self
            .read_only_paths
            .iter()
            .find(|p| self.root.starts_with(p) || p.starts_with(&self.root))
        {
            return Err(invalid(format!(
                "local provider root {} overlaps the sandboxes' readable path {}",
                self.root.display(),
                p.display()
            )));
        }
        if self.uid_count < 1024 || self.uid_base == 0 {
            return Err(invalid(
                "uid_base must be positive and uid_count at least 1024".into(),
            ));
        }
        if !matches!(self.default_template.as_str(), "host" | "base") {
            return Err(invalid(format!(
                "default_template {:?}: the templates are host and base",
                self.default_template
            )));
        }
        if self.max_output_bytes == 0 {
            return Err(invalid("max_output_bytes must be positive".into()));
        }
        Ok(())
    }

    /// The workspace path as a string (validated: UTF-8, absolute).
    pub(crate) fn workspace_str(&self) -> String {
        self.workspace_path.to_string_lossy().into_owned()
    }

    /// Where built templates live.
    pub(crate) fn templates(&self) -> PathBuf {
        self.templates_dir
            .clone()
            .unwrap_or_else(|| self.sibling("templates"))
    }

    /// Where snapshots live: `<root>-snapshots`.
    pub(crate) fn snapshots(&self) -> PathBuf {
        self.sibling("snapshots")
    }

    /// `<root>-<what>`, next to the root: the root holds sandboxes and nothing else.
    fn sibling(&self, what: &str) -> PathBuf {
        let name = self
            .root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sandboxes".into());
        self.root.with_file_name(format!("{name}-{what}"))
    }
}

/// The normal components of a workspace path; it must be absolute, clean, UTF-8, and
/// at least two levels deep (the first level is what gets hidden by a tmpfs).
pub(crate) fn workspace_components(path: &Path) -> Result<Vec<String>, ProviderError> {
    let invalid = |why: &str| ProviderError::InvalidRequest {
        message: format!("workspace_path {}: {why}", path.display()),
    };
    if !is_clean_absolute(path) {
        return Err(invalid("must be a normalized absolute path"));
    }
    let comps: Vec<String> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_str().map(str::to_owned).ok_or(())),
            _ => None,
        })
        .collect::<Result<_, ()>>()
        .map_err(|()| invalid("must be UTF-8"))?;
    if comps.len() < 2 {
        return Err(invalid("needs at least two components (like /home/user)"));
    }
    const SYSTEM: &[&str] = &[
        "bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "sys",
        "tmp", "usr",
    ];
    if SYSTEM.contains(&comps[0].as_str()) {
        return Err(invalid("must not live under a system directory"));
    }
    Ok(comps)
}

fn is_clean_absolute(p: &Path) -> bool {
    p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

fn yes() -> bool {
    true
}

fn default_workspace_path() -> PathBuf {
    PathBuf::from(DEFAULT_WORKSPACE_PATH)
}

fn default_read_only_paths() -> Vec<PathBuf> {
    DEFAULT_READ_ONLY_PATHS.iter().map(PathBuf::from).collect()
}

fn default_device_paths() -> Vec<PathBuf> {
    DEFAULT_DEVICE_PATHS.iter().map(PathBuf::from).collect()
}

fn default_template() -> String {
    DEFAULT_TEMPLATE.into()
}

fn default_uid_base() -> u32 {
    DEFAULT_UID_BASE
}

fn default_uid_count() -> u32 {
    DEFAULT_UID_COUNT
}

fn default_limits() -> ResourceLimits {
    ResourceLimits {
        memory_bytes: Some(DEFAULT_MEMORY_BYTES),
        pids: Some(DEFAULT_PIDS),
        cpu_millis: None,
        disk_bytes: Some(DEFAULT_DISK_BYTES),
    }
}

fn default_shm_bytes() -> u64 {
    DEFAULT_SHM_BYTES
}

fn default_init_timeout_ms() -> u64 {
    DEFAULT_INIT_TIMEOUT_MS
}

fn default_network_timeout_ms() -> u64 {
    DEFAULT_NETWORK_TIMEOUT_MS
}

fn default_fs_helper_timeout_ms() -> u64 {
    DEFAULT_FS_HELPER_TIMEOUT_MS
}

fn default_max_output_bytes() -> u64 {
    DEFAULT_MAX_OUTPUT_BYTES
}

fn default_drain_after_exit_ms() -> u64 {
    DEFAULT_DRAIN_AFTER_EXIT_MS
}

fn default_max_grace_ms() -> u64 {
    DEFAULT_MAX_GRACE_MS
}

fn default_kill_verify_ms() -> u64 {
    DEFAULT_KILL_VERIFY_MS
}

fn default_finished_commands_kept() -> usize {
    DEFAULT_FINISHED_COMMANDS_KEPT
}

fn default_orphan_grace_ms() -> u64 {
    DEFAULT_ORPHAN_GRACE_MS
}
