//! envd's REST surface and the routing of every envd request to its sandbox.
//!
//! Routing: the `E2b-Sandbox-Id` header (what the SDKs send when `E2B_SANDBOX_URL` is
//! set), else a `<port>-<id>.<domain>` host. A sandbox that does not exist (or is closed,
//! or belongs to no E2B tenant) gets the edge proxy's 502 answer, which the SDKs turn into
//! `SandboxNotRunningException`. Authentication: `X-Access-Token` must be the sandbox's
//! token; `/files` also takes a signed URL instead; `/health` answers 204 only with the
//! token, and without it exactly as for a sandbox that does not exist.
//!
//! Endpoints: `GET /health` (204), `POST /init` (sandbox-wide env and default user),
//! `GET /envs`, and `GET|POST /files`: streaming downloads (optionally gzip-encoded, with
//! single byte ranges) and streaming uploads (`application/octet-stream`, optionally
//! gzip-encoded, or `multipart/form-data`), with bounded memory whatever the file size.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    ApiError, ENVD_PORT, ENVD_VERSION, InitRequest, ProxyError, WrittenEntry,
};
use tether_protocol::fs::{ByteRange, FileKind, WriteGuard, WriteOutcome};
use tether_provider::{ByteStream, CallCtx, ProviderError};

use crate::multipart::{Multipart, boundary_of};
use crate::util::{query_param, resolve_path};
use crate::{EnvdState, Failure, Host, HostedSandbox, RequestCtx, RestError, Target, auth};
use tether_provider::{Clock, FsOp};

/// Chunks queued between an upload's body and the provider's write.
const UPLOAD_QUEUE: usize = 8;

/// What is left of an upload's body that is read (and dropped) after the upload was
/// refused part-way, before the answer: Go's server (envd) reads up to 256 KiB.
const DRAIN_AFTER_REFUSAL: usize = 256 * 1024;

pub(crate) fn routes<H: Host>() -> Router<Arc<H>> {
    Router::new()
        .route("/health", get(health::<H>))
        .route("/init", post(init::<H>))
        .route("/envs", get(envs::<H>))
        .route("/files", get(download::<H>).post(upload::<H>))
}

// === routing and auth ===

/// Why an envd request is refused before it reaches its sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// Neither the header nor the host names a sandbox.
    NoSandbox,
    /// No such live sandbox.
    NotFound(String),
    /// The sandbox exists but the port asked for is not envd's.
    PortClosed(String, u16),
    /// Wrong or missing access token.
    Unauthorized,
    /// A signed `/files` URL whose signature is right but whose expiration has passed.
    SignatureExpired,
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        match self {
            Self::NoSandbox => RestError::bad_request(
                "missing header: E2b-Sandbox-Id (or a 49983-<id>.<domain> host)",
            )
            .into_response(),
            Self::NotFound(id) => proxy_error(
                StatusCode::BAD_GATEWAY,
                id,
                "The sandbox was not found",
                None,
            ),
            Self::PortClosed(id, port) => proxy_error(
                StatusCode::BAD_GATEWAY,
                id,
                "The sandbox is running but port is not open",
                Some(port),
            ),
            Self::Unauthorized => unauthorized(
                "unauthorized access, please provide a valid access token or method signing if supported",
            ),
            // envd's words: the SDKs' tests compare the whole body.
            Self::SignatureExpired => unauthorized("signature is already expired"),
        }
    }
}

fn unauthorized(message: &str) -> Response {
    let body = ApiError {
        code: 401,
        message: message.into(),
        error_code: None,
    };
    (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
}

/// Whether a request's `User-Agent` is a browser's.
pub fn is_browser(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("Mozilla/"))
}

impl Reject {
    /// The answer for a client that is a `browser` ([`is_browser`]): E2B's edge proxy
    /// shows a person a page (`<title>Closed Port Error</title>`, `Sandbox Not Found`),
    /// and programs the JSON of [`Reject::into_response`].
    pub fn for_client(self, browser: bool) -> Response {
        let (title, text) = match (&self, browser) {
            (Self::PortClosed(id, port), true) => (
                "Closed Port Error",
                format!(
                    "The sandbox {id} is running but there is no service running on port {port}."
                ),
            ),
            (Self::NotFound(id), true) => (
                "Sandbox Not Found",
                format!("The sandbox {id} was not found."),
            ),
            _ => return self.into_response(),
        };
        let page = format!(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n\
             <body><h1>{title}</h1><p>{}</p></body></html>\n",
            html_escape(&text)
        );
        (
            StatusCode::BAD_GATEWAY,
            [(http::header::CONTENT_TYPE, "text/html; charset=utf-8")],
            page,
        )
            .into_response()
    }
}

/// `text` safe inside HTML.
fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// An answer of E2B's edge proxy (`{sandboxId, message, code, port}`).
pub fn proxy_error(
    status: StatusCode,
    sandbox_id: String,
    message: &str,
    port: Option<u16>,
) -> Response {
    (
        status,
        axum::Json(ProxyError {
            sandbox_id,
            message: message.into(),
            code: status.as_u16(),
            port,
        }),
    )
        .into_response()
}

/// The sandbox id and port an envd request names, if any.
pub fn addressed(headers: &HeaderMap) -> Option<(String, u16)> {
    if let Some(id) = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let port = headers
            .get("e2b-sandbox-port")
            .and_then(|v| v.to_str().ok())
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(ENVD_PORT);
        return Some((id.to_owned(), port));
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok())?;
    let label = host.split('.').next()?;
    // Only `<port>-<id>.<domain>`: a bare IP or `localhost` host names no sandbox.
    if !host.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    (!id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()))
    .then(|| (id.to_owned(), port))
}

/// Resolve the sandbox of an envd request and check its access token.
pub(crate) fn authorize<H: Host>(
    host: &H,
    headers: &HeaderMap,
) -> Result<Target<H::Sandbox>, Reject> {
    let target = locate(host, headers)?;
    let Some(token) = host.expected_token(&target.id) else {
        return Ok(target);
    };
    match auth::access_token_matches(headers, &token) {
        Some(true) => Ok(target),
        _ => Err(Reject::Unauthorized),
    }
}

fn locate<H: Host>(host: &H, headers: &HeaderMap) -> Result<Target<H::Sandbox>, Reject> {
    if let Some(id) = host.only() {
        // A host inside the machine serves one sandbox, whatever the request names.
        return host.find(&id).ok_or(Reject::NotFound(id));
    }
    let (id, port) = addressed(headers).ok_or(Reject::NoSandbox)?;
    let target = host.find(&id).ok_or_else(|| Reject::NotFound(id.clone()))?;
    if port != ENVD_PORT {
        return Err(Reject::PortClosed(id, port));
    }
    Ok(target)
}

/// An admitted Connect call: its options, its sandbox and the envd user it runs as.
pub(crate) type Admitted<S> = (crate::connect::CallOpts, Target<S>, String);

/// What every Connect RPC checks before its method runs: the call options, the sandbox and
/// its envd access token, and the envd user. A refusal is already a response in the
/// method's framing (a streaming method's errors travel in an end-of-stream frame).
pub(crate) fn admit<H: Host>(
    host: &H,
    headers: &HeaderMap,
    streaming: bool,
) -> Result<Admitted<H::Sandbox>, Box<Response>> {
    let refuse = |r: Response| Box::new(r);
    let opts = crate::connect::CallOpts::parse(headers, streaming)
        .map_err(|e| refuse(e.into_response()))?;
    let target = authorize(host, headers).map_err(|e| refuse(e.into_response()))?;
    let user = auth::basic_user(headers)
        .and_then(|u| effective_user(u, &target.state))
        .map_err(|e| {
            let e = crate::connect::RpcError::new(
                tether_protocol::e2b::ConnectCode::Unauthenticated,
                e,
            );
            refuse(if streaming {
                crate::connect::stream_error(&e)
            } else {
                e.into_response()
            })
        })?;
    target.sandbox.touch();
    Ok((opts, target, user))
}

/// The user an envd operation runs as: the one asked for (`user` or `root`), else the
/// `/init` default, else `user`.
pub(crate) fn effective_user(asked: Option<String>, state: &EnvdState) -> Result<String, String> {
    let user = asked
        .or_else(|| state.init().default_user)
        .unwrap_or_else(|| "user".to_owned());
    auth::check_user(&user)?;
    Ok(user)
}

/// A context for work that outlives the request handler (a streamed download): cancelled
/// only by the sandbox's end (or its host's shutdown), bounded by `limit`.
fn detached_ctx<S: HostedSandbox>(ctx: &CallCtx, sandbox: &S, limit: Duration) -> CallCtx {
    CallCtx::with_cancel(ctx.request_id.clone(), sandbox.lifetime().child())
        .with_trace(ctx.trace.clone())
        .with_timeout(limit, Clock::Total)
}

// === /health, /init, /envs ===

async fn health<H: Host>(State(host): State<Arc<H>>, headers: HeaderMap) -> Response {
    let no_store = || {
        (
            StatusCode::NO_CONTENT,
            [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
        )
            .into_response()
    };
    if let Some(id) = host.only() {
        // envd's own health: unauthenticated, 204 while the machine serves.
        return match host.find(&id) {
            Some(_) => no_store(),
            None => Reject::NotFound(id).into_response(),
        };
    }
    match addressed(&headers) {
        // envd's health: 204 while the sandbox lives, to a caller holding its access
        // token. Without it (or with another sandbox's) the answer is exactly the one for
        // a sandbox that does not exist, so an unauthenticated probe learns nothing.
        Some((id, _)) => match authorize(&*host, &headers) {
            Ok(_) => no_store(),
            Err(Reject::NoSandbox) => Reject::NoSandbox.into_response(),
            Err(_) => Reject::NotFound(id).into_response(),
        },
        // The control plane's health.
        None => (StatusCode::OK, "Health check successful").into_response(),
    }
}

async fn init<H: Host>(State(host): State<Arc<H>>, headers: HeaderMap, body: Bytes) -> Response {
    let target = match locate(&*host, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let req: InitRequest = if body.is_empty() {
        InitRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return RestError::bad_request(format!("invalid JSON body: {e}")).into_response();
            }
        }
    };
    if let Err(refused) = host.init(&target, &headers, &req) {
        return *refused;
    }
    apply_init(&target.state, req)
}

/// The `/init` check of a sandbox whose access token is `token` (a host's
/// [`Host::init`]): `/init` authenticates itself, so the token in the body (or the
/// header) must be the sandbox's; a different one is a mismatch, none at all is refused.
pub fn init_token_check(
    token: &str,
    headers: &HeaderMap,
    req: &InitRequest,
) -> Result<(), Box<Response>> {
    let in_body = req
        .access_token
        .as_deref()
        .map(|t| auth::constant_time_eq(t.as_bytes(), token.as_bytes()));
    let in_header = auth::access_token_matches(headers, token);
    if matches!(
        (in_body, in_header),
        (Some(true), None | Some(true)) | (None, Some(true))
    ) {
        Ok(())
    } else {
        Err(Box::new(Reject::Unauthorized.into_response()))
    }
}

/// `/init`'s defaults: the sandbox-wide environment, user and working directory.
fn apply_init(state: &EnvdState, req: InitRequest) -> Response {
    if let Some(u) = &req.default_user
        && let Err(e) = auth::check_user(u)
    {
        return RestError::bad_request(e).into_response();
    }
    if let Ok(mut init) = state.init.write() {
        if let Some(env) = req.env_vars {
            init.env.extend(env);
        }
        if let Some(u) = req.default_user {
            init.default_user = Some(u);
        }
        if let Some(w) = req.default_workdir {
            // Kept as given: envd resolves it per operation, under that user's home.
            init.default_workdir = Some(w);
        }
    }
    (
        StatusCode::NO_CONTENT,
        [("x-envd-version", HeaderValue::from_static(ENVD_VERSION))],
    )
        .into_response()
}

async fn envs<H: Host>(State(host): State<Arc<H>>, headers: HeaderMap) -> Response {
    let target = match authorize(&*host, &headers) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let mut env: BTreeMap<String, String> = target.sandbox.env().clone();
    env.extend(target.state.init().env);
    axum::Json(env).into_response()
}

// === /files ===

/// The query of `/files`.
#[derive(Debug, Clone, Default)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    expiration: Option<i64>,
}

impl FilesQuery {
    fn parse(q: Option<&str>) -> Self {
        Self {
            path: query_param(q, "path"),
            username: query_param(q, "username").filter(|u| !u.is_empty()),
            signature: query_param(q, "signature").filter(|s| !s.is_empty()),
            expiration: query_param(q, "signature_expiration").and_then(|e| e.parse().ok()),
        }
    }
}

/// Resolve and authorize a `/files` request: the access token, or a valid signature for
/// `op`. A signed URL may come without a routing header (it is a plain link): then the
/// signature itself names the sandbox.
fn files_target<H: Host>(
    host: &H,
    headers: &HeaderMap,
    q: &FilesQuery,
    op: &str,
) -> Result<Target<H::Sandbox>, Reject> {
    let located = match addressed(headers) {
        _ if host.only().is_some() => {
            let t = locate(host, headers)?;
            if host.expected_token(&t.id).is_none() {
                return Ok(t);
            }
            Some(t)
        }
        Some(_) => Some(locate(host, headers)?),
        None => None,
    };
    // The signature is checked before its expiration, so a forged URL never learns
    // whether its expiration was the problem.
    let signed = |t: &Target<H::Sandbox>| -> Signed {
        let Some(sig) = &q.signature else {
            return Signed::No;
        };
        let token = host.expected_token(&t.id).unwrap_or_default();
        let want = auth::file_signature(
            q.path.as_deref().unwrap_or(""),
            op,
            q.username.as_deref().unwrap_or(""),
            &token,
            q.expiration,
        );
        if !auth::constant_time_eq(want.as_bytes(), sig.as_bytes()) {
            return Signed::No;
        }
        match q.expiration {
            Some(exp) if exp < crate::util::now_ms() / 1000 => Signed::Expired,
            _ => Signed::Valid,
        }
    };
    let admit = |t: Target<H::Sandbox>, how: Signed| match how {
        Signed::Valid => Ok(t),
        Signed::Expired => Err(Reject::SignatureExpired),
        Signed::No => Err(Reject::Unauthorized),
    };
    match located {
        Some(t) => match auth::access_token_matches(
            headers,
            &host.expected_token(&t.id).unwrap_or_default(),
        ) {
            Some(true) => Ok(t),
            Some(false) => Err(Reject::Unauthorized),
            None => {
                let how = signed(&t);
                admit(t, how)
            }
        },
        None => {
            if q.signature.is_none() {
                return Err(Reject::NoSandbox);
            }
            host.all()
                .into_iter()
                .find_map(|t| match signed(&t) {
                    Signed::No => None,
                    how => Some(admit(t, how)),
                })
                .unwrap_or(Err(Reject::Unauthorized))
        }
    }
}

/// What a `/files` URL's signature says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signed {
    /// None, or not this sandbox's.
    No,
    /// This sandbox's, expired.
    Expired,
    /// This sandbox's, in force.
    Valid,
}

async fn download<H: Host>(
    State(host): State<Arc<H>>,
    RequestCtx(ctx): RequestCtx,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    let q = FilesQuery::parse(raw.as_deref());
    let target = match files_target(&*host, &headers, &q, "read") {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let span = tracing::info_span!("e2b.files.read", session.id = %target.id, sandbox.id = %target.id, outcome = tracing::field::Empty);
    crate::traced(span, serve_download(&*host, &ctx, &target, &q, &headers)).await
}

async fn serve_download<H: Host>(
    host: &H,
    ctx: &CallCtx,
    target: &Target<H::Sandbox>,
    q: &FilesQuery,
    headers: &HeaderMap,
) -> Response {
    let user = match effective_user(q.username.clone(), &target.state) {
        Ok(u) => u,
        Err(e) => return RestError::unauthorized(e).into_response(),
    };
    let shown = q.path.clone().unwrap_or_default();
    let path = resolve_path(&shown, &user);
    let sandbox = match target.sandbox.sandbox() {
        Ok(s) => s,
        Err(_) => return Reject::NotFound(target.id.clone()).into_response(),
    };
    let limit = host.limits().fs_op;
    let user_fs = match crate::UserFs::of(sandbox, &user) {
        Ok(f) => f,
        Err(e) => return RestError::from_envd(&e.into()).into_response(),
    };
    let fs = user_fs.get();
    let stat = crate::fs_op(target, ctx, FsOp::Stat, &path, |c, p| async move {
        fs.stat(&c, p).await
    })
    .await;
    let stat = match stat {
        Ok(s) => s,
        Err(e) if e.code() == ErrorCode::FsNotFound => {
            return RestError::new(
                StatusCode::NOT_FOUND,
                format!("path '{shown}' does not exist"),
            )
            .into_response();
        }
        Err(e) => return RestError::from_envd(&e.into()).into_response(),
    };
    if stat.kind == FileKind::Dir {
        return RestError::bad_request(format!("path '{shown}' is a directory")).into_response();
    }
    let size = stat.size;
    let range = match headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(|r| parse_range(r, size))
    {
        None | Some(RangeAsk::Ignore) => None,
        Some(RangeAsk::Range(r)) => Some(r),
        Some(RangeAsk::Unsatisfiable) => {
            return (
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(header::CONTENT_RANGE, format!("bytes */{size}"))],
            )
                .into_response();
        }
    };
    let gzip_asked = range.is_none() && accepts_gzip(headers);
    // The body outlives this handler: read under a context of its own.
    let rctx = detached_ctx(ctx, &*target.sandbox, limit);
    let want = range.map_or(ByteRange::default(), |(a, b)| ByteRange {
        offset: a,
        length: Some(b - a + 1),
    });
    let opened = crate::fs_op(target, &rctx, FsOp::Read, &path, |c, p| async move {
        fs.read(&c, p, want).await
    })
    .await;
    let stream = match opened {
        Ok(s) => s,
        Err(e) => return RestError::from_envd(&e.into()).into_response(),
    };
    // gzip only where it pays: the first bytes decide (see `worth_gzip`).
    let (stream, gzip) = if gzip_asked {
        match sniff(stream).await {
            Ok((s, worth)) => (s, worth),
            Err(e) => return RestError::from_envd(&e.into()).into_response(),
        }
    } else {
        (stream, false)
    };
    let base = path.rsplit('/').next().unwrap_or("file").replace('"', "");
    let mut resp = if gzip {
        Response::new(Body::from_stream(gzip_stream(stream, rctx)))
    } else {
        let keep = rctx;
        Response::new(Body::from_stream(stream.map(move |r| {
            let _ = &keep;
            r.map_err(std::io::Error::other)
        })))
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if let Ok(v) = HeaderValue::from_str(&format!("inline; filename=\"{base}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    } else {
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    }
    if let Some((a, b)) = range {
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        if let Ok(v) = HeaderValue::from_str(&format!("bytes {a}-{b}/{size}")) {
            resp.headers_mut().insert(header::CONTENT_RANGE, v);
        }
    }
    resp
}

/// What a `Range` header asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RangeAsk {
    /// Nothing servable as one range (multiple ranges, another unit): serve it whole.
    Ignore,
    /// Bytes `a..=b`.
    Range((u64, u64)),
    /// Outside the file.
    Unsatisfiable,
}

fn parse_range(h: &str, size: u64) -> RangeAsk {
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return RangeAsk::Ignore;
    };
    if spec.contains(',') {
        return RangeAsk::Ignore;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeAsk::Ignore;
    };
    let (a, b) = (a.trim(), b.trim());
    let r = match (a.parse::<u64>().ok(), b.parse::<u64>().ok()) {
        (Some(a), Some(b)) if a <= b => (a, b.min(size.saturating_sub(1))),
        (Some(a), None) if b.is_empty() => (a, size.saturating_sub(1)),
        (None, Some(n)) if a.is_empty() && n > 0 => {
            (size.saturating_sub(n), size.saturating_sub(1))
        }
        _ => return RangeAsk::Ignore,
    };
    if size == 0 || r.0 >= size {
        RangeAsk::Unsatisfiable
    } else {
        RangeAsk::Range(r)
    }
}

/// Whether `Accept-Encoding` admits gzip (as envd: any listing of gzip with q > 0).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';');
            let coding = parts.next().unwrap_or("").trim();
            let q = parts
                .find_map(|p| {
                    p.trim()
                        .strip_prefix("q=")
                        .and_then(|q| q.trim().parse::<f32>().ok())
                })
                .unwrap_or(1.0);
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && q > 0.0
        })
}

/// How much of a download is looked at before deciding whether to gzip it.
const SNIFF_BYTES: usize = 64 * 1024;
/// A download shorter than this is served as it is (gzip's header and trailer, and the
/// encoder's set-up, cost more than they save).
const GZIP_MIN_BYTES: usize = 1024;
/// gzip is used when the sample shrinks to at most this fraction (in percent).
const GZIP_MAX_RATIO_PCT: usize = 90;

/// Whether a download whose first bytes are `sample` is worth gzip-encoding: the sample is
/// compressed at the level the stream would use, and must shrink by at least a tenth.
///
/// Content sniffing rather than a lower level or a size rule: level 1 is already the
/// encoder's fastest and still spends ~1.5 s of CPU per 256 MiB of random bytes for no
/// gain, and size says nothing about compressibility. Already-compressed or random data
/// (archives, images, model weights) fails the sample at once; text and most binaries pass
/// it. Compressing 64 KiB once costs well under a millisecond.
fn worth_gzip(sample: &[u8]) -> bool {
    if sample.len() < GZIP_MIN_BYTES {
        return false;
    }
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(sample.len()),
        flate2::Compression::fast(),
    );
    match enc.write_all(sample).and_then(|()| enc.finish()) {
        Ok(out) => out.len() * 100 <= sample.len() * GZIP_MAX_RATIO_PCT,
        Err(_) => false,
    }
}

/// Read the first [`SNIFF_BYTES`] of a download and decide on gzip; the stream handed back
/// still yields every byte.
async fn sniff(mut input: ByteStream) -> tether_provider::Result<(ByteStream, bool)> {
    let mut head: Vec<Bytes> = Vec::new();
    let mut seen = 0usize;
    let mut ended = false;
    while seen < SNIFF_BYTES {
        match input.next().await {
            Some(Ok(chunk)) => {
                seen += chunk.len();
                head.push(chunk);
            }
            Some(Err(e)) => return Err(e),
            None => {
                ended = true;
                break;
            }
        }
    }
    let sample: Vec<u8> = head
        .iter()
        .flat_map(|c| c.iter().copied())
        .take(SNIFF_BYTES)
        .collect();
    let worth = worth_gzip(&sample);
    let replay = futures_util::stream::iter(head.into_iter().map(Ok));
    let stream: ByteStream = if ended {
        replay.boxed()
    } else {
        replay.chain(input).boxed()
    };
    Ok((stream, worth))
}

/// gzip-encode a byte stream chunk by chunk (bounded memory).
fn gzip_stream(
    input: ByteStream,
    keep: CallCtx,
) -> BoxStream<'static, Result<Bytes, std::io::Error>> {
    struct St {
        input: ByteStream,
        enc: Option<flate2::write::GzEncoder<Vec<u8>>>,
        _ctx: CallCtx,
    }
    let st = St {
        input,
        enc: Some(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        )),
        _ctx: keep,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            let enc = st.enc.as_mut()?;
            match st.input.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = enc.write_all(&chunk) {
                        st.enc = None;
                        return Some((Err(e), st));
                    }
                    let out = std::mem::take(enc.get_mut());
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), st));
                    }
                }
                Some(Err(e)) => {
                    st.enc = None;
                    return Some((Err(std::io::Error::other(e)), st));
                }
                None => {
                    let enc = st.enc.take()?;
                    return Some((enc.finish().map(Bytes::from), st));
                }
            }
        }
    })
    .boxed()
}

/// gunzip a byte stream chunk by chunk (bounded memory).
fn gunzip_stream(
    input: BoxStream<'static, Result<Bytes, String>>,
) -> BoxStream<'static, Result<Bytes, String>> {
    struct St {
        input: BoxStream<'static, Result<Bytes, String>>,
        dec: Option<flate2::write::GzDecoder<Vec<u8>>>,
    }
    let st = St {
        input,
        dec: Some(flate2::write::GzDecoder::new(Vec::new())),
    };
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            let dec = st.dec.as_mut()?;
            match st.input.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = dec.write_all(&chunk) {
                        st.dec = None;
                        return Some((Err(format!("invalid gzip body: {e}")), st));
                    }
                    let out = std::mem::take(dec.get_mut());
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), st));
                    }
                }
                Some(Err(e)) => {
                    st.dec = None;
                    return Some((Err(e), st));
                }
                None => {
                    let dec = st.dec.take()?;
                    return match dec.finish() {
                        Ok(rest) if rest.is_empty() => None,
                        Ok(rest) => Some((Ok(Bytes::from(rest)), st)),
                        Err(e) => Some((Err(format!("invalid gzip body: {e}")), st)),
                    };
                }
            }
        }
    })
    .boxed()
}

async fn upload<H: Host>(
    State(host): State<Arc<H>>,
    RequestCtx(ctx): RequestCtx,
    RawQuery(raw): RawQuery,
    req: Request,
) -> Response {
    let q = FilesQuery::parse(raw.as_deref());
    let headers = req.headers().clone();
    let target = match files_target(&*host, &headers, &q, "write") {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let span = tracing::info_span!("e2b.files.write", session.id = %target.id, sandbox.id = %target.id, outcome = tracing::field::Empty);
    crate::traced(
        span,
        serve_upload(&*host, &ctx, &target, &q, &headers, req.into_body()),
    )
    .await
}

async fn serve_upload<H: Host>(
    host: &H,
    ctx: &CallCtx,
    target: &Target<H::Sandbox>,
    q: &FilesQuery,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let user = match effective_user(q.username.clone(), &target.state) {
        Ok(u) => u,
        Err(e) => return RestError::unauthorized(e).into_response(),
    };
    let metadata = match metadata_of(headers) {
        Ok(m) => m,
        Err(e) => return RestError::bad_request(e).into_response(),
    };
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let max = host.limits().max_file_bytes;
    let body: BoxStream<'static, Result<Bytes, String>> = body
        .into_data_stream()
        .map(|r| r.map_err(|e| e.to_string()))
        .boxed();
    let mut written = Vec::new();
    if let Some(boundary) = boundary_of(&ct) {
        let mut mp = Multipart::new(body, &boundary);
        let mut seen = std::collections::HashSet::new();
        let parts_done: Result<(), Response> = async {
            loop {
                let part = match mp.next_part().await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(e) => return Err(RestError::bad_request(e.to_string()).into_response()),
                };
                if part.name.as_deref() != Some("file") {
                    continue;
                }
                let Some(shown) = q
                    .path
                    .clone()
                    .or(part.filename.clone())
                    .filter(|p| !p.is_empty())
                else {
                    return Err(RestError::bad_request(
                        "a file part has no filename and the request no path",
                    )
                    .into_response());
                };
                let path = resolve_path(&shown, &user);
                if !seen.insert(path.clone()) {
                    return Err(RestError::bad_request(format!(
                        "cannot upload the same path twice: '{shown}'"
                    ))
                    .into_response());
                }
                let (tx, rx) =
                    tokio::sync::mpsc::channel::<Result<Bytes, ProviderError>>(UPLOAD_QUEUE);
                let parts = &mut mp;
                let p2 = path.clone();
                // Feeds the part's bytes to the write; the sender drops (end of data) with it.
                let feed = async move {
                    let mut total = 0u64;
                    loop {
                        let item = match parts.next_chunk().await {
                            Ok(Some(c)) => {
                                total += c.len() as u64;
                                if total > max {
                                    Err(ProviderError::fs(
                                        ErrorCode::FsTooLarge,
                                        &p2,
                                        format!("file is larger than {max} bytes"),
                                    ))
                                } else {
                                    Ok(c)
                                }
                            }
                            Ok(None) => return,
                            Err(e) => Err(ProviderError::InvalidRequest {
                                message: e.to_string(),
                            }),
                        };
                        let failed = item.is_err();
                        if tx.send(item).await.is_err() || failed {
                            return;
                        }
                    }
                };
                let data: ByteStream = tokio_stream::wrappers::ReceiverStream::new(rx).boxed();
                let (res, ()) = tokio::join!(write_one(ctx, target, &user, &path, data), feed);
                match res {
                    Ok(()) => written.push(entry(&path, metadata.clone())),
                    Err(e) => return Err(RestError::from_envd(&e).into_response()),
                }
            }
            Ok(())
        }
        .await;
        if let Err(refused) = parts_done {
            // Refused part-way: read what the client is still sending (bounded) before
            // answering, as Go's server does, so it gets the answer and not a reset.
            let limit = host.limits().fs_op;
            let drained = tokio::time::timeout(limit, mp.drain(DRAIN_AFTER_REFUSAL))
                .await
                .unwrap_or(false);
            let mut refused = refused;
            if !drained {
                refused
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return refused;
        }
        if written.is_empty() {
            return RestError::bad_request("the multipart body holds no part named \"file\"")
                .into_response();
        }
    } else if ct.is_empty()
        || ct
            .split(';')
            .next()
            .is_some_and(|b| b.trim().eq_ignore_ascii_case("application/octet-stream"))
    {
        let Some(shown) = q.path.clone().filter(|p| !p.is_empty()) else {
            return RestError::bad_request(
                "the path query parameter is required for an octet-stream upload",
            )
            .into_response();
        };
        let path = resolve_path(&shown, &user);
        let gz = headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_ascii_lowercase());
        let body = match gz.as_deref() {
            None | Some("" | "identity") => body,
            Some("gzip" | "x-gzip") => gunzip_stream(body),
            Some(other) => {
                return RestError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!("unsupported Content-Encoding {other:?}"),
                )
                .into_response();
            }
        };
        let p2 = path.clone();
        let mut total = 0u64;
        let data: ByteStream = body
            .map(move |r| match r {
                Ok(c) => {
                    total += c.len() as u64;
                    if total > max {
                        Err(ProviderError::fs(
                            ErrorCode::FsTooLarge,
                            &p2,
                            format!("file is larger than {max} bytes"),
                        ))
                    } else {
                        Ok(c)
                    }
                }
                Err(e) => Err(ProviderError::InvalidRequest { message: e }),
            })
            .boxed();
        if let Err(e) = write_one(ctx, target, &user, &path, data).await {
            return RestError::from_envd(&e).into_response();
        }
        written.push(entry(&path, metadata.clone()));
    } else {
        return RestError::bad_request(format!(
            "unsupported Content-Type {ct:?}: use multipart/form-data or application/octet-stream"
        ))
        .into_response();
    }
    if let Err(e) = store_metadata(ctx, target, &user, &written, metadata.as_ref()).await {
        return RestError::from_envd(&e).into_response();
    }
    (StatusCode::OK, axum::Json(written)).into_response()
}

/// Keep the metadata of uploaded files as envd does, as `user.e2b.*` extended attributes
/// replacing those of an earlier upload (none given clears them); the front's own copy
/// where the provider has no extended attributes.
async fn store_metadata<S: HostedSandbox>(
    ctx: &CallCtx,
    target: &Target<S>,
    user: &str,
    written: &[WrittenEntry],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<(), Failure> {
    let sandbox = target.sandbox.sandbox()?;
    let user_fs = crate::UserFs::of(sandbox, user)?;
    let mctx = ctx.with_timeout(target.state.fs_op, Clock::Total);
    let values: BTreeMap<String, Vec<u8>> = metadata
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    for w in written {
        let r = user_fs
            .get()
            .set_xattrs(
                &mctx,
                &w.path,
                crate::filesystem::META_XATTR_PREFIX,
                values.clone(),
            )
            .await;
        match r {
            Ok(()) => target.state.set_meta(&w.path, None),
            Err(ProviderError::Unsupported { .. }) => {
                target.state.set_meta(&w.path, metadata.cloned());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn entry(path: &str, metadata: Option<BTreeMap<String, String>>) -> WrittenEntry {
    WrittenEntry {
        path: path.to_owned(),
        name: path.rsplit('/').next().unwrap_or(path).to_owned(),
        kind: "file".into(),
        metadata,
    }
}

/// Write one file through the seam, logged; the watches report it as envd does.
async fn write_one<S: HostedSandbox>(
    ctx: &CallCtx,
    target: &Target<S>,
    user: &str,
    path: &str,
    data: ByteStream,
) -> Result<(), Failure> {
    let sandbox = target.sandbox.sandbox()?;
    let user_fs = crate::UserFs::of(sandbox.clone(), user)?;
    target.sandbox.touch();
    target.state.upload_started(path);
    let (sb, state, fs) = (&sandbox, &target.state, user_fs.get());
    let r = target
        .sandbox
        .fs(
            ctx,
            FsOp::Write,
            path,
            target.state.fs_op,
            |o: &WriteOutcome| Some(o.size),
            |c| async move {
                let o = fs.write(&c, path, data, WriteGuard::None).await?;
                crate::filesystem::announce_upload(&c, sb, state, path, o.created).await;
                Ok(o)
            },
        )
        .await;
    target.state.upload_ended(path);
    r.map(|_| ()).map_err(Failure::from)
}

/// `X-Metadata-<key>: <value>` headers: keys lowercased; printable ASCII only; 4 KiB in all.
fn metadata_of(headers: &HeaderMap) -> Result<Option<BTreeMap<String, String>>, String> {
    let mut out = BTreeMap::new();
    let mut total = 0usize;
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        let value = value
            .to_str()
            .map_err(|_| format!("metadata {key:?}: the value is not printable ASCII"))?;
        let printable = |s: &str| s.bytes().all(|b| (0x20..0x7f).contains(&b));
        if key.is_empty() || key.len() > 246 || !printable(key) || !printable(value) {
            return Err(format!("invalid metadata key or value for {key:?}"));
        }
        total += key.len() + value.len();
        out.insert(key.to_owned(), value.to_owned());
    }
    if total > 4096 {
        return Err("metadata is larger than 4096 bytes".into());
    }
    Ok((!out.is_empty()).then_some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_encodings() {
        assert_eq!(parse_range("bytes=0-4", 10), RangeAsk::Range((0, 4)));
        assert_eq!(parse_range("bytes=5-", 10), RangeAsk::Range((5, 9)));
        assert_eq!(parse_range("bytes=-3", 10), RangeAsk::Range((7, 9)));
        assert_eq!(parse_range("bytes=20-30", 10), RangeAsk::Unsatisfiable);
        assert_eq!(parse_range("bytes=0-1,3-4", 10), RangeAsk::Ignore);
        let mut h = HeaderMap::new();
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("gzip, deflate"),
        );
        assert!(accepts_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert!(!accepts_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("gzip;q=0"),
        );
        assert!(!accepts_gzip(&h));
    }

    #[test]
    fn routing_by_header_and_by_host() {
        let mut h = HeaderMap::new();
        h.insert(
            header::HOST,
            HeaderValue::from_static("49983-iabc123.localhost:7420"),
        );
        assert_eq!(addressed(&h), Some(("iabc123".into(), 49983)));
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:7420"));
        assert_eq!(addressed(&h), None);
        h.insert("e2b-sandbox-id", HeaderValue::from_static("iabc"));
        h.insert("e2b-sandbox-port", HeaderValue::from_static("8080"));
        assert_eq!(addressed(&h), Some(("iabc".into(), 8080)));
    }

    #[tokio::test]
    async fn gzip_is_chosen_by_what_the_bytes_are() {
        let text: Vec<u8> = (0..10_000u32)
            .flat_map(|i| format!("line {i} of a log\n").into_bytes())
            .collect();
        assert!(worth_gzip(&text[..SNIFF_BYTES]));
        // Pseudo-random bytes (xorshift) do not shrink.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..SNIFF_BYTES)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(!worth_gzip(&random));
        assert!(!worth_gzip(b"tiny"));
        // Sniffing hands every byte back, in order, whatever the chunking.
        for data in [text.clone(), random.clone(), b"short".to_vec()] {
            let chunks: Vec<tether_provider::Result<Bytes>> = data
                .chunks(7_000)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            let (s, _) = sniff(futures_util::stream::iter(chunks).boxed())
                .await
                .unwrap();
            let back: Vec<Bytes> = s.map(|r| r.unwrap()).collect().await;
            assert_eq!(back.concat(), data);
        }
    }

    #[tokio::test]
    async fn gzip_round_trips_in_chunks() {
        let data: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let chunks: Vec<tether_provider::Result<Bytes>> = data
            .chunks(10_000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let gz: Vec<Bytes> = gzip_stream(
            futures_util::stream::iter(chunks).boxed(),
            CallCtx::new("t"),
        )
        .map(|r| r.unwrap())
        .collect()
        .await;
        assert!(gz.len() > 1, "the encoder streams");
        let back: Vec<Bytes> =
            gunzip_stream(futures_util::stream::iter(gz.into_iter().map(Ok)).boxed())
                .map(|r| r.unwrap())
                .collect()
                .await;
        assert_eq!(back.concat(), data);
        let bad: Vec<Result<Bytes, String>> = gunzip_stream(
            futures_util::stream::iter(vec![Ok(Bytes::from_static(b"not gzip at all"))]).boxed(),
        )
        .collect()
        .await;
        assert!(bad.iter().any(Result::is_err));
    }
}
