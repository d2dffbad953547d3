//! The local provider's configuration section (`kind = "local"`).
//!
//! Every field has a documented default, so an empty section is a working provider.
//! Durations are integer milliseconds, as everywhere else in tether's configuration.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
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

/// Default limit on how long `terminate()` waits for the kernel to reap a killed
/// command before it reports survivors.
pub const DEFAULT_KILL_VERIFY_MS: u64 = 5_000;

/// System paths a confined command may read and execute (and nothing else outside its
/// workspace, its private `/tmp` and `/dev/shm`, and the device nodes). `/etc` is
/// narrowed to what programs need to resolve users, hosts, locales, certificates and
/// shell start-up files: `/etc/shadow`, `/etc/ssh`, and other credentials stay out.
/// Paths that do not exist on the host are skipped.
pub const DEFAULT_READ_ONLY_PATHS: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/proc",
    "/sys/devices/system/cpu",
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
    "/etc/hostname",
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

/// Device nodes a confined command may read and write (ioctls included, for terminals).
/// `/dev/pts` is deliberately absent: a command under a pty is granted its own terminal
/// only, so that it cannot open the terminals of other sandboxes or of host sessions.
pub const DEFAULT_DEVICE_PATHS: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
];

/// Host directories replaced by an empty, unreadable tmpfs inside the sandbox (besides the
/// first component of the workspace path, always hidden). `/run` holds the host's
/// daemon sockets (container runtimes, D-Bus): Landlock before ABI 9 does not mediate
/// `connect()` on a named Unix socket, so hiding them is what keeps them out of reach.
pub const DEFAULT_HIDDEN_PATHS: &[&str] = &["/run"];

/// Private writable tmpfs mounts of every command.
pub const PRIVATE_TMPFS_PATHS: &[&str] = &["/tmp", "/dev/shm"];

/// Configuration of the local provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    /// Directory holding one subdirectory per sandbox (workspace, `sandbox.json`, output
    /// spools). Empty: the daemon fills in `<state_dir>/sandboxes/<provider name>`. It
    /// must not lie under a path confined commands may read.
    #[serde(default)]
    pub root: PathBuf,
    /// The workspace as sandbox paths see it. Absolute, at least two components; the
    /// first component (`/home`) is hidden by an empty tmpfs inside the sandbox.
    #[serde(default = "default_workspace_path")]
    pub workspace_path: PathBuf,
    /// Create sandboxes even when the full isolation (mount namespace plus a fully
    /// enforced Landlock ruleset) is not available; `SandboxInfo::enforcement` then says
    /// what is. Default false: `create()` fails with `ISOLATION_UNAVAILABLE`.
    #[serde(default)]
    pub allow_weaker_isolation: bool,
    /// Give every sandbox network access, even when its spec does not ask for it.
    /// Default false: a sandbox without network runs in an empty network namespace and
    /// Landlock denies TCP bind and connect.
    #[serde(default)]
    pub default_network: bool,
    /// The confinement trampoline. Default: `tether-confine` next to the running
    /// executable (or one directory up), else the running executable itself, called with
    /// the hidden `__confine` subcommand.
    #[serde(default)]
    pub confine_helper: Option<PathBuf>,
    /// Apply Landlock rules. Turning this off leaves the namespaces only, which the
    /// provider reports as `partial` enforcement (refused unless
    /// `allow_weaker_isolation`).
    #[serde(default = "yes")]
    pub landlock: bool,
    /// Paths confined commands may read and execute. Default: [`DEFAULT_READ_ONLY_PATHS`].
    #[serde(default = "default_read_only_paths")]
    pub read_only_paths: Vec<PathBuf>,
    /// Device nodes confined commands may read and write. Default: [`DEFAULT_DEVICE_PATHS`].
    #[serde(default = "default_device_paths")]
    pub device_paths: Vec<PathBuf>,
    /// Host directories hidden behind an empty tmpfs. Default: [`DEFAULT_HIDDEN_PATHS`].
    #[serde(default = "default_hidden_paths")]
    pub hidden_paths: Vec<PathBuf>,
    /// Track each command in its own cgroup (v2) so that `terminate()` and `destroy()`
    /// reach processes that left the process group (`setsid`, daemons). Falls back to
    /// process-group tracking when no writable cgroup v2 hierarchy is found.
    #[serde(default = "yes")]
    pub cgroups: bool,
    /// The cgroup under which tether creates its sandbox cgroups. Default: the daemon's
    /// own cgroup in the cgroup v2 hierarchy.
    #[serde(default)]
    pub cgroup_parent: Option<PathBuf>,
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
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::new(),
            workspace_path: default_workspace_path(),
            allow_weaker_isolation: false,
            default_network: false,
            confine_helper: None,
            landlock: true,
            read_only_paths: default_read_only_paths(),
            device_paths: default_device_paths(),
            hidden_paths: default_hidden_paths(),
            cgroups: true,
            cgroup_parent: None,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            drain_after_exit_ms: DEFAULT_DRAIN_AFTER_EXIT_MS,
            max_grace_ms: DEFAULT_MAX_GRACE_MS,
            kill_verify_ms: DEFAULT_KILL_VERIFY_MS,
            finished_commands_kept: DEFAULT_FINISHED_COMMANDS_KEPT,
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
        for p in self
            .read_only_paths
            .iter()
            .chain(&self.device_paths)
            .chain(&self.hidden_paths)
        {
            if !is_clean_absolute(p) {
                return Err(invalid(format!(
                    "{} must be a normalized absolute path",
                    p.display()
                )));
            }
        }
        // Sandboxes must not see each other's workspaces or output spools.
        if let Some(p) = self
            .read_only_paths
            .iter()
            .find(|p| self.root.starts_with(p) || p.starts_with(&self.root))
        {
            return Err(invalid(format!(
                "local provider root {} overlaps the confined commands' readable path {}",
                self.root.display(),
                p.display()
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

fn default_hidden_paths() -> Vec<PathBuf> {
    DEFAULT_HIDDEN_PATHS.iter().map(PathBuf::from).collect()
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
