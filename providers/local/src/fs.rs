//! File operations on a local sandbox's workspace.
//!
//! Fs operations cover the workspace only (`/home/user` and below): a sandbox's private
//! `/tmp` belongs to its processes and has no host-side counterpart. Sandbox paths are
//! mapped to the host workspace directory in two steps:
//!
//! 1. *Resolution*, in user space: `.` and `..` of the request are applied lexically,
//!    then the path is walked one component at a time, and symlinks are followed the way
//!    the sandbox sees them (an absolute target is a sandbox path, so `/home/user/a`
//!    maps into the workspace and `/etc/passwd` is refused). Anything that leaves the
//!    workspace is `FS_PERMISSION_DENIED`.
//! 2. *Access*, in the kernel: the resolved, symlink-free path is opened with
//!    `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//!    RESOLVE_NO_XDEV)` relative to a descriptor of the workspace. If a sandboxed
//!    process swaps a directory for a symlink between the two steps, the kernel refuses
//!    (`ELOOP`), which also reads as `FS_PERMISSION_DENIED`: no race reaches the host.
//!
//! Writes stream into a temporary file in the target's directory, `fsync` it, and
//! publish it with `rename` while holding the sandbox's write lock, after checking the
//! write guard (`create_if_absent` uses `RENAME_NOREPLACE`, atomic even against the
//! sandbox's own processes). Versions are `<mtime_ns>-<size>-<inode>` in hex; tether's
//! own writes stamp a strictly increasing nanosecond mtime, so two writes never share a
//! version even when the kernel's clock tick or a recycled inode number would collide.

use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{
    ByteRange, DirEntry, FileKind, FileStat, FsEvent, FsEventKind, Version, WriteGuard,
    WriteOutcome,
};
use tether_provider::{ByteStream, CallCtx, Fs, ProviderError, Result};
use tokio::sync::{Mutex, broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{bad_path, fs_errno, fs_io, internal, join, outside};

/// Size of the chunks of a file read.
pub const READ_CHUNK: usize = 256 * 1024;

/// Prefix of the temporary files of in-flight writes (hidden from watch events).
pub const TEMP_PREFIX: &str = ".tether-write-";

/// Symlinks followed in one resolution before giving up (as the kernel's `MAXSYMLINKS`).
const MAX_SYMLINKS: u32 = 40;

/// Components of a path relative to the workspace.
type Comps = Vec<OsString>;

// === impl Workspace ===

/// A sandbox's root as the provider reaches it (its init's `/proc/<pid>/root`), and how
/// sandbox paths map to it.
#[derive(Debug)]
pub(crate) struct Workspace {
    root: OwnedFd,
    /// Components of the home directory, where relative paths start.
    home: Vec<OsString>,
    /// Components every path must lie under (empty: the whole root).
    prefix: Vec<OsString>,
    display: String,
    /// Host uid and gid file operations run as (the sandbox's default user), or `None`
    /// to keep the provider's own.
    pub(crate) creds: Option<(u32, u32)>,
    /// uid and gid what a file operation creates is given to, or `None` to leave it to
    /// whoever runs the operation (E2B's file API acts with root's rights and gives what
    /// it creates to the user it was asked for).
    pub(crate) owner: Option<(u32, u32)>,
}

impl Workspace {
    /// Open the sandbox root at `host`, with relative paths starting at `home`
    /// (components `home_comps`), file operations running as `creds`.
    pub(crate) fn open_root(
        host: &std::path::Path,
        home: &str,
        home_comps: &[String],
        creds: Option<(u32, u32)>,
    ) -> std::io::Result<Self> {
        let root = rustix::fs::open(
            host,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            root,
            home: home_comps.iter().map(OsString::from).collect(),
            prefix: Vec::new(),
            display: home.to_owned(),
            creds,
            owner: None,
        })
    }

    /// The same sandbox root, with relative paths starting at `home` (components
    /// `home_comps`), operations running as `creds` and what they create given to `owner`.
    pub(crate) fn view(
        root: OwnedFd,
        home: &str,
        home_comps: &[String],
        creds: Option<(u32, u32)>,
        owner: Option<(u32, u32)>,
    ) -> Self {
        Self {
            root,
            home: home_comps.iter().map(OsString::from).collect(),
            prefix: Vec::new(),
            display: home.to_owned(),
            creds,
            owner,
        }
    }

    /// A descriptor of the sandbox root (for a view of it with other rights).
    pub(crate) fn root_fd(&self) -> std::io::Result<OwnedFd> {
        self.root.try_clone()
    }

    /// Give what an operation created to the owner, if one is set.
    fn give(&self, fd: BorrowedFd<'_>, name: Option<&OsStr>) -> rustix::io::Result<()> {
        let Some((uid, gid)) = self.owner else {
            return Ok(());
        };
        let (uid, gid) = (
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        );
        match name {
            None => rustix::fs::fchown(fd, uid, gid),
            Some(name) => rustix::fs::chownat(fd, name, uid, gid, AtFlags::SYMLINK_NOFOLLOW),
        }
    }

    /// A view confined to `host`, seen inside as `sandbox_path` (components `prefix`).
    #[cfg(test)]
    pub(crate) fn open(
        host: &std::path::Path,
        sandbox_path: &str,
        prefix: &[String],
    ) -> std::io::Result<Self> {
        let root = rustix::fs::open(
            host,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let prefix: Vec<OsString> = prefix.iter().map(OsString::from).collect();
        Ok(Self {
            root,
            home: prefix.clone(),
            prefix,
            display: sandbox_path.to_owned(),
            creds: None,
            owner: None,
        })
    }

    /// Open the regular file at `path` for reading.
    pub(crate) fn open_regular(&self, path: &str) -> Result<OwnedFd> {
        let comps = self.resolve(path, true)?;
        let fd = self
            .open_beneath(&comps, OFlags::RDONLY | OFlags::NONBLOCK)
            .map_err(|e| fs_errno(path, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| fs_errno(path, e))?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => Ok(fd),
            FileType::Directory => Err(ProviderError::fs(
                ErrorCode::FsIsDirectory,
                path,
                "is a directory",
            )),
            _ => Err(ProviderError::fs(
                ErrorCode::FsNotRegularFile,
                path,
                "not a regular file",
            )),
        }
    }

    /// The home directory as sandbox paths see it (`/home/user`).
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// The sandbox path of root-relative components.
    pub(crate) fn sandbox_path(&self, comps: &[OsString]) -> String {
        let mut s = String::new();
        for c in self.prefix.iter().chain(comps) {
            s.push('/');
            s.push_str(&c.to_string_lossy());
        }
        if s.is_empty() {
            s.push('/');
        }
        s
    }

    /// Lexically normalize a sandbox path into workspace-relative components.
    pub(crate) fn lexical(&self, path: &str) -> Result<Comps> {
        if path.contains('\0') {
            return Err(bad_path(path, "contains a NUL byte"));
        }
        let mut stack: Vec<OsString> = Vec::new();
        let rel = !path.starts_with('/');
        let base = if rel { self.home.clone() } else { Vec::new() };
        stack.extend(base);
        push_lexical(&mut stack, OsStr::new(path));
        strip_prefix(&self.prefix, stack).ok_or_else(|| outside(path))
    }

    /// Resolve a sandbox path to workspace-relative components free of symlinks (but
    /// the last, unless `follow_last`). Components after the first missing one are
    /// kept as they are.
    pub(crate) fn resolve(&self, path: &str, follow_last: bool) -> Result<Comps> {
        let mut todo: VecDeque<OsString> = self.lexical(path)?.into();
        let mut done: Comps = Vec::new();
        let mut hops = 0;
        let mut missing = false;
        while let Some(c) = todo.pop_front() {
            if c == "." {
                continue;
            }
            if c == ".." {
                // `/..` is `/` when the view is the whole root.
                if done.pop().is_none() && !self.prefix.is_empty() {
                    return Err(outside(path));
                }
                continue;
            }
            if missing {
                done.push(c);
                continue;
            }
            let last = todo.is_empty();
            let dir = self.open_dir(&done).map_err(|e| fs_errno(path, e))?;
            let st = match rustix::fs::statat(&dir, c.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => {
                    missing = true;
                    done.push(c);
                    continue;
                }
                Err(e) => return Err(fs_errno(path, e)),
            };
            if FileType::from_raw_mode(st.st_mode) != FileType::Symlink || (last && !follow_last) {
                done.push(c);
                continue;
            }
            hops += 1;
            if hops > MAX_SYMLINKS {
                return Err(fs_errno(path, Errno::LOOP));
            }
            let target = rustix::fs::readlinkat(&dir, c.as_os_str(), Vec::new())
                .map_err(|e| fs_errno(path, e))?;
            let target = OsStr::from_bytes(target.as_bytes());
            let mut spliced: VecDeque<OsString> = VecDeque::new();
            if target.as_bytes().starts_with(b"/") {
                // An absolute target is a sandbox path: it must land in the workspace.
                let mut stack = Vec::new();
                push_lexical(&mut stack, target);
                let rest = strip_prefix(&self.prefix, stack).ok_or_else(|| outside(path))?;
                done.clear();
                spliced.extend(rest);
            } else {
                spliced.extend(split(target));
            }
            spliced.extend(todo.drain(..));
            todo = spliced;
        }
        Ok(done)
    }

    /// Open a workspace-relative directory as an `O_PATH` descriptor, refusing any
    /// symlink or mount crossing on the way.
    pub(crate) fn open_dir(&self, comps: &[OsString]) -> rustix::io::Result<OwnedFd> {
        self.open_beneath(comps, OFlags::PATH | OFlags::DIRECTORY)
    }

    /// `openat2` of workspace-relative components beneath the workspace.
    pub(crate) fn open_beneath(
        &self,
        comps: &[OsString],
        flags: OFlags,
    ) -> rustix::io::Result<OwnedFd> {
        let rel = join_rel(comps);
        // openat2 refuses O_NOCTTY next to O_PATH (EINVAL): add it to real opens only.
        let extra = if flags.contains(OFlags::PATH) {
            OFlags::CLOEXEC
        } else {
            OFlags::CLOEXEC | OFlags::NOCTTY
        };
        rustix::fs::openat2(
            &self.root,
            rel.as_os_str(),
            flags | extra,
            Mode::empty(),
            // Mounts inside the sandbox (`/proc`, `/dev/shm`) are the sandbox's own: only
            // a view confined to a directory refuses to cross them.
            if self.prefix.is_empty() {
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
            } else {
                ResolveFlags::BENEATH
                    | ResolveFlags::NO_SYMLINKS
                    | ResolveFlags::NO_MAGICLINKS
                    | ResolveFlags::NO_XDEV
            },
        )
    }

    /// The parent directory of non-empty components, and the last name.
    fn parent(&self, path: &str, comps: &[OsString]) -> Result<(OwnedFd, OsString)> {
        let Some((name, parent)) = comps.split_last() else {
            return Err(ProviderError::fs(
                ErrorCode::FsPermissionDenied,
                path,
                "the workspace itself cannot be changed",
            ));
        };
        let dir = self.open_dir(parent).map_err(|e| fs_errno(path, e))?;
        Ok((dir, name.clone()))
    }

    /// Metadata of `name` in `dir` (no follow) as the seam reports it.
    fn stat_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        comps: &[OsString],
    ) -> rustix::io::Result<FileStat> {
        let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?;
        let target = if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
            rustix::fs::readlinkat(dir, name, Vec::new())
                .ok()
                .map(|t| t.to_string_lossy().into_owned())
        } else {
            None
        };
        Ok(file_stat(
            &st,
            self.sandbox_path(comps),
            display_name(comps, &self.display),
            target,
        ))
    }

    /// Metadata of workspace-relative components (no follow of the last).
    fn stat_comps(&self, path: &str, comps: &[OsString]) -> Result<FileStat> {
        if comps.is_empty() {
            let st = rustix::fs::fstat(&self.root).map_err(|e| fs_errno(path, e))?;
            return Ok(file_stat(
                &st,
                self.display.clone(),
                display_name(comps, &self.display),
                None,
            ));
        }
        let (dir, name) = self.parent(path, comps)?;
        self.stat_at(dir.as_fd(), &name, comps)
            .map_err(|e| fs_errno(path, e))
    }
}

fn push_lexical(stack: &mut Vec<OsString>, path: &OsStr) {
    for c in split(path) {
        if c == "." {
            continue;
        }
        if c == ".." {
            stack.pop();
            continue;
        }
        stack.push(c);
    }
}

fn split(path: &OsStr) -> impl Iterator<Item = OsString> + '_ {
    path.as_bytes()
        .split(|b| *b == b'/')
        .filter(|c| !c.is_empty())
        .map(|c| OsStr::from_bytes(c).to_owned())
}

fn strip_prefix(prefix: &[OsString], stack: Vec<OsString>) -> Option<Comps> {
    if stack.len() < prefix.len() || stack[..prefix.len()] != *prefix {
        return None;
    }
    Some(stack[prefix.len()..].to_vec())
}

fn join_rel(comps: &[OsString]) -> PathBuf {
    if comps.is_empty() {
        return PathBuf::from(".");
    }
    comps.iter().collect()
}

fn display_name(comps: &[OsString], display: &str) -> String {
    match comps.last() {
        Some(c) => c.to_string_lossy().into_owned(),
        None => display.rsplit('/').next().unwrap_or_default().to_owned(),
    }
}

fn file_kind(mode: u32) -> FileKind {
    match FileType::from_raw_mode(mode) {
        FileType::RegularFile => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    }
}

/// The version token of a stat: opaque to clients.
pub(crate) fn version_of(st: &rustix::fs::Stat) -> Version {
    let mtime_ns = i128::from(st.st_mtime) * 1_000_000_000 + i128::from(st.st_mtime_nsec as i64);
    Version(format!("{:x}-{:x}-{:x}", mtime_ns, st.st_size, st.st_ino))
}

fn file_stat(
    st: &rustix::fs::Stat,
    path: String,
    name: String,
    symlink_target: Option<String>,
) -> FileStat {
    let modified_ms = st.st_mtime.saturating_mul(1000) + (st.st_mtime_nsec as i64) / 1_000_000;
    FileStat {
        path,
        name,
        kind: file_kind(st.st_mode),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        modified_ms,
        version: version_of(st),
        symlink_target,
    }
}

/// A strictly increasing wall-clock nanosecond stamp for tether's own writes.
fn unique_mtime() -> rustix::fs::Timespec {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    let prev = LAST.fetch_max(now, Ordering::AcqRel);
    let ns = if prev >= now {
        LAST.fetch_add(1, Ordering::AcqRel) + 1
    } else {
        now
    };
    rustix::fs::Timespec {
        tv_sec: ns / 1_000_000_000,
        tv_nsec: ns % 1_000_000_000,
    }
}

/// Read up to `len` bytes of `file` at `offset` on the blocking pool.
fn read_at(
    file: Arc<OwnedFd>,
    offset: u64,
    len: usize,
) -> tokio::task::JoinHandle<std::io::Result<Vec<u8>>> {
    tokio::task::spawn_blocking(move || {
        let mut buf = Vec::with_capacity(len);
        loop {
            match rustix::io::pread(&*file, rustix::buffer::spare_capacity(&mut buf), offset) {
                Ok(_) => return Ok(buf),
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    })
}

/// Bytes gathered from an upload's chunks before one write.
const WRITE_BATCH: usize = 1 << 20;
/// Chunks gathered before one write, well under `IOV_MAX`.
const WRITE_SLICES: usize = 256;

/// What an upload's blocking writer is sent.
enum Batch {
    /// Chunks to append, in order.
    Data(Vec<Bytes>),
    /// The body ended: make the file durable and hand it back.
    Done,
}

/// Write every byte of `chunks` with as few `writev`s as it takes. (The standard
/// library's `write_all_vectored` is not stable yet.)
fn write_all_vectored(file: &mut std::fs::File, chunks: &[Bytes]) -> std::io::Result<()> {
    use std::io::{IoSlice, Write};
    let mut slices: Vec<IoSlice<'_>> = chunks.iter().map(|c| IoSlice::new(c)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match file.write_vectored(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Stream `range` of an open regular file. Each chunk is one `pread` on the blocking
/// pool, and the next one is started before a chunk is handed on, so the disk and the
/// consumer overlap. No thread waits on a consumer that stops reading: a stalled
/// download holds at most one finished chunk.
pub(crate) fn read_stream(fd: OwnedFd, range: ByteRange, path: &str) -> ByteStream {
    let file = Arc::new(fd);
    let want = |left: Option<u64>| left.map_or(READ_CHUNK, |l| l.min(READ_CHUNK as u64) as usize);
    let first =
        (range.length != Some(0)).then(|| read_at(file.clone(), range.offset, want(range.length)));
    let state = (file, first, range.offset, range.length, path.to_owned());
    let stream =
        futures_util::stream::unfold(state, move |(file, next, at, left, path)| async move {
            let buf = match next?.await {
                Ok(Ok(buf)) => buf,
                Ok(Err(e)) => {
                    return Some((Err(fs_io(&path, e)), (file, None, at, left, path)));
                }
                Err(e) => return Some((Err(join(e)), (file, None, at, left, path))),
            };
            if buf.is_empty() {
                return None;
            }
            let n = buf.len() as u64;
            let (at, left) = (at + n, left.map(|l| l - n));
            let next = (left != Some(0)).then(|| read_at(file.clone(), at, want(left)));
            Some((Ok(Bytes::from(buf)), (file, next, at, left, path)))
        });
    stream.boxed()
}

/// Run a blocking file-system closure on the blocking pool, unless the call is already
/// over. Once started, the closure is waited for even if the call is cancelled: these are
/// short local system calls, and returning early would report a cancel for an operation
/// that takes effect anyway (or leak the temporary file a write was creating).
async fn blocking<T, F>(ctx: &CallCtx, creds: Option<(u32, u32)>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    ctx.check()?;
    tokio::task::spawn_blocking(move || as_user(creds, f))
        .await
        .map_err(join)?
}

/// Run `f` on this thread with the file-system identity `creds` (the sandbox's user,
/// as the host sees it), then restore the provider's. The kernel then checks every
/// path access as it would for a process of the sandbox, and what is created belongs
/// to that user; a change of the file-system uid away from 0 also drops the
/// capabilities that bypass permission checks, for this thread only.
pub(crate) fn as_user<T>(creds: Option<(u32, u32)>, f: impl FnOnce() -> T) -> T {
    let Some((uid, gid)) = creds else {
        return f();
    };
    use nix::unistd::{Gid, Uid, setfsgid, setfsuid};
    let old_gid = setfsgid(Gid::from_raw(gid));
    let old_uid = setfsuid(Uid::from_raw(uid));
    let r = f();
    setfsuid(old_uid);
    setfsgid(old_gid);
    r
}

// === impl LocalFs ===

/// A write tether published, told to in-process watchers so that they report it as the
/// create/write it is rather than as a rename of a temporary file.
#[derive(Debug, Clone)]
struct Published {
    comps: Comps,
    created: bool,
}

/// Publications a slow watcher may fall behind by before it is told it lagged.
const PUBLISHED_QUEUE: usize = 256;

/// The `Fs` of a local sandbox.
#[derive(Debug)]
pub struct LocalFs {
    ws: Arc<Workspace>,
    /// Serializes guard checks with publication.
    publish_lock: Mutex<()>,
    /// Made by the first watch: most sandboxes are never watched, and the channel's
    /// slots are most of an idle sandbox's memory.
    published: std::sync::OnceLock<broadcast::Sender<Published>>,
    tasks: TaskTracker,
    closed: CancellationToken,
}

impl LocalFs {
    pub(crate) fn new(ws: Arc<Workspace>, tasks: TaskTracker, closed: CancellationToken) -> Self {
        Self {
            ws,
            publish_lock: Mutex::new(()),
            published: std::sync::OnceLock::new(),
            tasks,
            closed,
        }
    }
}

/// A write whose temporary file exists and whose data is not read yet.
pub(crate) struct PendingWrite {
    comps: Comps,
    parent: OwnedFd,
    fd: OwnedFd,
    tmp_name: OsString,
}

impl LocalFs {
    /// The first step of a write: resolve, create the parents, create the temporary file
    /// next to the target. Nothing of the data is read yet, so a caller may still write
    /// another way when this fails (without the rights: `FS_PERMISSION_DENIED`).
    pub(crate) async fn begin_write(&self, ctx: &CallCtx, path: &str) -> Result<PendingWrite> {
        let ws = self.ws.clone();
        let p = path.to_owned();
        let tmp_name = OsString::from(format!("{TEMP_PREFIX}{}", uuid::Uuid::new_v4().simple()));
        let tmp = tmp_name.clone();
        // Resolve, create the parents, create the temporary file next to the target.
        let (comps, parent, fd) = blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let (_, parent_comps) = comps.split_last().ok_or_else(|| {
                ProviderError::fs(ErrorCode::FsIsDirectory, &p, "is the workspace")
            })?;
            mkdir_all(&ws, &p, parent_comps)?;
            let parent = ws.open_dir(parent_comps).map_err(|e| fs_errno(&p, e))?;
            let fd = rustix::fs::openat(
                &parent,
                tmp.as_os_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )
            .map_err(|e| fs_errno(&p, e))?;
            if let Err(e) = ws.give(fd.as_fd(), None) {
                let _ = rustix::fs::unlinkat(&parent, tmp.as_os_str(), AtFlags::empty());
                return Err(fs_errno(&p, e));
            }
            Ok((comps, parent, fd))
        })
        .await?;
        Ok(PendingWrite {
            comps,
            parent,
            fd,
            tmp_name,
        })
    }

    /// The rest of a write begun by [`LocalFs::begin_write`]: stream the data into the
    /// temporary file, then publish it under the guard.
    pub(crate) async fn finish_write(
        &self,
        ctx: &CallCtx,
        path: &str,
        pending: PendingWrite,
        mut data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        let PendingWrite {
            comps,
            parent,
            fd,
            tmp_name,
        } = pending;
        let parent = Arc::new(parent);
        let creds = self.ws.creds;
        let cleanup = |parent: Arc<OwnedFd>, tmp: OsString| async move {
            let _ = tokio::task::spawn_blocking(move || {
                as_user(creds, || {
                    rustix::fs::unlinkat(&*parent, tmp.as_os_str(), AtFlags::empty())
                })
            })
            .await;
        };

        // Stream the data in; an error or the end of the call's budget abandons the
        // temporary file before anything is published. One blocking writer takes
        // batches of the body's chunks while the next batch is received: a hand-off
        // to the blocking pool per chunk (about 32 KiB from an HTTP body) cost more
        // than the write itself, and halved an upload's throughput.
        let (tx, mut rx) = mpsc::channel::<Batch>(1);
        let writer =
            tokio::task::spawn_blocking(move || -> std::io::Result<Option<std::fs::File>> {
                let mut file = std::fs::File::from(fd);
                while let Some(batch) = rx.blocking_recv() {
                    match batch {
                        Batch::Data(chunks) => write_all_vectored(&mut file, &chunks)?,
                        Batch::Done => {
                            file.sync_all()?;
                            return Ok(Some(file));
                        }
                    }
                }
                Ok(None)
            });
        let mut size = 0u64;
        let streamed: Result<()> = async {
            let mut batch = Vec::new();
            let mut batched = 0usize;
            loop {
                let next = ctx.run(async { Ok(data.next().await) }).await?;
                let end = match next {
                    None => true,
                    Some(chunk) => {
                        let chunk = chunk?;
                        size += chunk.len() as u64;
                        batched += chunk.len();
                        if !chunk.is_empty() {
                            batch.push(chunk);
                        }
                        false
                    }
                };
                if !batch.is_empty()
                    && (end || batched >= WRITE_BATCH || batch.len() >= WRITE_SLICES)
                {
                    let chunks = std::mem::take(&mut batch);
                    batched = 0;
                    if ctx
                        .run(async { Ok(tx.send(Batch::Data(chunks)).await.is_err()) })
                        .await?
                    {
                        // The writer stopped on an error; it is reported below.
                        return Ok(());
                    }
                }
                if end {
                    let _ = tx.send(Batch::Done).await;
                    return Ok(());
                }
            }
        }
        .await;
        drop(tx);
        let written = match streamed {
            Ok(()) => ctx
                .run(async { writer.await.map_err(join) })
                .await
                .and_then(|r| r.map_err(|e| fs_io(path, e))),
            Err(e) => Err(e),
        };
        let file = match written {
            Ok(Some(file)) => file,
            Ok(None) => {
                cleanup(parent, tmp_name).await;
                return Err(ProviderError::Internal {
                    message: "the file writer ended before the upload".into(),
                    source: None,
                });
            }
            Err(e) => {
                cleanup(parent, tmp_name).await;
                return Err(e);
            }
        };
        if let Err(e) = ctx.check() {
            cleanup(parent, tmp_name).await;
            return Err(e);
        }

        // Publish under the lock: the guard is checked against what is there now.
        let _publishing = self.publish_lock.lock().await;
        let ws = self.ws.clone();
        let p = path.to_owned();
        let (par, tmp) = (parent.clone(), tmp_name.clone());
        let published = tokio::task::spawn_blocking(move || {
            as_user(creds, move || -> Result<(WriteOutcome, Comps, bool)> {
                let Some(name) = comps.last().cloned() else {
                    return Err(ProviderError::fs(
                        ErrorCode::FsIsDirectory,
                        &p,
                        "is the workspace",
                    ));
                };
                let before =
                    match rustix::fs::statat(&*par, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(st) => Some(st),
                        Err(Errno::NOENT) => None,
                        Err(e) => return Err(fs_errno(&p, e)),
                    };
                if let Some(st) = &before {
                    match FileType::from_raw_mode(st.st_mode) {
                        FileType::Directory => {
                            return Err(ProviderError::fs(
                                ErrorCode::FsIsDirectory,
                                &p,
                                "is a directory",
                            ));
                        }
                        // Keep an overwritten file's permissions (an executable stays one).
                        FileType::RegularFile => {
                            let _ =
                                rustix::fs::fchmod(&file, Mode::from_raw_mode(st.st_mode & 0o7777));
                        }
                        _ => {}
                    }
                }
                let stamp = unique_mtime();
                rustix::fs::futimens(
                    &file,
                    &rustix::fs::Timestamps {
                        last_access: stamp,
                        last_modification: stamp,
                    },
                )
                .map_err(|e| fs_errno(&p, e))?;
                let flags = match &guard {
                    WriteGuard::None => RenameFlags::empty(),
                    WriteGuard::CreateIfAbsent => {
                        if before.is_some() {
                            return Err(ProviderError::fs(
                                ErrorCode::FsAlreadyExists,
                                &p,
                                "the file exists",
                            ));
                        }
                        RenameFlags::NOREPLACE
                    }
                    WriteGuard::ReplaceIfVersion { version } => {
                        if before.as_ref().map(version_of).as_ref() != Some(version) {
                            return Err(ProviderError::fs(
                                ErrorCode::FsVersionMismatch,
                                &p,
                                "the file changed since that version",
                            ));
                        }
                        RenameFlags::empty()
                    }
                };
                let renamed = match rustix::fs::renameat_with(
                    &*par,
                    tmp.as_os_str(),
                    &*par,
                    name.as_os_str(),
                    flags,
                ) {
                    // A file system without RENAME_NOREPLACE: the absence was checked under
                    // the lock, which covers every tether writer.
                    Err(Errno::INVAL) if !flags.is_empty() => {
                        rustix::fs::renameat(&*par, tmp.as_os_str(), &*par, name.as_os_str())
                    }
                    r => r,
                };
                match renamed {
                    Ok(()) => {}
                    Err(Errno::EXIST) => {
                        return Err(ProviderError::fs(
                            ErrorCode::FsAlreadyExists,
                            &p,
                            "the file exists",
                        ));
                    }
                    Err(e) => return Err(fs_errno(&p, e)),
                }
                // Make the rename itself durable.
                if let Ok(d) = rustix::fs::openat(
                    &*par,
                    ".",
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                ) {
                    let _ = rustix::fs::fsync(&d);
                }
                let st = rustix::fs::fstat(&file).map_err(|e| fs_errno(&p, e))?;
                let created = before.is_none();
                let outcome = WriteOutcome {
                    path: ws.sandbox_path(&comps),
                    version: version_of(&st),
                    size,
                    created,
                };
                Ok((outcome, comps, created))
            })
        })
        .await
        .map_err(join)
        .and_then(|r| r);
        drop(_publishing);
        match published {
            Ok((outcome, comps, created)) => {
                if let Some(tx) = self.published.get() {
                    let _ = tx.send(Published { comps, created });
                }
                Ok(outcome)
            }
            Err(e) => {
                cleanup(parent, tmp_name).await;
                Err(e)
            }
        }
    }
}

#[async_trait]
impl Fs for LocalFs {
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat> {
        let ws = self.ws.clone();
        let path = path.to_owned();
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&path, false)?;
            ws.stat_comps(&path, &comps)
        })
        .await
    }

    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream> {
        let ws = self.ws.clone();
        let p = path.to_owned();
        let fd = blocking(ctx, self.ws.creds, move || ws.open_regular(&p)).await?;
        Ok(read_stream(fd, range, path))
    }

    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        let pending = self.begin_write(ctx, path).await?;
        self.finish_write(ctx, path, pending, data, guard).await
    }

    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        if depth == 0 {
            return Err(ProviderError::InvalidRequest {
                message: "depth must be at least 1".into(),
            });
        }
        let ws = self.ws.clone();
        let p = path.to_owned();
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let fd = ws
                .open_beneath(&comps, OFlags::RDONLY | OFlags::DIRECTORY)
                .map_err(|e| fs_errno(&p, e))?;
            let mut out = Vec::new();
            walk(&ws, fd, &comps, 1, depth, &mut out).map_err(|e| fs_errno(&p, e))?;
            out.sort_by(|a, b| a.stat.path.cmp(&b.stat.path));
            Ok(out)
        })
        .await
    }

    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat> {
        let ws = self.ws.clone();
        let p = path.to_owned();
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let Some((_, parent_comps)) = comps.split_last() else {
                return Err(ProviderError::fs(
                    ErrorCode::FsAlreadyExists,
                    &p,
                    "the workspace exists",
                ));
            };
            if parents {
                mkdir_all(&ws, &p, parent_comps)?;
            }
            let (dir, name) = ws.parent(&p, &comps)?;
            rustix::fs::mkdirat(&dir, name.as_os_str(), Mode::from_raw_mode(0o755))
                .map_err(|e| fs_errno(&p, e))?;
            ws.give(dir.as_fd(), Some(&name))
                .map_err(|e| fs_errno(&p, e))?;
            ws.stat_at(dir.as_fd(), &name, &comps)
                .map_err(|e| fs_errno(&p, e))
        })
        .await
    }

    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat> {
        let ws = self.ws.clone();
        let (f, t) = (from.to_owned(), to.to_owned());
        blocking(ctx, self.ws.creds, move || {
            let fc = ws.resolve(&f, false)?;
            let tc = ws.resolve(&t, false)?;
            let (fdir, fname) = ws.parent(&f, &fc)?;
            let (tdir, tname) = ws.parent(&t, &tc)?;
            rustix::fs::renameat(&fdir, fname.as_os_str(), &tdir, tname.as_os_str())
                .map_err(|e| fs_errno(&f, e))?;
            ws.stat_at(tdir.as_fd(), &tname, &tc)
                .map_err(|e| fs_errno(&t, e))
        })
        .await
    }

    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()> {
        let ws = self.ws.clone();
        let p = path.to_owned();
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, false)?;
            let (dir, name) = ws.parent(&p, &comps)?;
            let st = rustix::fs::statat(&dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| fs_errno(&p, e))?;
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                return rustix::fs::unlinkat(&dir, name.as_os_str(), AtFlags::empty())
                    .map_err(|e| fs_errno(&p, e));
            }
            if recursive {
                remove_tree(dir.as_fd(), &name).map_err(|e| fs_errno(&p, e))
            } else {
                rustix::fs::unlinkat(&dir, name.as_os_str(), AtFlags::REMOVEDIR)
                    .map_err(|e| fs_errno(&p, e))
            }
        })
        .await
    }

    async fn xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
    ) -> Result<std::collections::BTreeMap<String, Vec<u8>>> {
        let (ws, p, prefix) = (self.ws.clone(), path.to_owned(), prefix.to_owned());
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let fd = ws
                .open_beneath(&comps, OFlags::RDONLY | OFlags::NONBLOCK)
                .map_err(|e| fs_errno(&p, e))?;
            let mut out = std::collections::BTreeMap::new();
            for name in xattr_names(&fd).map_err(|e| xattr_errno(&p, e))? {
                let Some(key) = name.strip_prefix(prefix.as_bytes()) else {
                    continue;
                };
                let Ok(key) = String::from_utf8(key.to_vec()) else {
                    continue;
                };
                match xattr_value(&fd, &name) {
                    Ok(v) => {
                        out.insert(key, v);
                    }
                    // Removed in between.
                    Err(Errno::NODATA) => {}
                    Err(e) => return Err(xattr_errno(&p, e)),
                }
            }
            Ok(out)
        })
        .await
    }

    async fn set_xattrs(
        &self,
        ctx: &CallCtx,
        path: &str,
        prefix: &str,
        values: std::collections::BTreeMap<String, Vec<u8>>,
    ) -> Result<()> {
        let (ws, p, prefix) = (self.ws.clone(), path.to_owned(), prefix.to_owned());
        blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let fd = ws
                .open_beneath(&comps, OFlags::RDONLY | OFlags::NONBLOCK)
                .map_err(|e| fs_errno(&p, e))?;
            for name in xattr_names(&fd).map_err(|e| xattr_errno(&p, e))? {
                let stale = name.strip_prefix(prefix.as_bytes()).is_some_and(|k| {
                    std::str::from_utf8(k).map_or(true, |k| !values.contains_key(k))
                });
                if stale {
                    match rustix::fs::fremovexattr(&fd, name.as_slice()) {
                        Ok(()) | Err(Errno::NODATA) => {}
                        Err(e) => return Err(xattr_errno(&p, e)),
                    }
                }
            }
            for (k, v) in &values {
                let name = format!("{prefix}{k}");
                rustix::fs::fsetxattr(&fd, name.as_str(), v, rustix::fs::XattrFlags::empty())
                    .map_err(|e| xattr_errno(&p, e))?;
            }
            Ok(())
        })
        .await
    }

    async fn watch(
        &self,
        ctx: &CallCtx,
        path: &str,
        recursive: bool,
    ) -> Result<BoxStream<'static, Result<FsEvent>>> {
        let ws = self.ws.clone();
        let p = path.to_owned();
        let (inotify, root_comps, wds) = blocking(ctx, self.ws.creds, move || {
            let comps = ws.resolve(&p, true)?;
            let dir = ws
                .open_beneath(&comps, OFlags::RDONLY | OFlags::DIRECTORY)
                .map_err(|e| fs_errno(&p, e))?;
            let inotify = rustix::fs::inotify::init(
                rustix::fs::inotify::CreateFlags::CLOEXEC
                    | rustix::fs::inotify::CreateFlags::NONBLOCK,
            )
            .map_err(|e| internal("inotify_init", std::io::Error::from(e)))?;
            let mut wds = HashMap::new();
            add_watches(&inotify, dir, Vec::new(), recursive, &mut wds)
                .map_err(|e| fs_errno(&p, e))?;
            Ok((inotify, comps, wds))
        })
        .await?;
        let inotify =
            crate::client::async_fd(inotify).map_err(|e| internal("inotify registration", e))?;
        let (tx, rx) = mpsc::channel(256);
        let watcher = Watcher {
            ws: self.ws.clone(),
            inotify,
            wds,
            root: root_comps,
            recursive,
            tx,
            temp_cookies: Vec::new(),
        };
        let published = self
            .published
            .get_or_init(|| broadcast::channel(PUBLISHED_QUEUE).0)
            .subscribe();
        let closed = self.closed.clone();
        self.tasks.spawn(watcher.run(published, closed));
        Ok(tokio_stream_from(rx))
    }
}

fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<FsEvent>>,
) -> BoxStream<'static, Result<FsEvent>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

/// Create each missing directory of `comps` (which are already resolved).
fn mkdir_all(ws: &Workspace, path: &str, comps: &[OsString]) -> Result<()> {
    for i in 0..comps.len() {
        let dir = ws.open_dir(&comps[..i]).map_err(|e| fs_errno(path, e))?;
        match rustix::fs::mkdirat(&dir, comps[i].as_os_str(), Mode::from_raw_mode(0o755)) {
            Ok(()) => ws
                .give(dir.as_fd(), Some(&comps[i]))
                .map_err(|e| fs_errno(path, e))?,
            Err(Errno::EXIST) => {}
            Err(e) => return Err(fs_errno(path, e)),
        }
    }
    Ok(())
}

/// List `dir` into `out`, descending while `level < max`. Never follows symlinks.
fn walk(
    ws: &Workspace,
    dir: OwnedFd,
    comps: &[OsString],
    level: u32,
    max: u32,
    out: &mut Vec<DirEntry>,
) -> rustix::io::Result<()> {
    let mut names = Vec::new();
    let mut d = rustix::fs::Dir::new(dir)?;
    for entry in d.by_ref() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(name).to_owned());
        }
    }
    let dirfd = d.fd()?;
    for name in names {
        let mut child = comps.to_vec();
        child.push(name.clone());
        let stat = match ws.stat_at(dirfd, &name, &child) {
            Ok(s) => s,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(e),
        };
        let is_dir = stat.kind == FileKind::Dir;
        out.push(DirEntry { stat, depth: level });
        if is_dir && level < max {
            match rustix::fs::openat(
                dirfd,
                name.as_os_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(sub) => walk(ws, sub, &child, level + 1, max, out)?,
                // Replaced or removed meanwhile: list what is there, skip the rest.
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Remove `name` in `parent` and everything below it, without following symlinks.
fn remove_tree(parent: BorrowedFd<'_>, name: &OsStr) -> rustix::io::Result<()> {
    let fd = rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut entries = Vec::new();
    let mut d = rustix::fs::Dir::new(fd)?;
    for entry in d.by_ref() {
        let entry = entry?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            entries.push(OsStr::from_bytes(n).to_owned());
        }
    }
    let dirfd = d.fd()?;
    for e in entries {
        let st = match rustix::fs::statat(dirfd, e.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => continue,
            Err(err) => return Err(err),
        };
        let r = if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            remove_tree(dirfd, &e)
        } else {
            rustix::fs::unlinkat(dirfd, e.as_os_str(), AtFlags::empty())
        };
        match r {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(err) => return Err(err),
        }
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
}

// === impl Watcher ===

const WATCH_FLAGS: rustix::fs::inotify::WatchFlags = rustix::fs::inotify::WatchFlags::CREATE
    .union(rustix::fs::inotify::WatchFlags::DELETE)
    .union(rustix::fs::inotify::WatchFlags::MODIFY)
    .union(rustix::fs::inotify::WatchFlags::MOVED_FROM)
    .union(rustix::fs::inotify::WatchFlags::MOVED_TO)
    .union(rustix::fs::inotify::WatchFlags::ATTRIB)
    .union(rustix::fs::inotify::WatchFlags::DELETE_SELF)
    .union(rustix::fs::inotify::WatchFlags::ONLYDIR)
    .union(rustix::fs::inotify::WatchFlags::EXCL_UNLINK);

/// Add a watch on `dir` (and, when `recursive`, on every directory below it). The
/// watch is added through `/proc/self/fd`, so it lands on the directory that was
/// opened beneath the workspace, whatever happens to the path meanwhile.
fn add_watches(
    inotify: &OwnedFd,
    dir: OwnedFd,
    rel: Comps,
    recursive: bool,
    wds: &mut HashMap<i32, Comps>,
) -> rustix::io::Result<()> {
    let wd = rustix::fs::inotify::add_watch(
        inotify,
        format!("/proc/self/fd/{}", dir.as_raw_fd()),
        WATCH_FLAGS,
    )?;
    wds.insert(wd, rel.clone());
    if !recursive {
        return Ok(());
    }
    let mut d = rustix::fs::Dir::new(dir)?;
    let mut subdirs = Vec::new();
    for entry in d.by_ref() {
        let entry = entry?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." && entry.file_type() == FileType::Directory {
            subdirs.push(OsStr::from_bytes(n).to_owned());
        }
    }
    let dirfd = d.fd()?;
    for name in subdirs {
        if let Ok(sub) = rustix::fs::openat(
            dirfd,
            name.as_os_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            let mut r = rel.clone();
            r.push(name);
            add_watches(inotify, sub, r, true, wds)?;
        }
    }
    Ok(())
}

/// Turns inotify events (and tether's own publications) into `FsEvent`s.
struct Watcher {
    ws: Arc<Workspace>,
    inotify: tokio::io::unix::AsyncFd<OwnedFd>,
    wds: HashMap<i32, Comps>,
    root: Comps,
    recursive: bool,
    tx: mpsc::Sender<Result<FsEvent>>,
    temp_cookies: Vec<u32>,
}

impl Watcher {
    async fn run(
        mut self,
        mut published: broadcast::Receiver<Published>,
        closed: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = closed.cancelled() => return,
                _ = self.tx.closed() => return,
                p = published.recv() => match p {
                    Ok(p) => if !self.on_published(p).await { return },
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                ready = self.inotify.readable() => {
                    let Ok(mut guard) = ready else { return };
                    let mut events = Vec::new();
                    // Read until EWOULDBLOCK, which is what clears the readiness.
                    let read: std::result::Result<std::io::Result<()>, _> = guard.try_io(|fd| {
                        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
                        let mut reader = rustix::fs::inotify::Reader::new(fd.get_ref(), &mut buf);
                        loop {
                            let ev = reader.next().map_err(std::io::Error::from)?;
                            let name = ev.file_name().map(|n| OsStr::from_bytes(n.to_bytes()).to_owned());
                            events.push((ev.wd(), ev.events(), ev.cookie(), name));
                        }
                    });
                    let gone = matches!(read, Ok(Err(_)));
                    for (wd, mask, cookie, name) in events {
                        if !self.on_inotify(wd, mask, cookie, name).await {
                            return;
                        }
                    }
                    if gone {
                        return;
                    }
                }
            }
        }
    }

    async fn send(&self, kind: FsEventKind, name: String) -> bool {
        self.tx.send(Ok(FsEvent { kind, name })).await.is_ok()
    }

    async fn on_published(&self, p: Published) -> bool {
        let Some(rest) = p.comps.strip_prefix(self.root.as_slice()) else {
            return true;
        };
        if rest.is_empty() || (!self.recursive && rest.len() > 1) {
            return true;
        }
        let name = join_rel(rest).to_string_lossy().into_owned();
        if p.created && !self.send(FsEventKind::Create, name.clone()).await {
            return false;
        }
        self.send(FsEventKind::Write, name).await
    }

    async fn on_inotify(
        &mut self,
        wd: i32,
        mask: rustix::fs::inotify::ReadFlags,
        cookie: u32,
        name: Option<OsString>,
    ) -> bool {
        use rustix::fs::inotify::ReadFlags as F;
        let Some(dir) = self.wds.get(&wd).cloned() else {
            return true;
        };
        if mask.contains(F::DELETE_SELF) && dir.is_empty() {
            // The watched directory itself is gone: the stream ends.
            return false;
        }
        if mask.contains(F::IGNORED) {
            self.wds.remove(&wd);
            return true;
        }
        let Some(name) = name else { return true };
        let temp = name.as_bytes().starts_with(TEMP_PREFIX.as_bytes());
        if temp {
            if mask.contains(F::MOVED_FROM) {
                self.temp_cookies.push(cookie);
                if self.temp_cookies.len() > 64 {
                    self.temp_cookies.remove(0);
                }
            }
            return true;
        }
        if mask.contains(F::MOVED_TO) && self.temp_cookies.contains(&cookie) {
            // tether's own publication: reported from `Published`.
            return true;
        }
        let mut rel = dir.clone();
        rel.push(name.clone());
        if mask.contains(F::ISDIR)
            && self.recursive
            && (mask.contains(F::CREATE) || mask.contains(F::MOVED_TO))
        {
            let mut full = self.root.clone();
            full.extend(rel.iter().cloned());
            if let Ok(fd) = self
                .ws
                .open_beneath(&full, OFlags::RDONLY | OFlags::DIRECTORY)
            {
                let _ = add_watches(self.inotify.get_ref(), fd, rel.clone(), true, &mut self.wds);
            }
        }
        let kind = if mask.contains(F::CREATE) || mask.contains(F::MOVED_TO) {
            FsEventKind::Create
        } else if mask.contains(F::MODIFY) {
            FsEventKind::Write
        } else if mask.contains(F::DELETE) {
            FsEventKind::Remove
        } else if mask.contains(F::MOVED_FROM) {
            FsEventKind::Rename
        } else if mask.contains(F::ATTRIB) {
            FsEventKind::Chmod
        } else {
            return true;
        };
        self.send(kind, join_rel(&rel).to_string_lossy().into_owned())
            .await
    }
}

/// The extended attribute names of an open file.
fn xattr_names(fd: &OwnedFd) -> rustix::io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 4096];
    loop {
        match rustix::fs::flistxattr(fd, &mut buf[..]) {
            Ok(n) => {
                return Ok(buf[..n]
                    .split(|b| *b == 0)
                    .filter(|n| !n.is_empty())
                    .map(<[u8]>::to_vec)
                    .collect());
            }
            Err(Errno::RANGE) if buf.len() < XATTR_LIST_MAX => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e),
        }
    }
}

/// The value of one extended attribute of an open file.
fn xattr_value(fd: &OwnedFd, name: &[u8]) -> rustix::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    loop {
        match rustix::fs::fgetxattr(fd, name, &mut buf[..]) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(Errno::RANGE) if buf.len() < XATTR_SIZE_MAX => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e),
        }
    }
}

/// Linux's limits on an attribute list and on one value.
const XATTR_LIST_MAX: usize = 64 * 1024;
const XATTR_SIZE_MAX: usize = 64 * 1024;

/// An xattr `errno`: a file system without them is `Unsupported`.
fn xattr_errno(path: &str, e: Errno) -> ProviderError {
    if e == Errno::NOTSUP || e == Errno::OPNOTSUPP {
        ProviderError::Unsupported { op: "xattrs" }
    } else {
        fs_errno(path, e)
    }
}
