//! The raw transport: the envd client (its REST endpoints and its Connect services) over
//! the Connect codec of [`tether_protocol::connect`], which tetherd's E2B front shares,
//! and the bounded, retried HTTP calls a provider's own REST client (E2B's control plane)
//! makes the same way.
//!
//! One `reqwest::Client` may be shared by everything a provider does. Every call is bounded
//! by tether's clocks, each reported with its own code: the connect / first-byte phase
//! (`CONNECT_TIMEOUT`), silence on a stream with keepalives counted as life
//! (`TRANSPORT_IDLE_TIMEOUT`), and the total of a request/response call plus the caller's
//! deadline (`DEADLINE_EXCEEDED`). Idempotent calls are retried with `backon` within the
//! remaining deadline, honouring `Retry-After`.

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_protocol::ErrorCode;
use tether_protocol::connect::{self as codec, Decoder, Frame};
use tether_protocol::e2b::InitRequest;
use tether_provider::clock::{CancelReason, CancelToken, IdleWatchdog};
use tether_provider::{CallCtx, ProviderError, Result};

use crate::config::{EnvdClientConfig, RetryConfig};
use crate::error::{Op, WireError, from_connect, from_reqwest, from_status, malformed};
use tether_provider::Clock;

/// Largest envelope accepted (a longer length prefix means a corrupted stream).
pub const MAX_ENVELOPE_BYTES: usize = 64 * 1024 * 1024;

// === timing ===

/// Run the connect / first-byte phase of a call: bounded by the connect limit (and by
/// `ctx`), reported as `CONNECT_TIMEOUT` when that limit is what fired.
pub(crate) async fn within_connect<T>(
    ctx: &CallCtx,
    limit: Duration,
    f: impl Future<Output = Result<T>>,
) -> Result<T> {
    let cctx = ctx.with_timeout(limit, Clock::Connect);
    cctx.run(f).await
}

/// Retry an idempotent call: exponential backoff with jitter, `Retry-After` honoured (up
/// to the largest delay), only retryable errors, never past `ctx`'s deadline.
pub async fn retry<T, F, Fut>(
    ctx: &CallCtx,
    policy: RetryConfig,
    what: &'static str,
    f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    retry_when(ctx, policy, what, false, f).await
}

/// [`retry`] for a call sent again to wait for a slow answer (a create under its
/// idempotency key, which the backend answers with the sandbox the first attempt is
/// making): an attempt whose answer did not start within the connect limit
/// (`CONNECT_TIMEOUT`) is tried again however often that happens, until `ctx`'s deadline,
/// which must be set; other failures count against the policy as usual.
pub async fn retry_unanswered<T, F, Fut>(
    ctx: &CallCtx,
    policy: RetryConfig,
    what: &'static str,
    f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    retry_when(ctx, policy, what, ctx.remaining().is_some(), f).await
}

async fn retry_when<T, F, Fut>(
    ctx: &CallCtx,
    policy: RetryConfig,
    what: &'static str,
    unanswered_free: bool,
    f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(policy.min_delay_ms))
        .with_max_delay(Duration::from_millis(policy.max_delay_ms))
        .with_jitter();
    let backoff = if unanswered_free {
        // The deadline bounds the attempts; `when` counts the other failures.
        backoff.without_max_times()
    } else {
        backoff.with_max_times(policy.max_times)
    };
    let max = Duration::from_millis(policy.max_delay_ms);
    let cancel = ctx.cancel.clone();
    let remaining = || ctx.remaining();
    let mut counted = 0usize;
    f.retry(backoff)
        .sleep(tokio::time::sleep)
        .when(|e: &ProviderError| {
            if !e.retryable() || cancel.is_cancelled() {
                return false;
            }
            if !unanswered_free || e.code() == ErrorCode::ConnectTimeout {
                return true;
            }
            counted += 1;
            counted <= policy.max_times
        })
        .adjust(|e, dur| {
            // The policy's budget bounds the retries (`dur` is `None` once it is spent);
            // `Retry-After` only says how long to wait before the next one.
            let d = dur?;
            let d = e.retry_after().map_or(d, |a| a.min(max));
            match remaining() {
                Some(left) if left <= d => None,
                _ => Some(d),
            }
        })
        .notify(|e, d| tracing::debug!(op = what, error = %e, delay_ms = d.as_millis() as u64, "Retrying an E2B call"))
        .await
}

// === impl Http ===

/// The shared HTTP client and the limits every call observes.
#[derive(Debug, Clone)]
pub struct Http {
    /// The HTTP client.
    pub client: reqwest::Client,
    /// Limit of the connect / first-byte phase.
    pub connect: Duration,
    /// Total limit of a request/response call.
    pub request: Duration,
    /// Limit of transport silence, ms.
    pub transport_idle_ms: f64,
    /// Retry policy of idempotent calls.
    pub retry: RetryConfig,
}

impl Http {
    /// The limits of `cfg` over `client`.
    pub fn new(cfg: &EnvdClientConfig, client: reqwest::Client) -> Self {
        Self {
            client,
            connect: cfg.connect_timeout(),
            request: cfg.request_timeout(),
            transport_idle_ms: cfg.transport_idle_ms as f64,
            retry: cfg.retry,
        }
    }

    /// Send a request; the connect / first-byte phase is bounded.
    pub async fn send(
        &self,
        ctx: &CallCtx,
        req: reqwest::RequestBuilder,
        op: Op<'_>,
    ) -> Result<reqwest::Response> {
        within_connect(ctx, self.connect, async {
            req.send().await.map_err(|e| from_reqwest(e, op))
        })
        .await
    }

    /// A whole request/response call bounded by the total limit: the answer's status and
    /// body, whatever the status.
    pub async fn call(
        &self,
        ctx: &CallCtx,
        req: reqwest::RequestBuilder,
        op: Op<'_>,
    ) -> Result<(StatusCode, HeaderMap, Bytes)> {
        let tctx = ctx.with_timeout(self.request, Clock::Total);
        let resp = self.send(&tctx, req, op).await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = tctx
            .run(async { resp.bytes().await.map_err(|e| from_reqwest(e, op)) })
            .await?;
        Ok((status, headers, body))
    }

    /// A watchdog of transport silence under `parent`.
    pub(crate) fn transport_watchdog(&self, parent: &CancelToken) -> Result<IdleWatchdog> {
        IdleWatchdog::new(Some(parent), self.transport_idle_ms, Clock::TransportIdle).map_err(|e| {
            ProviderError::Internal {
                message: "cannot arm the transport watchdog".into(),
                source: Some(Box::new(e)),
            }
        })
    }
}

/// Decode a JSON body, empty meaning `{}`.
pub fn decode<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T> {
    codec::decode_json(body).map_err(|e| ProviderError::Backend {
        message: format!("malformed answer to {what}"),
        source: Some(Box::new(WireError::Json(e))),
    })
}

// === impl ByteBody ===

/// A streaming HTTP body with a deadline on each chunk: the transport watchdog fires when
/// nothing arrives for the transport idle limit.
pub(crate) struct ByteBody {
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    watchdog: IdleWatchdog,
    op: String,
    done: bool,
}

impl std::fmt::Debug for ByteBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBody")
            .field("op", &self.op)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ByteBody {
    pub(crate) fn new(
        resp: reqwest::Response,
        watchdog: IdleWatchdog,
        op: impl Into<String>,
    ) -> Self {
        Self {
            body: resp.bytes_stream().boxed(),
            watchdog,
            op: op.into(),
            done: false,
        }
    }

    /// The next chunk; `Ok(None)` at the end of the body.
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>> {
        if self.done {
            return Ok(None);
        }
        let token = self.watchdog.token().clone();
        // A chunk that is already there involved no silence: take it without arming the
        // watchdog (a timer per chunk is a measurable share of a fast transfer).
        if !token.is_cancelled()
            && let Some(ready) = futures_util::FutureExt::now_or_never(self.body.next())
        {
            return self.take(ready);
        }
        let next = self
            .watchdog
            .next(async {
                tokio::select! {
                    biased;
                    _ = token.cancelled() => None,
                    c = self.body.next() => Some(c),
                }
            })
            .await
            .map_err(|e| ProviderError::Internal {
                message: "transport watchdog misuse".into(),
                source: Some(Box::new(e)),
            })?;
        match next {
            None => {
                self.done = true;
                Err(ProviderError::from_reason(
                    token.reason().unwrap_or(CancelReason::Caller("stream")),
                ))
            }
            Some(item) => self.take(item),
        }
    }

    fn take(&mut self, item: Option<reqwest::Result<Bytes>>) -> Result<Option<Bytes>> {
        match item {
            None => {
                self.done = true;
                Ok(None)
            }
            Some(Ok(b)) => Ok(Some(b)),
            Some(Err(e)) => {
                self.done = true;
                Err(from_reqwest(e, Op::Api("stream")))
            }
        }
    }
}

// === impl ConnectStream ===

/// A Connect server stream of `T` messages.
pub(crate) struct ConnectStream {
    body: ByteBody,
    reader: Decoder,
    op: &'static str,
    id: String,
    fs: bool,
    ended: bool,
}

impl std::fmt::Debug for ConnectStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectStream")
            .field("op", &self.op)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

/// How a stream ended.
#[derive(Debug)]
pub(crate) enum StreamItem<T> {
    /// A message.
    Message(T),
    /// The end frame said the call succeeded.
    End,
}

impl ConnectStream {
    /// The next message, the clean end, or the failure (an error end frame, a body that
    /// stops without its end frame, transport silence).
    pub(crate) async fn next<T: DeserializeOwned>(&mut self) -> Result<StreamItem<T>> {
        loop {
            if self.ended {
                return Ok(StreamItem::End);
            }
            match self.reader.next_frame() {
                Ok(Some(Frame::Message(m))) => {
                    return serde_json::from_slice(&m)
                        .map(StreamItem::Message)
                        .map_err(|e| ProviderError::Backend {
                            message: format!("malformed {} message", self.op),
                            source: Some(Box::new(WireError::Json(e))),
                        });
                }
                Ok(Some(Frame::End(end))) => {
                    self.ended = true;
                    return match end.error {
                        None => Ok(StreamItem::End),
                        Some(e) => {
                            let op = if self.fs {
                                Op::Fs {
                                    op: self.op,
                                    path: &self.id,
                                }
                            } else {
                                Op::Process {
                                    op: self.op,
                                    id: &self.id,
                                }
                            };
                            Err(from_connect(op, e.code, &e.message))
                        }
                    };
                }
                Ok(None) => {}
                Err(what) => return Err(malformed(what.to_string())),
            }
            match self.body.next().await? {
                Some(chunk) => self.reader.push(&chunk),
                None => {
                    return Err(crate::error::unavailable(
                        format!("the {} stream ended without its end frame", self.op),
                        None,
                        None,
                    ));
                }
            }
        }
    }
}

// === impl Envd ===

/// The envd client of one sandbox.
#[derive(Debug, Clone)]
pub(crate) struct Envd {
    pub(crate) http: Http,
    base: Url,
    headers: HeaderMap,
    /// `Keepalive-Ping-Interval` asked of streams, seconds.
    keepalive_s: u32,
    /// The envd version the backend reported.
    pub(crate) version: EnvdVersion,
}

/// A `major.minor.patch` version, for feature gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct EnvdVersion(pub u32, pub u32, pub u32);

impl EnvdVersion {
    /// Parse `0.6.13` (leading `v`, pre-release and build suffixes ignored); unparsable
    /// parts read as 0.
    pub fn parse(s: &str) -> Option<Self> {
        let core = s.trim().trim_start_matches('v').split(['-', '+']).next()?;
        let mut it = core.split('.').map(|p| p.parse::<u32>().ok());
        let major = it.next().flatten()?;
        Some(Self(
            major,
            it.next().flatten().unwrap_or(0),
            it.next().flatten().unwrap_or(0),
        ))
    }

    /// `CloseStdin` exists (envd 0.5.2).
    pub fn close_stdin(self) -> bool {
        self >= Self(0, 5, 2)
    }

    /// Raw `application/octet-stream` uploads (envd 0.5.7); before, multipart only.
    pub fn octet_stream_upload(self) -> bool {
        self >= Self(0, 5, 7)
    }

    /// A default user exists (envd 0.4.0); before, every call names one.
    pub fn default_user(self) -> bool {
        self >= Self(0, 4, 0)
    }

    /// File metadata (`X-Metadata-*`, envd 0.6.2).
    pub fn file_metadata(self) -> bool {
        self >= Self(0, 6, 2)
    }
}

/// A user in envd's `Authorization: Basic` form.
pub(crate) fn basic_user(user: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
    )
}

/// Where one sandbox's envd is and how to address it.
#[derive(Debug, Clone)]
pub struct EnvdEndpoint {
    /// envd's base URL (a base path is kept: `http://10.0.2.2:49983`,
    /// `https://49983-<id>.<domain>`).
    pub base_url: Url,
    /// envd's access token, sent as `X-Access-Token` on every call, if it has one.
    pub access_token: Option<String>,
    /// Headers added to every call (E2B's edge routes by `E2b-Sandbox-Id`,
    /// `E2b-Sandbox-Port`).
    pub headers: HeaderMap,
    /// The envd version of the sandbox, for feature gates.
    pub version: EnvdVersion,
}

impl Envd {
    pub(crate) fn new(http: Http, endpoint: EnvdEndpoint, keepalive_s: u32) -> Result<Self> {
        let EnvdEndpoint {
            base_url,
            access_token,
            mut headers,
            version,
        } = endpoint;
        if let Some(t) = access_token {
            let mut v = HeaderValue::from_str(&t)
                .map_err(|_| malformed("an envd access token that is not a header value"))?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static("x-access-token"), v);
        }
        Ok(Self {
            http,
            base: base_url,
            headers,
            keepalive_s,
            version,
        })
    }

    fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.request_url(method, join(&self.base, path))
    }

    fn request_url(&self, method: Method, url: Url) -> reqwest::RequestBuilder {
        self.http
            .client
            .request(method, url)
            .headers(self.headers.clone())
    }

    /// The `/files` URL of `path`.
    fn files_url(&self, path: &str, user: Option<&str>) -> Url {
        let mut url = join(&self.base, "/files");
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("path", path);
            if let Some(u) = self.effective_user(user) {
                q.append_pair("username", &u);
            }
        }
        url
    }

    fn rpc_request(
        &self,
        method: &str,
        user: Option<&str>,
        content_type: &'static str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .request(Method::POST, &format!("/{method}"))
            .header(codec::PROTOCOL_VERSION_HEADER, "1")
            .header(reqwest::header::CONTENT_TYPE, content_type);
        if let Some(u) = self.effective_user(user) {
            req = req.header(reqwest::header::AUTHORIZATION, basic_user(&u));
        }
        req
    }

    /// The user to name on a call: the one asked for, else (on envd without a default
    /// user) `user`.
    pub(crate) fn effective_user(&self, user: Option<&str>) -> Option<String> {
        match user {
            Some(u) if !u.is_empty() => Some(u.to_owned()),
            _ if !self.version.default_user() => Some("user".to_owned()),
            _ => None,
        }
    }

    /// A unary Connect call with the JSON codec, bounded by the total limit.
    pub(crate) async fn unary<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        ctx: &CallCtx,
        method: &'static str,
        req: &Req,
        user: Option<&str>,
        op: Op<'_>,
    ) -> Result<Resp> {
        let body = serde_json::to_vec(req).map_err(|e| ProviderError::Internal {
            message: "cannot encode a request".into(),
            source: Some(Box::new(e)),
        })?;
        let tctx = ctx.with_timeout(self.http.request, Clock::Total);
        let mut rb = self.rpc_request(method, user, codec::UNARY_JSON).body(body);
        if let Some(left) = tctx.remaining() {
            rb = rb.header(codec::TIMEOUT_HEADER, codec::format_timeout_ms(left));
        }
        let (status, headers, body) = self.http.call(&tctx, rb, op).await?;
        if status == StatusCode::OK {
            return decode(&body, method);
        }
        Err(from_status(op, status, &headers, &body))
    }

    /// Open a server stream: the request is sent and the answer's headers are checked
    /// within the connect limit. The stream's silence is then bounded by the transport
    /// idle limit, under `parent`.
    pub(crate) async fn server_stream<Req: Serialize>(
        &self,
        ctx: &CallCtx,
        parent: &CancelToken,
        method: &'static str,
        req: &Req,
        user: Option<&str>,
        op: Op<'_>,
    ) -> Result<ConnectStream> {
        let json = serde_json::to_vec(req).map_err(|e| ProviderError::Internal {
            message: "cannot encode a request".into(),
            source: Some(Box::new(e)),
        })?;
        let frame = codec::message(&json).map_err(|e| ProviderError::InvalidRequest {
            message: format!("{method}: {e}"),
        })?;
        let rb = self
            .rpc_request(method, user, codec::STREAM_JSON)
            .header("connect-accept-encoding", "identity")
            .header("connect-content-encoding", "identity")
            .header("keepalive-ping-interval", self.keepalive_s.to_string())
            .body(frame);
        let resp = self.http.send(ctx, rb, op).await?;
        let status = resp.status();
        if status != StatusCode::OK {
            let headers = resp.headers().clone();
            let body = within_connect(ctx, self.http.connect, async {
                resp.bytes().await.map_err(|e| from_reqwest(e, op))
            })
            .await
            .unwrap_or_default();
            return Err(from_status(op, status, &headers, &body));
        }
        let ct = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !ct.starts_with(codec::STREAM_JSON) {
            return Err(malformed(format!(
                "a {method} stream of content type {ct:?}"
            )));
        }
        let (id, fs) = match op {
            Op::Process { id, .. } | Op::Sandbox { id, .. } => (id.to_owned(), false),
            Op::Fs { path, .. } => (path.to_owned(), true),
            Op::Api(_) => (String::new(), false),
        };
        let watchdog = self.http.transport_watchdog(parent)?;
        Ok(ConnectStream {
            body: ByteBody::new(resp, watchdog, method),
            reader: Decoder::new(MAX_ENVELOPE_BYTES),
            op: method_op(method),
            id,
            fs,
            ended: false,
        })
    }

    /// `GET /files`: the response (any status), with an optional byte range.
    pub(crate) async fn get_file(
        &self,
        ctx: &CallCtx,
        path: &str,
        range: Option<(u64, Option<u64>)>,
        user: Option<&str>,
    ) -> Result<reqwest::Response> {
        let mut rb = self
            .request_url(Method::GET, self.files_url(path, user))
            .header(reqwest::header::ACCEPT_ENCODING, "identity");
        if let Some((from, to)) = range {
            let v = match to {
                Some(end) => format!("bytes={from}-{}", end.saturating_sub(1)),
                None => format!("bytes={from}-"),
            };
            rb = rb.header(reqwest::header::RANGE, v);
        }
        self.http.send(ctx, rb, Op::Fs { op: "read", path }).await
    }

    /// `POST /files` with a streaming body; `Ok` once envd answered 200.
    pub(crate) async fn post_file(
        &self,
        ctx: &CallCtx,
        path: &str,
        body: reqwest::Body,
        content_type: &str,
        metadata: &[(String, String)],
        user: Option<&str>,
    ) -> Result<()> {
        let op = Op::Fs { op: "write", path };
        let mut rb = self
            .request_url(Method::POST, self.files_url(path, user))
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .body(body);
        if self.version.file_metadata() {
            for (k, v) in metadata {
                rb = rb.header(format!("x-metadata-{k}"), v.as_str());
            }
        }
        // The answer comes only once the whole body is in: the connect limit cannot bound
        // this call; the caller watches the body's progress instead.
        let resp = ctx
            .run(async { rb.send().await.map_err(|e| from_reqwest(e, op)) })
            .await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = ctx
            .run(async { resp.bytes().await.map_err(|e| from_reqwest(e, op)) })
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(from_status(op, status, &headers, &body))
        }
    }

    /// `GET /health`: `Ok` on 2xx, bounded by the total limit.
    pub(crate) async fn health(&self, ctx: &CallCtx) -> Result<()> {
        let (status, headers, body) = self
            .http
            .call(ctx, self.request(Method::GET, "/health"), Op::Api("health"))
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(from_status(Op::Api("health"), status, &headers, &body))
        }
    }

    /// `GET /health` bounded by `limit` (connect to answer).
    pub(crate) async fn health_within(&self, ctx: &CallCtx, limit: Duration) -> Result<()> {
        let op = Op::Api("health");
        let tctx = ctx.with_timeout(limit, Clock::Total);
        let (status, headers, body) = self
            .http
            .call(&tctx, self.request(Method::GET, "/health"), op)
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(from_status(op, status, &headers, &body))
        }
    }

    /// `POST /init`: `Ok` on 2xx, bounded by the total limit.
    pub(crate) async fn init(&self, ctx: &CallCtx, req: &InitRequest) -> Result<()> {
        let op = Op::Api("init");
        let rb = self.request(Method::POST, "/init").json(req);
        let (status, headers, body) = self.http.call(ctx, rb, op).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(from_status(op, status, &headers, &body))
        }
    }
}

/// The short operation name of an RPC method, for error reports.
fn method_op(method: &'static str) -> &'static str {
    match method.rsplit('/').next() {
        Some("Start") => "start",
        Some("Connect") => "connect",
        Some("WatchDir") => "watch",
        _ => "stream",
    }
}

/// `base` with `path` appended to its path (a base path is kept).
pub fn join(base: &Url, path: &str) -> Url {
    let mut u = base.clone();
    let joined = format!("{}{}", base.path().trim_end_matches('/'), path);
    u.set_path(&joined);
    u.set_query(None);
    u
}
