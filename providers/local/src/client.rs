//! The raw transport of the local provider: the sandbox init's control channel, the
//! network helper, pseudo-terminals, and process scans.
//!
//! Nothing here knows about sandboxes' file layout or the seam; `sandbox.rs` and
//! `process.rs` build on it.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::signal::Signal as NixSignal;
use nix::unistd::Pid;
use rustix::net::RecvFlags;
use tether_protocol::network::Egress;
use tether_protocol::process::ExitStatus;
use tether_provider::{ProviderError, Result};
use tokio::io::unix::AsyncFd;
use tokio::process::Command;
use tokio::sync::{Mutex, oneshot, watch};

use crate::config::LocalConfig;
use crate::confine::CONFINE_SUBCOMMAND;
use crate::error::{internal, spawn_failed};
use crate::init::{Counts, FromInit, InitSpec, MAX_RUNNING_REPLY, ToInit, recv_with, send};

/// The standalone trampoline's file name.
pub const CONFINE_BINARY: &str = "tether-confine";

// === impl Launcher ===

/// Starts the helper (`<helper> __confine holder`).
#[derive(Debug, Clone)]
pub(crate) struct Launcher {
    program: PathBuf,
}

impl Launcher {
    /// Find the helper: the configured path, `tether-confine` next to (or one level
    /// above) the running executable, else the running executable itself.
    pub(crate) fn resolve(cfg: &LocalConfig) -> Result<Self> {
        if let Some(p) = &cfg.confine_helper {
            if !p.is_file() {
                return Err(ProviderError::InvalidRequest {
                    message: format!("confine_helper {} is not a file", p.display()),
                });
            }
            return Ok(Self { program: p.clone() });
        }
        let exe = std::env::current_exe()
            .map_err(|e| internal("cannot locate the running executable", e))?;
        let candidates = exe
            .parent()
            .into_iter()
            .flat_map(|d| [Some(d), d.parent()])
            .flatten();
        for dir in candidates {
            let p = dir.join(CONFINE_BINARY);
            if p.is_file() {
                return Ok(Self { program: p });
            }
        }
        Ok(Self { program: exe })
    }

    /// The helper binary.
    pub(crate) fn program(&self) -> &Path {
        &self.program
    }
}

// === impl Init ===

/// How a command ended, and its final output counts.
pub(crate) type Final = (ExitStatus, Counts);

/// What a spawn request yields: the command's pid inside, a pidfd, its output counts
/// as pid1 spools them, and its end.
pub(crate) struct Spawned {
    pub pid: u32,
    /// `None` when the command had already ended and been reaped.
    pub host_pid: Option<u32>,
    pub counts: watch::Receiver<Counts>,
    pub exit: oneshot::Receiver<Final>,
}

/// A command a reconnected init knew (see [`Init::reconnect`]).
pub(crate) struct Adopted {
    pub pid: u32,
    /// What the daemon that started it said about it.
    pub tag: String,
    pub pty: bool,
    pub counts: Counts,
    /// Its end, when it ended while no daemon was there.
    pub exit: Option<ExitStatus>,
    /// A running one: as [`Spawned`].
    pub running: Option<Spawned>,
}

enum SpawnReply {
    Ok(Spawned, Option<OwnedFd>),
    Failed { not_found: bool, message: String },
}

#[derive(Default)]
struct Waiters {
    spawns: HashMap<u64, oneshot::Sender<SpawnReply>>,
    exits: HashMap<u32, oneshot::Sender<Final>>,
    outputs: HashMap<u32, watch::Sender<Counts>>,
    closed: bool,
}

impl Waiters {
    /// Follow command `pid`: its counts and its end.
    fn track(
        &mut self,
        pid: u32,
        counts: Counts,
    ) -> (watch::Receiver<Counts>, oneshot::Receiver<Final>) {
        let (tx, rx) = oneshot::channel();
        self.exits.insert(pid, tx);
        let (ctx, crx) = watch::channel(counts);
        self.outputs.insert(pid, ctx);
        (crx, rx)
    }
}

/// The waiters, and whether the init is gone (readable without the lock).
#[derive(Default)]
struct Shared {
    waiters: Mutex<Waiters>,
    closed: AtomicBool,
}

/// The provider's side of a sandbox's init (see [`crate::init`]).
pub(crate) struct Init {
    sock: Arc<AsyncFd<OwnedFd>>,
    holder: Mutex<Option<tokio::process::Child>>,
    /// Host pid of the sandbox's pid 1.
    pub(crate) pid1: u32,
    /// A pidfd of pid 1: signals through it never reach a process that took its pid
    /// after it ended.
    pid1_fd: Option<OwnedFd>,
    /// The sandbox's store (its image's mount, in the sandbox's namespace only).
    pub(crate) store: Option<OwnedFd>,
    next: AtomicU64,
    shared: Arc<Shared>,
    send_lock: Mutex<()>,
    /// Stops the reader, which closes the provider's end of the socket: the init
    /// then ends the sandbox.
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for Init {
    /// An init this daemon lets go of ends its sandbox: only a daemon that dies (where
    /// nothing is dropped) leaves a sandbox to its orphan grace.
    fn drop(&mut self) {
        self.kill_now();
        self.stop.cancel();
    }
}

impl std::fmt::Debug for Init {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Init")
            .field("pid1", &self.pid1)
            .finish_non_exhaustive()
    }
}

/// Largest message an init sends (they are small: no command output goes this way).
const FROM_INIT_MAX: usize = 64 * 1024;

async fn recv_async(
    sock: &AsyncFd<OwnedFd>,
    buf: &mut [u8],
) -> std::io::Result<Option<(FromInit, Vec<OwnedFd>)>> {
    loop {
        let mut guard = sock.readable().await?;
        match guard
            .try_io(|fd| recv_with::<FromInit>(fd.get_ref().as_fd(), RecvFlags::DONTWAIT, buf))
        {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

/// [`recv_async`] for a running sandbox's init, whose messages are small: received into
/// a buffer on the stack, so that a sandbox holds none between messages (a thousand
/// sandboxes would hold a thousand).
async fn recv_running(
    sock: &AsyncFd<OwnedFd>,
) -> std::io::Result<Option<(FromInit, Vec<OwnedFd>)>> {
    loop {
        let mut guard = sock.readable().await?;
        match guard.try_io(|fd| {
            let mut buf = [0u8; MAX_RUNNING_REPLY];
            recv_with::<FromInit>(fd.get_ref().as_fd(), RecvFlags::DONTWAIT, &mut buf)
        }) {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

async fn send_async(
    sock: &AsyncFd<OwnedFd>,
    msg: &ToInit,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    loop {
        let mut guard = sock.writable().await?;
        match guard.try_io(|fd| send(fd.get_ref().as_fd(), msg, fds)) {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

fn init_failed(message: impl Into<String>) -> ProviderError {
    ProviderError::IsolationUnavailable {
        requested: "full".into(),
        why: message.into(),
    }
}

/// The host pid behind a pidfd.
fn pidfd_host_pid(fd: &OwnedFd) -> Option<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|p| p.trim().parse::<i64>().ok())
        .filter(|p| *p > 0)
        .map(|p| p as u32)
}

impl Init {
    /// Start a sandbox's init: holder, namespaces, id maps, pid1, set-up. `join` puts
    /// the holder into the sandbox's cgroups before it creates anything. A later daemon
    /// reconnects through the socket `control` ([`Init::reconnect`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        launcher: &Launcher,
        spec: &InitSpec,
        uid_base: u32,
        uid_count: u32,
        log: &Path,
        control: &Path,
        join: impl FnOnce(u32) -> std::io::Result<()>,
        timeout: Duration,
    ) -> Result<Self> {
        let listener =
            listen(control).map_err(|e| internal("cannot create the init's control socket", e))?;
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| internal("cannot create the init socket", std::io::Error::from(e)))?;
        rustix::io::ioctl_fionbio(&ours, true)
            .map_err(|e| internal("cannot configure the init socket", std::io::Error::from(e)))?;
        let log_file =
            std::fs::File::create(log).map_err(|e| internal("cannot create init.log", e))?;
        let mut cmd = Command::new(&launcher.program);
        cmd.arg(CONFINE_SUBCOMMAND)
            .arg("holder")
            .env_clear()
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|e| {
            spawn_failed(
                format!(
                    "cannot start the sandbox init {}",
                    launcher.program.display()
                ),
                Some(e),
            )
        })?;
        drop(cmd);
        let holder_pid = child.id().unwrap_or_default();
        let sock =
            Arc::new(async_fd(ours).map_err(|e| internal("cannot register the init socket", e))?);
        let fail_log = |why: String| {
            let detail = std::fs::read_to_string(log).unwrap_or_default();
            init_failed(format!("{why}: {}", detail.trim()))
        };
        let mut buf = vec![0u8; FROM_INIT_MAX];
        let setup = async {
            join(holder_pid).map_err(|e| internal("cannot put the sandbox into its cgroups", e))?;
            send_async(&sock, &ToInit::Setup(spec.clone()), &[])
                .await
                .map_err(|e| internal("cannot talk to the sandbox init", e))?;
            let store = match recv_async(&sock, &mut buf).await {
                Ok(Some((FromInit::Unshared, mut fds))) => fds.pop(),
                Ok(Some((FromInit::Failed { message }, _))) => return Err(init_failed(message)),
                other => return Err(fail_log(format!("the init did not unshare ({other:?})"))),
            };
            let maps: &[(&str, &str)] = if spec.isolate {
                &[("uid_map", "uid"), ("gid_map", "gid")]
            } else {
                &[]
            };
            for (file, what) in maps {
                std::fs::write(
                    format!("/proc/{holder_pid}/{file}"),
                    format!("0 {uid_base} {uid_count}\n"),
                )
                .map_err(|e| internal(format!("cannot write the sandbox's {what} map"), e))?;
            }
            send_async(&sock, &ToInit::Mapped, &[])
                .await
                .map_err(|e| internal("cannot talk to the sandbox init", e))?;
            // pid1 reads its own copy (never on its command line: that is visible inside),
            // with the socket a later daemon reconnects through, and the store.
            let mut fds = vec![listener.as_fd()];
            fds.extend(store.as_ref().map(|s| s.as_fd()));
            send_async(&sock, &ToInit::Setup(spec.clone()), &fds)
                .await
                .map_err(|e| internal("cannot talk to the sandbox init", e))?;
            match recv_async(&sock, &mut buf).await {
                Ok(Some((FromInit::Ready, _))) => Ok(store),
                Ok(Some((FromInit::Failed { message }, _))) => Err(init_failed(message)),
                other => Err(fail_log(format!("the init did not get ready ({other:?})"))),
            }
        };
        let store = match tokio::time::timeout(timeout, setup).await {
            Ok(Ok(store)) => store,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(fail_log(format!(
                    "the init was not ready within {timeout:?}"
                )));
            }
        };
        let pid1 =
            std::fs::read_to_string(format!("/proc/{holder_pid}/task/{holder_pid}/children"))
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()))
                .ok_or_else(|| {
                    internal(
                        "cannot find the sandbox's pid 1",
                        std::io::Error::other("no child"),
                    )
                })?;
        drop(listener);
        Ok(Self::serve(
            sock,
            Some(child),
            pid1,
            store,
            Shared::default(),
        ))
    }

    /// The provider's side from here on: a reader of pid1's messages.
    fn serve(
        sock: Arc<AsyncFd<OwnedFd>>,
        holder: Option<tokio::process::Child>,
        pid1: u32,
        store: Option<OwnedFd>,
        shared: Shared,
    ) -> Self {
        let shared = Arc::new(shared);
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(read_loop(sock.clone(), shared.clone(), stop.clone()));
        Self {
            sock,
            holder: Mutex::new(holder),
            pid1,
            pid1_fd: rustix::process::Pid::from_raw(pid1 as i32).and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            }),
            store,
            next: AtomicU64::new(1),
            shared,
            send_lock: Mutex::new(()),
            stop,
        }
    }

    /// Take over the init of a sandbox whose daemon went away (a crash, `kill -9`):
    /// connect to its control socket, learn the commands it knows. `Ok(None)` when no
    /// init listens there (it ended: its orphan grace passed, or the machine rebooted).
    pub(crate) async fn reconnect(
        control: &Path,
        timeout: Duration,
    ) -> Result<Option<(Self, Vec<Adopted>)>> {
        let conn = match connect(control) {
            Ok(c) => c,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(internal("cannot reach the sandbox's init", e)),
        };
        let pid1 = rustix::net::sockopt::socket_peercred(&conn)
            .map_err(|e| {
                internal(
                    "cannot identify the sandbox's init",
                    std::io::Error::from(e),
                )
            })?
            .pid
            .as_raw_nonzero()
            .get() as u32;
        let sock =
            Arc::new(async_fd(conn).map_err(|e| internal("cannot register the init socket", e))?);
        let mut buf = vec![0u8; FROM_INIT_MAX];
        let learn = async {
            send_async(&sock, &ToInit::Reattach, &[])
                .await
                .map_err(|e| internal("cannot talk to the sandbox's init", e))?;
            let mut waiters = Waiters::default();
            let mut known = Vec::new();
            loop {
                match recv_async(&sock, &mut buf).await {
                    Ok(Some((
                        FromInit::Known {
                            pid,
                            tag,
                            pty,
                            counts,
                            exit,
                        },
                        mut fds,
                    ))) => {
                        let running = match exit {
                            Some(_) => None,
                            None => {
                                let (counts_rx, exit_rx) = waiters.track(pid, counts);
                                Some(Spawned {
                                    pid,
                                    host_pid: fds.pop().as_ref().and_then(pidfd_host_pid),
                                    counts: counts_rx,
                                    exit: exit_rx,
                                })
                            }
                        };
                        known.push(Adopted {
                            pid,
                            tag,
                            pty,
                            counts,
                            exit: exit.map(|e| ExitStatus {
                                code: e.code,
                                signal: e.signal,
                            }),
                            running,
                        });
                    }
                    Ok(Some((FromInit::Attached, mut fds))) => {
                        return Ok((waiters, known, fds.pop()));
                    }
                    // Counts pid1 had not sent to the daemon that went away; the list
                    // has them too.
                    Ok(Some((FromInit::Output { .. } | FromInit::Exited { .. }, _))) => {}
                    Ok(Some((other, _))) => {
                        tracing::debug!(message = ?other, "Unexpected message from a sandbox init during re-attach")
                    }
                    Ok(None) => {
                        return Err(internal(
                            "the sandbox's init went away during re-attach",
                            std::io::Error::other("end of file"),
                        ));
                    }
                    Err(e) => return Err(internal("cannot talk to the sandbox's init", e)),
                }
            }
        };
        let (waiters, known, store) =
            tokio::time::timeout(timeout, learn).await.map_err(|_| {
                init_failed(format!(
                    "the sandbox's init did not answer a re-attach within {timeout:?}"
                ))
            })??;
        let shared = Shared {
            waiters: Mutex::new(waiters),
            closed: AtomicBool::new(false),
        };
        Ok(Some((Self::serve(sock, None, pid1, store, shared), known)))
    }

    /// End the init listening at `control` that no daemon holds (best effort: one that
    /// is not there is already gone). True when one was asked.
    pub(crate) fn end_orphan(control: &Path) -> bool {
        match connect(control) {
            Ok(conn) => send(conn.as_fd(), &ToInit::Shutdown, &[]).is_ok(),
            Err(_) => false,
        }
    }

    /// Start a command with `fds` as stdin, stdout, stderr (or one pty descriptor).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn spawn(
        &self,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: PathBuf,
        pty: bool,
        (uid, gid): (u32, u32),
        tag: String,
        caps: [u64; 2],
        drain_ms: u64,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Spawned> {
        let req = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.shared.waiters.lock().await;
            if w.closed {
                return Err(spawn_failed("the sandbox's init is gone", None));
            }
            w.spawns.insert(req, tx);
        }
        let msg = ToInit::Spawn {
            req,
            argv,
            env,
            cwd,
            pty,
            uid,
            gid,
            tag,
            caps,
            drain_ms,
        };
        {
            let _g = self.send_lock.lock().await;
            send_async(&self.sock, &msg, fds)
                .await
                .map_err(|e| spawn_failed("cannot reach the sandbox's init", Some(e)))?;
        }
        match rx.await {
            Ok(SpawnReply::Ok(mut spawned, pidfd)) => {
                spawned.host_pid = pidfd.as_ref().and_then(pidfd_host_pid);
                Ok(spawned)
            }
            Ok(SpawnReply::Failed { not_found, message }) => Err(spawn_failed(
                message,
                Some(std::io::Error::from(if not_found {
                    std::io::ErrorKind::NotFound
                } else {
                    std::io::ErrorKind::Other
                })),
            )),
            Err(_) => Err(spawn_failed("the sandbox's init is gone", None)),
        }
    }

    /// Whether the init still runs.
    pub(crate) fn alive(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
    }

    /// Ask pid1 to end the sandbox (it does not end when the socket closes: a later
    /// daemon may take it over).
    pub(crate) fn shutdown_now(&self) {
        let _ = send(self.sock.get_ref().as_fd(), &ToInit::Shutdown, &[]);
    }

    /// SIGKILL pid 1, and so the whole pid namespace.
    pub(crate) fn kill_now(&self) {
        self.shutdown_now();
        if let Some(fd) = &self.pid1_fd {
            let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
        }
    }

    /// Kill the whole sandbox (its pid namespace) and wait for the holder.
    pub(crate) async fn kill(&self, limit: Duration) {
        self.kill_now();
        if let Some(mut child) = self.holder.lock().await.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(limit, child.wait()).await;
        }
    }
}

async fn read_loop(
    sock: Arc<AsyncFd<OwnedFd>>,
    shared: Arc<Shared>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let next = tokio::select! {
            r = recv_running(&sock) => r,
            () = stop.cancelled() => break,
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) | Err(_) => break,
        };
        let mut w = shared.waiters.lock().await;
        match msg {
            (FromInit::Spawned { req, pid }, mut fds) => {
                let (counts, exit) = w.track(pid, Counts::default());
                if let Some(s) = w.spawns.remove(&req) {
                    let spawned = Spawned {
                        pid,
                        host_pid: None,
                        counts,
                        exit,
                    };
                    let _ = s.send(SpawnReply::Ok(spawned, fds.pop()));
                }
            }
            (FromInit::Output { pid, counts }, _) => {
                if let Some(o) = w.outputs.get(&pid) {
                    o.send_replace(counts);
                }
            }
            (
                FromInit::SpawnFailed {
                    req,
                    not_found,
                    message,
                },
                _,
            ) => {
                if let Some(s) = w.spawns.remove(&req) {
                    let _ = s.send(SpawnReply::Failed { not_found, message });
                }
            }
            (
                FromInit::Exited {
                    pid,
                    code,
                    signal,
                    counts,
                },
                _,
            ) => {
                if let Some(o) = w.outputs.remove(&pid) {
                    o.send_replace(counts);
                }
                if let Some(s) = w.exits.remove(&pid) {
                    let _ = s.send((ExitStatus { code, signal }, counts));
                }
            }
            (other, _) => {
                tracing::debug!(message = ?other, "Unexpected message from a sandbox init")
            }
        }
    }
    shared.closed.store(true, Ordering::Release);
    let mut w = shared.waiters.lock().await;
    w.closed = true;
    // Dropping the senders tells every waiter the init is gone.
    w.spawns.clear();
    w.exits.clear();
    w.outputs.clear();
}

/// A control socket bound at `path` (a stale one from an init that ended is replaced),
/// reachable by the daemon's user only.
fn listen(path: &Path) -> std::io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let _ = std::fs::remove_file(path);
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    with_short_path(path, |p| rustix::net::bind(&fd, &SocketAddrUnix::new(p)?))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    // pid1 calls listen(2) (see [`crate::init`]).
    Ok(fd)
}

/// Run `f` with a name of `path` that fits into a socket address (108 bytes): the
/// path through a descriptor of its directory (`/proc/self/fd/N/name`), as a state
/// directory's path may be longer than that.
fn with_short_path(
    path: &Path,
    f: impl FnOnce(&Path) -> rustix::io::Result<()>,
) -> std::io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::other("not a socket path"));
    };
    let dir = rustix::fs::open(
        dir,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    f(&short)?;
    Ok(())
}

/// Connect to the control socket at `path`.
fn connect(path: &Path) -> std::io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    with_short_path(path, |p| {
        rustix::net::connect(&fd, &SocketAddrUnix::new(p)?)
    })?;
    rustix::io::ioctl_fionbio(&fd, true)?;
    Ok(fd)
}

// === impl Network ===

/// The userspace NAT of a sandbox with network (`pasta`): egress only; nothing is
/// forwarded into the sandbox, and neither the host's loopback nor the gateway address
/// leads to the host.
pub(crate) struct Network {
    /// The helper this daemon started; `None` for one it took over ([`Network::adopt`]).
    child: Option<tokio::process::Child>,
    /// The helper's pid.
    pid: Option<u32>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network").finish_non_exhaustive()
    }
}

/// The network helper: the configured one, else `pasta` on `PATH`.
pub(crate) fn network_helper(cfg: &LocalConfig) -> Option<PathBuf> {
    if let Some(p) = &cfg.network_helper {
        return p.is_file().then(|| p.clone());
    }
    find_program("pasta")
}

/// A program on the daemon's `PATH` (or the usual system directories).
pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

impl Network {
    /// Attach the NAT to the network namespace of host pid `pid1` and wait until the
    /// namespace has a default route. `outer`: the namespace belongs to the host's user
    /// namespace ([`InitSpec::outer_netns`](crate::init::InitSpec::outer_netns)), so the
    /// helper joins it alone, not the sandbox's user namespace.
    pub(crate) async fn start(
        helper: &Path,
        pid1: u32,
        outer: bool,
        limit: Duration,
    ) -> Result<Self> {
        let mut cmd = Command::new(helper);
        // `--runas 0`: as root pasta would switch to `nobody`, which cannot join the
        // sandbox's user namespace (owned by root); it drops its capabilities itself.
        cmd.args(NAT_SIGNATURE);
        if outer {
            cmd.args(["--netns-only", "--netns"])
                .arg(format!("/proc/{pid1}/ns/net"));
        } else {
            cmd.arg(pid1.to_string());
        }
        cmd.env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| spawn_failed(format!("cannot start {}", helper.display()), Some(e)))?;
        let route = format!("/proc/{pid1}/net/route");
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let ready = std::fs::read_to_string(&route).is_ok_and(|s| {
                s.lines()
                    .skip(1)
                    .any(|l| l.split_whitespace().nth(1) == Some("00000000"))
            });
            if ready {
                let pid = child.id();
                return Ok(Self {
                    child: Some(child),
                    pid,
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(init_failed(format!(
                    "the network helper {} exited ({status})",
                    helper.display()
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.start_kill();
                return Err(init_failed(format!(
                    "the network helper {} did not configure the sandbox within {limit:?}",
                    helper.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The NAT a previous daemon started for the sandbox whose pid 1 is `pid1`, if it
    /// still runs.
    pub(crate) fn adopt(helper: &Path, pid1: u32) -> Option<Self> {
        let pid = nat_helpers(helper)
            .into_iter()
            .find_map(|(pid, target)| (target == pid1).then_some(pid))?;
        Some(Self {
            child: None,
            pid: Some(pid as u32),
        })
    }

    /// Stop the NAT.
    pub(crate) async fn stop(&mut self) {
        match &mut self.child {
            Some(child) => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
            }
            None => {
                if let Some(pid) = self.pid {
                    let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), NixSignal::SIGKILL);
                }
            }
        }
    }
}

/// The arguments every NAT helper of this provider is started with, before the target pid
/// (see [`Network::start`]): how a leftover one is recognised.
const NAT_SIGNATURE: &[&str] = &[
    "--config-net",
    "--foreground",
    "--quiet",
    "--no-map-gw",
    "--runas",
    "0",
    "-t",
    "none",
    "-u",
    "none",
    "-T",
    "none",
    "-U",
    "none",
];

// === egress rules ===

/// `nft` and `nsenter`, which egress rules need, or why not.
pub(crate) fn egress_tools() -> std::result::Result<(PathBuf, PathBuf), String> {
    let nft = find_program("nft").ok_or("no nft (nftables) to enforce egress rules")?;
    let nsenter =
        find_program("nsenter").ok_or("no nsenter (util-linux) to enforce egress rules")?;
    Ok((nft, nsenter))
}

/// The nftables rule set of `egress`: one table, `inet tether`, whose output chain
/// accepts the loopback and the allowed networks and refuses (at once, not by silence)
/// the denied ones. Written in the sandbox's own network namespace, which belongs to the
/// host's user namespace: the sandbox cannot change it.
pub(crate) fn egress_ruleset(egress: &Egress) -> String {
    let mut out = String::from(
        "table inet tether {\n  chain egress {\n    type filter hook output priority 0; policy accept;\n    oifname \"lo\" accept\n",
    );
    for (list, verdict) in [
        (&egress.allow, "accept"),
        (&egress.deny, "reject with icmpx admin-prohibited"),
    ] {
        for family in ["ip", "ip6"] {
            let nets: Vec<String> = list
                .iter()
                .filter(|c| c.is_ipv4() == (family == "ip"))
                .map(ToString::to_string)
                .collect();
            if !nets.is_empty() {
                out.push_str(&format!(
                    "    {family} daddr {{ {} }} {verdict}\n",
                    nets.join(", ")
                ));
            }
        }
    }
    out.push_str("  }\n}\n");
    out
}

/// Write `egress`'s rule set into the network namespace of host pid `pid1` (replacing
/// the one there), within `limit`.
pub(crate) async fn apply_egress(pid1: u32, egress: &Egress, limit: Duration) -> Result<()> {
    let (nft, nsenter) = egress_tools().map_err(|why| ProviderError::IsolationUnavailable {
        requested: "egress rules".into(),
        why,
    })?;
    // Replaced whole: the table is deleted and made again in one transaction.
    let rules = format!(
        "table inet tether {{}}\ndelete table inet tether\n{}",
        egress_ruleset(egress)
    );
    let mut child = Command::new(nsenter)
        .arg(format!("--net=/proc/{pid1}/ns/net"))
        .arg(nft)
        .args(["-f", "-"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| spawn_failed("cannot start nsenter for the egress rules", Some(e)))?;
    let mut stdin = child.stdin.take();
    let run = async {
        if let Some(mut w) = stdin.take() {
            tokio::io::AsyncWriteExt::write_all(&mut w, rules.as_bytes()).await?;
        }
        child.wait_with_output().await
    };
    let out = tokio::time::timeout(limit, run)
        .await
        .map_err(|_| {
            init_failed(format!(
                "the egress rules were not written within {limit:?}"
            ))
        })?
        .map_err(|e| init_failed(format!("cannot write the egress rules: {e}")))?;
    if !out.status.success() {
        return Err(init_failed(format!(
            "nft refused the egress rules ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Kill the NAT helpers left by a daemon that died without stopping them (kill -9): a
/// helper started by this provider (`helper` with exactly [`NAT_SIGNATURE`]) whose target
/// sandbox pid no longer exists serves no sandbox. Returns how many were killed.
pub(crate) fn sweep_orphaned_nats(helper: &Path) -> usize {
    let mut killed = 0;
    for (pid, target) in nat_helpers(helper) {
        if !Path::new(&format!("/proc/{target}")).exists()
            && nix::sys::signal::kill(Pid::from_raw(pid), NixSignal::SIGKILL).is_ok()
        {
            killed += 1;
        }
    }
    killed
}

/// The NAT helpers of this provider that run (`helper` with exactly [`NAT_SIGNATURE`]):
/// their pids and the sandbox pid each serves.
fn nat_helpers(helper: &Path) -> Vec<(i32, u32)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
        let Some((program, rest)) = args.split_first() else {
            continue;
        };
        if *program != helper.as_os_str().as_encoded_bytes() {
            continue;
        }
        let signed = rest.len() > NAT_SIGNATURE.len()
            && rest
                .iter()
                .zip(NAT_SIGNATURE)
                .all(|(a, want)| *a == want.as_bytes());
        // The target: `<pid>`, or `--netns-only --netns /proc/<pid>/ns/net`.
        let target = match rest.get(NAT_SIGNATURE.len()..).unwrap_or_default() {
            [pid] => std::str::from_utf8(pid)
                .ok()
                .and_then(|t| t.parse::<u32>().ok()),
            [only, flag, path] if *only == b"--netns-only" && *flag == b"--netns" => {
                std::str::from_utf8(path)
                    .ok()
                    .and_then(|p| p.strip_prefix("/proc/")?.strip_suffix("/ns/net"))
                    .and_then(|t| t.parse::<u32>().ok())
            }
            _ => None,
        };
        if let (true, Some(target)) = (signed, target) {
            out.push((pid, target));
        }
    }
    out
}

// === process scans ===

/// Live (non-zombie) processes whose process group or session is `id`: the command's
/// group, plus anything that called `setsid` from a pty session (it keeps the session
/// id only if it did not itself `setsid`). Used when no cgroup tracks the command.
pub(crate) fn group_members(id: i32) -> Vec<i32> {
    let mut out = Vec::new();
    scan_processes(|pid, pgrp, session| {
        if pgrp == id || session == id {
            out.push(pid);
        }
    });
    out
}

/// Live processes by process group and by session (a process is listed under both),
/// from one pass over `/proc`: what many [`group_members`] calls would find.
pub(crate) fn live_groups() -> HashMap<i32, Vec<i32>> {
    let mut out: HashMap<i32, Vec<i32>> = HashMap::new();
    scan_processes(|pid, pgrp, session| {
        out.entry(pgrp).or_default().push(pid);
        if session != pgrp {
            out.entry(session).or_default().push(pid);
        }
    });
    out
}

/// `f(pid, process group, session)` for every live (non-zombie) process.
fn scan_processes(mut f: impl FnMut(i32, i32, i32)) {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The comm field may contain spaces and parentheses: split after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let (Some(state), _, Some(pgrp), Some(session)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if state == "Z" || state == "X" {
            continue;
        }
        if let (Ok(pgrp), Ok(session)) = (pgrp.parse::<i32>(), session.parse::<i32>()) {
            f(pid, pgrp, session);
        }
    }
}

/// Signal a process group, ignoring a group that is already gone.
pub(crate) fn signal_group(pgid: i32, sig: NixSignal) {
    let _ = nix::sys::signal::killpg(Pid::from_raw(pgid), sig);
}

// === impl Pty ===

/// A freshly allocated pseudo-terminal.
#[derive(Debug)]
pub(crate) struct Pty {
    /// The daemon's side.
    pub master: OwnedFd,
    /// The command's side (its stdin, stdout and stderr).
    pub slave: OwnedFd,
}

/// Allocate a pty of `rows` x `cols` from the multiplexer `ptmx` (the sandbox's own
/// `/dev/pts` instance, so that the terminal has a name inside).
pub(crate) fn open_pty(
    ptmx: &Path,
    rows: u16,
    cols: u16,
    owner: Option<(u32, u32)>,
) -> std::io::Result<Pty> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::{OpenptFlags, grantpt, ioctl_tiocgptpeer, unlockpt};
    // The path goes through the init's root (a magic link only the provider may
    // follow); the terminal's owner is the file-system uid at the open: `owner`.
    let dir = rustix::fs::open(
        ptmx.parent().unwrap_or(Path::new("/")),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let master = crate::fs::as_user(owner, || {
        rustix::fs::openat(
            &dir,
            "ptmx",
            OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    })?;
    grantpt(&master)?;
    unlockpt(&master)?;
    set_winsize(&master, rows, cols)?;
    let slave = ioctl_tiocgptpeer(
        &master,
        OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC,
    )?;
    rustix::fs::fcntl_setfl(
        &master,
        rustix::fs::fcntl_getfl(&master)? | OFlags::NONBLOCK,
    )?;
    Ok(Pty { master, slave })
}

/// Set a pty's window size (the kernel sends SIGWINCH to its foreground group).
pub(crate) fn set_winsize(fd: &OwnedFd, rows: u16, cols: u16) -> std::io::Result<()> {
    let ws = rustix::termios::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(fd, ws)?;
    Ok(())
}

/// The argv of a shell command line: `bash -lc` where bash exists, else `sh -c`.
pub(crate) fn shell_argv(cmd: &str) -> Vec<String> {
    if Path::new("/bin/bash").is_file() {
        vec!["/bin/bash".into(), "-lc".into(), cmd.into()]
    } else {
        vec!["/bin/sh".into(), "-c".into(), cmd.into()]
    }
}

/// Register an owned descriptor with the runtime's reactor.
///
/// `AsyncFd::new` is deprecated because a generic inner type could close its descriptor
/// while it is registered; an `OwnedFd` that stays inside the `AsyncFd` (tether never
/// calls `try_io_mut` to swap it) cannot, so the safe constructor is sound here, and
/// `unsafe` is forbidden in this crate.
#[allow(deprecated)]
pub(crate) fn async_fd(fd: OwnedFd) -> std::io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    tokio::io::unix::AsyncFd::new(fd)
}

/// Connect to `port` on the loopback of the network namespace `netns` (a sandbox's, held
/// open by the caller). A thread of its own enters the namespace, because `setns` moves
/// the calling thread, which must never be one of the runtime's; the thread ends with
/// the connect, and the socket keeps the namespace it was made in. IPv4's loopback first
/// (servers on `0.0.0.0` and dual-stack ones take it), then IPv6's; the first failure is
/// the one reported.
pub(crate) async fn connect_in_netns(
    netns: std::fs::File,
    port: u16,
    limit: Duration,
) -> std::io::Result<tokio::net::TcpStream> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("tether-port".into())
        .spawn(move || {
            let connect = || -> std::io::Result<TcpStream> {
                nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
                let mut first = None;
                for ip in [
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(Ipv6Addr::LOCALHOST),
                ] {
                    match TcpStream::connect_timeout(&SocketAddr::new(ip, port), limit) {
                        Ok(s) => {
                            s.set_nonblocking(true)?;
                            s.set_nodelay(true)?;
                            return Ok(s);
                        }
                        Err(e) => {
                            first.get_or_insert(e);
                        }
                    }
                }
                Err(first.unwrap_or_else(|| std::io::Error::other("no loopback address")))
            };
            let _ = tx.send(connect());
        })?;
    let s = rx
        .await
        .map_err(|_| std::io::Error::other("the connecting thread ended"))??;
    tokio::net::TcpStream::from_std(s)
}

#[cfg(test)]
mod egress_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_rule_set_accepts_allowed_networks_before_it_refuses_denied_ones() {
        let egress = Egress {
            allow: vec![
                "10.1.2.3".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
            deny: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
        };
        let r = egress_ruleset(&egress);
        let at = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle} in {r}"));
        assert!(at("oifname \"lo\" accept") < at("ip daddr { 10.1.2.3/32 } accept"));
        assert!(at("ip6 daddr { 2001:db8::/32 } accept") < at("ip daddr { 0.0.0.0/0 } reject"));
        assert!(
            at("ip daddr { 10.1.2.3/32 } accept")
                < at("ip6 daddr { ::/0 } reject with icmpx admin-prohibited")
        );
        // No rules of a family, no line for it.
        let only_v4 = egress_ruleset(&Egress {
            allow: Vec::new(),
            deny: vec!["192.0.2.0/24".parse().unwrap()],
        });
        assert!(
            !only_v4.contains("ip6") && !only_v4.contains("} accept"),
            "{only_v4}"
        );
    }
}
