//! The HTTP server: one listener for HTTP/1.1 and h2c, the native API and the E2B front,
//! request ids, auth, trace-context continuation, and graceful shutdown.
//!
//! Layers, outermost first: request id + span (continuing an inbound `traceparent`) ->
//! auth (bearer token on `/v1/*` when configured) -> route -> handler. Every error leaves
//! through [`DaemonError`]'s one mapping to status and code.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use tether_provider::clock::{CancelReason, CancelToken};
use tether_provider::{CallCtx, TraceContext};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::auth::Principal;
use crate::config::{Config, ShutdownPolicy};
use crate::error::{DaemonError, Result};
use crate::invariants::Invariants;
use crate::pipeline::Pipeline;
use crate::providers::ProviderRegistry;
use crate::sessions::{RecoveryReport, SessionManager};
use crate::state::AppState;
use crate::telemetry::Metrics;
use tether_provider::Clock;

tokio::task_local! {
    static REQUEST_ID: String;
}

/// The request id of the request being handled, if any.
pub fn current_request_id() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

impl IntoResponse for DaemonError {
    fn into_response(self) -> Response {
        let rid = current_request_id();
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(request_id = rid.as_deref().unwrap_or(""), code = %self.code(), error = %self, "Request failed");
        } else {
            tracing::debug!(request_id = rid.as_deref().unwrap_or(""), code = %self.code(), error = %self, "Request refused");
        }
        let retry_after = match &self {
            DaemonError::Provider(e) => e.retry_after(),
            _ => None,
        };
        let mut resp = (status, axum::Json(self.body(rid.as_deref()))).into_response();
        if let Some(d) = retry_after {
            // Delta-seconds, rounded up so a client never retries early.
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// A JSON body extractor whose rejections are tether errors (`INVALID_REQUEST`,
/// `PAYLOAD_TOO_LARGE`), not axum's plain-text ones.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = DaemonError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(crate::config::DEFAULT_MAX_BODY_BYTES, |l| l.0);
        let bytes = match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => b,
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(DaemonError::PayloadTooLarge { limit });
            }
            Err(e) => return Err(DaemonError::invalid(format!("cannot read the body: {e}"))),
        };
        if bytes.is_empty() {
            return Err(DaemonError::invalid(
                "the body is empty; a JSON object is required",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| DaemonError::invalid(format!("invalid JSON body: {e}")))
    }
}

impl<T: serde::Serialize> IntoResponse for ApiJson<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// The body limit in force, as a request extension.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub u64);

/// The call context of a request: its id, its cancellation (cancelled with reason
/// `Caller("client disconnected")` if the client goes away), and its trace context.
#[derive(Debug, Clone)]
pub struct RequestCtx(pub CallCtx);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RequestCtx {
    type Rejection = DaemonError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<RequestCtx>()
            .cloned()
            .ok_or_else(|| DaemonError::internal("request context missing"))
    }
}

/// Cancels the request's token when the request future is dropped (client gone).
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel(CancelReason::Caller("client disconnected"));
    }
}

/// The native API's inbound deadline header, milliseconds.
pub const TIMEOUT_HEADER: &str = "tether-timeout-ms";

async fn request_layer(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let rid = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned);
    let span = tracing::info_span!(
        "http.request",
        http.request.method = %req.method(),
        url.path = %req.uri().path(),
        request.id = %rid,
        http.response.status_code = tracing::field::Empty,
        otel.kind = "server",
    );
    crate::telemetry::set_parent(&span, req.headers());
    let trace: TraceContext = crate::telemetry::current_trace_context(&span);
    let token = state.shutdown.child();
    let _guard = CancelOnDrop(token.clone());
    let mut ctx = CallCtx::with_cancel(rid.clone(), token).with_trace(trace);
    // A caller's own deadline, as the E2B front honours `Connect-Timeout-Ms`: clamped to
    // the configured maximum; expiry is DEADLINE_EXCEEDED.
    if let Some(v) = req.headers().get(TIMEOUT_HEADER) {
        let max = state.config.server.max_request_timeout_ms;
        match v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
        {
            Some(ms) => {
                ctx = ctx.with_timeout(Duration::from_millis(ms.min(max)), Clock::Total);
            }
            None => {
                return REQUEST_ID
                    .scope(rid, async {
                        DaemonError::invalid(format!(
                            "{TIMEOUT_HEADER} must be a positive number of milliseconds"
                        ))
                        .into_response()
                    })
                    .await;
            }
        }
    }
    req.extensions_mut().insert(RequestCtx(ctx));
    req.extensions_mut()
        .insert(BodyLimit(state.config.server.max_body_bytes));
    let fut = REQUEST_ID.scope(rid.clone(), next.run(req));
    let mut resp = fut.instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Resolves the caller's [`Principal`] for the native API. As soon as any credential is
/// configured, every `/v1/*` route but `/v1/health` needs a valid token or API key
/// (401 `UNAUTHORIZED` otherwise). The E2B front authenticates itself (API keys on the
/// control plane, access tokens on envd), with the same credentials.
async fn auth_layer(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path.starts_with("/v1/") && path != "/v1/health" {
        match crate::auth::resolve(&state.config, req.headers()) {
            Ok(p) => {
                req.extensions_mut().insert(p);
            }
            Err(()) => {
                return REQUEST_ID
                    .scope(current_request_id().unwrap_or_default(), async {
                        DaemonError::Unauthorized.into_response()
                    })
                    .await;
            }
        }
    }
    next.run(req).await
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Principal {
    type Rejection = DaemonError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Principal>()
            .cloned()
            .ok_or(DaemonError::Unauthorized)
    }
}

async fn not_found() -> DaemonError {
    DaemonError::RouteNotFound
}

async fn method_not_allowed() -> DaemonError {
    DaemonError::MethodNotAllowed
}

/// The whole router: native API, E2B front, layers.
pub fn router(state: Arc<AppState>) -> Router {
    let mut app: Router<Arc<AppState>> = crate::api::router();
    if state.config.e2b_front.enabled {
        app = app.merge(crate::e2b_front::router());
    }
    app.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            auth_layer,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            request_layer,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(
            usize::try_from(state.config.server.max_body_bytes).unwrap_or(usize::MAX),
        ))
        .with_state(state)
}

/// A daemon being started.
#[derive(Debug)]
pub struct Daemon;

/// A running daemon.
#[derive(Debug)]
pub struct RunningDaemon {
    /// The bound address.
    pub addr: SocketAddr,
    /// Shared state.
    pub state: Arc<AppState>,
    /// What start-up recovery did.
    pub recovery: RecoveryReport,
    /// The Prometheus scrape listener's address, when `[telemetry.prometheus]` is on.
    pub metrics_addr: Option<SocketAddr>,
    server: JoinHandle<()>,
}

impl Daemon {
    /// Build everything from `config`, bind, recover sessions, and serve in the background.
    pub async fn start(config: Config) -> Result<RunningDaemon> {
        config
            .validate()
            .map_err(|e| DaemonError::invalid(e.to_string()))?;
        let listener = TcpListener::bind(config.server.listen).await.map_err(|e| {
            DaemonError::internal(format!("cannot listen on {}: {e}", config.server.listen))
        })?;
        Self::start_on(config, listener).await
    }

    /// As [`Daemon::start`], on an already bound listener.
    pub async fn start_on(mut config: Config, listener: TcpListener) -> Result<RunningDaemon> {
        let addr = listener
            .local_addr()
            .map_err(|e| DaemonError::internal(e.to_string()))?;
        config.server.listen = addr;
        // The scrape listener `telemetry::init` set up, bound first: a taken port fails
        // the start-up before anything runs.
        let scrape = crate::telemetry::scrape::bind_installed()
            .await
            .map_err(|e| DaemonError::internal(format!("{e}: {}", chain_of(&e))))?;
        let config = Arc::new(config);
        let shutdown = CancelToken::new();
        let tasks = TaskTracker::new();
        let metrics = Metrics::new();
        let invariants =
            Invariants::new(&config.invariants).map_err(|e| DaemonError::invalid(e.to_string()))?;
        let providers = Arc::new(ProviderRegistry::from_config(&config)?);
        for (name, p) in providers.iter() {
            let ctx = CallCtx::new("healthcheck")
                .with_timeout(config.limits.deadlines().sandbox_op, Clock::Total);
            if let Err(e) = p.healthcheck(&ctx).await {
                tracing::warn!(provider = %name, code = %e.code(), error = %e, "Provider healthcheck failed");
            }
        }
        let sessions = Arc::new(
            SessionManager::new(
                config.server.state_dir.clone(),
                providers,
                shutdown.clone(),
                tasks.clone(),
                metrics.clone(),
                invariants.clone(),
                config.limits.deadlines(),
            )
            .await?,
        );
        let recovery = sessions.recover(config.server.closed_retention()).await?;
        let pipeline = Arc::new(
            Pipeline::new(&config.pipeline, &config.limits, metrics.clone())
                .map_err(|e| DaemonError::invalid(e.to_string()))?,
        );
        let e2b =
            crate::e2b_front::FrontState::new(&config.e2b_front, config.limits.deadlines().fs_op);
        let state = Arc::new(AppState {
            config: Arc::clone(&config),
            sessions: Arc::clone(&sessions),
            pipeline,
            metrics,
            shutdown: shutdown.clone(),
            tasks: tasks.clone(),
            invariants,
            e2b,
        });
        if crate::auth::is_development(&config) {
            tracing::warn!(
                listen = %addr,
                "Development mode: no auth token or API key is configured, so every caller on this loopback listener is trusted"
            );
        }
        spawn_housekeeping(&state);
        let stop = shutdown.clone();
        let metrics_addr = scrape.map(|s| s.spawn(&tasks, async move { stop.cancelled().await }));
        let app = router(Arc::clone(&state));
        let stop = shutdown.clone();
        let server = tokio::spawn(async move {
            // Streams (NDJSON, Connect server-streaming) write small frames: without
            // TCP_NODELAY, Nagle's algorithm and the peer's delayed ACK hold each one ~40 ms.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "Cannot set TCP_NODELAY");
                }
            });
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "The server stopped with an error");
            }
        });
        Ok(RunningDaemon {
            addr,
            state,
            recovery,
            metrics_addr,
            server,
        })
    }
}

/// How often closed sessions past their retention are removed, seconds.
const RETENTION_SWEEP_EVERY_S: u64 = 3_600;

fn chain_of(e: &dyn std::error::Error) -> String {
    std::iter::successors(e.source(), |s| s.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// The reaper (TTL expiry, every second), the renewer, the reconciler (orphaned
/// sandboxes) and the retention sweep.
fn spawn_housekeeping(state: &Arc<AppState>) {
    let s = Arc::clone(state);
    state.tasks.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let reconcile_every = s.config.leases.reconcile_interval_s.max(1);
        let renew_every = s.config.leases.renew_interval_s.max(1);
        let renew_ttl = Duration::from_secs(s.config.leases.renew_ttl_s);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = s.shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            for id in s.sessions.expire().await {
                tracing::info!(session.id = %id, "Session expired; its sandbox was destroyed");
            }
            n += 1;
            if n.is_multiple_of(renew_every) {
                s.sessions.renew_all(renew_ttl).await;
            }
            if n.is_multiple_of(reconcile_every) {
                s.sessions.reconcile().await;
            }
            if let Some(retention) = s.config.server.closed_retention()
                && n.is_multiple_of(RETENTION_SWEEP_EVERY_S)
            {
                s.sessions.sweep_retention(retention).await;
            }
        }
    });
}

impl RunningDaemon {
    /// `http://addr`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful shutdown: stop accepting, cancel, drain within the grace period, then
    /// keep or release sandboxes per config.
    pub async fn shutdown(self) {
        let grace = Duration::from_millis(self.state.config.server.shutdown_grace_ms);
        self.state.shutdown.cancel(CancelReason::Shutdown);
        let release = self.state.config.server.on_shutdown == ShutdownPolicy::Release;
        let _ = tokio::time::timeout(grace, self.state.sessions.shutdown(release)).await;
        self.state.tasks.close();
        if tokio::time::timeout(grace, self.state.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("Some tasks did not finish within the shutdown grace period");
        }
        let _ = tokio::time::timeout(grace, self.server).await;
    }

    /// Wait until the server stops (it stops after shutdown is requested).
    pub async fn wait_for_shutdown_signal(&self) {
        self.state.shutdown.cancelled().await
    }
}
