//! The raw transport of the local provider: launching the confinement trampoline,
//! per-command cgroups, pseudo-terminals, and process scans.
//!
//! Nothing here knows about sandboxes' file layout or the seam; `sandbox.rs` and
//! `process.rs` build on it.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sys::signal::Signal as NixSignal;
use nix::unistd::Pid;
use tether_provider::{CallCtx, ProviderError, Result};
use tokio::process::Command;

use crate::config::LocalConfig;
use crate::confine::{CONFINE_SUBCOMMAND, ConfineSpec, ProbeReport};
use crate::error::{internal, spawn_failed};

/// The standalone trampoline's file name.
pub const CONFINE_BINARY: &str = "tether-confine";

// === impl Launcher ===

/// Starts the trampoline (`<helper> __confine run|probe <spec>`).
#[derive(Debug, Clone)]
pub(crate) struct Launcher {
    program: PathBuf,
}

impl Launcher {
    /// Find the trampoline: the configured path, `tether-confine` next to (or one level
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

    /// The trampoline's path.
    pub(crate) fn program(&self) -> &Path {
        &self.program
    }

    /// A command that runs `verb` on the spec at `spec_path`, with an empty environment
    /// (nothing of the daemon's environment reaches the trampoline, let alone the command).
    pub(crate) fn command(&self, verb: &str, spec_path: &Path) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.arg(CONFINE_SUBCOMMAND)
            .arg(verb)
            .arg(spec_path)
            .env_clear()
            .kill_on_drop(false);
        cmd
    }

    /// Run the trampoline in probe mode with `spec`, written to `spec_path`.
    pub(crate) async fn probe(
        &self,
        ctx: &CallCtx,
        spec: &ConfineSpec,
        spec_path: &Path,
    ) -> Result<ProbeReport> {
        write_spec(spec_path, spec).await?;
        let mut cmd = self.command("probe", spec_path);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let out = ctx
            .run(async {
                cmd.output().await.map_err(|e| {
                    spawn_failed(
                        format!(
                            "cannot run the confinement helper {}",
                            self.program.display()
                        ),
                        Some(e),
                    )
                })
            })
            .await;
        let _ = tokio::fs::remove_file(spec_path).await;
        let out = out?;
        let report: ProbeReport =
            serde_json::from_slice(&out.stdout).map_err(|e| ProviderError::Unavailable {
                message: format!(
                    "the confinement helper {} did not report ({}): {}",
                    self.program.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                retry_after: None,
                source: Some(Box::new(e)),
            })?;
        Ok(report)
    }
}

/// Write a trampoline spec, readable by the owner only (it carries the environment).
pub(crate) async fn write_spec(path: &Path, spec: &ConfineSpec) -> Result<()> {
    let json =
        serde_json::to_vec(spec).map_err(|e| internal("cannot encode the confinement spec", e))?;
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        f.write_all(&json)
    })
    .await
    .map_err(crate::error::join)?
    .map_err(|e| internal("cannot write the confinement spec", e))
}

// === impl CgroupTree ===

/// Where tether keeps its cgroups: `<parent>/tether/<sandbox>/<command>`.
#[derive(Debug, Clone)]
pub(crate) struct CgroupTree {
    base: PathBuf,
}

impl CgroupTree {
    /// Find a writable cgroup v2 hierarchy, or `None` (tracking falls back to process
    /// groups and sessions).
    pub(crate) fn detect(cfg: &LocalConfig) -> Option<Self> {
        if !cfg.cgroups {
            return None;
        }
        let parent = match &cfg.cgroup_parent {
            Some(p) => p.clone(),
            None => own_cgroup_v2()?,
        };
        let base = parent.join("tether");
        std::fs::create_dir_all(&base).ok()?;
        base.join("cgroup.procs").is_file().then_some(Self { base })
    }

    /// Create (or reuse) the cgroup of sandbox `id`.
    pub(crate) fn sandbox(&self, id: &str) -> Option<Cgroup> {
        let path = self.base.join(id);
        match std::fs::create_dir(&path) {
            Ok(()) => Some(Cgroup { path }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Some(Cgroup { path }),
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "Cannot create a sandbox cgroup; tracking by process group");
                None
            }
        }
    }

    /// Where the cgroup of sandbox `id` lives.
    pub(crate) fn path_of(&self, id: &str) -> PathBuf {
        self.base.join(id)
    }

    /// The cgroup of sandbox `id` if it exists.
    pub(crate) fn existing(&self, id: &str) -> Option<Cgroup> {
        let path = self.base.join(id);
        path.is_dir().then_some(Cgroup { path })
    }
}

/// The daemon's own cgroup in the cgroup v2 hierarchy.
fn own_cgroup_v2() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        (post.split(' ').next()? == "cgroup2").then(|| pre.split(' ').nth(4).map(PathBuf::from))?
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(mount.join(rel.trim_start_matches('/')))
}

// === impl Cgroup ===

/// One cgroup v2 directory.
#[derive(Debug, Clone)]
pub(crate) struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A child cgroup, created.
    pub(crate) fn child(&self, name: &str) -> std::io::Result<Cgroup> {
        let path = self.path.join(name);
        // The sandbox's own cgroup may have been cleaned up while it was empty.
        std::fs::create_dir_all(&self.path)?;
        std::fs::create_dir(&path)?;
        Ok(Cgroup { path })
    }

    /// The pids in this cgroup and its descendants.
    pub(crate) fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        collect_pids(&self.path, &mut out);
        out
    }

    /// Whether any process lives in this cgroup or below.
    pub(crate) fn populated(&self) -> bool {
        match std::fs::read_to_string(self.path.join("cgroup.events")) {
            Ok(s) => s.lines().any(|l| l == "populated 1"),
            Err(_) => !self.pids().is_empty(),
        }
    }

    /// Send `sig` to every process of the cgroup.
    pub(crate) fn signal(&self, sig: NixSignal) -> usize {
        let pids = self.pids();
        for pid in &pids {
            let _ = nix::sys::signal::kill(Pid::from_raw(*pid), sig);
        }
        pids.len()
    }

    /// SIGKILL everything in the cgroup, atomically with respect to forks
    /// (`cgroup.kill`); on kernels without it, freeze, kill each process, thaw.
    pub(crate) fn kill_all(&self) {
        if std::fs::write(self.path.join("cgroup.kill"), "1").is_ok() {
            return;
        }
        let freeze = self.path.join("cgroup.freeze");
        let frozen = std::fs::write(&freeze, "1").is_ok();
        self.signal(NixSignal::SIGKILL);
        if frozen {
            let _ = std::fs::write(&freeze, "0");
        }
    }

    /// Remove the cgroup and its (empty) children. Best effort: a cgroup that still
    /// has processes stays.
    pub(crate) fn remove(&self) {
        remove_tree(&self.path);
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(s) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_pids(&e.path(), out);
            }
        }
    }
}

fn remove_tree(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

// === process scans ===

/// Live (non-zombie) processes whose process group or session is `id`: the command's
/// group, plus anything that called `setsid` from a pty session (it keeps the session
/// id only if it did not itself `setsid`). Used when no cgroup tracks the command.
pub(crate) fn group_members(id: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
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
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let (Some(state), Some(pgrp), Some(session)) =
            (fields.first(), fields.get(2), fields.get(3))
        else {
            continue;
        };
        if *state == "Z" || *state == "X" {
            continue;
        }
        if pgrp.parse::<i32>().ok() == Some(id) || session.parse::<i32>().ok() == Some(id) {
            out.push(pid);
        }
    }
    out
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

/// Allocate a pty of `rows` x `cols`.
pub(crate) fn open_pty(rows: u16, cols: u16) -> std::io::Result<Pty> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname(&master, Vec::new())?;
    set_winsize(&master, rows, cols)?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
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
