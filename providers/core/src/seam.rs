//! The capability traits every provider implements.
//!
//! The traits are object-safe (`#[async_trait]`): the daemon keeps providers, sandboxes
//! and command handles as trait objects chosen at run time from its config, and a
//! provider call is a remote (or at least a process-level) operation, so one boxed
//! future per call costs nothing measurable next to it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::BoxStream;
use serde::{Deserialize, Serialize};
pub use tether_protocol::events::PauseKind;
use tether_protocol::fs::{ByteRange, DirEntry, FileStat, FsEvent, WriteGuard, WriteOutcome};
use tether_protocol::limits::{LimitKind, ResourceLimits};
use tether_protocol::process::{ExitStatus, ProcessEvent, ProcessInfo, ProcessSpec, PtySize};

use crate::ctx::CallCtx;
use crate::error::{ProviderError, Result};

/// A stream of bytes (file contents).
pub type ByteStream = BoxStream<'static, Result<Bytes>>;

/// A stream of a command's events.
pub type EventStream = BoxStream<'static, Result<ProcessEvent>>;

/// How much isolation a sandbox actually enforces. Reported honestly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Nothing is confined.
    None,
    /// Some of the promised confinement is missing (e.g. an older Landlock ABI).
    Partial,
    /// Everything promised is enforced (a VM, or namespaces plus Landlock).
    Full,
}

impl Enforcement {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Partial => "partial",
            Self::Full => "full",
        }
    }
}

/// What a new sandbox should be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxSpec {
    /// Template (image) id, where the provider has templates.
    pub template: Option<String>,
    /// Time to live without renewal.
    pub ttl: Option<Duration>,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// Metadata stored with the sandbox at the provider (tether stamps its session id here).
    pub metadata: BTreeMap<String, String>,
    /// Allow network access from inside.
    pub network: bool,
    /// Resource limits; unset ones take the provider's defaults.
    pub limits: ResourceLimits,
    /// Egress rules (with `network`): enforced where the sandbox cannot change them, or
    /// the create is refused (`UNSUPPORTED`); never ignored.
    pub egress: tether_protocol::network::Egress,
}

/// What a sandbox uses, as the provider measures it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxMetrics {
    /// CPU time used by the sandbox's processes so far, in microseconds.
    pub cpu_usage_us: u64,
    /// Memory charged to the sandbox now, in bytes.
    pub memory_bytes: u64,
    /// The memory limit, in bytes.
    pub memory_limit_bytes: Option<u64>,
    /// Processes alive now.
    pub pids: u64,
    /// Bytes used on the sandbox's own file system.
    pub disk_used_bytes: u64,
    /// Size of the sandbox's own file system, in bytes.
    pub disk_limit_bytes: Option<u64>,
    /// CPUs the sandbox has (a VM's vCPUs), where the provider fixes them.
    #[serde(default)]
    pub cpus: Option<u32>,
}

/// What a sandbox is, as the provider reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// The provider's id of the sandbox.
    pub id: String,
    /// The provider kind (`local`, `e2b`, `ssh`).
    pub provider: String,
    /// The template, if any.
    pub template: Option<String>,
    /// The workspace directory as sandbox paths see it (`/home/user`).
    pub workspace: String,
    /// What the sandbox enforces.
    pub enforcement: Enforcement,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: i64,
    /// When it expires unless renewed, ms since the Unix epoch.
    pub expires_ms: Option<i64>,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
    /// Whether network access is allowed.
    pub network: bool,
}

/// Optional capabilities of a provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// `pause` / `resume`.
    pub pause: bool,
    /// `Fs::watch`.
    pub watch: bool,
    /// Commands under a pty.
    pub pty: bool,
    /// `Process::attach` after a broken stream.
    pub reattach: bool,
    /// `renew` (TTL extension).
    pub renew: bool,
    /// Egress rules are enforced (`SandboxSpec::egress` at create, `set_egress` later).
    pub egress: bool,
    /// `pause` with [`PauseKind::Filesystem`]: the processes end, resume boots again.
    pub pause_filesystem: bool,
}

/// A signal to deliver to a command's process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Signal {
    /// SIGTERM.
    Term,
    /// SIGKILL.
    Kill,
    /// SIGINT.
    Int,
    /// SIGHUP.
    Hup,
    /// SIGQUIT.
    Quit,
    /// SIGUSR1.
    Usr1,
    /// SIGUSR2.
    Usr2,
    /// SIGSTOP.
    Stop,
    /// SIGCONT.
    Cont,
}

impl Signal {
    /// Parse `TERM`, `SIGTERM`, `term`, or a number.
    pub fn parse(s: &str) -> Option<Self> {
        let up = s.trim().to_ascii_uppercase();
        let name = up.strip_prefix("SIG").unwrap_or(&up);
        Some(match name {
            "TERM" | "15" => Self::Term,
            "KILL" | "9" => Self::Kill,
            "INT" | "2" => Self::Int,
            "HUP" | "1" => Self::Hup,
            "QUIT" | "3" => Self::Quit,
            "USR1" | "10" => Self::Usr1,
            "USR2" | "12" => Self::Usr2,
            "STOP" | "19" => Self::Stop,
            "CONT" | "18" => Self::Cont,
            _ => return None,
        })
    }

    /// The Linux signal number.
    pub fn number(self) -> i32 {
        match self {
            Self::Hup => 1,
            Self::Int => 2,
            Self::Quit => 3,
            Self::Kill => 9,
            Self::Usr1 => 10,
            Self::Usr2 => 12,
            Self::Term => 15,
            Self::Cont => 18,
            Self::Stop => 19,
        }
    }
}

/// What `terminate()` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminateReport {
    /// SIGTERM was sent (false when the group was already gone).
    pub term_sent: bool,
    /// The grace period ran out and SIGKILL was sent.
    pub killed: bool,
    /// Processes of the group still present after verification (0 unless the kill failed).
    pub survivors: u32,
}

/// How to find a command again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessSelector {
    /// By the client command id (tag).
    CommandId(String),
    /// By pid.
    Pid(u32),
}

/// Per-stream offsets to resume output from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOffsets {
    /// Offset into stdout (or the pty stream).
    pub stdout: u64,
    /// Offset into stderr.
    pub stderr: u64,
}

/// A sandbox backend.
#[async_trait]
pub trait Provider: Send + Sync + std::fmt::Debug + 'static {
    /// The provider kind (`local`, `e2b`, `ssh`).
    fn kind(&self) -> &'static str;

    /// Optional capabilities.
    fn capabilities(&self) -> Capabilities;

    /// Check that the backend is reachable and usable. Run at daemon start.
    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()>;

    /// Create a sandbox.
    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>>;

    /// Connect to an existing sandbox by id (after a daemon restart, say).
    async fn connect(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>>;

    /// List the sandboxes this provider can see.
    async fn list(&self, ctx: &CallCtx) -> Result<Vec<SandboxInfo>>;

    /// Destroy a sandbox and everything running in it. Destroying a sandbox that is
    /// already gone succeeds.
    async fn destroy(&self, ctx: &CallCtx, id: &str) -> Result<()>;

    /// Extend a sandbox's time to live.
    async fn renew(&self, ctx: &CallCtx, id: &str, ttl: Duration) -> Result<()> {
        let _ = (ctx, id, ttl);
        Err(ProviderError::Unsupported { op: "renew" })
    }

    /// Pause a sandbox. [`PauseKind::Memory`] keeps its state and stops its processes'
    /// clock; [`PauseKind::Filesystem`] ends its processes and keeps its file system
    /// (`UNSUPPORTED` where [`Capabilities::pause_filesystem`] is false). Pausing a
    /// paused sandbox succeeds.
    async fn pause(&self, ctx: &CallCtx, id: &str, kind: PauseKind) -> Result<()> {
        let _ = (ctx, id, kind);
        Err(ProviderError::Unsupported { op: "pause" })
    }

    /// Resume a paused sandbox: one paused with [`PauseKind::Filesystem`] boots again.
    async fn resume(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        let _ = (ctx, id);
        Err(ProviderError::Unsupported { op: "resume" })
    }

    /// Take a snapshot of a sandbox's file system; returns the snapshot's id.
    async fn snapshot(&self, ctx: &CallCtx, id: &str) -> Result<String> {
        let _ = (ctx, id);
        Err(ProviderError::Unsupported { op: "snapshot" })
    }

    /// Create a sandbox whose file system starts as snapshot `snapshot` (a fork).
    async fn create_from_snapshot(
        &self,
        ctx: &CallCtx,
        snapshot: &str,
        spec: SandboxSpec,
    ) -> Result<Arc<dyn Sandbox>> {
        let _ = (ctx, snapshot, spec);
        Err(ProviderError::Unsupported {
            op: "create_from_snapshot",
        })
    }

    /// The snapshots this provider keeps in storage of its own (not shared with other
    /// clients, as a backend's team's are), complete or not, by id: a daemon that
    /// starts deletes the ones it has no record of (a crash between a snapshot and its
    /// record, or during a fork). A provider whose snapshots are shared answers
    /// `UNSUPPORTED`.
    async fn list_snapshots(&self, ctx: &CallCtx) -> Result<Vec<String>> {
        let _ = ctx;
        Err(ProviderError::Unsupported {
            op: "list_snapshots",
        })
    }

    /// Delete a snapshot. Deleting one that is already gone succeeds.
    async fn delete_snapshot(&self, ctx: &CallCtx, snapshot: &str) -> Result<()> {
        let _ = (ctx, snapshot);
        Err(ProviderError::Unsupported {
            op: "delete_snapshot",
        })
    }

    /// Replace a running sandbox's egress rules (`egress` empty: none): enforced, where
    /// the sandbox cannot change them, for every connection opened from then on, or
    /// refused (`UNSUPPORTED`, `ISOLATION_UNAVAILABLE`). A sandbox without network is
    /// `INVALID_REQUEST`.
    async fn set_egress(
        &self,
        ctx: &CallCtx,
        id: &str,
        egress: tether_protocol::network::Egress,
    ) -> Result<()> {
        let _ = (ctx, id, egress);
        Err(ProviderError::Unsupported { op: "set_egress" })
    }

    /// What a sandbox uses now (CPU, memory, processes, disk).
    async fn metrics(&self, ctx: &CallCtx, id: &str) -> Result<SandboxMetrics> {
        let _ = (ctx, id);
        Err(ProviderError::Unsupported { op: "metrics" })
    }

    /// A TCP connection to `port` on the sandbox's own loopback: a server a command
    /// started inside it, reached as E2B's port proxy reaches it (`<port>-<id>.<domain>`).
    /// `SANDBOX_NOT_FOUND` for an unknown sandbox; a port nothing listens on is
    /// `PROVIDER_UNAVAILABLE`. The stream is the caller's until it drops it.
    async fn connect_port(&self, ctx: &CallCtx, id: &str, port: u16) -> Result<PortStream> {
        let _ = (ctx, id, port);
        Err(ProviderError::Unsupported { op: "connect_port" })
    }

    /// How an HTTP request for `port` of sandbox `id` is addressed over the stream of
    /// [`Provider::connect_port`] where a proxy in front of the port routes it (E2B's
    /// edge: the `Host` and the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers). `None`
    /// (the default): the stream reaches the port's server itself.
    fn port_route(&self, id: &str, port: u16) -> Option<PortRoute> {
        let _ = (id, port);
        None
    }
}

/// The addressing of a request to a sandbox port behind a routing proxy
/// ([`Provider::port_route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRoute {
    /// The `Host` the request carries.
    pub host: String,
    /// Headers the proxy routes by, added to the request.
    pub headers: Vec<(String, String)>,
}

/// A byte stream to a port of a sandbox ([`Provider::connect_port`]).
pub trait PortIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> PortIo for T {}

/// What [`Provider::connect_port`] yields.
pub type PortStream = Box<dyn PortIo>;

/// One live sandbox.
pub trait Sandbox: Send + Sync + std::fmt::Debug {
    /// What it is.
    fn info(&self) -> SandboxInfo;
    /// Its file system.
    fn fs(&self) -> &dyn Fs;
    /// Its processes.
    fn process(&self) -> &dyn Process;

    /// Its file system as E2B's file API serves it to `user` (a user of the sandbox,
    /// `user` or `root`): operations act with the sandbox root's rights, inside the
    /// sandbox only, and what they create (files, missing parent directories) belongs
    /// to `user`, as envd does. `Ok(None)`: the provider has no such view, and
    /// [`Sandbox::fs`] serves instead. An unknown user is `INVALID_REQUEST`.
    fn fs_for(&self, user: &str) -> Result<Option<Arc<dyn Fs>>> {
        let _ = user;
        Ok(None)
    }
}

/// A file operation of the [`Fs`] seam, named: what the daemon's operation layer and
/// envd's server measure, trace and log each file operation as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsOp {
    /// Stat a path.
    Stat,
    /// Read a file.
    Read,
    /// Write a file.
    Write,
    /// List a directory.
    List,
    /// Make a directory.
    Mkdir,
    /// Rename a path.
    Rename,
    /// Remove a path.
    Remove,
}

impl FsOp {
    /// The span and metric name (`fs.stat`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Stat => "fs.stat",
            Self::Read => "fs.read",
            Self::Write => "fs.write",
            Self::List => "fs.list",
            Self::Mkdir => "fs.mkdir",
            Self::Rename => "fs.rename",
            Self::Remove => "fs.remove",
        }
    }

    /// Whether the operation changes the sandbox, and then its name in a log of changes
    /// (`write`, `mkdir`, `rename`, `remove`).
    pub fn change(self) -> Option<&'static str> {
        match self {
            Self::Write => Some("write"),
            Self::Mkdir => Some("mkdir"),
            Self::Rename => Some("rename"),
            Self::Remove => Some("remove"),
            Self::Stat | Self::Read | Self::List => None,
        }
    }
}

/// File operations on sandbox paths. Relative paths resolve against the workspace; no
/// path may reach outside the sandbox's view (`FS_PERMISSION_DENIED` or
/// `INVALID_REQUEST`, never a read of the host).
#[async_trait]
pub trait Fs: Send + Sync {
    /// Metadata of a path (symlinks are not followed).
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat>;

    /// Stream a file's bytes in `range`.
    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream>;

    /// Write a file atomically (readers see the old or the new content, never a mix),
    /// creating parent directories; `guard` is checked at publication.
    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome>;

    /// List a directory to `depth` levels (1 = direct children), sorted by path.
    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>>;

    /// Create a directory (with parents when `parents`). `FS_ALREADY_EXISTS` if it exists.
    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat>;

    /// Rename (move) a path, replacing a file at the destination.
    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat>;

    /// Remove a file, or a directory (recursively when `recursive`).
    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()>;

    /// Watch a directory for changes.
    async fn watch(
        &self,
        ctx: &CallCtx,
        path: &str,
        recursive: bool,
    ) -> Result<BoxStream<'static, Result<FsEvent>>> {
        let _ = (ctx, path, recursive);
        Err(ProviderError::Unsupported { op: "watch" })
    }

    /// The extended attributes of a path (followed if a symlink) whose names start with
    /// `prefix` (`user.e2b.`), by name without the prefix. Optional: `Unsupported` where
    /// the provider (or the file system under it) has none.
    async fn xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let _ = (ctx, path, prefix);
        Err(ProviderError::Unsupported { op: "xattrs" })
    }

    /// Replace a path's extended attributes under `prefix` with `values` (names without
    /// the prefix): those not in `values` are removed, so an empty map clears them.
    /// Optional: `Unsupported` where the provider has none.
    async fn set_xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
        values: BTreeMap<String, Vec<u8>>,
    ) -> Result<()> {
        let _ = (ctx, path, prefix, values);
        Err(ProviderError::Unsupported { op: "set_xattrs" })
    }
}

/// Starting and finding commands. Every command runs in its own process group (session)
/// so that a kill reaches all of its descendants.
#[async_trait]
pub trait Process: Send + Sync {
    /// Start a command. The command is owned by the sandbox, not by `ctx`: cancelling
    /// `ctx` aborts only the start itself.
    async fn spawn(&self, ctx: &CallCtx, spec: ProcessSpec) -> Result<Arc<dyn ProcessHandle>>;

    /// Find a running or finished command again.
    async fn attach(
        &self,
        ctx: &CallCtx,
        which: ProcessSelector,
    ) -> Result<Arc<dyn ProcessHandle>> {
        let _ = (ctx, which);
        Err(ProviderError::Unsupported { op: "attach" })
    }

    /// The sandbox's commands (running, and finished ones still remembered).
    async fn list(&self, ctx: &CallCtx) -> Result<Vec<ProcessInfo>>;
}

/// A started command.
#[async_trait]
pub trait ProcessHandle: Send + Sync + std::fmt::Debug {
    /// The command id (client-chosen or generated).
    fn command_id(&self) -> &str;

    /// The pid (process-group leader) inside the sandbox.
    fn pid(&self) -> u32;

    /// An independent reader of the command's events from `from`: the output chunks at or
    /// after those offsets (already produced ones first), then `Exited`. The stream ends
    /// after `Exited`. Several readers may exist at once.
    fn events(&self, from: StreamOffsets) -> EventStream;

    /// Write to stdin (spec `stdin: pipe`).
    async fn write_stdin(&self, ctx: &CallCtx, data: Bytes) -> Result<()>;

    /// Close stdin.
    async fn close_stdin(&self, ctx: &CallCtx) -> Result<()>;

    /// Send a signal to the whole process group.
    async fn signal(&self, ctx: &CallCtx, signal: Signal) -> Result<()>;

    /// Resize the pty.
    async fn resize(&self, ctx: &CallCtx, size: PtySize) -> Result<()> {
        let _ = (ctx, size);
        Err(ProviderError::Unsupported { op: "resize" })
    }

    /// SIGTERM to the group, wait the grace period, SIGKILL, then verify that nothing of
    /// the group is left. Idempotent.
    async fn terminate(&self, ctx: &CallCtx) -> Result<TerminateReport>;

    /// Wait for the command (its whole group) to end.
    async fn wait(&self, ctx: &CallCtx) -> Result<ExitStatus>;

    /// The exit status if it has ended.
    fn try_status(&self) -> Option<ExitStatus>;

    /// The caller has stored the output below `upto` durably elsewhere (tetherd's output
    /// journal): the provider may free its own copy of it, so that a long command's output
    /// is on disk once, not twice. Readers asking for released output afterwards get
    /// `InvalidRequest`; what was produced at or after `upto` stays readable. Default:
    /// the provider keeps everything.
    async fn release(&self, upto: StreamOffsets) {
        let _ = upto;
    }

    /// The sandbox limit the command ran into, once it has ended (an out-of-memory
    /// kill, a refused fork, a full disk); `None` when it hit none or the provider
    /// cannot tell.
    fn limit_hit(&self) -> Option<LimitKind> {
        None
    }
}
