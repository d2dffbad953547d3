//! Commands of a local sandbox: started by the sandbox's init, output spools, signals
//! and termination.
//!
//! The provider hands the init the command's stdio (pipes, or a pty it allocated) over
//! the init's socket; the init starts the command as its child, in its own process
//! group (its own session under a pty), inside every namespace and cgroup of the
//! sandbox, and reports its exit. Signals go to the command's process group (and
//! session) by host pid; `terminate()` verifies with a scan of `/proc` that nothing of
//! the group is left. `destroy` kills the whole pid namespace, which reaches whatever
//! left its group.
//!
//! Output is spooled to one file per stream in the sandbox's private state directory
//! (outside the workspace), up to the capture cap; the pipe is drained past the cap so
//! the command never blocks, and the true totals are reported in `Exited`. Readers
//! ([`ProcessHandle::events`]) read the spool from any offset, as many at once as
//! wanted, and are woken by a `watch` channel as output arrives.
//!
//! A reader starting at offset zero gets `Started` first; a reader resuming from an
//! offset gets only the output at or after it, then `Exited`. The capture cap
//! (`stdout_max_bytes`, default `max_output_bytes`) bounds what is spooled and
//! delivered: the first N bytes of the stream.
//!
//! `ProcessSpec::user` names a user of the sandbox (`root`, or one in its
//! `/etc/passwd`); without it commands run as the template's default user (root in
//! `host`, `user` in `base`). Pids are the sandbox's own.
//!
//! A command has exited once its leader has exited and its pipes reached end of file,
//! or `drain_after_exit_ms` after the leader exited, whichever comes first: background
//! processes it leaves behind keep running (a server started with `&` outlives the
//! command) until `terminate()` or the sandbox's destruction.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use nix::sys::signal::Signal as NixSignal;
use serde::{Deserialize, Serialize};
use tether_protocol::limits::LimitKind;
use tether_protocol::process::{
    Command as CommandSpec, ExitStatus, ProcessEvent, ProcessInfo, ProcessSpec, PtySize, StdinMode,
    StreamKind,
};
use tether_provider::{
    CallCtx, EventStream, Process, ProcessHandle, ProcessSelector, ProviderError, Result, Signal,
    StreamOffsets, TerminateReport,
};
use tokio::io::AsyncWriteExt;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Mutex, watch};

use crate::client::{group_members, open_pty, set_winsize, shell_argv, signal_group};
use crate::error::{fs_errno, internal, spawn_failed};
use crate::init::Capture;
use crate::sandbox::SandboxCore;

/// Size of the chunks read from pipes and spools.
const CHUNK: usize = 64 * 1024;

/// The `PATH` of every command unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The end-of-file character a pty's line discipline turns into end of input.
const PTY_EOF: u8 = 0x04;

// === impl LocalProcess ===

/// The `Process` of a local sandbox.
#[derive(Debug)]
pub struct LocalProcess {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    core: Arc<SandboxCore>,
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    by_id: HashMap<String, Arc<LocalCommand>>,
    /// Finished commands, oldest first, forgotten beyond `finished_commands_kept`.
    finished: VecDeque<String>,
}

impl LocalProcess {
    pub(crate) fn new(core: Arc<SandboxCore>) -> Self {
        Self {
            inner: Arc::new(Inner {
                core,
                table: Mutex::new(Table::default()),
            }),
        }
    }

    /// Kill every command of the sandbox at once (no grace: the sandbox is going away)
    /// and wait, bounded, until they are gone.
    pub(crate) async fn kill_all(&self) {
        let commands: Vec<Arc<LocalCommand>> = self
            .inner
            .table
            .lock()
            .await
            .by_id
            .values()
            .cloned()
            .collect();
        // One pass over /proc for all of them: a sandbox remembers every command it ran,
        // and a pass per command made a destroy quadratic.
        let live = tokio::task::spawn_blocking(crate::client::live_groups)
            .await
            .unwrap_or_default();
        for c in &commands {
            c.kill_among(&live);
        }
    }

    /// Take over the commands a reconnected init knew (a daemon restart): running ones
    /// are supervised again from what their spools hold; ended ones are remembered with
    /// their status. Their stdin was the previous daemon's and is gone; a pty command's
    /// terminal went with it too (its output is what was spooled before).
    pub(crate) async fn adopt(&self, adopted: Vec<crate::client::Adopted>) {
        let core = &self.inner.core;
        let mut table = self.inner.table.lock().await;
        for a in adopted {
            let meta: CommandMeta = match serde_json::from_str(&a.tag) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(sandbox.id = %core.id, pid = a.pid, error = %e, "A command of a re-attached sandbox has an unreadable description");
                    continue;
                }
            };
            let id = meta.id.clone();
            let spool = core.state_dir.join("cmd").join(&meta.key);
            let out_path = spool.join("stdout");
            let err_path = spool.join("stderr");
            let mut start = Progress::default();
            if a.pty {
                let len = std::fs::metadata(&out_path).map_or(0, |m| m.len());
                start.out = len;
                start.out_total = len;
            } else {
                start.apply(a.counts);
            }
            start.exited = a.exit;
            let (progress, _) = watch::channel(start);
            let host_pid = a.running.as_ref().and_then(|r| r.host_pid);
            let command = Arc::new(LocalCommand {
                id: meta.id.clone(),
                pid: a.pid,
                info: ProcessInfo {
                    command_id: meta.id.clone(),
                    pid: a.pid,
                    command: meta.command,
                    cwd: meta.cwd,
                    pty: a.pty,
                    exit: None,
                },
                spool,
                out_path,
                err_path,
                stdin: Mutex::new(None),
                pty: None,
                progress,
                host_pid,
                limit: std::sync::OnceLock::new(),
                grace: Duration::from_millis(meta.grace_ms),
                verify: Duration::from_millis(core.cfg.kill_verify_ms),
                terminating: Mutex::new(None),
                released: std::sync::RwLock::new(StreamOffsets::default()),
            });
            table.by_id.insert(id.clone(), command.clone());
            match a.running {
                Some(running) => {
                    let before = core
                        .cgroup
                        .as_ref()
                        .map(|cg| (cg.oom_kills(), cg.pids_refusals()));
                    core.tasks.spawn(supervise(
                        running,
                        before,
                        command,
                        Vec::new(),
                        Arc::new(AtomicBool::new(false)),
                        Duration::from_millis(core.cfg.drain_after_exit_ms),
                        Arc::downgrade(&self.inner),
                    ));
                }
                None => table.finished.push_back(id.clone()),
            }
            tracing::info!(sandbox.id = %core.id, command.id = %id, "Re-attached a command of a sandbox that outlived its daemon");
        }
    }

    fn resolve_cwd(&self, cwd: Option<&str>) -> Result<(PathBuf, Option<String>)> {
        let ws = &self.inner.core.ws;
        let Some(cwd) = cwd else {
            return Ok((PathBuf::from(ws.display()), None));
        };
        // The directory must exist, checked the way Fs checks paths.
        let comps = ws.resolve(cwd, true)?;
        ws.open_dir(&comps).map_err(|e| fs_errno(cwd, e))?;
        Ok((PathBuf::from(ws.sandbox_path(&comps)), Some(cwd.to_owned())))
    }
}

/// A command that used all the free space of the sandbox's disk left less than this.
const DISK_FULL_BYTES: u64 = 1 << 20;

/// uid and gid inside of user `name`, from the sandbox's `/etc/passwd`.
pub(crate) fn lookup_user(core: &SandboxCore, name: &str) -> Result<(u32, u32)> {
    if name == "root" {
        return Ok((0, 0));
    }
    let passwd = std::fs::read_to_string(format!("/proc/{}/root/etc/passwd", core.init.pid1))
        .unwrap_or_default();
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 3 && f[0] == name)
                .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
                .flatten()
        })
        .or_else(|| (name == "user").then_some(core.user))
        .ok_or_else(|| ProviderError::InvalidRequest {
            message: format!("no user {name:?} in the sandbox"),
        })
}

fn build_env(
    core: &SandboxCore,
    ctx: &CallCtx,
    spec: &ProcessSpec,
) -> Result<Vec<(String, String)>> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), core.ws.display().into());
    env.insert("LANG".into(), "C.UTF-8".into());
    if spec.pty.is_some() {
        env.insert("TERM".into(), "xterm-256color".into());
    }
    env.extend(core.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    if let Some(tp) = &ctx.trace.traceparent {
        env.insert("TRACEPARENT".into(), tp.clone());
    }
    if let Some(ts) = &ctx.trace.tracestate {
        env.insert("TRACESTATE".into(), ts.clone());
    }
    for (k, v) in &spec.env {
        if k.is_empty()
            || k.contains('=')
            || k.contains('\0')
            || v.as_ref().is_some_and(|v| v.contains('\0'))
        {
            return Err(ProviderError::InvalidRequest {
                message: format!("invalid environment variable {k:?}"),
            });
        }
        match v {
            Some(v) => env.insert(k.clone(), v.clone()),
            None => env.remove(k),
        };
    }
    Ok(env.into_iter().collect())
}

#[async_trait]
impl Process for LocalProcess {
    async fn spawn(&self, ctx: &CallCtx, spec: ProcessSpec) -> Result<Arc<dyn ProcessHandle>> {
        ctx.check()?;
        let core = &self.inner.core;
        if core.closed.is_cancelled() {
            return Err(ProviderError::SandboxNotFound {
                id: core.id.clone(),
            });
        }
        let argv = match &spec.command {
            CommandSpec::Argv(v) if v.first().is_some_and(|p| !p.is_empty()) => v.clone(),
            CommandSpec::Argv(_) => {
                return Err(ProviderError::InvalidRequest {
                    message: "argv needs a program name at argv[0]".into(),
                });
            }
            CommandSpec::Shell(s) => shell_argv(s),
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(ProviderError::InvalidRequest {
                message: "argv contains a NUL byte".into(),
            });
        }
        if let Some(PtySize { rows: 0, .. } | PtySize { cols: 0, .. }) = spec.pty {
            return Err(ProviderError::InvalidRequest {
                message: "pty size must be positive".into(),
            });
        }
        let (cwd, cwd_display) = self.resolve_cwd(spec.cwd.as_deref())?;
        let env = build_env(core, ctx, &spec)?;
        let id = spec
            .command_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        let key = uuid::Uuid::new_v4().simple().to_string();

        // Reserve the id: a finished command with the same id is forgotten.
        {
            let mut table = self.inner.table.lock().await;
            if let Some(old) = table.by_id.get(&id) {
                if old.try_status().is_none() {
                    return Err(ProviderError::InvalidRequest {
                        message: format!("command id {id} is in use"),
                    });
                }
                let old = table.by_id.remove(&id);
                table.finished.retain(|f| f != &id);
                if let Some(old) = old {
                    old.forget().await;
                }
            }
        }

        let spool = core.state_dir.join("cmd").join(&key);
        let out_path = spool.join("stdout");
        let err_path = spool.join("stderr");
        // One trip to the blocking pool for the spool (each trip is a thread wake-up).
        let (d, o, e) = (spool.clone(), out_path.clone(), err_path.clone());
        let (out_file, err_file) = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&d)?;
            Ok::<_, std::io::Error>((std::fs::File::create(&o)?, std::fs::File::create(&e)?))
        })
        .await
        .map_err(crate::error::join)?
        .map_err(|e| internal("cannot create the output spool", e))?;
        let (uid, gid) = match spec.user.as_deref() {
            None => core.user,
            Some(name) => lookup_user(core, name)?,
        };
        let before = core
            .cgroup
            .as_ref()
            .map(|cg| (cg.oom_kills(), cg.pids_refusals()));

        // Pipes and ptys belong to whoever creates them, and a command that reopens its
        // stdio by name (`/dev/fd/1`, `/dev/pts/N`) is checked against that owner: create
        // them as the command's user, as the host sees it.
        let owner = Some((
            core.cfg.uid_base.saturating_add(uid),
            core.cfg.uid_base.saturating_add(gid),
        ));
        let pipe = || {
            crate::fs::as_user(owner, || {
                rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            })
            .map_err(|e| spawn_failed("cannot create a pipe", Some(e.into())))
        };
        let mut master = None;
        let mut stdin_w = None;
        let mut pty_spool = None;
        let theirs: Vec<OwnedFd> = match spec.pty {
            Some(size) => {
                let ptmx = PathBuf::from(format!("/proc/{}/root/dev/pts/ptmx", core.init.pid1));
                // The multiplexer is opened as the provider (through the init's root);
                // the terminal is created as the command's user.
                let p = open_pty(&ptmx, size.rows, size.cols, owner)
                    .map_err(|e| spawn_failed("cannot allocate a pty", Some(e)))?;
                master = Some(Arc::new(
                    crate::client::async_fd(p.master)
                        .map_err(|e| spawn_failed("cannot register the pty", Some(e)))?,
                ));
                // The daemon spools a pty (pid1 never holds the terminal's master).
                pty_spool = Some(tokio::fs::File::from_std(out_file));
                drop(err_file);
                vec![p.slave]
            }
            None => {
                let (in_r, in_w) = pipe()?;
                if !matches!(spec.stdin, StdinMode::Ignore) {
                    stdin_w = Some(in_w);
                }
                let (o_r, o_w) = pipe()?;
                let (e_r, e_w) = pipe()?;
                // pid1 copies the pipes into the spools: output is kept while no daemon
                // is there, and the daemon's part is to read the spools.
                vec![
                    in_r,
                    o_w,
                    e_w,
                    o_r,
                    e_r,
                    OwnedFd::from(out_file),
                    OwnedFd::from(err_file),
                ]
            }
        };
        let out_cap = spec.stdout_max_bytes.unwrap_or(core.cfg.max_output_bytes);
        let err_cap = spec.stderr_max_bytes.unwrap_or(core.cfg.max_output_bytes);
        let grace = Duration::from_millis(spec.grace_ms.min(core.cfg.max_grace_ms));
        let meta = CommandMeta {
            id: id.clone(),
            key: key.clone(),
            command: spec.command.clone(),
            cwd: cwd_display.clone(),
            grace_ms: grace.as_millis() as u64,
        };
        let mut tag = serde_json::to_string(&meta)
            .map_err(|e| internal("cannot describe the command", std::io::Error::other(e)))?;
        if tag.len() > MAX_TAG {
            // pid1 hands the description back in one message: a long command line is
            // summed up (the session log keeps it whole).
            let len = tag.len();
            tag = serde_json::to_string(&CommandMeta {
                command: CommandSpec::Shell(format!("<a command of {len} bytes>")),
                ..meta
            })
            .map_err(|e| internal("cannot describe the command", std::io::Error::other(e)))?;
        }
        let fds: Vec<BorrowedFd<'_>> = theirs.iter().map(|f| f.as_fd()).collect();
        let started = core
            .init
            .spawn(
                argv,
                env,
                cwd.clone(),
                master.is_some(),
                (uid, gid),
                tag,
                [out_cap, err_cap],
                core.cfg.drain_after_exit_ms,
                &fds,
            )
            .await;
        // Our copies of the command's ends go now: end of file must come when the
        // command's side closes.
        drop(fds);
        drop(theirs);
        let started = match started {
            Ok(s) => s,
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(&spool).await;
                return Err(e);
            }
        };
        let pid = started.pid;
        let (progress, _) = watch::channel(Progress::default());
        let to_sender = |fd: OwnedFd| {
            tokio::net::unix::pipe::Sender::from_owned_fd(fd)
                .map_err(|e| spawn_failed("cannot register a pipe", Some(e)))
        };
        let stdin = match (&master, spec.stdin.clone(), stdin_w) {
            (Some(m), _, _) => Some(StdinSink::Pty(m.clone())),
            (None, StdinMode::Pipe, Some(w)) => Some(StdinSink::Pipe(to_sender(w)?)),
            (None, StdinMode::Data { data }, Some(w)) => {
                let mut w = to_sender(w)?;
                core.tasks.spawn(async move {
                    // A command that exits without reading ends this with EPIPE.
                    let _ = w.write_all(&data).await;
                });
                None
            }
            _ => None,
        };
        let command = Arc::new(LocalCommand {
            id: id.clone(),
            pid,
            info: ProcessInfo {
                command_id: id.clone(),
                pid,
                command: spec.command.clone(),
                cwd: cwd_display,
                pty: master.is_some(),
                exit: None,
            },
            spool: spool.clone(),
            out_path,
            err_path,
            stdin: Mutex::new(stdin),
            pty: master.clone(),
            progress,
            host_pid: started.host_pid,
            limit: std::sync::OnceLock::new(),
            grace,
            verify: Duration::from_millis(core.cfg.kill_verify_ms),
            terminating: Mutex::new(None),
            released: std::sync::RwLock::new(StreamOffsets::default()),
        });

        // A pty's pump (pid1 spools pipes), then the supervisor that reports the exit.
        let sealed = Arc::new(AtomicBool::new(false));
        let mut pumps = Vec::new();
        if let (Some(m), Some(file)) = (&master, pty_spool) {
            pumps.push(core.tasks.spawn(pump_pty(
                m.clone(),
                file,
                out_cap,
                command.progress.clone(),
                sealed.clone(),
            )));
        }
        {
            let mut table = self.inner.table.lock().await;
            table.by_id.insert(id.clone(), command.clone());
        }
        let drain = Duration::from_millis(core.cfg.drain_after_exit_ms);
        core.tasks.spawn(supervise(
            started,
            before,
            command.clone(),
            pumps,
            sealed,
            drain,
            Arc::downgrade(&self.inner),
        ));
        tracing::debug!(sandbox.id = %core.id, command.id = %id, pid, "Started a command");
        Ok(command)
    }

    async fn attach(
        &self,
        ctx: &CallCtx,
        which: ProcessSelector,
    ) -> Result<Arc<dyn ProcessHandle>> {
        ctx.check()?;
        let table = self.inner.table.lock().await;
        let found = match &which {
            ProcessSelector::CommandId(id) => table.by_id.get(id).cloned(),
            ProcessSelector::Pid(pid) => table.by_id.values().find(|c| c.pid == *pid).cloned(),
        };
        match found {
            Some(c) => Ok(c),
            None => Err(ProviderError::CommandNotFound {
                id: match which {
                    ProcessSelector::CommandId(id) => id,
                    ProcessSelector::Pid(pid) => pid.to_string(),
                },
            }),
        }
    }

    async fn list(&self, ctx: &CallCtx) -> Result<Vec<ProcessInfo>> {
        ctx.check()?;
        let table = self.inner.table.lock().await;
        let mut out: Vec<ProcessInfo> = table.by_id.values().map(|c| c.info()).collect();
        out.sort_by_key(|p| p.pid);
        Ok(out)
    }
}

/// Follow the command's output counts (pid1 spools its pipes) until its end, let a
/// pty's pump drain (bounded), then report the exit.
async fn supervise(
    started: crate::client::Spawned,
    before: Option<(u64, u64)>,
    command: Arc<LocalCommand>,
    pumps: Vec<tokio::task::JoinHandle<()>>,
    sealed: Arc<AtomicBool>,
    drain: Duration,
    owner: Weak<Inner>,
) {
    let crate::client::Spawned {
        mut counts,
        mut exit,
        ..
    } = started;
    // pid1 counts pipes; a pty's counts are its pump's.
    let mut follow = command.pty.is_none();
    let ended = loop {
        tokio::select! {
            r = &mut exit => break r.ok(),
            c = counts.changed(), if follow => match c {
                Ok(()) => {
                    let n = *counts.borrow_and_update();
                    command.progress.send_modify(|p| p.apply(n));
                }
                Err(_) => follow = false,
            },
        }
    };
    // The init is gone (the sandbox was destroyed): the command died with it.
    let status = match ended {
        Some((status, n)) => {
            if command.pty.is_none() {
                command.progress.send_modify(|p| p.apply(n));
            }
            status
        }
        None => ExitStatus {
            code: None,
            signal: Some(NixSignal::SIGKILL as i32),
        },
    };
    if let Some(owner) = owner.upgrade() {
        let core = &owner.core;
        let hit = match (&core.cgroup, before) {
            // The out-of-memory killer took the command, or a process it waited for.
            (Some(cg), Some((oom, _))) if !status.success() && cg.oom_kills() > oom => {
                Some(LimitKind::Memory)
            }
            (Some(cg), Some((_, pids))) if !status.success() && cg.pids_refusals() > pids => {
                Some(LimitKind::Pids)
            }
            _ if !status.success()
                && crate::rootfs::disk_free(&core.root_view())
                    .is_some_and(|f| f < DISK_FULL_BYTES) =>
            {
                Some(LimitKind::Disk)
            }
            _ => None,
        };
        if let Some(hit) = hit {
            let _ = command.limit.set(hit);
        }
    }
    let _ = tokio::time::timeout(drain, futures_util::future::join_all(pumps)).await;
    // Later output (a background process still writing) is drained and dropped, so it
    // never blocks on a full pipe, nor dies of SIGPIPE.
    sealed.store(true, Ordering::Release);
    command.progress.send_modify(|p| p.exited = Some(status));
    let Some(owner) = owner.upgrade() else { return };
    let mut table = owner.table.lock().await;
    table.finished.push_back(command.id.clone());
    let keep = owner.core.cfg.finished_commands_kept;
    while table.finished.len() > keep {
        let Some(old) = table.finished.pop_front() else {
            break;
        };
        if let Some(c) = table.by_id.remove(&old) {
            c.forget().await;
        }
    }
}

/// Free the blocks of `len` bytes of the spool at `path` from `offset` (a hole: the file
/// keeps its length, so later offsets stay where they are).
fn free_range(path: &std::path::Path, offset: u64, len: u64) -> std::io::Result<()> {
    use rustix::fs::FallocateFlags;
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    rustix::fs::fallocate(
        &file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    )?;
    Ok(())
}

/// Copy a pty's output into the stdout spool. The master reads `EIO` once every slave
/// descriptor is closed: that is its end of file.
async fn pump_pty(
    master: Arc<AsyncFd<OwnedFd>>,
    mut file: tokio::fs::File,
    cap: u64,
    progress: watch::Sender<Progress>,
    sealed: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; CHUNK];
    let mut capture = Capture::new(cap);
    loop {
        let Ok(mut guard) = master.readable().await else {
            return;
        };
        let n = match guard
            .try_io(|fd| rustix::io::read(fd.get_ref(), &mut buf[..]).map_err(std::io::Error::from))
        {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => n,
            Err(_would_block) => continue,
        };
        if sealed.load(Ordering::Acquire) {
            continue;
        }
        let keep = capture.read(n);
        if keep > 0 {
            if file.write_all(&buf[..keep]).await.is_err() || file.flush().await.is_err() {
                return;
            }
            capture.kept(keep);
        }
        progress.send_modify(|p| {
            p.out += keep as u64;
            p.out_total += n as u64;
        });
    }
}

/// Poll `done` every few milliseconds until it holds or `limit` passes.
async fn poll_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let mut every = Duration::from_millis(2);
    loop {
        if done() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every).await;
        every = (every * 2).min(Duration::from_millis(25));
    }
}

// === impl LocalCommand ===

/// What the command has produced so far (spooled bytes, and true totals).
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    out: u64,
    err: u64,
    out_total: u64,
    err_total: u64,
    exited: Option<ExitStatus>,
}

impl Progress {
    /// Take pid1's counts of the pipes (they only grow).
    fn apply(&mut self, n: crate::init::Counts) {
        self.out = self.out.max(n.kept[0]);
        self.err = self.err.max(n.kept[1]);
        self.out_total = self.out_total.max(n.total[0]);
        self.err_total = self.err_total.max(n.total[1]);
    }
}

/// Largest description of a command pid1 keeps ([`CommandMeta`], as JSON).
const MAX_TAG: usize = 16 * 1024;

/// What the daemon tells pid1 about a command, and learns back from it after a restart
/// (see [`LocalProcess::adopt`]).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandMeta {
    id: String,
    /// The spool's directory name under `state/cmd/`.
    key: String,
    command: CommandSpec,
    cwd: Option<String>,
    grace_ms: u64,
}

#[derive(Debug)]
enum StdinSink {
    Pipe(tokio::net::unix::pipe::Sender),
    Pty(Arc<AsyncFd<OwnedFd>>),
}

/// One command of a local sandbox.
#[derive(Debug)]
pub struct LocalCommand {
    id: String,
    pid: u32,
    info: ProcessInfo,
    spool: PathBuf,
    out_path: PathBuf,
    err_path: PathBuf,
    stdin: Mutex<Option<StdinSink>>,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
    progress: watch::Sender<Progress>,
    /// The leader's pid on the host (what signals are sent to); `None` when it had
    /// ended before it could be identified.
    host_pid: Option<u32>,
    /// The limit the command ran into, known once it has exited.
    limit: std::sync::OnceLock<LimitKind>,
    grace: Duration,
    verify: Duration,
    /// Serializes `terminate()`, and remembers its first report (it is idempotent).
    terminating: Mutex<Option<TerminateReport>>,
    /// Output below these offsets was released by the caller and its spool blocks freed.
    released: std::sync::RwLock<StreamOffsets>,
}

impl LocalCommand {
    fn info(&self) -> ProcessInfo {
        ProcessInfo {
            exit: self.try_status(),
            ..self.info.clone()
        }
    }

    /// Processes of the command still alive (host pids): its process group, and
    /// under a pty its session.
    fn members(&self) -> Vec<i32> {
        match self.host_pid {
            Some(pid) if pid > 1 => group_members(pid as i32),
            _ => Vec::new(),
        }
    }

    fn deliver(&self, sig: NixSignal) {
        let Some(pid) = self.host_pid.filter(|p| *p > 1) else {
            return;
        };
        signal_group(pid as i32, sig);
        // Members that left the group but kept the session: only a pty command leads a
        // session (any other's members are its group, which the signal reached).
        if self.pty.is_some() {
            for member in group_members(pid as i32) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(member), sig);
            }
        }
    }

    /// SIGKILL for the command's group and session, found in `live` (from
    /// [`crate::client::live_groups`]); nothing for a command that ended and left
    /// nothing behind (its group id may since name someone else's group).
    fn kill_among(&self, live: &HashMap<i32, Vec<i32>>) {
        let Some(pid) = self.host_pid.filter(|p| *p > 1).map(|p| p as i32) else {
            return;
        };
        let members = live.get(&pid);
        if self.progress.borrow().exited.is_some() && members.is_none() {
            return;
        }
        signal_group(pid, NixSignal::SIGKILL);
        for &member in members.into_iter().flatten() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(member), NixSignal::SIGKILL);
        }
    }

    fn kill_now(&self) {
        self.deliver(NixSignal::SIGKILL);
    }

    async fn wait_gone(&self, limit: Duration) -> bool {
        poll_until(limit, || {
            self.members().is_empty() && self.progress.borrow().exited.is_some()
        })
        .await
    }

    async fn wait_exited(&self) {
        let mut rx = self.progress.subscribe();
        let _ = rx.wait_for(|p| p.exited.is_some()).await;
    }

    /// Drop the spool of a command no longer remembered.
    async fn forget(&self) {
        let _ = tokio::fs::remove_dir_all(&self.spool).await;
    }

    async fn write_pty(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            let mut guard = fd.writable().await?;
            match guard
                .try_io(|fd| rustix::io::write(fd.get_ref(), data).map_err(std::io::Error::from))
            {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

fn to_nix(signal: Signal) -> NixSignal {
    match signal {
        Signal::Term => NixSignal::SIGTERM,
        Signal::Kill => NixSignal::SIGKILL,
        Signal::Int => NixSignal::SIGINT,
        Signal::Hup => NixSignal::SIGHUP,
        Signal::Quit => NixSignal::SIGQUIT,
        Signal::Usr1 => NixSignal::SIGUSR1,
        Signal::Usr2 => NixSignal::SIGUSR2,
        Signal::Stop => NixSignal::SIGSTOP,
        Signal::Cont => NixSignal::SIGCONT,
    }
}

#[async_trait]
impl ProcessHandle for LocalCommand {
    fn command_id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn events(&self, from: StreamOffsets) -> EventStream {
        let released = *self.released.read().unwrap_or_else(|p| p.into_inner());
        if from.stdout < released.stdout || from.stderr < released.stderr {
            let e = ProviderError::InvalidRequest {
                message: format!(
                    "the output of {} below offsets {}/{} was released by its reader; read from there on",
                    self.id, released.stdout, released.stderr
                ),
            };
            return futures_util::stream::once(async { Err(e) }).boxed();
        }
        let reader = Reader {
            started: (from == StreamOffsets::default()).then(|| ProcessEvent::Started {
                command_id: self.id.clone(),
                pid: self.pid,
            }),
            rx: self.progress.subscribe(),
            out: SpoolCursor::new(self.out_path.clone(), from.stdout),
            err: SpoolCursor::new(self.err_path.clone(), from.stderr),
            out_kind: if self.pty.is_some() {
                StreamKind::Pty
            } else {
                StreamKind::Stdout
            },
            done: false,
        };
        futures_util::stream::unfold(
            reader,
            |mut r| async move { r.next().await.map(|ev| (ev, r)) },
        )
        .boxed()
    }

    async fn release(&self, upto: StreamOffsets) {
        let punch = {
            let mut released = self.released.write().unwrap_or_else(|p| p.into_inner());
            let punch = [
                (self.out_path.clone(), released.stdout, upto.stdout),
                (self.err_path.clone(), released.stderr, upto.stderr),
            ];
            released.stdout = released.stdout.max(upto.stdout);
            released.stderr = released.stderr.max(upto.stderr);
            punch
        };
        let freed = tokio::task::spawn_blocking(move || {
            for (path, from, to) in punch {
                if to > from {
                    free_range(&path, from, to - from)?;
                }
            }
            Ok::<_, std::io::Error>(())
        })
        .await;
        if let Ok(Err(e)) | Err(e) = freed.map_err(std::io::Error::other) {
            // The copy stays on disk until the command is forgotten: only space is lost.
            tracing::debug!(command.id = %self.id, error = %e, "Could not free released output");
        }
    }

    async fn write_stdin(&self, ctx: &CallCtx, data: Bytes) -> Result<()> {
        let mut stdin = self.stdin.lock().await;
        match stdin.as_mut() {
            Some(StdinSink::Pipe(w)) => ctx
                .run(async {
                    w.write_all(&data)
                        .await
                        .map_err(|e| spawn_failed("cannot write to stdin", Some(e)))
                })
                .await
                .map_err(|e| stdin_error(e, &self.id)),
            Some(StdinSink::Pty(fd)) => {
                let fd = fd.clone();
                ctx.run(async move {
                    Self::write_pty(&fd, &data)
                        .await
                        .map_err(|e| spawn_failed("cannot write to the pty", Some(e)))
                })
                .await
                .map_err(|e| stdin_error(e, &self.id))
            }
            None => Err(ProviderError::InvalidRequest {
                message: format!("command {} has no open stdin", self.id),
            }),
        }
    }

    async fn close_stdin(&self, ctx: &CallCtx) -> Result<()> {
        let mut stdin = self.stdin.lock().await;
        match stdin.take() {
            Some(StdinSink::Pipe(mut w)) => {
                let _ = w.shutdown().await;
                Ok(())
            }
            // A pty has no half-close: send the end-of-file character instead.
            Some(StdinSink::Pty(fd)) => {
                let r = ctx
                    .run(async {
                        Self::write_pty(&fd, &[PTY_EOF])
                            .await
                            .map_err(|e| spawn_failed("cannot write to the pty", Some(e)))
                    })
                    .await;
                *stdin = Some(StdinSink::Pty(fd));
                r
            }
            None => Ok(()),
        }
    }

    async fn signal(&self, ctx: &CallCtx, signal: Signal) -> Result<()> {
        ctx.check()?;
        if self.progress.borrow().exited.is_none() || !self.members().is_empty() {
            self.deliver(to_nix(signal));
        }
        Ok(())
    }

    async fn resize(&self, ctx: &CallCtx, size: PtySize) -> Result<()> {
        ctx.check()?;
        let Some(fd) = &self.pty else {
            return Err(ProviderError::InvalidRequest {
                message: format!("command {} has no pty", self.id),
            });
        };
        if size.rows == 0 || size.cols == 0 {
            return Err(ProviderError::InvalidRequest {
                message: "pty size must be positive".into(),
            });
        }
        set_winsize(fd.get_ref(), size.rows, size.cols)
            .map_err(|e| internal("cannot resize the pty", e))
    }

    /// Runs to completion whatever `ctx` says: it is the cleanup that follows a cancel.
    /// Bounded by the grace period plus `kill_verify_ms`.
    async fn terminate(&self, _ctx: &CallCtx) -> Result<TerminateReport> {
        let mut done = self.terminating.lock().await;
        if let Some(r) = *done
            && self.members().is_empty()
        {
            return Ok(r);
        }
        let mut report = TerminateReport::default();
        // Right after spawn the cgroup may still be empty while the trampoline runs: a
        // leader not yet seen to exit counts as present.
        if !self.members().is_empty() || self.progress.borrow().exited.is_none() {
            self.deliver(NixSignal::SIGTERM);
            // A stopped process would never act on SIGTERM.
            self.deliver(NixSignal::SIGCONT);
            report.term_sent = true;
            if !self.wait_gone(self.grace).await {
                self.kill_now();
                report.killed = true;
                self.wait_gone(self.verify).await;
            }
        }
        let survivors = self.members();
        report.survivors = survivors.len() as u32;
        if !survivors.is_empty() {
            tracing::warn!(command.id = %self.id, survivors = ?survivors, "Processes survived terminate");
        }
        let _ = tokio::time::timeout(self.verify, self.wait_exited()).await;
        *done = Some(report);
        Ok(report)
    }

    async fn wait(&self, ctx: &CallCtx) -> Result<ExitStatus> {
        let mut rx = self.progress.subscribe();
        tokio::select! {
            r = rx.wait_for(|p| p.exited.is_some()) => match r {
                Ok(p) => p.exited.ok_or_else(|| internal("exit status vanished", std::io::Error::other("none"))),
                Err(e) => Err(internal("the command's supervisor is gone", e)),
            },
            _ = ctx.cancel.cancelled() => Err(ctx.check().err().unwrap_or(ProviderError::Cancelled {
                reason: tether_provider::clock::CancelReason::Caller("wait"),
            })),
        }
    }

    fn try_status(&self) -> Option<ExitStatus> {
        self.progress.borrow().exited
    }

    fn limit_hit(&self) -> Option<LimitKind> {
        self.limit.get().copied()
    }
}

fn stdin_error(e: ProviderError, id: &str) -> ProviderError {
    match e {
        ProviderError::SpawnFailed {
            source: Some(io), ..
        } if io.kind() == std::io::ErrorKind::BrokenPipe => ProviderError::InvalidRequest {
            message: format!("command {id} closed its stdin"),
        },
        e => e,
    }
}

// === impl Reader ===

/// A read position in one spool file.
struct SpoolCursor {
    path: PathBuf,
    file: Option<Arc<std::fs::File>>,
    pos: u64,
}

impl SpoolCursor {
    fn new(path: PathBuf, pos: u64) -> Self {
        Self {
            path,
            file: None,
            pos,
        }
    }

    /// Read the next chunk below `available`.
    async fn read(&mut self, available: u64) -> Result<Option<(u64, Vec<u8>)>> {
        if self.pos >= available {
            return Ok(None);
        }
        let file = match &self.file {
            Some(f) => f.clone(),
            None => {
                let f = Arc::new(
                    std::fs::File::open(&self.path)
                        .map_err(|e| internal("cannot open the output spool", e))?,
                );
                self.file = Some(f.clone());
                f
            }
        };
        let pos = self.pos;
        let want = (available - pos).min(CHUNK as u64) as usize;
        let data = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; want];
            let n = file.read_at(&mut buf, pos)?;
            buf.truncate(n);
            Ok::<_, std::io::Error>(buf)
        })
        .await
        .map_err(crate::error::join)?
        .map_err(|e| internal("cannot read the output spool", e))?;
        if data.is_empty() {
            return Err(internal(
                "the output spool is shorter than reported",
                std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
            ));
        }
        self.pos += data.len() as u64;
        Ok(Some((pos, data)))
    }
}

/// One independent reader of a command's events.
struct Reader {
    started: Option<ProcessEvent>,
    rx: watch::Receiver<Progress>,
    out: SpoolCursor,
    err: SpoolCursor,
    out_kind: StreamKind,
    done: bool,
}

impl Reader {
    async fn next(&mut self) -> Option<Result<ProcessEvent>> {
        if self.done {
            return None;
        }
        if let Some(ev) = self.started.take() {
            return Some(Ok(ev));
        }
        loop {
            let p = *self.rx.borrow_and_update();
            match self.out.read(p.out).await {
                Ok(Some((offset, data))) => {
                    return Some(Ok(ProcessEvent::Output {
                        stream: self.out_kind,
                        offset,
                        data,
                    }));
                }
                Ok(None) => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
            match self.err.read(p.err).await {
                Ok(Some((offset, data))) => {
                    return Some(Ok(ProcessEvent::Output {
                        stream: StreamKind::Stderr,
                        offset,
                        data,
                    }));
                }
                Ok(None) => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
            if let Some(status) = p.exited {
                self.done = true;
                return Some(Ok(ProcessEvent::Exited {
                    status,
                    stdout_bytes: p.out_total,
                    stderr_bytes: p.err_total,
                }));
            }
            if self.rx.changed().await.is_err() {
                self.done = true;
                return Some(Err(ProviderError::CommandNotFound {
                    id: "the command is gone".into(),
                }));
            }
        }
    }
}
