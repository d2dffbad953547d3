//! The HTTP plumbing every route shares (apart from the server's assembly in
//! [`crate::server`], so the API modules depend on this and not on the server): the request
//! id, the request's [`CallCtx`] (cancelled if the client leaves; a `Tether-Timeout-Ms`
//! deadline), the caller's [`Principal`], typed JSON bodies whose rejections are tether
//! errors, and the one conversion of a [`DaemonError`] into a response.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use tether_envd_server::CancelOnDrop;
use tether_provider::{CallCtx, Clock, TraceContext};
use tracing::Instrument;

use crate::auth::Principal;
use crate::error::DaemonError;
use crate::state::AppState;

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
/// `Caller("client disconnected")` if the client goes away), and its trace context. One
/// extractor for the daemon's handlers and envd's server: [`request_layer`] puts the
/// `CallCtx` in the request's extensions.
pub use tether_envd_server::RequestCtx;

/// The native API's inbound deadline header, milliseconds.
pub const TIMEOUT_HEADER: &str = "tether-timeout-ms";

pub(crate) async fn request_layer(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let rid = tether_envd_server::request_id(req.headers());
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
    req.extensions_mut().insert(ctx);
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
pub(crate) async fn auth_layer(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    if path.starts_with("/v1/") && path != "/v1/health" {
        match crate::auth::resolve(&state.config, req.headers()) {
            Some(p) => {
                req.extensions_mut().insert(p);
            }
            None => {
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

pub(crate) async fn not_found() -> DaemonError {
    DaemonError::RouteNotFound
}

pub(crate) async fn method_not_allowed() -> DaemonError {
    DaemonError::MethodNotAllowed
}
