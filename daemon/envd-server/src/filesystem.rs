//! envd's `filesystem.Filesystem` service over Connect, on the provider's `Fs` seam.
//!
//! Each operation runs under the call's `Connect-Timeout-Ms` and the daemon's file
//! operation limit; changes (`MakeDir`, `Move`, `Remove`) are recorded in the session log.
//! Watches use the provider's `Fs::watch` when it has one, else a poller that lists the
//! directory and reports the differences (create, write, remove), so `watch_dir` works on
//! every provider. `CreateWatcher` buffers a watch's events until `GetWatcherEvents` takes
//! them (the Python SDK polls), `WatchDir` streams them (the JS SDK).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::HeaderMap;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    ConnectCode, CreateWatcherResponse, Empty, EntryInfo, EntryResponse, EventType, FileType,
    FilesystemEvent, ListDirRequest, ListDirResponse, MoveRequest, PathRequest, WatchDirResponse,
    WatchRequest, WatcherEventsResponse, WatcherRequest,
};
use tether_protocol::fs::{FileKind, FileStat, FsEvent, FsEventKind};
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, ProviderError, Sandbox};
use tracing::Instrument;

use crate::connect::{self, CallOpts, RpcError, StreamOpts};
use crate::util::resolve_path;
use crate::{EnvdState, Host, HostedSandbox, RequestCtx, Target, rest};
use tether_provider::{Clock, FsOp};

/// How often the polling watcher lists a directory.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// Depth the polling watcher lists to when recursive.
const POLL_DEPTH: u32 = 32;
/// Events a watcher keeps until they are taken; older ones are dropped beyond this.
const WATCHER_BUFFER: usize = 10_000;

pub(crate) fn routes<H: Host>() -> Router<Arc<H>> {
    Router::new().route("/filesystem.Filesystem/{method}", post(rpc::<H>))
}

/// The methods of `filesystem.Filesystem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Stat,
    MakeDir,
    Move,
    ListDir,
    Remove,
    WatchDir,
    CreateWatcher,
    GetWatcherEvents,
    RemoveWatcher,
}

impl Method {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "Stat" => Self::Stat,
            "MakeDir" => Self::MakeDir,
            "Move" => Self::Move,
            "ListDir" => Self::ListDir,
            "Remove" => Self::Remove,
            "WatchDir" => Self::WatchDir,
            "CreateWatcher" => Self::CreateWatcher,
            "GetWatcherEvents" => Self::GetWatcherEvents,
            "RemoveWatcher" => Self::RemoveWatcher,
            _ => return None,
        })
    }

    /// The span's name in the trace vocabulary (`docs/telemetry.md`).
    fn span_name(self) -> &'static str {
        match self {
            Self::Stat => "e2b.filesystem.stat",
            Self::MakeDir => "e2b.filesystem.make_dir",
            Self::Move => "e2b.filesystem.move",
            Self::ListDir => "e2b.filesystem.list_dir",
            Self::Remove => "e2b.filesystem.remove",
            Self::WatchDir => "e2b.filesystem.watch_dir",
            Self::CreateWatcher => "e2b.filesystem.create_watcher",
            Self::GetWatcherEvents => "e2b.filesystem.get_watcher_events",
            Self::RemoveWatcher => "e2b.filesystem.remove_watcher",
        }
    }

    fn span<S: HostedSandbox>(self, t: &Target<S>) -> tracing::Span {
        let (s, id) = (t.sandbox.session_id(), &t.id);
        // One callsite for every method; `otel.name` carries the method's span name.
        tracing::info_span!(
            "e2b.filesystem",
            otel.name = self.span_name(),
            session.id = %s,
            sandbox.id = %id,
            command.id = tracing::field::Empty,
            outcome = tracing::field::Empty,
        )
    }
}

async fn rpc<H: Host>(
    State(host): State<Arc<H>>,
    Path(method): Path<String>,
    RequestCtx(ctx): RequestCtx,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some(m) = Method::parse(&method) else {
        return RpcError::new(
            ConnectCode::Unimplemented,
            format!("filesystem.Filesystem/{method} is not a method of this service"),
        )
        .into_response();
    };
    let (opts, target, user) = match rest::admit(&*host, &headers, m == Method::WatchDir) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let span = m.span(&target);
    // Every operation is bounded by the call's timeout and by the daemon's fs limit.
    let fs_limit = host.limits().fs_op;
    let limit = opts.timeout.map_or(fs_limit, |t| t.min(fs_limit));
    let cctx = ctx.with_timeout(limit, Clock::Total);
    let resp = async {
        if m == Method::WatchDir {
            return watch_dir(&cctx, opts, &target, &user, body).await;
        }
        let r = match connect::read_body(body, connect::MAX_MESSAGE_BYTES).await {
            Ok(bytes) => unary(m, &cctx, &target, &user, &bytes).await,
            Err(e) => Err(e),
        };
        r.unwrap_or_else(IntoResponse::into_response)
    };
    crate::traced(span, resp).await
}

async fn unary<S: HostedSandbox>(
    m: Method,
    ctx: &CallCtx,
    t: &Target<S>,
    user: &str,
    body: &[u8],
) -> Result<Response, RpcError> {
    let sandbox = t.sandbox.sandbox()?;
    let user_fs = crate::UserFs::of(sandbox.clone(), user)?;
    let fs = user_fs.get();
    match m {
        Method::Stat => {
            let req: PathRequest = connect::decode_unary(body)?;
            let path = resolve_path(&req.path, user);
            let st = crate::fs_op(t, ctx, FsOp::Stat, &path, |c, p| async move {
                fs.stat(&c, p).await
            })
            .await?;
            let entry = ctx.run(async { Ok(resolved_entry(ctx, fs, &st, &t.state).await) });
            Ok(connect::unary_ok(&EntryResponse {
                entry: entry.await?,
            }))
        }
        Method::ListDir => {
            let req: ListDirRequest = connect::decode_unary(body)?;
            let path = resolve_path(&req.path, user);
            let st = ctx.run(fs.stat(ctx, &path)).await?;
            if st.kind != FileKind::Dir {
                return Err(RpcError::invalid(format!(
                    "path '{}' is not a directory",
                    req.path
                )));
            }
            let depth = req.depth.max(1);
            let listed = crate::fs_op(t, ctx, FsOp::List, &path, |c, p| async move {
                fs.list(&c, p, depth).await
            })
            .await?;
            let entries = ctx.run(async {
                let mut out = Vec::with_capacity(listed.len());
                for e in &listed {
                    out.push(resolved_entry(ctx, fs, &e.stat, &t.state).await);
                }
                Ok(out)
            });
            Ok(connect::unary_ok(&ListDirResponse {
                entries: entries.await?,
            }))
        }
        Method::MakeDir => {
            let req: PathRequest = connect::decode_unary(body)?;
            let path = resolve_path(&req.path, user);
            let r = crate::fs_op(t, ctx, FsOp::Mkdir, &path, |c, p| async move {
                fs.mkdir(&c, p, true).await
            })
            .await;
            match r {
                Ok(st) => Ok(connect::unary_ok(&EntryResponse {
                    entry: resolved_entry(ctx, fs, &st, &t.state).await,
                })),
                Err(e) if e.code() == ErrorCode::FsAlreadyExists => {
                    // envd: an existing directory is `already_exists`, anything else in the
                    // way is a bad argument.
                    match ctx.run(fs.stat(ctx, &path)).await {
                        Ok(st) if st.kind == FileKind::Dir => Err(RpcError::new(
                            ConnectCode::AlreadyExists,
                            format!("directory '{}' already exists", req.path),
                        )),
                        _ => Err(RpcError::invalid(format!(
                            "path '{}' already exists and is not a directory",
                            req.path
                        ))),
                    }
                }
                Err(e) => Err(e.into()),
            }
        }
        Method::Move => {
            let req: MoveRequest = connect::decode_unary(body)?;
            let (from, to) = (
                resolve_path(&req.source, user),
                resolve_path(&req.destination, user),
            );
            let (f, d) = (&from, &to);
            let both = format!("{from} -> {to}");
            let st = crate::fs_op(t, ctx, FsOp::Rename, &both, |c, _| async move {
                fs.rename(&c, f, d).await
            })
            .await?;
            t.state.move_meta(&from, Some(&to));
            Ok(connect::unary_ok(&EntryResponse {
                entry: resolved_entry(ctx, fs, &st, &t.state).await,
            }))
        }
        Method::Remove => {
            let req: PathRequest = connect::decode_unary(body)?;
            let path = resolve_path(&req.path, user);
            // envd removes with `os.RemoveAll`: a path that is not there is already
            // removed.
            crate::fs_op(t, ctx, FsOp::Remove, &path, |c, p| async move {
                match fs.remove(&c, p, true).await {
                    Err(e) if e.code() == ErrorCode::FsNotFound => Ok(()),
                    r => r,
                }
            })
            .await?;
            t.state.move_meta(&path, None);
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::CreateWatcher => {
            let req: WatchRequest = connect::decode_unary(body)?;
            let id = create_watcher(ctx, t, user, sandbox, &req).await?;
            Ok(connect::unary_ok(&CreateWatcherResponse { watcher_id: id }))
        }
        Method::GetWatcherEvents => {
            let req: WatcherRequest = connect::decode_unary(body)?;
            let w = watcher(&t.state, &req.watcher_id)?;
            let (events, failure) = w.take();
            if let Some(e) = failure
                && events.is_empty()
            {
                return Err(e);
            }
            Ok(connect::unary_ok(&WatcherEventsResponse { events }))
        }
        Method::RemoveWatcher => {
            let req: WatcherRequest = connect::decode_unary(body)?;
            let w = t
                .state
                .watchers
                .write()
                .ok()
                .and_then(|mut m| m.remove(&req.watcher_id))
                .ok_or_else(|| {
                    RpcError::not_found(format!("watcher with id {} not found", req.watcher_id))
                })?;
            w.stop();
            Ok(connect::unary_ok(&Empty {}))
        }
        Method::WatchDir => Err(RpcError::new(
            ConnectCode::Internal,
            "a streaming method was dispatched as unary",
        )),
    }
}

// === entries ===

/// `EntryInfo` of a seam stat.
pub(crate) fn entry_info(st: &FileStat, extra: &EnvdState) -> EntryInfo {
    EntryInfo {
        name: st.name.clone(),
        kind: file_type(st.kind),
        path: st.path.clone(),
        size: i64::try_from(st.size).unwrap_or(i64::MAX),
        mode: st.mode & 0o7777,
        permissions: permissions(st.kind, st.mode),
        owner: "user".into(),
        group: "user".into(),
        modified_time: Some(crate::util::rfc3339(st.modified_ms)),
        symlink_target: st.symlink_target.clone(),
        metadata: extra.meta_of(&st.path),
        is_symlink: st.kind == FileKind::Symlink,
    }
}

/// The extended attribute namespace of file metadata (envd's `MetadataXattrPrefix`).
pub(crate) const META_XATTR_PREFIX: &str = "user.e2b.";

/// How many links a symlink chain may have before it counts as a loop (Linux's limit).
const MAX_SYMLINK_HOPS: usize = 40;

/// `EntryInfo` of a seam stat, as envd reports it: a symlink is described by what it
/// points to (type and mode of the final target, `symlinkTarget` its absolute path),
/// while name, path, size and `permissions` stay the link's. A link that leads nowhere
/// has type unspecified, mode 0, and its own path as target (Go's `EvalSymlinks` failed).
pub(crate) async fn resolved_entry(
    ctx: &CallCtx,
    fs: &dyn tether_provider::Fs,
    st: &FileStat,
    extra: &EnvdState,
) -> EntryInfo {
    let mut info = entry_info(st, extra);
    // envd keeps file metadata as `user.e2b.*` extended attributes, so what a process
    // sets there shows too; the front's own copy serves providers without them.
    if let Ok(attrs) = fs.xattrs(ctx, &st.path, META_XATTR_PREFIX).await {
        info.metadata = attrs
            .into_iter()
            .filter_map(|(k, v)| String::from_utf8(v).ok().map(|v| (k, v)))
            .collect();
    }
    if st.kind != FileKind::Symlink {
        return info;
    }
    let mut at = st.clone();
    let mut target = None;
    for _ in 0..MAX_SYMLINK_HOPS {
        let Some(raw) = at.symlink_target.as_deref() else {
            break;
        };
        let next = link_destination(&at.path, raw);
        match fs.stat(ctx, &next).await {
            Ok(n) if n.kind == FileKind::Symlink => at = n,
            Ok(n) => {
                target = Some(n);
                break;
            }
            Err(_) => break,
        }
    }
    match target {
        Some(t) => {
            info.kind = file_type(t.kind);
            info.mode = t.mode & 0o777;
            info.symlink_target = Some(t.path);
        }
        None => {
            info.kind = FileType::Unspecified;
            info.mode = 0;
            info.symlink_target = Some(st.path.clone());
        }
    }
    info
}

/// Where a link at `link` with target `raw` points: `raw` itself when absolute, else
/// relative to the link's directory; `.` and `..` resolved lexically.
fn link_destination(link: &str, raw: &str) -> String {
    let joined = if raw.starts_with('/') {
        raw.to_owned()
    } else {
        let dir = link.rsplit_once('/').map_or("", |(d, _)| d);
        format!("{dir}/{raw}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for p in joined.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::File,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Other => FileType::Unspecified,
    }
}

/// Go's `os.FileMode.String()`: `drwxr-xr-x`, `-rw-r--r--`, `Lrwxrwxrwx`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let t = match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        FileKind::File => '-',
        FileKind::Other => '?',
    };
    let mut s = String::with_capacity(10);
    s.push(t);
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

// === watches ===

/// Open a watch on a directory: the provider's, or the polling fallback.
async fn open_watch(
    ctx: &CallCtx,
    watch_ctx: CallCtx,
    sandbox: Arc<dyn Sandbox>,
    path: &str,
    shown: &str,
    recursive: bool,
    limit: Duration,
) -> Result<BoxStream<'static, Result<FsEvent, RpcError>>, RpcError> {
    let st = ctx.run(sandbox.fs().stat(ctx, path)).await?;
    if st.kind != FileKind::Dir {
        return Err(RpcError::invalid(format!(
            "path '{shown}' is not a directory"
        )));
    }
    match sandbox.fs().watch(&watch_ctx, path, recursive).await {
        Ok(s) => {
            let keep = watch_ctx;
            Ok(s.map(move |r| {
                let _ = &keep;
                r.map_err(RpcError::from)
            })
            .boxed())
        }
        Err(ProviderError::Unsupported { .. }) => {
            poll_watch(ctx, watch_ctx, sandbox, path.to_owned(), recursive, limit).await
        }
        Err(e) => Err(e.into()),
    }
}

/// What the poller remembers of one path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: FileKind,
    size: u64,
    modified_ms: i64,
    mode: u32,
    version: String,
}

async fn snapshot(
    ctx: &CallCtx,
    sandbox: &Arc<dyn Sandbox>,
    root: &str,
    recursive: bool,
) -> Result<BTreeMap<String, Seen>, ProviderError> {
    let entries = sandbox
        .fs()
        .list(ctx, root, if recursive { POLL_DEPTH } else { 1 })
        .await?;
    let prefix = format!("{}/", root.trim_end_matches('/'));
    Ok(entries
        .into_iter()
        .map(|e| {
            let name = e
                .stat
                .path
                .strip_prefix(&prefix)
                .unwrap_or(&e.stat.name)
                .to_owned();
            let seen = Seen {
                kind: e.stat.kind,
                size: e.stat.size,
                modified_ms: e.stat.modified_ms,
                mode: e.stat.mode,
                version: e.stat.version.0.clone(),
            };
            (name, seen)
        })
        .collect())
}

/// The polling watcher: the first listing is taken before this returns, so every change
/// after the watch was created is reported.
async fn poll_watch(
    ctx: &CallCtx,
    watch_ctx: CallCtx,
    sandbox: Arc<dyn Sandbox>,
    root: String,
    recursive: bool,
    limit: Duration,
) -> Result<BoxStream<'static, Result<FsEvent, RpcError>>, RpcError> {
    let first = ctx.run(snapshot(ctx, &sandbox, &root, recursive)).await?;
    struct St {
        ctx: CallCtx,
        sandbox: Arc<dyn Sandbox>,
        root: String,
        recursive: bool,
        last: BTreeMap<String, Seen>,
        pending: VecDeque<FsEvent>,
        limit: Duration,
    }
    let st = St {
        limit,
        ctx: watch_ctx,
        sandbox,
        root,
        recursive,
        last: first,
        pending: VecDeque::new(),
    };
    Ok(futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            tokio::select! {
                _ = st.ctx.cancel.cancelled() => return None,
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
            let lctx = st.ctx.with_timeout(st.limit, Clock::Total);
            let now = match snapshot(&lctx, &st.sandbox, &st.root, st.recursive).await {
                Ok(n) => n,
                Err(e) if e.code() == ErrorCode::FsNotFound => {
                    // The watched directory itself is gone: the watch ends.
                    return Some((
                        Err(RpcError::not_found(format!(
                            "watched directory '{}' was removed",
                            st.root
                        ))),
                        st,
                    ));
                }
                Err(e) if st.ctx.cancel.is_cancelled() => {
                    let _ = e;
                    return None;
                }
                Err(e) => return Some((Err(e.into()), st)),
            };
            st.pending.extend(diff(&st.last, &now));
            st.last = now;
        }
    })
    .boxed())
}

/// The events that turn listing `a` into listing `b`.
fn diff(a: &BTreeMap<String, Seen>, b: &BTreeMap<String, Seen>) -> Vec<FsEvent> {
    let mut out = Vec::new();
    for (name, new) in b {
        match a.get(name) {
            None => out.push(FsEvent {
                kind: FsEventKind::Create,
                name: name.clone(),
            }),
            Some(old) if old.kind != new.kind => {
                out.push(FsEvent {
                    kind: FsEventKind::Remove,
                    name: name.clone(),
                });
                out.push(FsEvent {
                    kind: FsEventKind::Create,
                    name: name.clone(),
                });
            }
            Some(old)
                if old.kind == FileKind::File
                    && (old.size != new.size
                        || old.modified_ms != new.modified_ms
                        || old.version != new.version) =>
            {
                out.push(FsEvent {
                    kind: FsEventKind::Write,
                    name: name.clone(),
                });
            }
            Some(old) if old.mode != new.mode => out.push(FsEvent {
                kind: FsEventKind::Chmod,
                name: name.clone(),
            }),
            Some(_) => {}
        }
    }
    for name in a.keys() {
        if !b.contains_key(name) {
            out.push(FsEvent {
                kind: FsEventKind::Remove,
                name: name.clone(),
            });
        }
    }
    out
}

/// A seam event as envd reports it, with the entry when asked for (and still there).
async fn to_event(
    ctx: &CallCtx,
    sandbox: &Arc<dyn Sandbox>,
    extra: &EnvdState,
    root: &str,
    ev: FsEvent,
    include_entry: bool,
) -> FilesystemEvent {
    let kind = match ev.kind {
        FsEventKind::Create => EventType::Create,
        FsEventKind::Write => EventType::Write,
        FsEventKind::Remove => EventType::Remove,
        FsEventKind::Rename => EventType::Rename,
        FsEventKind::Chmod => EventType::Chmod,
    };
    let entry = if include_entry && !matches!(ev.kind, FsEventKind::Remove | FsEventKind::Rename) {
        let path = format!("{}/{}", root.trim_end_matches('/'), ev.name);
        let sctx = ctx.with_timeout(extra.fs_op, Clock::Total);
        match sandbox.fs().stat(&sctx, &path).await.ok() {
            Some(st) => Some(resolved_entry(&sctx, sandbox.fs(), &st, extra).await),
            None => None,
        }
    } else {
        None
    };
    FilesystemEvent {
        name: ev.name,
        kind,
        entry,
    }
}

async fn watch_dir<S: HostedSandbox>(
    ctx: &CallCtx,
    opts: CallOpts,
    t: &Target<S>,
    user: &str,
    body: Body,
) -> Response {
    let req: WatchRequest = match connect::read_single_message(body).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(&e),
    };
    let sandbox = match t.sandbox.sandbox() {
        Ok(s) => s,
        Err(e) => return connect::stream_error(&RpcError::from(e)),
    };
    let path = resolve_path(&req.path, user);
    let wctx = CallCtx::with_cancel(ctx.request_id.clone(), t.sandbox.lifetime().child());
    let events = match open_watch(
        ctx,
        wctx.clone(),
        Arc::clone(&sandbox),
        &path,
        &req.path,
        req.recursive,
        t.state.fs_op,
    )
    .await
    {
        Ok(s) => with_uploads(s, Arc::clone(&t.state), path.clone(), req.recursive),
        Err(e) => return connect::stream_error(&e),
    };
    let extra = Arc::clone(&t.state);
    let include = req.include_entry;
    let first =
        futures_util::stream::once(async { Ok(connect::msg(&WatchDirResponse::Start(Empty {}))) });
    let rest = events.then(move |r| {
        let (wctx, sandbox, extra, path) = (
            wctx.clone(),
            Arc::clone(&sandbox),
            Arc::clone(&extra),
            path.clone(),
        );
        async move {
            let ev = r?;
            let e = to_event(&wctx, &sandbox, &extra, &path, ev, include).await;
            Ok(connect::msg(&WatchDirResponse::Filesystem(Box::new(e))))
        }
    });
    connect::stream_response(
        first.chain(rest).boxed(),
        StreamOpts {
            keepalive: opts.keepalive,
            keepalive_msg: connect::msg(&WatchDirResponse::Keepalive(Empty {})),
            deadline: opts.deadline(),
            sever: Some(t.sandbox.lifetime().clone()),
            span: tracing::Span::current(),
        },
    )
}

// === uploads as envd reports them ===

/// What an upload did to a path, as envd's watches see it.
#[derive(Debug, Clone)]
pub(crate) struct Announced {
    /// The absolute sandbox path.
    path: String,
    /// The events, in order.
    kinds: Vec<FsEventKind>,
}

/// The name of `abs` in a watch of `root`: relative to it, and for a watch that is not
/// recursive only a direct child.
fn watched_name(root: &str, recursive: bool, abs: &str) -> Option<String> {
    let prefix = format!("{}/", root.trim_end_matches('/'));
    let rel = abs.strip_prefix(&prefix)?;
    (!rel.is_empty() && (recursive || !rel.contains('/'))).then(|| rel.to_owned())
}

/// Whether a provider's event is one an upload in progress (or just answered) makes,
/// which the front reports itself.
fn upload_noise(extra: &EnvdState, root: &str, ev: &FsEvent) -> bool {
    matches!(
        ev.kind,
        FsEventKind::Create | FsEventKind::Write | FsEventKind::Chmod
    ) && extra.upload_quiet(&format!("{}/{}", root.trim_end_matches('/'), ev.name))
}

/// An upload of `path` ended: the watches get envd's events of it. A new file is
/// created, its owner set and its bytes written (`CREATE`, `CHMOD`, `WRITE`); an existing
/// one is written. The `CreateWatcher` buffers have them before the upload is answered
/// (the Python SDK reads them right after); the `WatchDir` streams get them in order.
pub(crate) async fn announce_upload(
    ctx: &CallCtx,
    sandbox: &Arc<dyn Sandbox>,
    extra: &Arc<EnvdState>,
    path: &str,
    created: bool,
) {
    let kinds = if created {
        vec![FsEventKind::Create, FsEventKind::Chmod, FsEventKind::Write]
    } else {
        vec![FsEventKind::Write]
    };
    let watchers: Vec<Arc<Watcher>> = extra
        .watchers
        .read()
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default();
    for w in watchers {
        let Some(name) = watched_name(&w.root, w.recursive, path) else {
            continue;
        };
        for kind in &kinds {
            let ev = FsEvent {
                kind: *kind,
                name: name.clone(),
            };
            w.push(to_event(ctx, sandbox, extra, &w.root, ev, w.include_entry).await);
        }
    }
    // No stream listening is not an error.
    let _ = extra.announced.send(Announced {
        path: path.to_owned(),
        kinds,
    });
}

/// A watch's events with uploads reported as envd reports them: the provider's own
/// events of an uploaded path dropped, the front's announcements merged in. Ends when
/// the provider's watch ends.
fn with_uploads(
    events: BoxStream<'static, Result<FsEvent, RpcError>>,
    extra: Arc<EnvdState>,
    root: String,
    recursive: bool,
) -> BoxStream<'static, Result<FsEvent, RpcError>> {
    struct St {
        events: BoxStream<'static, Result<FsEvent, RpcError>>,
        announced: tokio::sync::broadcast::Receiver<Announced>,
        extra: Arc<EnvdState>,
        root: String,
        recursive: bool,
        pending: VecDeque<FsEvent>,
    }
    let st = St {
        announced: extra.announced.subscribe(),
        events,
        extra,
        root,
        recursive,
        pending: VecDeque::new(),
    };
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            tokio::select! {
                biased;
                a = st.announced.recv() => match a {
                    Ok(a) => {
                        if let Some(name) = watched_name(&st.root, st.recursive, &a.path) {
                            st.pending.extend(a.kinds.iter().map(|kind| FsEvent {
                                kind: *kind,
                                name: name.clone(),
                            }));
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::debug!(missed = n, "A watch stream fell behind the upload announcements");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        st.announced = st.extra.announced.subscribe();
                    }
                },
                e = st.events.next() => match e {
                    Some(Ok(ev)) if upload_noise(&st.extra, &st.root, &ev) => {}
                    Some(item) => return Some((item, st)),
                    None => return None,
                },
            }
        }
    })
    .boxed()
}

// === watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher) ===

/// A watch whose events wait to be taken.
#[derive(Debug)]
pub(crate) struct Watcher {
    events: RwLock<VecDeque<FilesystemEvent>>,
    failure: RwLock<Option<RpcError>>,
    stop: CancelToken,
    /// The watched directory (absolute), how deep, and whether events carry entries.
    root: String,
    recursive: bool,
    include_entry: bool,
}

impl Watcher {
    pub(crate) fn stop(&self) {
        self.stop.cancel(CancelReason::Caller("watcher removed"));
    }

    fn push(&self, e: FilesystemEvent) {
        if let Ok(mut q) = self.events.write() {
            if q.len() >= WATCHER_BUFFER {
                q.pop_front();
            }
            q.push_back(e);
        }
    }

    fn take(&self) -> (Vec<FilesystemEvent>, Option<RpcError>) {
        let events = self
            .events
            .write()
            .map(|mut q| q.drain(..).collect())
            .unwrap_or_default();
        let failure = self.failure.read().ok().and_then(|f| f.clone());
        (events, failure)
    }
}

fn watcher(extra: &EnvdState, id: &str) -> Result<Arc<Watcher>, RpcError> {
    extra
        .watchers
        .read()
        .ok()
        .and_then(|m| m.get(id).cloned())
        .ok_or_else(|| RpcError::not_found(format!("watcher with id {id} not found")))
}

async fn create_watcher<S: HostedSandbox>(
    ctx: &CallCtx,
    t: &Target<S>,
    user: &str,
    sandbox: Arc<dyn Sandbox>,
    req: &WatchRequest,
) -> Result<String, RpcError> {
    let path = resolve_path(&req.path, user);
    let stop = t.sandbox.lifetime().child();
    let wctx = CallCtx::with_cancel(format!("watcher-{}", ctx.request_id), stop.clone());
    let mut events = open_watch(
        ctx,
        wctx.clone(),
        Arc::clone(&sandbox),
        &path,
        &req.path,
        req.recursive,
        t.state.fs_op,
    )
    .await?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let w = Arc::new(Watcher {
        events: RwLock::new(VecDeque::new()),
        failure: RwLock::new(None),
        stop: stop.clone(),
        root: path.clone(),
        recursive: req.recursive,
        include_entry: req.include_entry,
    });
    if let Ok(mut m) = t.state.watchers.write() {
        m.insert(id.clone(), Arc::clone(&w));
    }
    let (extra, include) = (Arc::clone(&t.state), req.include_entry);
    let span = tracing::info_span!("e2b.filesystem.watcher", session.id = %t.sandbox.session_id(), watcher.id = %id);
    t.sandbox.spawn(
        async move {
            loop {
                let next = tokio::select! {
                    _ = stop.cancelled() => break,
                    n = events.next() => n,
                };
                match next {
                    Some(Ok(ev)) if upload_noise(&extra, &path, &ev) => {}
                    Some(Ok(ev)) => {
                        w.push(to_event(&wctx, &sandbox, &extra, &path, ev, include).await)
                    }
                    Some(Err(e)) => {
                        if let Ok(mut f) = w.failure.write() {
                            *f = Some(e);
                        }
                        break;
                    }
                    None => break,
                }
            }
        }
        .instrument(span),
    );
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(kind: FileKind, size: u64, m: i64) -> Seen {
        Seen {
            kind,
            size,
            modified_ms: m,
            mode: 0o644,
            version: format!("{size}-{m}"),
        }
    }

    #[test]
    fn poller_diff_reports_create_write_remove() {
        let mut a = BTreeMap::new();
        a.insert("keep".to_owned(), seen(FileKind::File, 1, 1));
        a.insert("gone".to_owned(), seen(FileKind::File, 1, 1));
        a.insert("grow".to_owned(), seen(FileKind::File, 1, 1));
        let mut b = a.clone();
        b.remove("gone");
        b.insert("grow".to_owned(), seen(FileKind::File, 2, 2));
        b.insert("new".to_owned(), seen(FileKind::Dir, 0, 3));
        let mut d: Vec<(FsEventKind, String)> =
            diff(&a, &b).into_iter().map(|e| (e.kind, e.name)).collect();
        d.sort_by(|x, y| x.1.cmp(&y.1));
        assert_eq!(
            d,
            vec![
                (FsEventKind::Remove, "gone".to_owned()),
                (FsEventKind::Write, "grow".to_owned()),
                (FsEventKind::Create, "new".to_owned()),
            ]
        );
        assert!(diff(&b, &b).is_empty());
    }

    #[test]
    fn link_destinations_resolve_like_a_path_walk() {
        assert_eq!(
            link_destination("/home/user/l", "d.txt"),
            "/home/user/d.txt"
        );
        assert_eq!(
            link_destination("/home/user/a/l", "../b/./c"),
            "/home/user/b/c"
        );
        assert_eq!(link_destination("/home/user/l", "/etc/hosts"), "/etc/hosts");
        assert_eq!(link_destination("/l", "../../x"), "/x");
    }

    #[test]
    fn uploads_are_named_as_the_watch_sees_them() {
        assert_eq!(
            watched_name("/home/user/w", false, "/home/user/w/a.txt").as_deref(),
            Some("a.txt")
        );
        assert_eq!(
            watched_name("/home/user/w", false, "/home/user/w/d/a.txt"),
            None
        );
        assert_eq!(
            watched_name("/home/user/w/", true, "/home/user/w/d/a.txt").as_deref(),
            Some("d/a.txt")
        );
        assert_eq!(
            watched_name("/home/user/w", true, "/home/user/wx/a.txt"),
            None
        );
        assert_eq!(watched_name("/home/user/w", true, "/home/user/w"), None);
    }

    #[test]
    fn permissions_read_like_go() {
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
    }
}
