//! File operations with the sandbox root's rights, for E2B's file API.
//!
//! envd runs every file operation as root and gives what it creates to the user it was
//! asked for: `files.write("/root/x", user="root")`, or a write of `/etc/app.conf` as
//! `user`, succeed in an E2B sandbox. The sandbox's root is root only inside the
//! sandbox's user namespace, and the kernel grants its rights (`CAP_DAC_OVERRIDE` and
//! the rest, over the ids mapped into that namespace) only to a process that is a
//! member of it. A thread of tetherd cannot join a user namespace (`setns` demands a
//! single-threaded process), and tetherd's own host rights are wider than the
//! sandbox root's: the host template's root shows host files, whose owners are not
//! mapped, and host root would read them.
//!
//! So an operation first runs in process with the asked user's own rights ([`UserFs`]:
//! most need no more, and they cost what the default view's cost), and one the kernel
//! refuses runs again in a short-lived helper (`tether-confine __confine fsop`): tetherd hands it, over a socket on its stdin, the operation, a descriptor
//! of the sandbox's user namespace and one of the sandbox's root (and for a write, the
//! read end of a pipe carrying the data). The helper joins the user namespace as its
//! root, and runs the same [`LocalFs`] code as every other file operation on a view of
//! the root with no credentials of its own and the asked user as owner: resolution
//! confined beneath the root, one mount, no symlink out. Its reply is JSON on its
//! stdout; a read's reply is the open file, passed back on the socket, which tetherd
//! streams itself. A write is published only after tetherd says the data ended
//! whole (`Commit`); a broken body or a cancelled call closes the socket instead, and
//! the helper removes its temporary file. The helper bounds itself with the call's
//! remaining time.
//!
//! Where the sandbox has no user namespace of its own (`isolation = "none"`, the
//! microVM guest), tetherd already runs with the machine's root rights: the view is
//! made in process.

use std::collections::BTreeMap;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use rustix::net::RecvFlags;
use serde::{Deserialize, Serialize};
use tether_protocol::fs::{ByteRange, DirEntry, FileStat, WriteGuard, WriteOutcome};
use tether_protocol::{Clock, ErrorCode};
use tether_provider::{ByteStream, CallCtx, Fs, ProviderError, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{internal, spawn_failed};
use crate::fs::{LocalFs, Workspace, read_stream};
use crate::init::{recv, send};
use crate::sandbox::SandboxCore;

/// Largest reply read from a helper (a deep listing of a large tree).
const MAX_REPLY: u64 = 256 << 20;

/// One operation for the helper.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum FsRequest {
    Stat {
        path: String,
    },
    Open {
        path: String,
    },
    Write {
        path: String,
        guard: WriteGuard,
    },
    List {
        path: String,
        depth: u32,
    },
    Mkdir {
        path: String,
        parents: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Xattrs {
        path: String,
        prefix: String,
    },
    SetXattrs {
        path: String,
        prefix: String,
        values: BTreeMap<String, Vec<u8>>,
    },
}

/// What the helper is handed, with the descriptors of the user namespace, the root
/// and (for a write) the data pipe.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct FsJob {
    home: String,
    home_comps: Vec<String>,
    /// uid and gid inside the sandbox that what is created belongs to.
    owner: (u32, u32),
    /// How long the helper may take, in ms.
    budget_ms: u64,
    req: FsRequest,
}

/// tetherd's word on a write's data, after its pipe is closed.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum DataEnd {
    Commit,
}

/// The helper's answer.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum FsReply {
    Stat(FileStat),
    /// The file is open: its descriptor follows on the socket.
    Opened,
    Written(WriteOutcome),
    Listed(Vec<DirEntry>),
    Done,
    Xattrs(BTreeMap<String, Vec<u8>>),
    Failed {
        code: ErrorCode,
        path: String,
        message: String,
    },
}

impl FsReply {
    fn failed(e: &ProviderError) -> Self {
        let path = match e {
            ProviderError::Fs { path, .. } => path.clone(),
            _ => String::new(),
        };
        let message = match e {
            ProviderError::Fs { message, .. } => message.clone(),
            ProviderError::InvalidRequest { message } => message.clone(),
            other => other.to_string(),
        };
        Self::Failed {
            code: e.code(),
            path,
            message,
        }
    }
}

/// The error a helper reported, as the seam's.
fn reported(code: ErrorCode, path: String, message: String) -> ProviderError {
    match code {
        ErrorCode::InvalidRequest => ProviderError::InvalidRequest { message },
        c if c.as_str().starts_with("FS_") => ProviderError::fs(c, path, message),
        _ => ProviderError::Internal {
            message: format!("file helper: {message}"),
            source: None,
        },
    }
}

// === impl ElevatedFs ===

/// The `Fs` of a local sandbox with its root's rights, what it creates given to `owner`.
#[derive(Debug)]
pub(crate) struct ElevatedFs {
    core: Arc<SandboxCore>,
    home: String,
    home_comps: Vec<String>,
    owner: (u32, u32),
}

/// The view of `core`'s sandbox that E2B's file API gives `user`.
pub(crate) fn view_for(core: &Arc<SandboxCore>, user: &str) -> Result<Arc<dyn Fs>> {
    let owner = crate::process::lookup_user(core, user)?;
    let (home, home_comps) = if owner.0 == 0 {
        ("/root".to_owned(), vec!["root".to_owned()])
    } else {
        (core.cfg.workspace_str(), core.home.clone())
    };
    if core.userns.is_none() {
        // No namespace of its own: tetherd's rights are the machine's.
        let root = core
            .ws
            .root_fd()
            .map_err(|e| internal("cannot open the sandbox's root", e))?;
        let own = nix::unistd::geteuid().is_root().then_some(owner);
        let ws = Workspace::view(root, &home, &home_comps, None, own);
        return Ok(Arc::new(LocalFs::new(
            Arc::new(ws),
            core.tasks.clone(),
            core.closed.clone(),
        )));
    }
    // Most operations need no more than the user's own rights (its home, `/tmp`; root's
    // own files for root): they run in process as that user, as the default view's do,
    // and what they create is the user's already. Only those the kernel refuses them pay
    // for the helper, which then acts with root's rights.
    let uid_base = core.cfg.uid_base;
    let creds = (uid_base + owner.0, uid_base + owner.1);
    let ws = if core.ws.creds == Some(creds) {
        core.ws.clone()
    } else {
        let root = core
            .ws
            .root_fd()
            .map_err(|e| internal("cannot open the sandbox's root", e))?;
        Arc::new(Workspace::view(root, &home, &home_comps, Some(creds), None))
    };
    Ok(Arc::new(UserFs {
        own: LocalFs::new(ws, core.tasks.clone(), core.closed.clone()),
        root: ElevatedFs {
            core: core.clone(),
            home,
            home_comps,
            owner,
        },
    }))
}

// === impl UserFs ===

/// E2B's view for one user: the user's own rights first, root's (through the helper)
/// where the kernel refuses those.
#[derive(Debug)]
pub(crate) struct UserFs {
    own: LocalFs,
    root: ElevatedFs,
}

/// `own`, else (the kernel refused the user's own rights, or the path is out of reach,
/// which the helper refuses as well) `root`.
async fn own_then_root<T, R: Future<Output = Result<T>>>(
    own: impl Future<Output = Result<T>>,
    root: impl FnOnce() -> R,
) -> Result<T> {
    match own.await {
        Err(e) if e.code() == ErrorCode::FsPermissionDenied => root().await,
        r => r,
    }
}

#[async_trait]
impl Fs for UserFs {
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat> {
        own_then_root(self.own.stat(ctx, path), || self.root.stat(ctx, path)).await
    }

    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream> {
        own_then_root(self.own.read(ctx, path, range), || {
            self.root.read(ctx, path, range)
        })
        .await
    }

    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        // Decided before a byte of the data is read.
        let begun = self.own.begin_write(ctx, path).await;
        match begun {
            Ok(pending) => self.own.finish_write(ctx, path, pending, data, guard).await,
            Err(e) if e.code() == ErrorCode::FsPermissionDenied => {
                self.root.write(ctx, path, data, guard).await
            }
            Err(e) => Err(e),
        }
    }

    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        own_then_root(self.own.list(ctx, path, depth), || {
            self.root.list(ctx, path, depth)
        })
        .await
    }

    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat> {
        own_then_root(self.own.mkdir(ctx, path, parents), || {
            self.root.mkdir(ctx, path, parents)
        })
        .await
    }

    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat> {
        own_then_root(self.own.rename(ctx, from, to), || {
            self.root.rename(ctx, from, to)
        })
        .await
    }

    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()> {
        own_then_root(self.own.remove(ctx, path, recursive), || {
            self.root.remove(ctx, path, recursive)
        })
        .await
    }

    async fn watch(
        &self,
        ctx: &CallCtx,
        path: &str,
        recursive: bool,
    ) -> Result<futures_util::stream::BoxStream<'static, Result<tether_protocol::fs::FsEvent>>>
    {
        self.own.watch(ctx, path, recursive).await
    }

    async fn xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        own_then_root(self.own.xattrs(ctx, path, prefix), || {
            self.root.xattrs(ctx, path, prefix)
        })
        .await
    }

    async fn set_xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
        values: BTreeMap<String, Vec<u8>>,
    ) -> Result<()> {
        own_then_root(
            self.own.set_xattrs(ctx, path, prefix, values.clone()),
            || self.root.set_xattrs(ctx, path, prefix, values),
        )
        .await
    }
}

/// A running helper.
struct Helper {
    child: tokio::process::Child,
    sock: OwnedFd,
    data: Option<tokio::net::unix::pipe::Sender>,
}

impl ElevatedFs {
    fn budget(&self, ctx: &CallCtx) -> Duration {
        // Never zero: a zero budget would leave the helper unbounded.
        ctx.remaining()
            .unwrap_or(Duration::from_millis(self.core.cfg.fs_helper_timeout_ms))
            .max(Duration::from_millis(1))
    }

    /// Start a helper on `req`.
    fn start(&self, ctx: &CallCtx, req: FsRequest) -> Result<Helper> {
        let Some(userns) = &self.core.userns else {
            return Err(internal(
                "the sandbox has no user namespace",
                std::io::Error::other("not isolated"),
            ));
        };
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| internal("cannot create the helper socket", std::io::Error::from(e)))?;
        let wants_data = matches!(req, FsRequest::Write { .. });
        let job = FsJob {
            home: self.home.clone(),
            home_comps: self.home_comps.clone(),
            owner: self.owner,
            budget_ms: u64::try_from(self.budget(ctx).as_millis()).unwrap_or(u64::MAX),
            req,
        };
        let mut cmd = tokio::process::Command::new(self.core.launcher.program());
        cmd.arg(crate::confine::CONFINE_SUBCOMMAND)
            .arg("fsop")
            .env_clear()
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let child = cmd
            .spawn()
            .map_err(|e| spawn_failed("cannot start the file helper", Some(e)))?;
        let root = self
            .core
            .ws
            .root_fd()
            .map_err(|e| internal("cannot open the sandbox's root", e))?;
        let (data, data_end) = if wants_data {
            let (tx, rx) = tokio::net::unix::pipe::pipe()
                .map_err(|e| internal("cannot create the data pipe", e))?;
            let rx = rx
                .into_blocking_fd()
                .map_err(|e| internal("cannot create the data pipe", e))?;
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let mut fds = vec![userns.as_fd(), root.as_fd()];
        fds.extend(data_end.as_ref().map(|d| d.as_fd()));
        send(ours.as_fd(), &job, &fds)
            .map_err(|e| internal("cannot talk to the file helper", e))?;
        Ok(Helper {
            child,
            sock: ours,
            data,
        })
    }

    /// The helper's reply, once it has exited.
    async fn reply(ctx: &CallCtx, helper: &mut Helper) -> Result<FsReply> {
        let Some(out) = helper.child.stdout.take() else {
            return Err(internal(
                "the file helper has no stdout",
                std::io::Error::other("no pipe"),
            ));
        };
        let mut buf = Vec::new();
        ctx.run(async {
            out.take(MAX_REPLY)
                .read_to_end(&mut buf)
                .await
                .map_err(|e| internal("cannot read the file helper's reply", e))
        })
        .await?;
        let status = ctx
            .run(async {
                helper
                    .child
                    .wait()
                    .await
                    .map_err(|e| internal("cannot wait for the file helper", e))
            })
            .await?;
        match serde_json::from_slice::<FsReply>(&buf) {
            Ok(FsReply::Failed {
                code,
                path,
                message,
            }) => Err(reported(code, path, message)),
            Ok(r) => Ok(r),
            Err(e) => Err(internal(
                format!("the file helper ended ({status}) without a reply"),
                e,
            )),
        }
    }

    /// Run `req` in a helper; its reply as `pick` takes it (a reply `pick` gives back
    /// answered out of turn).
    async fn ask<T>(
        &self,
        ctx: &CallCtx,
        req: FsRequest,
        pick: impl FnOnce(FsReply) -> std::result::Result<T, FsReply>,
    ) -> Result<T> {
        ctx.check()?;
        let mut helper = self.start(ctx, req)?;
        pick(Self::reply(ctx, &mut helper).await?).map_err(|other| unexpected(&other))
    }
}

fn unexpected(reply: &FsReply) -> ProviderError {
    internal(
        "the file helper answered out of turn",
        std::io::Error::other(format!("{reply:?}")),
    )
}

#[async_trait]
impl Fs for ElevatedFs {
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat> {
        self.ask(ctx, FsRequest::Stat { path: path.into() }, |r| match r {
            FsReply::Stat(v) => Ok(v),
            other => Err(other),
        })
        .await
    }

    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream> {
        ctx.check()?;
        let mut helper = self.start(ctx, FsRequest::Open { path: path.into() })?;
        match Self::reply(ctx, &mut helper).await? {
            FsReply::Opened => {}
            other => return Err(unexpected(&other)),
        }
        let fd = match recv::<FsReply>(helper.sock.as_fd(), RecvFlags::DONTWAIT) {
            Ok(Some((FsReply::Opened, mut fds))) if fds.len() == 1 => fds.remove(0),
            other => {
                return Err(internal(
                    "the file helper passed no file",
                    std::io::Error::other(format!("{:?}", other.map(|o| o.map(|m| m.0)))),
                ));
            }
        };
        Ok(read_stream(fd, range, path))
    }

    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        mut data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        ctx.check()?;
        let mut helper = self.start(
            ctx,
            FsRequest::Write {
                path: path.into(),
                guard,
            },
        )?;
        let Some(mut pipe) = helper.data.take() else {
            return Err(unexpected(&FsReply::Done));
        };
        // Pump the data; the helper answers on its own if it fails first (the pipe then
        // breaks), so its reply is read in every case.
        let pumped: Result<()> = async {
            while let Some(chunk) = ctx.run(async { Ok(data.next().await) }).await? {
                let chunk = chunk?;
                if ctx
                    .run(async { Ok(pipe.write_all(&chunk).await.is_err()) })
                    .await?
                {
                    return Ok(());
                }
            }
            Ok(())
        }
        .await;
        drop(pipe);
        if pumped.is_ok() {
            // Not sent on a broken body: the helper sees the socket close and abandons
            // the temporary file.
            let _ = send(helper.sock.as_fd(), &DataEnd::Commit, &[]);
        } else {
            let _ = rustix::net::shutdown(&helper.sock, rustix::net::Shutdown::Write);
        }
        let reply = Self::reply(ctx, &mut helper).await;
        pumped?;
        match reply? {
            FsReply::Written(o) => Ok(o),
            other => Err(unexpected(&other)),
        }
    }

    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        self.ask(
            ctx,
            FsRequest::List {
                path: path.into(),
                depth,
            },
            |r| match r {
                FsReply::Listed(v) => Ok(v),
                other => Err(other),
            },
        )
        .await
    }

    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat> {
        self.ask(
            ctx,
            FsRequest::Mkdir {
                path: path.into(),
                parents,
            },
            |r| match r {
                FsReply::Stat(v) => Ok(v),
                other => Err(other),
            },
        )
        .await
    }

    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat> {
        self.ask(
            ctx,
            FsRequest::Rename {
                from: from.into(),
                to: to.into(),
            },
            |r| match r {
                FsReply::Stat(v) => Ok(v),
                other => Err(other),
            },
        )
        .await
    }

    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()> {
        self.ask(
            ctx,
            FsRequest::Remove {
                path: path.into(),
                recursive,
            },
            |r| match r {
                FsReply::Done => Ok(()),
                other => Err(other),
            },
        )
        .await
    }

    async fn xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        self.ask(
            ctx,
            FsRequest::Xattrs {
                path: path.into(),
                prefix: prefix.into(),
            },
            |r| match r {
                FsReply::Xattrs(v) => Ok(v),
                other => Err(other),
            },
        )
        .await
    }

    async fn set_xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
        values: BTreeMap<String, Vec<u8>>,
    ) -> Result<()> {
        self.ask(
            ctx,
            FsRequest::SetXattrs {
                path: path.into(),
                prefix: prefix.into(),
                values,
            },
            |r| match r {
                FsReply::Done => Ok(()),
                other => Err(other),
            },
        )
        .await
    }
}

// === the helper ===

/// `__confine fsop`: join the sandbox's user namespace as its root, run one file
/// operation, print the reply. Must start single-threaded.
pub(crate) fn helper() -> ExitCode {
    let stdin = std::io::stdin();
    let sock = stdin.as_fd();
    let reply = match recv::<FsJob>(sock, RecvFlags::empty()) {
        Ok(Some((job, fds))) => run_job(sock, job, fds),
        Ok(None) => return ExitCode::from(2),
        Err(e) => FsReply::failed(&internal("cannot read the job", e)),
    };
    match serde_json::to_writer(std::io::stdout(), &reply) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(1),
    }
}

fn run_job(sock: std::os::fd::BorrowedFd<'_>, job: FsJob, fds: Vec<OwnedFd>) -> FsReply {
    let mut fds = fds.into_iter();
    let (Some(userns), Some(root)) = (fds.next(), fds.next()) else {
        return FsReply::failed(&internal(
            "the job came without its descriptors",
            std::io::Error::other("missing descriptors"),
        ));
    };
    let data = fds.next();
    if let Err(e) = become_sandbox_root(&userns) {
        return FsReply::failed(&internal("cannot join the sandbox's user namespace", e));
    }
    drop(userns);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return FsReply::failed(&internal("cannot start a runtime", e)),
    };
    let budget = Duration::from_millis(job.budget_ms);
    rt.block_on(async move {
        let ws = Arc::new(Workspace::view(
            root,
            &job.home,
            &job.home_comps,
            None,
            Some(job.owner),
        ));
        let fs = LocalFs::new(ws.clone(), TaskTracker::new(), CancellationToken::new());
        let ctx = CallCtx::new("fsop").with_timeout(budget, Clock::Total);
        match perform(&ctx, &ws, &fs, sock, job.req, data).await {
            Ok(r) => r,
            Err(e) => FsReply::failed(&e),
        }
    })
}

/// Join the user namespace `userns` and become its root, with its capabilities over
/// what its ids own and nothing else.
fn become_sandbox_root(userns: &OwnedFd) -> std::io::Result<()> {
    use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};
    nix::sched::setns(userns, nix::sched::CloneFlags::CLONE_NEWUSER)?;
    let (g, u) = (Gid::from_raw(0), Uid::from_raw(0));
    // Denied where the namespace's setgroups is "deny"; the host's groups then stay
    // unmapped, which grants nothing.
    let _ = setgroups(&[g]);
    setresgid(g, g, g)?;
    setresuid(u, u, u)?;
    Ok(())
}

async fn perform(
    ctx: &CallCtx,
    ws: &Workspace,
    fs: &LocalFs,
    sock: std::os::fd::BorrowedFd<'_>,
    req: FsRequest,
    data: Option<OwnedFd>,
) -> Result<FsReply> {
    Ok(match req {
        FsRequest::Stat { path } => FsReply::Stat(fs.stat(ctx, &path).await?),
        FsRequest::Open { path } => {
            let fd = ws.open_regular(&path)?;
            send(sock, &FsReply::Opened, &[fd.as_fd()])
                .map_err(|e| internal("cannot pass the file", e))?;
            FsReply::Opened
        }
        FsRequest::Write { path, guard } => {
            let Some(data) = data else {
                return Err(ProviderError::InvalidRequest {
                    message: "a write without data".into(),
                });
            };
            let stream = committed(data, sock)?;
            FsReply::Written(fs.write(ctx, &path, stream, guard).await?)
        }
        FsRequest::List { path, depth } => FsReply::Listed(fs.list(ctx, &path, depth).await?),
        FsRequest::Mkdir { path, parents } => FsReply::Stat(fs.mkdir(ctx, &path, parents).await?),
        FsRequest::Rename { from, to } => FsReply::Stat(fs.rename(ctx, &from, &to).await?),
        FsRequest::Remove { path, recursive } => {
            fs.remove(ctx, &path, recursive).await?;
            FsReply::Done
        }
        FsRequest::Xattrs { path, prefix } => {
            FsReply::Xattrs(fs.xattrs(ctx, &path, &prefix).await?)
        }
        FsRequest::SetXattrs {
            path,
            prefix,
            values,
        } => {
            fs.set_xattrs(ctx, &path, &prefix, values).await?;
            FsReply::Done
        }
    })
}

/// The data of a write: the pipe's bytes, ended by tetherd's `Commit` on the socket.
/// Without it (the socket closed: a broken body, a cancelled call), the stream ends in
/// an error and the write publishes nothing.
fn committed(data: OwnedFd, sock: std::os::fd::BorrowedFd<'_>) -> Result<ByteStream> {
    let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(data)
        .map_err(|e| internal("cannot read the data pipe", e))?;
    let sock = sock
        .try_clone_to_owned()
        .map_err(|e| internal("cannot keep the socket", e))?;
    let bytes = tokio_util::io::ReaderStream::with_capacity(rx, crate::fs::READ_CHUNK)
        .map(|r| r.map_err(|e| ProviderError::from_io("", e)));
    let end = futures_util::stream::once(async move {
        tokio::task::spawn_blocking(move || recv::<DataEnd>(sock.as_fd(), RecvFlags::empty()))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    })
    .filter_map(|end| async move {
        match end {
            Some((DataEnd::Commit, _)) => None,
            None => Some(Err(ProviderError::Cancelled {
                reason: tether_provider::clock::CancelReason::Caller(
                    "the write's data ended unfinished",
                ),
            })),
        }
    });
    Ok(bytes.chain(end).boxed())
}
