//! A sandbox's init: the process that holds the sandbox's namespaces and starts its
//! commands.
//!
//! The provider starts the helper binary as `__confine holder`, with one end of a
//! `SOCK_SEQPACKET` socket pair as its standard input, and talks to it in JSON
//! messages ([`ToInit`], [`FromInit`]), passing file descriptors alongside:
//!
//! 1. The *holder* reads [`ToInit::Setup`]; in a mount namespace of its own (still
//!    root on the host) it mounts the sandbox's ext4 image (loop device) and the overlay
//!    over the template, so that nothing of the sandbox is mounted in the host's
//!    namespace and everything goes with its last process. It changes into the root,
//!    creates the user, mount, pid, UTS, IPC, network and cgroup namespaces with one
//!    `unshare`, and says [`FromInit::Unshared`] (with a descriptor of the store). The provider
//!    (root on the host) writes the new user namespace's uid and gid maps (root inside
//!    is an unprivileged uid range outside) and answers [`ToInit::Mapped`].
//! 2. The holder becomes root of the new user namespace and starts `__confine pid1`,
//!    the first process of the new pid namespace, then waits for it. pid1 reads its own
//!    copy of [`ToInit::Setup`] (a command line would be visible inside).
//! 3. *pid1* builds the sandbox's view: its own `/proc`, a `/dev` with the host's
//!    harmless device nodes, its own `/dev/pts`, a sized `/dev/shm`, `/sys`, `/run`,
//!    the template's read-only binds, the loopback interface up; then `pivot_root`s
//!    into the sandbox root and detaches the host's. It says [`FromInit::Ready`].
//! 4. From then on pid1 starts commands ([`ToInit::Spawn`], with the command's stdio
//!    descriptors, and for pipes their read ends and the output spools) as its children
//!    in their own process groups, answers [`FromInit::Spawned`] with a pidfd of the new
//!    process, copies each pipe into its spool up to its cap (draining the rest) and
//!    reports the counts ([`FromInit::Output`]), reaps every process of the sandbox,
//!    and reports each command's end once its leader exited and its pipes are done, or
//!    the drain time after the leader's exit passed ([`FromInit::Exited`]).
//!
//! The sandbox ends on [`ToInit::Shutdown`]: pid1 exits, and the kernel kills every
//! process of the pid namespace: nothing of a sandbox outlives its init. When the
//! provider's end of the socket closes without it (the daemon crashed), pid1 keeps
//! serving its commands and spooling their output, and listens on the control socket
//! the provider bound for it (`state/init.sock`, outside the sandbox): a daemon that
//! connects there within the orphan grace sends [`ToInit::Reattach`], learns every
//! command ([`FromInit::Known`]: running ones with a pidfd, ended ones with their
//! status) and carries on. After the grace pid1 ends the sandbox.
//!
//! pid1 is single-threaded: it waits on the socket and a `signalfd` for `SIGCHLD` with
//! `poll`, so the standard library's own `waitpid` after a failed `exec` never races a
//! reaper thread.

use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};

use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, Signal as NixSignal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// Largest message on the control socket.
pub(crate) const MAX_MESSAGE: usize = 1 << 20;

/// Largest message pid1 sends once a sandbox runs, outside a reattach's list (a spawn's
/// outcome, output counts, an exit): the daemon reads them into a buffer this large for
/// the sandbox's whole life, so a spawn's failure message is cut to fit.
pub(crate) const MAX_RUNNING_REPLY: usize = 4 * 1024;

/// Longest failure message of a spawn.
const MAX_SPAWN_MESSAGE: usize = 2 * 1024;

/// Most descriptors passed with one message.
const MAX_FDS: usize = 8;

/// What the init sets up (sent by the provider in [`ToInit::Setup`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitSpec {
    /// Create the namespaces and the sandbox's own root (false: the sandbox is the
    /// machine itself, see [`Isolation::None`](crate::Isolation::None); every field
    /// below but `home` and `home_owner` is then unused).
    pub isolate: bool,
    /// The mount point of the sandbox's root on the host (an empty directory).
    pub root: PathBuf,
    /// The sandbox's file-system image (ext4).
    pub image: PathBuf,
    /// Where to mount the image (it holds the overlay's `upper` and `work`).
    pub store: PathBuf,
    /// The template: the overlay's lower layer.
    pub lower: PathBuf,
    /// Host uid (and gid) of root inside: owner of the upper layer's root.
    pub owner: u32,
    /// The `mount` program (it sets up the loop device).
    pub mount: PathBuf,
    /// The `losetup` program, which switches the loop device to direct I/O.
    #[serde(default)]
    pub losetup: Option<PathBuf>,
    /// Add the host name to `/etc/hosts` (templates whose `/etc` is the sandbox's own).
    pub hosts_entry: bool,
    /// Host paths to bind read-only at the same path inside.
    pub binds: Vec<PathBuf>,
    /// Files tether supplies, shown read-only in place of a bind of the host's file at
    /// the same path: path inside -> content.
    #[serde(default)]
    pub bind_texts: std::collections::BTreeMap<PathBuf, String>,
    /// Host device nodes to bind into `/dev`.
    pub devices: Vec<PathBuf>,
    /// Size of `/dev/shm` in bytes.
    pub shm_bytes: u64,
    /// The sandbox's host name.
    pub hostname: String,
    /// The home directory to create (`/home/user`), and its owner inside.
    pub home: PathBuf,
    /// Owner (uid, gid inside) of the home directory.
    pub home_owner: (u32, u32),
    /// The host's `ip` program, used to bring the loopback interface up.
    pub ip: Option<PathBuf>,
    /// How long pid1 waits for a daemon to reconnect after the control socket closed
    /// without [`ToInit::Shutdown`], in ms ([`LocalConfig::orphan_grace_ms`](crate::LocalConfig::orphan_grace_ms)).
    pub orphan_grace_ms: u64,
    /// Make the network namespace before the user namespace, as host root: it then
    /// belongs to the host's user namespace, so nothing in the sandbox (its root
    /// included) can change its interfaces, routes or egress rules; the provider
    /// configures it from outside.
    #[serde(default)]
    pub outer_netns: bool,
}

/// Provider to init.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum ToInit {
    /// What to set up (to the holder; to pid1 with the listening socket a later daemon
    /// reconnects through, and the store).
    Setup(InitSpec),
    /// The uid and gid maps are written (to the holder).
    Mapped,
    /// Start a command. Without a pty the message carries its stdin, stdout and stderr,
    /// the read ends of its stdout and stderr pipes and the two spool files: pid1 copies
    /// each pipe into its spool up to its cap, so output is kept while no daemon is
    /// there. With a pty it carries the terminal only (the daemon spools the master).
    Spawn {
        req: u64,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: PathBuf,
        pty: bool,
        uid: u32,
        gid: u32,
        /// The daemon's description of the command, handed back on [`ToInit::Reattach`].
        tag: String,
        /// Spool caps of stdout and stderr, in bytes.
        caps: [u64; 2],
        /// How long after the leader's exit output is still collected, in ms.
        drain_ms: u64,
    },
    /// First message of a daemon that reconnected: pid1 answers with every command it
    /// knows ([`FromInit::Known`]), then [`FromInit::Attached`].
    Reattach,
    /// End the sandbox.
    Shutdown,
}

/// Spooled (`kept`) and produced (`total`) bytes of stdout and stderr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub kept: [u64; 2],
    pub total: [u64; 2],
}

/// One output stream's capture: what it produced and what of it is kept under its cap.
/// pid1's pipe pump and the daemon's pty pump count the same way through it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Capture {
    /// Most bytes kept.
    pub cap: u64,
    /// Bytes kept.
    pub kept: u64,
    /// Bytes produced (kept or not).
    pub total: u64,
}

impl Capture {
    /// A capture keeping at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    /// Count `n` bytes just read: how many of the first of them fit under the cap.
    /// [`Capture::kept`] records the ones actually kept.
    pub fn read(&mut self, n: usize) -> usize {
        self.total += n as u64;
        self.cap.saturating_sub(self.kept).min(n as u64) as usize
    }

    /// `n` more bytes were kept.
    pub fn kept(&mut self, n: usize) {
        self.kept += n as u64;
    }
}

/// How a command's leader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ended {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// Init to provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum FromInit {
    /// The namespaces exist: map the ids (from the holder).
    Unshared,
    /// The sandbox is set up (from pid1).
    Ready,
    /// A step of the set-up failed.
    Failed { message: String },
    /// A command started; the message carries a pidfd of it.
    Spawned { req: u64, pid: u32 },
    /// A command could not be started.
    SpawnFailed {
        req: u64,
        not_found: bool,
        message: String,
    },
    /// More output of a command was spooled (totals so far).
    Output { pid: u32, counts: Counts },
    /// A command ended: its leader exited and its pipes reached end of file (or the
    /// drain time after the leader's exit passed). `counts` are final.
    Exited {
        pid: u32,
        code: Option<i32>,
        signal: Option<i32>,
        counts: Counts,
    },
    /// A command pid1 knows (after [`ToInit::Reattach`]); running ones carry a pidfd.
    Known {
        pid: u32,
        tag: String,
        pty: bool,
        counts: Counts,
        exit: Option<Ended>,
    },
    /// The end of the [`FromInit::Known`] list; carries the store when there is one.
    Attached,
}

/// Send one message with `fds`.
pub(crate) fn send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("too many descriptors"));
    }
    rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// Receive one message and its descriptors; `None` at end of file.
pub(crate) fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    flags: RecvFlags,
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    recv_with(sock, flags, &mut buf)
}

/// [`recv`] into a caller's buffer (pid1 keeps one for its whole life).
pub(crate) fn recv_with<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    flags: RecvFlags,
    buf: &mut [u8],
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        flags | RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(list) = m {
            fds.extend(list);
        }
    }
    if r.bytes == 0 {
        return Ok(None);
    }
    if r.flags.contains(rustix::net::ReturnFlags::TRUNC) {
        return Err(std::io::Error::other(format!(
            "a message longer than {} bytes was cut",
            buf.len()
        )));
    }
    let msg = serde_json::from_slice(&buf[..r.bytes]).map_err(std::io::Error::other)?;
    Ok(Some((msg, fds)))
}

fn fail(step: &str, e: impl std::fmt::Display) -> ExitCode {
    let message = format!("{step}: {e}");
    eprintln!("tether-init: {message}");
    let stdin = std::io::stdin();
    let _ = send(stdin.as_fd(), &FromInit::Failed { message }, &[]);
    ExitCode::from(crate::error::CONFINE_FAILED_EXIT as u8)
}

/// `__confine holder`: create the namespaces, wait for the id maps, start pid1.
pub(crate) fn holder() -> ExitCode {
    let stdin = std::io::stdin();
    let sock = stdin.as_fd();
    let spec = match recv::<ToInit>(sock, RecvFlags::empty()) {
        Ok(Some((ToInit::Setup(spec), _))) => spec,
        Ok(_) => return fail("setup", "no setup message"),
        Err(e) => return fail("setup", e),
    };
    if !spec.isolate {
        // The sandbox is this machine: nothing to create, pid1 only starts commands.
        if let Err(e) = send(sock, &FromInit::Unshared, &[]) {
            return fail("report the set-up", e);
        }
        match recv::<ToInit>(sock, RecvFlags::empty()) {
            Ok(Some((ToInit::Mapped, _))) => {}
            Ok(_) => return fail("id maps", "no maps"),
            Err(e) => return fail("id maps", e),
        }
        return start_pid1();
    }
    // Still host root, in a mount namespace of our own: the sandbox's file system is
    // mounted here, never in the host's, and goes away with the sandbox's last process.
    let store = match mount_rootfs(&spec) {
        Ok(fd) => fd,
        Err((step, e)) => return fail(&step, e),
    };
    if let Err(e) = std::env::set_current_dir(&spec.root) {
        return fail("enter the sandbox root", e);
    }
    let mut flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWCGROUP;
    if spec.outer_netns {
        if let Err(e) = unshare(CloneFlags::CLONE_NEWNET) {
            return fail("unshare the network namespace", e);
        }
        // Only host root can bring its loopback up now.
        let up = spec.ip.as_ref().map(|ip| {
            std::process::Command::new(ip)
                .args(["link", "set", "lo", "up"])
                .env_clear()
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
        });
        match up {
            Some(Ok(s)) if s.success() => {}
            Some(Ok(s)) => return fail("bring the loopback up", format!("ip exited {s}")),
            Some(Err(e)) => return fail("bring the loopback up", e),
            None => return fail("bring the loopback up", "no ip program"),
        }
    } else {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    if let Err(e) = unshare(flags) {
        return fail("unshare", e);
    }
    // The provider keeps a handle on the store (snapshots copy its upper layer).
    if let Err(e) = send(sock, &FromInit::Unshared, &[store.as_fd()]) {
        return fail("report the namespaces", e);
    }
    match recv::<ToInit>(sock, RecvFlags::empty()) {
        Ok(Some((ToInit::Mapped, _))) => {}
        Ok(_) => return fail("id maps", "no maps"),
        Err(e) => return fail("id maps", e),
    }
    // The overlay came from the host's mount namespace, so it is locked here; a bind
    // of it made in this namespace is ours, and can become the root.
    if let Err(e) = rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    ) {
        return fail("make / private", e);
    }
    if let Err(e) = rustix::mount::mount_bind_recursive(&spec.root, &spec.root) {
        return fail("bind the sandbox root", e);
    }
    if let Err(e) = std::env::set_current_dir(&spec.root) {
        return fail("enter the sandbox root", e);
    }
    let root = nix::unistd::Gid::from_raw(0);
    if let Err(e) = nix::unistd::setgroups(&[root]) {
        return fail("setgroups", e);
    }
    if let Err(e) = nix::unistd::setresgid(root, root, root) {
        return fail("setresgid", e);
    }
    let uroot = nix::unistd::Uid::from_raw(0);
    if let Err(e) = nix::unistd::setresuid(uroot, uroot, uroot) {
        return fail("setresuid", e);
    }
    start_pid1()
}

/// The holder's last step: start pid1 (which reads its own copy of the spec from the
/// socket) and wait for it.
fn start_pid1() -> ExitCode {
    let child = std::process::Command::new("/proc/self/exe")
        .arg(crate::confine::CONFINE_SUBCOMMAND)
        .arg("pid1")
        .env_clear()
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return fail("start pid1", e),
    };
    // The socket belongs to pid1 now.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = rustix::stdio::dup2_stdin(&null);
    }
    match child.wait() {
        Ok(s) => ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(_) => ExitCode::FAILURE,
    }
}

/// Let the store's loop device write to its image with direct I/O: the image's pages
/// are then not cached a second time under the sandbox's own, which halves the page
/// cache a sandbox's writes take and makes an upload's `fsync` about a quarter
/// faster. Best effort: a state directory whose file system refuses direct I/O keeps
/// buffered I/O, which is correct, only slower.
fn direct_io(losetup: &Path, store: &Path) {
    let Some(dev) = crate::rootfs::mount_source(store).filter(|d| d.starts_with("/dev/loop"))
    else {
        return;
    };
    let _ = std::process::Command::new(losetup)
        .args(["--direct-io=on", &dev])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Mount the image at `store` and the overlay at `root`, in the holder's own mount
/// namespace; returns a descriptor of the store.
fn mount_rootfs(spec: &InitSpec) -> Result<OwnedFd, (String, std::io::Error)> {
    let step = |s: &str| {
        let s = s.to_owned();
        move |e: std::io::Error| (s, e)
    };
    unshare(CloneFlags::CLONE_NEWNS)
        .map_err(|e| ("unshare the mount namespace".to_owned(), e.into()))?;
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(|e| ("make / private".to_owned(), e.into()))?;
    std::fs::create_dir_all(&spec.store).map_err(step("create the store mount point"))?;
    let out = std::process::Command::new(&spec.mount)
        .args(["-o", "loop,nodev,nosuid"])
        .arg(&spec.image)
        .arg(&spec.store)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(step("run mount"))?;
    if !out.status.success() {
        return Err((
            "mount the sandbox's image".to_owned(),
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
        ));
    }
    if let Some(losetup) = &spec.losetup {
        direct_io(losetup, &spec.store);
    }
    for d in ["upper", "work"] {
        let p = spec.store.join(d);
        if !p.exists() {
            std::fs::create_dir(&p).map_err(step(&format!("create {d}")))?;
            std::os::unix::fs::chown(&p, Some(spec.owner), Some(spec.owner))
                .map_err(step(&format!("chown {d}")))?;
        }
    }
    std::fs::create_dir_all(&spec.root).map_err(step("create the root mount point"))?;
    // The layers by descriptor: the options are shown in the sandbox's mount table, and
    // the host's paths have no business there.
    let open = |p: &Path| {
        rustix::fs::open(
            p,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| (format!("open {}", p.display()), std::io::Error::from(e)))
    };
    let (lower, upper, work) = (
        open(&spec.lower)?,
        open(&spec.store.join("upper"))?,
        open(&spec.store.join("work"))?,
    );
    let fd = |f: &OwnedFd| format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(f));
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        fd(&lower),
        fd(&upper),
        fd(&work)
    );
    // Set-id programs of a template (`sudo` in `base`) must work: their owner is root
    // inside, an unprivileged uid outside, so they grant nothing on the host.
    mount_fs(
        "overlay",
        &spec.root.to_string_lossy(),
        MountFlags::NODEV,
        &data,
    )
    .map_err(step("mount the sandbox's overlay"))?;
    let fd = rustix::fs::open(
        &spec.store,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| ("open the store".to_owned(), e.into()))?;
    Ok(fd)
}

fn mount_fs(fstype: &str, target: &str, flags: MountFlags, data: &str) -> std::io::Result<()> {
    let data = std::ffi::CString::new(data).map_err(std::io::Error::other)?;
    rustix::mount::mount(fstype, target, fstype, flags, Some(data.as_c_str()))?;
    Ok(())
}

fn bind(source: &Path, target: &Path, read_only: bool) -> std::io::Result<()> {
    rustix::mount::mount_bind_recursive(source, target)?;
    if read_only {
        rustix::mount::mount_remount(
            target,
            MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID,
            "",
        )?;
    }
    Ok(())
}

/// Show each of `texts` read-only at its path (relative to the sandbox root). The files
/// are written to a tmpfs of their own, which is detached once they are bound: the
/// sandbox's mount table names no host path for them.
fn bind_texts(texts: &std::collections::BTreeMap<PathBuf, String>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if texts.is_empty() {
        return Ok(());
    }
    let stage = Path::new("dev/.tether-files");
    std::fs::create_dir_all(stage)?;
    mount_fs(
        "tmpfs",
        "dev/.tether-files",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "mode=0755,size=1m",
    )?;
    let bound = texts.iter().enumerate().try_for_each(|(i, (p, text))| {
        let file = stage.join(i.to_string());
        std::fs::write(&file, text)?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
        let rel = relative(p);
        mount_point(&rel, &file)?;
        bind(&file, &rel, true)
    });
    let _ = rustix::mount::unmount(stage, rustix::mount::UnmountFlags::DETACH);
    let _ = std::fs::remove_dir(stage);
    bound
}

/// A file bound over a part of `/proc` (the boot id) makes that proc mount not fully
/// visible, and the kernel lets a user namespace made inside the sandbox mount a proc of
/// its own only where one is (`mnt_already_visible`): `unshare --mount-proc`, container
/// runtimes and build sandboxes inside would fail. So one proc is mounted with nothing
/// over its files, under an empty read-only tmpfs that covers it (as LXC keeps
/// `/dev/.lxc/proc`).
fn keep_proc_visible() -> std::io::Result<()> {
    let dir = Path::new("dev/.tether");
    std::fs::create_dir_all(dir.join("proc"))?;
    mount_fs(
        "proc",
        "dev/.tether/proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "",
    )?;
    mount_fs(
        "tmpfs",
        "dev/.tether",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::RDONLY,
        "mode=0555,size=4k",
    )
}

/// Make `rel` (relative to the sandbox root) a mount point of the same kind as `src`.
fn mount_point(rel: &Path, src: &Path) -> std::io::Result<()> {
    if src.is_dir() {
        std::fs::create_dir_all(rel)?;
    } else {
        if let Some(p) = rel.parent() {
            std::fs::create_dir_all(p)?;
        }
        if std::fs::symlink_metadata(rel).is_err() {
            std::fs::write(rel, b"")?;
        }
    }
    Ok(())
}

fn relative(p: &Path) -> PathBuf {
    p.strip_prefix("/").unwrap_or(p).to_owned()
}

fn build_root(spec: &InitSpec) -> Result<(), (String, std::io::Error)> {
    let step = |s: &str| {
        let s = s.to_owned();
        move |e: std::io::Error| (s, e)
    };
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(|e| ("make / private".to_owned(), e.into()))?;
    // cwd is the sandbox root: every path below is relative to it.
    for p in spec
        .binds
        .iter()
        .filter(|p| !spec.bind_texts.contains_key(*p))
    {
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            continue;
        };
        let rel = relative(p);
        if meta.file_type().is_symlink() {
            continue;
        }
        mount_point(&rel, p).map_err(step(&format!("mount point {}", p.display())))?;
        bind(p, &rel, true).map_err(step(&format!("bind {}", p.display())))?;
    }
    let nosuid = MountFlags::NOSUID | MountFlags::NODEV;
    std::fs::create_dir_all("proc").map_err(step("mkdir /proc"))?;
    mount_fs("proc", "proc", nosuid | MountFlags::NOEXEC, "").map_err(step("mount /proc"))?;
    std::fs::create_dir_all("dev").map_err(step("mkdir /dev"))?;
    mount_fs(
        "tmpfs",
        "dev",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "mode=0755,size=1m",
    )
    .map_err(step("mount /dev"))?;
    if spec.bind_texts.keys().any(|p| p.starts_with("/proc")) {
        keep_proc_visible().map_err(step("mount a covered /proc"))?;
    }
    bind_texts(&spec.bind_texts).map_err(step("bind the supplied files"))?;
    for d in &spec.devices {
        if !d.exists() {
            continue;
        }
        let rel = relative(d);
        mount_point(&rel, d).map_err(step(&format!("mount point {}", d.display())))?;
        bind(d, &rel, false).map_err(step(&format!("bind {}", d.display())))?;
    }
    std::fs::create_dir_all("dev/pts").map_err(step("mkdir /dev/pts"))?;
    mount_fs(
        "devpts",
        "dev/pts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )
    .map_err(step("mount /dev/pts"))?;
    let _ = std::os::unix::fs::symlink("pts/ptmx", "dev/ptmx");
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(target, format!("dev/{name}"));
    }
    std::fs::create_dir_all("dev/shm").map_err(step("mkdir /dev/shm"))?;
    mount_fs(
        "tmpfs",
        "dev/shm",
        nosuid,
        &format!("mode=1777,size={}", spec.shm_bytes.max(4096)),
    )
    .map_err(step("mount /dev/shm"))?;
    std::fs::create_dir_all("sys").map_err(step("mkdir /sys"))?;
    if mount_fs(
        "sysfs",
        "sys",
        nosuid | MountFlags::NOEXEC | MountFlags::RDONLY,
        "",
    )
    .is_err()
    {
        tracing::debug!("no sysfs in the sandbox");
    }
    std::fs::create_dir_all("run").map_err(step("mkdir /run"))?;
    mount_fs("tmpfs", "run", nosuid, "mode=0755,size=16m").map_err(step("mount /run"))?;
    std::fs::create_dir_all("tmp").map_err(step("mkdir /tmp"))?;
    set_mode("tmp", 0o1777).map_err(step("chmod /tmp"))?;
    let home = relative(&spec.home);
    if !home.exists() {
        std::fs::create_dir_all(&home).map_err(step("mkdir home"))?;
        let (uid, gid) = spec.home_owner;
        std::os::unix::fs::chown(&home, Some(uid), Some(gid)).map_err(step("chown home"))?;
    }
    if let Some(ip) = &spec.ip {
        let _ = std::process::Command::new(ip)
            .args(["link", "set", "lo", "up"])
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let _ = rustix::system::sethostname(spec.hostname.as_bytes());
    if spec.hosts_entry {
        // Programs that resolve their own host name (sudo) find it.
        let line = format!("127.0.1.1\t{}\n", spec.hostname);
        let current = std::fs::read_to_string("etc/hosts").unwrap_or_default();
        if !current.contains(&line) {
            let _ = std::fs::write("etc/hosts", format!("{current}{line}"));
        }
    }
    rustix::process::pivot_root(".", ".").map_err(|e| ("pivot_root".to_owned(), e.into()))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH)
        .map_err(|e| ("detach the host root".to_owned(), e.into()))?;
    std::env::set_current_dir("/").map_err(step("chdir /"))?;
    Ok(())
}

fn set_mode(p: &str, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
}

/// `__confine pid1`: read the spec from the socket, build the sandbox's view, serve.
// pid1 is a plain single-threaded process without a runtime: std's clock is its clock.
#[allow(clippy::disallowed_types)]
pub(crate) fn pid1() -> ExitCode {
    let (spec, mut fds) = {
        let stdin = std::io::stdin();
        match recv::<ToInit>(stdin.as_fd(), RecvFlags::empty()) {
            Ok(Some((ToInit::Setup(spec), fds))) => (spec, fds),
            Ok(_) => return fail("pid1 setup", "no setup message"),
            Err(e) => return fail("pid1 setup", e),
        }
    };
    // The listening socket a later daemon reconnects through, and the store.
    let store = (fds.len() > 1).then(|| fds.remove(1));
    // pid1 listens (the daemon only bound it): a connecting daemon's peer credentials
    // are the listener's, so they name pid1.
    let listener = fds.pop().filter(|l| rustix::net::listen(l, 4).is_ok());
    if spec.isolate
        && let Err((step, e)) = build_root(&spec)
    {
        return fail(&step, e);
    }
    let mut mask = SigSet::empty();
    mask.add(NixSignal::SIGCHLD);
    if let Err(e) = mask.thread_block() {
        return fail("block SIGCHLD", e);
    }
    let sfd = match SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC) {
        Ok(s) => s,
        Err(e) => return fail("signalfd", e),
    };
    let ctl = {
        let stdin = std::io::stdin();
        match stdin.as_fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(e) => return fail("take the control socket", e),
        }
    };
    // Nothing but the control socket (a close-on-exec copy) is the daemon's way in.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = rustix::stdio::dup2_stdin(&null);
    }
    if let Err(e) = send(ctl.as_fd(), &FromInit::Ready, &[]) {
        return fail("report ready", e);
    }
    let mut init = Pid1 {
        ctl: Some(ctl),
        listener,
        store,
        grace: std::time::Duration::from_millis(spec.orphan_grace_ms),
        orphaned_at: None,
        commands: Vec::new(),
        finished: std::collections::VecDeque::new(),
        buf: vec![0u8; MAX_MESSAGE],
        want_write: false,
    };
    init.serve(&sfd);
    ExitCode::SUCCESS
}

/// Finished commands pid1 remembers for a daemon that reconnects (their ends may not
/// have reached the daemon that went away).
const FINISHED_KEPT: usize = 64;

/// What pid1 reads from a pipe at once.
const PIPE_CHUNK: usize = 64 * 1024;

/// A command pid1 started.
// pid1 is a plain single-threaded process without a runtime: std's clock is its clock.
#[allow(clippy::disallowed_types)]
struct Cmd {
    pid: i32,
    tag: String,
    pty: bool,
    /// Read ends of stdout and stderr (until end of file).
    pipes: [Option<OwnedFd>; 2],
    /// The spools (dropped once writing one fails: the disk is full).
    spools: [Option<std::fs::File>; 2],
    capture: [Capture; 2],
    drain: std::time::Duration,
    /// The leader's end, and when it was seen.
    leader: Option<(Ended, std::time::Instant)>,
    /// The end was reported (output after it is read and dropped).
    sealed: bool,
    /// Counts changed since the daemon was last told.
    dirty: bool,
}

impl Cmd {
    fn counts(&self) -> Counts {
        let [out, err] = self.capture;
        Counts {
            kept: [out.kept, err.kept],
            total: [out.total, err.total],
        }
    }

    fn pipes_done(&self) -> bool {
        self.pipes.iter().all(Option::is_none)
    }

    /// Read once from stream `s`: spool what fits under the cap, count everything.
    fn pump(&mut self, s: usize, buf: &mut [u8]) {
        let Some(pipe) = &self.pipes[s] else { return };
        let len = PIPE_CHUNK.min(buf.len());
        let n = match rustix::io::read(pipe, &mut buf[..len]) {
            Ok(0) => {
                self.pipes[s] = None;
                return;
            }
            Ok(n) => n,
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => return,
            Err(_) => {
                self.pipes[s] = None;
                return;
            }
        };
        if self.sealed {
            return;
        }
        let keep = self.capture[s].read(n);
        if keep > 0
            && let Some(f) = &mut self.spools[s]
        {
            use std::io::Write;
            if f.write_all(&buf[..keep]).is_ok() {
                self.capture[s].kept(keep);
            } else {
                self.spools[s] = None;
            }
        }
        self.dirty = true;
    }
}

/// pid1's state: the daemon's socket (when one is connected), the commands.
// pid1 is a plain single-threaded process without a runtime: std's clock is its clock.
#[allow(clippy::disallowed_types)]
struct Pid1 {
    ctl: Option<OwnedFd>,
    listener: Option<OwnedFd>,
    store: Option<OwnedFd>,
    grace: std::time::Duration,
    /// When the last daemon went away without shutting the sandbox down.
    orphaned_at: Option<std::time::Instant>,
    commands: Vec<Cmd>,
    finished: std::collections::VecDeque<Cmd>,
    buf: Vec<u8>,
    /// An `Output` did not fit into the socket: poll for writability too (the next
    /// [`Pid1::settle`] sends it).
    want_write: bool,
}

/// What woke pid1.
enum Wake {
    Ctl,
    Listener,
    Signal,
    Pipe(usize, usize),
}

// pid1 is a plain single-threaded process without a runtime: std's clock is its clock.
#[allow(clippy::disallowed_types)]
impl Pid1 {
    fn serve(&mut self, sfd: &SignalFd) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        loop {
            let now = std::time::Instant::now();
            if let Some(at) = self.orphaned_at
                && now.duration_since(at) >= self.grace
            {
                // No daemon came back: the sandbox ends (its files stay).
                return;
            }
            let mut wakes = Vec::new();
            {
                let mut fds = Vec::with_capacity(4 + 2 * self.commands.len());
                let mut kinds = Vec::with_capacity(fds.capacity());
                if let Some(c) = &self.ctl {
                    let mut f = PollFlags::POLLIN;
                    if self.want_write {
                        f |= PollFlags::POLLOUT;
                    }
                    fds.push(PollFd::new(c.as_fd(), f));
                    kinds.push(Wake::Ctl);
                }
                // Always: a daemon knocking while another is connected is turned away
                // at once (its messages are never read later, by surprise).
                if let Some(l) = &self.listener {
                    fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
                    kinds.push(Wake::Listener);
                }
                fds.push(PollFd::new(sfd.as_fd(), PollFlags::POLLIN));
                kinds.push(Wake::Signal);
                for (i, c) in self.commands.iter().enumerate() {
                    for (s, p) in c.pipes.iter().enumerate() {
                        if let Some(p) = p {
                            fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
                            kinds.push(Wake::Pipe(i, s));
                        }
                    }
                }
                let timeout = self.next_timer(now).map_or(PollTimeout::NONE, |d| {
                    PollTimeout::try_from(d.as_millis().clamp(1, 60_000) as i32)
                        .unwrap_or(PollTimeout::MAX)
                });
                match poll(&mut fds, timeout) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => return,
                }
                for (f, k) in fds.iter().zip(kinds) {
                    let Some(ev) = f.revents() else { continue };
                    if ev.is_empty() {
                        continue;
                    }
                    // The socket only became writable: the settling below sends what
                    // waits.
                    if matches!(k, Wake::Ctl)
                        && !ev
                            .intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR)
                    {
                        continue;
                    }
                    wakes.push(k);
                }
            }
            let mut shutdown = false;
            for w in wakes {
                match w {
                    Wake::Pipe(i, s) => {
                        if let Some(c) = self.commands.get_mut(i) {
                            c.pump(s, &mut self.buf);
                        }
                    }
                    Wake::Signal => {
                        while let Ok(Some(_)) = sfd.read_signal() {}
                        self.reap();
                    }
                    Wake::Listener => self.accept(),
                    Wake::Ctl => {
                        if self.read_ctl() {
                            shutdown = true;
                        }
                    }
                }
            }
            if shutdown {
                return;
            }
            self.settle();
            if self.ctl.is_none() && self.orphaned_at.is_none() {
                if self.listener.is_none() {
                    // Nobody could reconnect: the sandbox ends with its daemon.
                    return;
                }
                self.orphaned_at = Some(std::time::Instant::now());
            }
        }
    }

    /// Time until the next drain deadline or the end of the orphan grace.
    fn next_timer(&self, now: std::time::Instant) -> Option<std::time::Duration> {
        let drains = self.commands.iter().filter_map(|c| match c.leader {
            Some((_, at)) if !c.sealed => Some((at + c.drain).saturating_duration_since(now)),
            _ => None,
        });
        let orphan = self
            .orphaned_at
            .map(|at| (at + self.grace).saturating_duration_since(now));
        drains.chain(orphan).min()
    }

    /// Reap every process of the sandbox; note the ends of commands' leaders.
    fn reap(&mut self) {
        loop {
            let (pid, code, signal) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid, Some(code), None),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, None, Some(sig as i32)),
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(_) => continue,
            };
            if let Some(c) = self
                .commands
                .iter_mut()
                .find(|c| c.pid == pid.as_raw() && c.leader.is_none())
            {
                c.leader = Some((Ended { code, signal }, std::time::Instant::now()));
            }
        }
    }

    /// Tell the daemon what changed: output, and the ends of commands whose leader
    /// exited and whose pipes are done (or whose drain time passed).
    fn settle(&mut self) {
        let now = std::time::Instant::now();
        let mut i = 0;
        while i < self.commands.len() {
            let c = &mut self.commands[i];
            if let Some((end, at)) = c.leader
                && !c.sealed
                && (c.pipes_done() || now.duration_since(at) >= c.drain)
            {
                c.sealed = true;
                c.dirty = false;
                let msg = FromInit::Exited {
                    pid: c.pid as u32,
                    code: end.code,
                    signal: end.signal,
                    counts: c.counts(),
                };
                if let Some(ctl) = &self.ctl {
                    // Not sent (the daemon just went away): the next one learns it
                    // from [`ToInit::Reattach`].
                    let _ = send(ctl.as_fd(), &msg, &[]);
                }
            }
            let c = &self.commands[i];
            if c.sealed && c.pipes_done() {
                let mut done = self.commands.swap_remove(i);
                done.spools = [None, None];
                self.finished.push_back(done);
                while self.finished.len() > FINISHED_KEPT {
                    self.finished.pop_front();
                }
                continue;
            }
            i += 1;
        }
        self.want_write = false;
        let Some(ctl) = &self.ctl else { return };
        for c in self.commands.iter_mut().filter(|c| c.dirty && !c.sealed) {
            let msg = FromInit::Output {
                pid: c.pid as u32,
                counts: c.counts(),
            };
            // Counts are totals: one that does not fit is sent again, newer, later.
            match send_nonblocking(ctl.as_fd(), &msg) {
                Ok(true) => c.dirty = false,
                Ok(false) => {
                    self.want_write = true;
                    break;
                }
                Err(_) => break,
            }
        }
    }

    /// A message from the daemon; true when the sandbox is to end.
    fn read_ctl(&mut self) -> bool {
        let Some(ctl) = &self.ctl else { return false };
        match recv_with::<ToInit>(ctl.as_fd(), RecvFlags::DONTWAIT, &mut self.buf) {
            Ok(Some((ToInit::Shutdown, _))) => true,
            Ok(Some((ToInit::Reattach, _))) => {
                self.reattach();
                false
            }
            Ok(Some((msg, fds))) => {
                self.spawn(msg, fds);
                false
            }
            Ok(None) => {
                self.disconnect();
                false
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted =>
            {
                false
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::InvalidData
                    || e.kind() == std::io::ErrorKind::Other =>
            {
                // A message that does not parse: ignore it, keep serving.
                false
            }
            Err(_) => {
                self.disconnect();
                false
            }
        }
    }

    fn disconnect(&mut self) {
        // A later daemon learns every command again ([`ToInit::Reattach`]): the one
        // that went away may not have recorded what it was told.
        self.ctl = None;
        self.want_write = false;
    }

    /// A daemon knocks: it becomes the one connected, unless one already is (then the
    /// connection is closed unread).
    fn accept(&mut self) {
        let Some(l) = &self.listener else { return };
        let Ok(conn) = rustix::net::accept_with(l, rustix::net::SocketFlags::CLOEXEC) else {
            return;
        };
        if self.ctl.is_some() {
            return;
        }
        self.ctl = Some(conn);
        self.orphaned_at = None;
    }

    /// Answer [`ToInit::Reattach`]: every command known, then the store.
    fn reattach(&mut self) {
        let Some(ctl) = &self.ctl else { return };
        for c in self.commands.iter_mut().chain(self.finished.iter_mut()) {
            let exit = if c.sealed {
                c.leader.map(|(e, _)| e)
            } else {
                None
            };
            let msg = FromInit::Known {
                pid: c.pid as u32,
                tag: c.tag.clone(),
                pty: c.pty,
                counts: c.counts(),
                exit,
            };
            // Only a leader not yet reaped: a reaped one's pid may be another's now.
            let pidfd = if c.leader.is_none() {
                rustix::process::Pid::from_raw(c.pid).and_then(|p| {
                    rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
                })
            } else {
                None
            };
            let fds: Vec<BorrowedFd<'_>> = pidfd.iter().map(|f| f.as_fd()).collect();
            if send(ctl.as_fd(), &msg, &fds).is_err() {
                return;
            }
            c.dirty = false;
        }
        let fds: Vec<BorrowedFd<'_>> = self.store.iter().map(|f| f.as_fd()).collect();
        let _ = send(ctl.as_fd(), &FromInit::Attached, &fds);
        // What the daemon was told about is no longer needed here.
        self.finished.clear();
    }

    fn spawn(&mut self, msg: ToInit, mut fds: Vec<OwnedFd>) {
        let ToInit::Spawn {
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
        } = msg
        else {
            return;
        };
        let Some(ctl) = &self.ctl else { return };
        let refuse = |not_found: bool, mut message: String| {
            if message.len() > MAX_SPAWN_MESSAGE {
                let mut end = MAX_SPAWN_MESSAGE;
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                message.truncate(end);
                message.push('…');
            }
            let _ = send(
                ctl.as_fd(),
                &FromInit::SpawnFailed {
                    req,
                    not_found,
                    message,
                },
                &[],
            );
        };
        let Some((program, args)) = argv.split_first() else {
            return refuse(false, "empty command".into());
        };
        let expected = if pty { 1 } else { 7 };
        if fds.len() != expected {
            return refuse(
                false,
                format!("expected {expected} descriptors, got {}", fds.len()),
            );
        }
        let mut cmd = if pty {
            // setsid and the controlling terminal need code between fork and exec: a
            // second pass through this binary does them, then execs the command.
            let mut c = std::process::Command::new("/proc/self/exe");
            c.arg(crate::confine::CONFINE_SUBCOMMAND)
                .arg("ptyexec")
                .arg(program)
                .args(args);
            c
        } else {
            let mut c = std::process::Command::new(program);
            c.args(args).process_group(0);
            c
        };
        let mut pipes = [None, None];
        let mut spools = [None, None];
        let (stdin, stdout, stderr) = if pty {
            let slave = fds.remove(0);
            let (Ok(a), Ok(b)) = (slave.try_clone(), slave.try_clone()) else {
                return refuse(false, "cannot duplicate the pty".into());
            };
            (slave, a, b)
        } else {
            spools[1] = fds.pop().map(std::fs::File::from);
            spools[0] = fds.pop().map(std::fs::File::from);
            pipes[1] = fds.pop();
            pipes[0] = fds.pop();
            let stderr = fds.remove(2);
            let stdout = fds.remove(1);
            (fds.remove(0), stdout, stderr)
        };
        cmd.env_clear()
            .envs(
                env.iter()
                    .map(|(k, v)| (OsString::from(k), OsString::from(v))),
            )
            .current_dir(&cwd)
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        if uid != 0 || gid != 0 {
            cmd.uid(uid).gid(gid);
        }
        match cmd.spawn() {
            Ok(child) => {
                let pid = child.id();
                // The command's ends of its pipes went with `cmd`: ours read to the end.
                drop(cmd);
                self.commands.push(Cmd {
                    pid: pid as i32,
                    tag,
                    pty,
                    pipes,
                    spools,
                    capture: caps.map(Capture::new),
                    drain: std::time::Duration::from_millis(drain_ms),
                    leader: None,
                    sealed: false,
                    dirty: false,
                });
                let pidfd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
                    rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
                });
                let fds: Vec<BorrowedFd<'_>> = pidfd.iter().map(|f| f.as_fd()).collect();
                let _ = send(ctl.as_fd(), &FromInit::Spawned { req, pid }, &fds);
                // The child is reaped by `reap`, never through `child`.
                drop(child);
            }
            Err(e) => refuse(
                e.kind() == std::io::ErrorKind::NotFound,
                format!("cannot execute {program}: {e}"),
            ),
        }
    }
}

/// [`send`] without waiting for room: `Ok(false)` when the socket is full.
fn send_nonblocking<T: Serialize>(sock: BorrowedFd<'_>, msg: &T) -> std::io::Result<bool> {
    let bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    match rustix::net::send(sock, &bytes, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
        Ok(_) => Ok(true),
        Err(rustix::io::Errno::AGAIN) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `__confine ptyexec <argv...>`: become a session leader with stdin as controlling
/// terminal, then exec.
pub(crate) fn ptyexec(argv: &[OsString]) -> ExitCode {
    let Some((program, args)) = argv.split_first() else {
        eprintln!("tether-init: empty command");
        return ExitCode::from(127);
    };
    if let Err(e) = nix::unistd::setsid() {
        eprintln!("tether-init: setsid: {e}");
        return ExitCode::from(126);
    }
    if let Err(e) = rustix::process::ioctl_tiocsctty(std::io::stdin().as_fd()) {
        eprintln!("tether-init: cannot acquire the controlling terminal: {e}");
        return ExitCode::from(126);
    }
    let err = std::process::Command::new(program).args(args).exec();
    eprintln!(
        "tether-init: cannot execute {}: {err}",
        program.to_string_lossy()
    );
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}
