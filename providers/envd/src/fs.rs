//! File operations in a sandbox through its envd: envd's `/files` for contents (streamed both ways,
//! never buffered whole) and the `filesystem.Filesystem` service for the rest.
//!
//! Writes are atomic: the data is uploaded to a temporary file next to the target and
//! published with a rename (`Move`), or, for `create_if_absent`, with a hard link that
//! fails if the target exists. Guards are checked before the upload and again right
//! before publication; publication itself is not interrupted by the caller's
//! cancellation (it is bounded by the call limit instead), so a write either takes effect
//! and is reported, or does not take effect. Versions are derived from what envd reports
//! (size, modification time, mode, link target) plus a random version id each write
//! stores in the file's metadata, so two writes of the same size within the same
//! millisecond still get different versions.
//!
//! Paths are sandbox paths; relative ones resolve against the workspace. The whole
//! microVM is the sandbox, so no path is refused here: the backend decides.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use reqwest::StatusCode;
use sha2::{Digest, Sha256};
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    EntryInfo, EntryResponse, EventType, FileType, ListDirRequest, ListDirResponse, MoveRequest,
    PathRequest, WatchDirResponse, WatchRequest,
};
use tether_protocol::fs::{
    ByteRange, DirEntry, FileKind, FileStat, FsEvent, FsEventKind, Version, WriteGuard,
    WriteOutcome,
};
use tether_provider::clock::{CancelToken, TimeoutReason};
use tether_provider::{ByteStream, CallCtx, Fs, ProviderError, Result};

use crate::client::{ByteBody, Envd, StreamItem, retry, within_connect};
use crate::error::{Op, from_status};
use crate::sandbox::{SandboxCore, parse_time_ms};
use tether_provider::Clock;

/// Metadata key of the per-write version id.
pub const VERSION_META: &str = "tether-version";

/// Name prefix of the temporary files of atomic writes (hidden from watches).
pub const TEMP_PREFIX: &str = ".tether-e2b-";

/// Largest piece of a file fetched in one request when output is read back.
pub(crate) const READ_BACK_CHUNK: u64 = 1024 * 1024;

/// The version token of an entry.
pub fn version_of(e: &EntryInfo) -> Version {
    let mut h = Sha256::new();
    for part in [
        e.metadata
            .get(VERSION_META)
            .map(String::as_str)
            .unwrap_or(""),
        kind_name(e),
        &e.size.to_string(),
        e.modified_time.as_deref().unwrap_or(""),
        &(e.mode & 0o7777).to_string(),
        e.symlink_target.as_deref().unwrap_or(""),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    Version(format!("e2b-{}", hex::encode(&h.finalize()[..16])))
}

fn kind_name(e: &EntryInfo) -> &'static str {
    match kind_of(e) {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    }
}

fn kind_of(e: &EntryInfo) -> FileKind {
    if e.is_symlink || e.symlink_target.is_some() {
        return FileKind::Symlink;
    }
    match e.kind {
        FileType::File => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        FileType::Unspecified => FileKind::Other,
    }
}

/// tether's metadata of an envd entry.
pub fn to_stat(e: &EntryInfo) -> FileStat {
    FileStat {
        path: e.path.clone(),
        name: e.name.clone(),
        kind: kind_of(e),
        size: u64::try_from(e.size).unwrap_or(0),
        mode: e.mode & 0o777,
        modified_ms: e
            .modified_time
            .as_deref()
            .and_then(parse_time_ms)
            .unwrap_or(0),
        version: version_of(e),
        symlink_target: e.symlink_target.clone(),
    }
}

/// Resolve a sandbox path: relative paths against `workspace`, `.` and `..` folded
/// lexically (never above `/`).
pub fn resolve(workspace: &str, path: &str) -> String {
    let p = path.trim();
    let full = if p.starts_with('/') {
        p.to_owned()
    } else if p == "~" {
        workspace.to_owned()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("{workspace}/{rest}")
    } else {
        format!("{workspace}/{p}")
    };
    let mut stack: Vec<&str> = Vec::new();
    for c in full.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                stack.pop();
            }
            c => stack.push(c),
        }
    }
    format!("/{}", stack.join("/"))
}

fn parent_of(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(0) => ("/", &path[1..]),
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("/", path),
    }
}

fn join_path(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn fs_err(code: ErrorCode, path: &str, message: impl Into<String>) -> ProviderError {
    ProviderError::fs(code, path, message)
}

// === impl EnvdFs ===

/// The `Fs` of a sandbox with envd.
#[derive(Debug)]
pub struct EnvdFs {
    core: Arc<SandboxCore>,
    /// The envd user of its operations, where not the configured one.
    user: Option<String>,
}

impl EnvdFs {
    pub(crate) fn new(core: Arc<SandboxCore>) -> Self {
        Self { core, user: None }
    }

    /// The same sandbox's file system as envd serves it to `user` (envd acts with
    /// root's rights and gives what it creates to `user`).
    pub fn for_user(&self, user: &str) -> Self {
        Self {
            core: self.core.clone(),
            user: Some(user.to_owned()),
        }
    }

    fn resolve(&self, path: &str) -> String {
        resolve(self.core.cfg.workspace.trim_end_matches('/'), path)
    }

    fn user(&self) -> Option<&str> {
        self.user.as_deref().or(self.core.user())
    }

    /// `Stat` of an absolute path (retried: it is idempotent).
    pub(crate) async fn stat_entry(&self, ctx: &CallCtx, path: &str) -> Result<EntryInfo> {
        let req = PathRequest {
            path: path.to_owned(),
        };
        let op = Op::Fs { op: "stat", path };
        let r: EntryResponse = retry(ctx, self.core.envd.http.retry, "stat", || {
            self.core
                .envd
                .unary(ctx, "filesystem.Filesystem/Stat", &req, self.user(), op)
        })
        .await
        .map_err(|e| self.refine_stat(e, path))?;
        Ok(r.entry)
    }

    /// `Stat`, with a missing path as `None`.
    async fn stat_opt(&self, ctx: &CallCtx, path: &str) -> Result<Option<EntryInfo>> {
        match self.stat_entry(ctx, path).await {
            Ok(e) => Ok(Some(e)),
            Err(e) if e.code() == ErrorCode::FsNotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// envd reports a path below a regular file as an invalid argument.
    fn refine_stat(&self, e: ProviderError, path: &str) -> ProviderError {
        match e.code() {
            ErrorCode::InvalidRequest => fs_err(
                ErrorCode::FsNotDirectory,
                path,
                "a component of the path is not a directory",
            ),
            _ => e,
        }
    }

    /// Classify an invalid-argument answer about `path` by looking at what is there.
    async fn classify(&self, ctx: &CallCtx, path: &str, e: ProviderError) -> ProviderError {
        if e.code() != ErrorCode::InvalidRequest {
            return e;
        }
        match self.stat_opt(ctx, path).await {
            Ok(Some(entry)) if kind_of(&entry) == FileKind::Dir => {
                fs_err(ErrorCode::FsIsDirectory, path, "is a directory")
            }
            Ok(Some(_)) => fs_err(ErrorCode::FsNotDirectory, path, "not a directory"),
            Ok(None) => {
                let (dir, _) = parent_of(path);
                match self.stat_opt(ctx, dir).await {
                    Ok(Some(p)) if kind_of(&p) != FileKind::Dir => fs_err(
                        ErrorCode::FsNotDirectory,
                        path,
                        "the parent is not a directory",
                    ),
                    Ok(None) => fs_err(ErrorCode::FsNotFound, path, "no such file or directory"),
                    _ => e,
                }
            }
            Err(other) => other,
        }
    }

    async fn move_entry(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<EntryInfo> {
        let req = MoveRequest {
            source: from.to_owned(),
            destination: to.to_owned(),
        };
        let r: EntryResponse = self
            .core
            .envd
            .unary(
                ctx,
                "filesystem.Filesystem/Move",
                &req,
                self.user(),
                Op::Fs {
                    op: "rename",
                    path: from,
                },
            )
            .await?;
        Ok(r.entry)
    }

    /// Remove a temporary file in the background: an error must reach the caller without
    /// waiting on the cleanup (the backend may be what failed).
    fn remove_quiet(&self, path: &str) {
        let core = self.core.clone();
        let path = path.to_owned();
        let user = self.user().map(str::to_owned);
        self.core.tasks.spawn(async move {
            let r = core
                .background_fs_call(
                    "filesystem.Filesystem/Remove",
                    "remove",
                    &path,
                    user.as_deref(),
                )
                .await;
            if let Err(e) = r {
                tracing::debug!(path = %path, error = %e, "Could not remove a temporary file");
            }
        });
    }

    /// Upload `data` to `path` (streamed), returning its size and SHA-256 (zeros unless
    /// writes are verified). Stalls of the
    /// upload are bounded by the transport idle limit.
    async fn upload(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        version_id: &str,
    ) -> Result<(u64, [u8; 32])> {
        let envd = &self.core.envd;
        let progress = Arc::new(Progress::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<(u64, [u8; 32])>();
        let multipart = !envd.version.octet_stream_upload();
        let boundary = format!("tether-{}", uuid::Uuid::new_v4().simple());
        // The digest is needed only to verify the write; hashing 64 MiB is CPU the upload
        // shares with the connection otherwise.
        let hash = self.core.cfg.verify_writes;
        let body = hashing_body(
            data,
            progress.clone(),
            tx,
            multipart.then(|| (boundary.clone(), path.to_owned())),
            hash,
        );
        let content_type = if multipart {
            format!("multipart/form-data; boundary={boundary}")
        } else {
            "application/octet-stream".to_owned()
        };
        let meta = [(VERSION_META.to_owned(), version_id.to_owned())];
        let send = envd.post_file(
            ctx,
            path,
            reqwest::Body::wrap_stream(body),
            &content_type,
            &meta,
            self.user(),
        );
        let cfg = &self.core.cfg;
        let idle = std::time::Duration::from_millis(cfg.transport_idle_ms);
        let connect = cfg.connect_timeout();
        let stall = async {
            // Until the body is first pulled the connection is being made (connect limit);
            // then silence counts only while the upload waits on the network, not on the
            // caller's data (transport idle limit).
            let mut tick = tokio::time::interval(
                (connect.min(idle) / 8).max(std::time::Duration::from_millis(5)),
            );
            loop {
                tick.tick().await;
                if !progress.started.load(Ordering::Acquire) {
                    if progress.start.elapsed() >= connect {
                        return TimeoutReason {
                            clock: Clock::Connect,
                            timeout_ms: cfg.connect_timeout_ms,
                        };
                    }
                } else if !progress.waiting_on_caller.load(Ordering::Acquire)
                    && progress.silent_for() >= idle
                {
                    return TimeoutReason {
                        clock: Clock::TransportIdle,
                        timeout_ms: cfg.transport_idle_ms,
                    };
                }
            }
        };
        tokio::select! {
            r = send => r?,
            reason = stall => return Err(ProviderError::Timeout { reason }),
        }
        rx.await.map_err(|_| ProviderError::Internal {
            message: "the upload body was not read to its end".into(),
            source: None,
        })
    }

    /// Publish with a hard link, which fails if the target exists.
    async fn link_no_replace(&self, ctx: &CallCtx, tmp: &str, target: &str) -> Result<bool> {
        let out = self
            .core
            .control(
                ctx,
                None,
                "ln -T -- \"$1\" \"$2\" 2>/dev/null",
                &[tmp, target],
            )
            .await?;
        Ok(out.status.code == Some(0))
    }

    async fn verify(&self, ctx: &CallCtx, tmp: &str, sha: &[u8; 32]) -> Result<()> {
        let expected = hex::encode(sha);
        let script = "s=$(sha256sum < \"$1\") && [ \"${s%% *}\" = \"$2\" ]";
        let out = self
            .core
            .control(ctx, None, script, &[tmp, &expected])
            .await?;
        if out.status.code == Some(0) {
            Ok(())
        } else {
            Err(fs_err(
                ErrorCode::FsIoError,
                tmp,
                "the written file's SHA-256 differs from the data sent",
            ))
        }
    }

    async fn write_inner(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        if path == "/" {
            return Err(fs_err(ErrorCode::FsIsDirectory, path, "is a directory"));
        }
        let prior = self.stat_opt(ctx, path).await?;
        if let Some(p) = &prior
            && kind_of(p) == FileKind::Dir
        {
            return Err(fs_err(ErrorCode::FsIsDirectory, path, "is a directory"));
        }
        check_guard(path, prior.as_ref(), &guard)?;
        let (dir, _) = parent_of(path);
        let version_id = uuid::Uuid::new_v4().simple().to_string();
        let tmp = join_path(dir, &format!("{TEMP_PREFIX}{version_id}.tmp"));
        let uploaded = self.upload(ctx, &tmp, data, &version_id).await;
        let (size, sha) = match uploaded {
            Ok(v) => v,
            Err(e) => {
                self.remove_quiet(&tmp);
                return Err(self.classify_write(ctx, path, e).await);
            }
        };
        let published = self.publish(ctx, path, &tmp, &guard, &sha).await;
        match published {
            Ok(entry) => Ok(WriteOutcome {
                path: path.to_owned(),
                version: version_of(&entry),
                size,
                created: prior.is_none(),
            }),
            Err(e) => {
                self.remove_quiet(&tmp);
                Err(e)
            }
        }
    }

    async fn classify_write(&self, ctx: &CallCtx, path: &str, e: ProviderError) -> ProviderError {
        if !matches!(
            e.code(),
            ErrorCode::InvalidRequest | ErrorCode::FsIoError | ErrorCode::FsNotFound
        ) {
            return e;
        }
        let (dir, _) = parent_of(path);
        // The parent chain has a file in it: the upload could not create the directory.
        let mut d = dir.to_owned();
        loop {
            match self.stat_opt(ctx, &d).await {
                Ok(Some(p)) if kind_of(&p) != FileKind::Dir => {
                    return fs_err(
                        ErrorCode::FsNotDirectory,
                        path,
                        "a parent is not a directory",
                    );
                }
                Ok(Some(_)) => return e,
                Ok(None) if d != "/" => d = parent_of(&d).0.to_owned(),
                _ => return e,
            }
        }
    }

    /// Check the guard again and make the temporary file the target. Runs under its own
    /// bounded context: a caller's cancellation must not leave its outcome unknown.
    async fn publish(
        &self,
        ctx: &CallCtx,
        path: &str,
        tmp: &str,
        guard: &WriteGuard,
        sha: &[u8; 32],
    ) -> Result<EntryInfo> {
        ctx.check().map_err(|e| match e.code() {
            ErrorCode::Cancelled => fs_err(
                ErrorCode::FsAborted,
                path,
                "the write was cancelled before publication",
            ),
            _ => e,
        })?;
        let pctx = CallCtx::new(ctx.request_id.clone())
            .with_trace(ctx.trace.clone())
            .with_timeout(self.core.cfg.request_timeout() * 2, Clock::Total);
        if self.core.cfg.verify_writes {
            self.verify(&pctx, tmp, sha).await?;
        }
        match guard {
            WriteGuard::None => self
                .move_entry(&pctx, tmp, path)
                .await
                .map_err(|e| map_publish(e, path)),
            WriteGuard::ReplaceIfVersion { .. } => {
                let now = self.stat_opt(&pctx, path).await?;
                check_guard(path, now.as_ref(), guard)?;
                self.move_entry(&pctx, tmp, path)
                    .await
                    .map_err(|e| map_publish(e, path))
            }
            WriteGuard::CreateIfAbsent => {
                if !self.link_no_replace(&pctx, tmp, path).await? {
                    return Err(match self.stat_opt(&pctx, path).await {
                        Ok(Some(_)) => fs_err(ErrorCode::FsAlreadyExists, path, "the path exists"),
                        _ => fs_err(ErrorCode::FsIoError, path, "could not publish the file"),
                    });
                }
                self.remove_quiet(tmp);
                self.stat_entry(&pctx, path).await
            }
        }
    }
}

fn map_publish(e: ProviderError, path: &str) -> ProviderError {
    match e.code() {
        ErrorCode::InvalidRequest | ErrorCode::FsIoError => fs_err(
            ErrorCode::FsIsDirectory,
            path,
            "cannot replace a directory with a file",
        ),
        _ => e,
    }
}

fn check_guard(path: &str, current: Option<&EntryInfo>, guard: &WriteGuard) -> Result<()> {
    match guard {
        WriteGuard::None => Ok(()),
        WriteGuard::CreateIfAbsent => match current {
            Some(_) => Err(fs_err(ErrorCode::FsAlreadyExists, path, "the path exists")),
            None => Ok(()),
        },
        WriteGuard::ReplaceIfVersion { version } => match current {
            Some(e) if &version_of(e) == version => Ok(()),
            Some(_) => Err(fs_err(
                ErrorCode::FsVersionMismatch,
                path,
                "the file changed since that version",
            )),
            None => Err(fs_err(
                ErrorCode::FsVersionMismatch,
                path,
                "the file does not exist",
            )),
        },
    }
}

/// Upload progress, for the stall watchdog.
#[derive(Debug)]
struct Progress {
    start: tokio::time::Instant,
    last_ms: AtomicU64,
    /// The HTTP client pulled the body: the connection is up.
    started: AtomicBool,
    waiting_on_caller: AtomicBool,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            start: tokio::time::Instant::now(),
            last_ms: AtomicU64::new(0),
            started: AtomicBool::new(false),
            waiting_on_caller: AtomicBool::new(false),
        }
    }
}

impl Progress {
    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Release);
    }

    fn silent_for(&self) -> std::time::Duration {
        let now = self.start.elapsed().as_millis() as u64;
        std::time::Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Acquire)))
    }
}

/// The upload body: the caller's chunks (optionally framed as one multipart part),
/// hashed and counted on the way; the size and digest are sent once the body ends.
fn hashing_body(
    data: ByteStream,
    progress: Arc<Progress>,
    done: tokio::sync::oneshot::Sender<(u64, [u8; 32])>,
    multipart: Option<(String, String)>,
    hash: bool,
) -> BoxStream<'static, Result<Bytes>> {
    struct St {
        data: ByteStream,
        hasher: Option<Sha256>,
        size: u64,
        progress: Arc<Progress>,
        done: Option<tokio::sync::oneshot::Sender<(u64, [u8; 32])>>,
        head: Option<Bytes>,
        tail: Option<Bytes>,
    }
    let (head, tail) = match multipart {
        Some((boundary, path)) => {
            let name = path.replace('"', "%22");
            (
                Some(Bytes::from(format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
                ))),
                Some(Bytes::from(format!("\r\n--{boundary}--\r\n"))),
            )
        }
        None => (None, None),
    };
    let st = St {
        data,
        hasher: hash.then(Sha256::new),
        size: 0,
        progress,
        done: Some(done),
        head,
        tail,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        st.progress.started.store(true, Ordering::Release);
        st.progress.touch();
        if let Some(h) = st.head.take() {
            return Some((Ok(h), st));
        }
        if st.done.is_some() {
            st.progress.waiting_on_caller.store(true, Ordering::Release);
            let next = st.data.next().await;
            st.progress
                .waiting_on_caller
                .store(false, Ordering::Release);
            st.progress.touch();
            match next {
                Some(Ok(chunk)) => {
                    if let Some(h) = st.hasher.as_mut() {
                        h.update(&chunk);
                    }
                    st.size += chunk.len() as u64;
                    return Some((Ok(chunk), st));
                }
                Some(Err(e)) => {
                    st.done = None;
                    return Some((Err(e), st));
                }
                None => {
                    if let Some(tx) = st.done.take() {
                        let digest: [u8; 32] = st
                            .hasher
                            .take()
                            .map(|h| h.finalize().into())
                            .unwrap_or_default();
                        let _ = tx.send((st.size, digest));
                    }
                }
            }
        }
        st.tail.take().map(|t| (Ok(t), st))
    })
    .boxed()
}

/// Open `[from, to)` of a file: the `GET /files` answer with the bytes to skip (a backend
/// that ignores the range answers 200 from 0), or `None` past the end. A retryable status
/// (429, 502-504) is retried like a failed request, within the call's budget.
async fn open_range(
    envd: &Envd,
    user: Option<&str>,
    ctx: &CallCtx,
    path: &str,
    from: u64,
    to: Option<u64>,
) -> Result<Option<(reqwest::Response, u64)>> {
    let range = (from > 0 || to.is_some()).then_some((from, to));
    retry(ctx, envd.http.retry, "read", || async {
        let resp = envd.get_file(ctx, path, range, user).await?;
        let status = resp.status();
        match status {
            StatusCode::PARTIAL_CONTENT => Ok(Some((resp, 0))),
            StatusCode::OK => Ok(Some((resp, from))),
            StatusCode::RANGE_NOT_SATISFIABLE => Ok(None),
            _ => {
                let headers = resp.headers().clone();
                let body: Bytes = within_connect(ctx, envd.http.connect, async {
                    Ok(resp.bytes().await.unwrap_or_default())
                })
                .await?;
                Err(from_status(
                    Op::Fs { op: "read", path },
                    status,
                    &headers,
                    &body,
                ))
            }
        }
    })
    .await
}

/// Read `[from, to)` of a file (a range read; `to` `None` reads to the end), streamed. A
/// body broken by a retryable error (a reset, a stall past the transport idle limit) is
/// resumed from the byte reached with a new range read (reads are idempotent), up to the
/// retry policy's attempts and within the call's budget; bytes already delivered are never
/// delivered twice.
pub(crate) async fn open_read(
    core: &SandboxCore,
    user: Option<&str>,
    ctx: &CallCtx,
    parent: &CancelToken,
    path: &str,
    from: u64,
    to: Option<u64>,
) -> Result<ByteStream> {
    let envd = core.envd.clone();
    let user = user.map(str::to_owned);
    let Some((resp, skip)) = open_range(&envd, user.as_deref(), ctx, path, from, to).await? else {
        return Ok(futures_util::stream::empty().boxed());
    };
    let body = ByteBody::new(resp, envd.http.transport_watchdog(parent)?, "read");
    struct St {
        envd: Envd,
        user: Option<String>,
        ctx: CallCtx,
        parent: CancelToken,
        path: String,
        /// The file offset of the next byte to deliver.
        pos: u64,
        to: Option<u64>,
        body: Option<ByteBody>,
        skip: u64,
        resumes_left: usize,
    }
    let st = St {
        resumes_left: envd.http.retry.max_times,
        envd,
        user,
        ctx: ctx.clone(),
        parent: parent.clone(),
        path: path.to_owned(),
        pos: from,
        to,
        body: Some(body),
        skip,
    };
    Ok(futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if st.to.is_some_and(|t| st.pos >= t) {
                return None;
            }
            let body = st.body.as_mut()?;
            match body.next().await {
                Ok(None) => return None,
                Err(e) if e.retryable() && st.resumes_left > 0 && !st.ctx.cancel.is_cancelled() => {
                    st.resumes_left -= 1;
                    tracing::debug!(path = %st.path, offset = st.pos, error = %e, "Resuming a broken file read");
                    let reopened =
                        open_range(&st.envd, st.user.as_deref(), &st.ctx, &st.path, st.pos, st.to)
                            .await
                            .and_then(|r| match r {
                                Some((resp, skip)) => st
                                    .envd
                                    .http
                                    .transport_watchdog(&st.parent)
                                    .map(|w| Some((ByteBody::new(resp, w, "read"), skip))),
                                None => Ok(None),
                            });
                    match reopened {
                        Ok(Some((b, skip))) => {
                            st.body = Some(b);
                            st.skip = skip;
                        }
                        Ok(None) => return None,
                        Err(e) => {
                            st.body = None;
                            return Some((Err(e), st));
                        }
                    }
                }
                Err(e) => {
                    st.body = None;
                    return Some((Err(e), st));
                }
                Ok(Some(mut chunk)) => {
                    if st.skip > 0 {
                        let n = st.skip.min(chunk.len() as u64) as usize;
                        st.skip -= n as u64;
                        chunk = chunk.slice(n..);
                    }
                    if let Some(t) = st.to {
                        let left = t.saturating_sub(st.pos);
                        if chunk.len() as u64 > left {
                            chunk = chunk.slice(..left as usize);
                        }
                    }
                    st.pos += chunk.len() as u64;
                    if !chunk.is_empty() {
                        return Some((Ok(chunk), st));
                    }
                }
            }
        }
    })
    .boxed())
}

#[async_trait]
impl Fs for EnvdFs {
    #[tracing::instrument(name = "fs.stat", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat> {
        ctx.check()?;
        let path = self.resolve(path);
        Ok(to_stat(&self.stat_entry(ctx, &path).await?))
    }

    #[tracing::instrument(name = "fs.read", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream> {
        ctx.check()?;
        let path = self.resolve(path);
        if range.length == Some(0) {
            return Ok(futures_util::stream::empty().boxed());
        }
        let to = range.length.map(|l| range.offset.saturating_add(l));
        match open_read(
            &self.core,
            self.user(),
            ctx,
            &ctx.cancel,
            &path,
            range.offset,
            to,
        )
        .await
        {
            Ok(s) => Ok(s),
            Err(e) => Err(self.classify(ctx, &path, e).await),
        }
    }

    #[tracing::instrument(name = "fs.write", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        ctx.check()?;
        let path = self.resolve(path);
        self.write_inner(ctx, &path, data, guard).await
    }

    #[tracing::instrument(name = "fs.list", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        ctx.check()?;
        let path = self.resolve(path);
        let depth = depth.max(1);
        let req = ListDirRequest {
            path: path.clone(),
            depth,
        };
        let op = Op::Fs {
            op: "list",
            path: &path,
        };
        let r: Result<ListDirResponse> = retry(ctx, self.core.envd.http.retry, "list", || {
            self.core
                .envd
                .unary(ctx, "filesystem.Filesystem/ListDir", &req, self.user(), op)
        })
        .await;
        let r = match r {
            Ok(r) => r,
            Err(e) => return Err(self.classify(ctx, &path, e).await),
        };
        let prefix = if path == "/" {
            "/".to_owned()
        } else {
            format!("{path}/")
        };
        let mut out: Vec<DirEntry> = r
            .entries
            .iter()
            .filter(|e| !e.name.starts_with(TEMP_PREFIX))
            .filter_map(|e| {
                let rel = e.path.strip_prefix(&prefix)?;
                let d = rel.split('/').filter(|c| !c.is_empty()).count() as u32;
                (d >= 1 && d <= depth).then(|| DirEntry {
                    stat: to_stat(e),
                    depth: d,
                })
            })
            .collect();
        out.sort_by(|a, b| a.stat.path.cmp(&b.stat.path));
        Ok(out)
    }

    #[tracing::instrument(name = "fs.mkdir", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat> {
        ctx.check()?;
        let path = self.resolve(path);
        if !parents {
            let (dir, _) = parent_of(&path);
            match self.stat_opt(ctx, dir).await? {
                None => {
                    return Err(fs_err(
                        ErrorCode::FsNotFound,
                        &path,
                        "the parent directory does not exist",
                    ));
                }
                Some(p) if kind_of(&p) != FileKind::Dir => {
                    return Err(fs_err(
                        ErrorCode::FsNotDirectory,
                        &path,
                        "the parent is not a directory",
                    ));
                }
                Some(_) => {}
            }
        }
        let req = PathRequest { path: path.clone() };
        let r: Result<EntryResponse> = self
            .core
            .envd
            .unary(
                ctx,
                "filesystem.Filesystem/MakeDir",
                &req,
                self.user(),
                Op::Fs {
                    op: "mkdir",
                    path: &path,
                },
            )
            .await;
        match r {
            Ok(r) => Ok(to_stat(&r.entry)),
            Err(e) if e.code() == ErrorCode::InvalidRequest => {
                match self.stat_opt(ctx, &path).await? {
                    Some(_) => Err(fs_err(ErrorCode::FsAlreadyExists, &path, "the path exists")),
                    None => Err(self.classify_write(ctx, &path, e).await),
                }
            }
            Err(e) => Err(e),
        }
    }

    #[tracing::instrument(name = "fs.rename", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, from, to))]
    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat> {
        ctx.check()?;
        let (from, to) = (self.resolve(from), self.resolve(to));
        match self.move_entry(ctx, &from, &to).await {
            Ok(e) => Ok(to_stat(&e)),
            Err(e) if e.code() == ErrorCode::InvalidRequest => {
                Err(self.classify(ctx, &from, e).await)
            }
            Err(e) => Err(e),
        }
    }

    #[tracing::instrument(name = "fs.remove", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()> {
        ctx.check()?;
        let path = self.resolve(path);
        let entry = self.stat_entry(ctx, &path).await?;
        if kind_of(&entry) == FileKind::Dir && !recursive {
            // envd removes recursively; a plain remove of a non-empty directory must not.
            let req = ListDirRequest {
                path: path.clone(),
                depth: 1,
            };
            let r: ListDirResponse = self
                .core
                .envd
                .unary(
                    ctx,
                    "filesystem.Filesystem/ListDir",
                    &req,
                    self.user(),
                    Op::Fs {
                        op: "remove",
                        path: &path,
                    },
                )
                .await?;
            if !r.entries.is_empty() {
                return Err(fs_err(
                    ErrorCode::FsNotEmpty,
                    &path,
                    "the directory is not empty",
                ));
            }
        }
        let req = PathRequest { path: path.clone() };
        let _: serde_json::Value = self
            .core
            .envd
            .unary(
                ctx,
                "filesystem.Filesystem/Remove",
                &req,
                self.user(),
                Op::Fs {
                    op: "remove",
                    path: &path,
                },
            )
            .await?;
        Ok(())
    }

    #[tracing::instrument(name = "fs.watch", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, path))]
    async fn watch(
        &self,
        ctx: &CallCtx,
        path: &str,
        recursive: bool,
    ) -> Result<BoxStream<'static, Result<FsEvent>>> {
        ctx.check()?;
        let path = self.resolve(path);
        // Names that exist now: replacing one (a rename over it, which is how atomic
        // writes publish) is reported as a write, not a creation.
        let seed = self
            .list(ctx, &path, if recursive { 16 } else { 1 })
            .await?;
        let prefix = if path == "/" {
            "/".to_owned()
        } else {
            format!("{path}/")
        };
        let known: HashSet<String> = seed
            .iter()
            .filter_map(|e| e.stat.path.strip_prefix(&prefix).map(str::to_owned))
            .collect();
        let req = WatchRequest {
            path: path.clone(),
            recursive,
            include_entry: false,
            allow_network_mounts: false,
        };
        // The watch outlives the call that opened it; it ends with the sandbox or when dropped.
        let parent = self.core.closed.child();
        let op = Op::Fs {
            op: "watch",
            path: &path,
        };
        let mut stream = self
            .core
            .envd
            .server_stream(
                ctx,
                &parent,
                "filesystem.Filesystem/WatchDir",
                &req,
                self.user(),
                op,
            )
            .await?;
        match within_connect(
            ctx,
            self.core.envd.http.connect,
            stream.next::<WatchDirResponse>(),
        )
        .await?
        {
            StreamItem::Message(WatchDirResponse::Start(_)) => {}
            StreamItem::Message(_) => {
                return Err(crate::error::malformed(
                    "a watch that did not start with its start event",
                ));
            }
            StreamItem::End => {
                return Err(crate::error::malformed(
                    "a watch that ended before it started",
                ));
            }
        }
        struct St {
            stream: crate::client::ConnectStream,
            known: HashSet<String>,
            done: bool,
            _parent: CancelToken,
        }
        let st = St {
            stream,
            known,
            done: false,
            _parent: parent,
        };
        Ok(futures_util::stream::unfold(st, |mut st| async move {
            loop {
                if st.done {
                    return None;
                }
                match st.stream.next::<WatchDirResponse>().await {
                    Ok(StreamItem::Message(WatchDirResponse::Filesystem(ev))) => {
                        let base = ev.name.rsplit('/').next().unwrap_or(&ev.name);
                        if base.starts_with(TEMP_PREFIX) {
                            continue;
                        }
                        let kind = match ev.kind {
                            EventType::Create if st.known.contains(&ev.name) => FsEventKind::Write,
                            EventType::Create => {
                                st.known.insert(ev.name.clone());
                                FsEventKind::Create
                            }
                            EventType::Write => FsEventKind::Write,
                            EventType::Remove => {
                                st.known.remove(&ev.name);
                                FsEventKind::Remove
                            }
                            EventType::Rename => {
                                st.known.remove(&ev.name);
                                FsEventKind::Rename
                            }
                            EventType::Chmod => FsEventKind::Chmod,
                            EventType::Unspecified => continue,
                        };
                        return Some((
                            Ok(FsEvent {
                                kind,
                                name: ev.name,
                            }),
                            st,
                        ));
                    }
                    Ok(StreamItem::Message(_)) => {}
                    Ok(StreamItem::End) => return None,
                    Err(e) => {
                        st.done = true;
                        return Some((Err(e), st));
                    }
                }
            }
        })
        .boxed())
    }
}
