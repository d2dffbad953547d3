//! The Prometheus scrape endpoint: `GET /metrics` in the Prometheus text exposition
//! format, on a listener of its own (`[telemetry.prometheus]`), off by default.
//!
//! The exporter is `opentelemetry-prometheus`, the OpenTelemetry project's own, released in
//! step with the SDK in use. It is a second `MetricReader` on the same meter provider as
//! the OTLP periodic reader, so both paths carry the same instruments, and it names series
//! by the OpenTelemetry-to-Prometheus compatibility rules, as the Collector's `prometheus`
//! exporter does: dots become underscores, the unit is appended (`s` -> `_seconds`;
//! annotations such as `{timeout}` are dropped), monotonic counters get `_total`, histograms
//! `_bucket`/`_sum`/`_count`, attributes become labels with `_` for `.`. One dashboard
//! therefore works whichever way the metrics reach Prometheus. Resource attributes are on
//! `target_info`; the instrumentation scope is on the `otel_scope_*` labels.
//!
//! Auth is [`PrometheusConfig`]'s rule: a bearer token when tokens are configured, none
//! otherwise (which config validation allows only on loopback or when asked for
//! explicitly). Scrapes are not traced: they would fill the traces with noise.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use opentelemetry_prometheus::PrometheusExporter;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use super::config::PrometheusConfig;
use super::error::TelemetryError;

/// The path of the exposition.
pub const METRICS_PATH: &str = "/metrics";

/// The scrape endpoint set up by `telemetry::init`, if `[telemetry.prometheus]` is on.
static INSTALLED: OnceLock<ScrapeEndpoint> = OnceLock::new();

/// A Prometheus registry fed by the meter provider, and the rule for serving it. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct ScrapeEndpoint {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: prometheus::Registry,
    config: PrometheusConfig,
}

/// A bound scrape listener, not yet serving.
#[derive(Debug)]
pub struct ScrapeListener {
    endpoint: ScrapeEndpoint,
    listener: TcpListener,
    addr: SocketAddr,
}

/// The endpoint `telemetry::init` installed for this process, if any.
pub fn installed() -> Option<ScrapeEndpoint> {
    INSTALLED.get().cloned()
}

/// Install `endpoint` as the process's scrape endpoint (once; `init` runs once).
pub(super) fn install(endpoint: &ScrapeEndpoint) {
    if INSTALLED.set(endpoint.clone()).is_err() {
        tracing::warn!("A Prometheus scrape endpoint is already installed; keeping the first.");
    }
}

/// Bind the installed endpoint's listener; `None` when no endpoint is installed.
pub async fn bind_installed() -> Result<Option<ScrapeListener>, TelemetryError> {
    match installed() {
        Some(ep) => ep.bind().await.map(Some),
        None => Ok(None),
    }
}

// === impl ScrapeEndpoint ===

impl ScrapeEndpoint {
    /// A new endpoint, and the metric reader to register on the meter provider that feeds
    /// it.
    pub fn new(config: PrometheusConfig) -> Result<(Self, PrometheusExporter), TelemetryError> {
        let registry = prometheus::Registry::new();
        let reader = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .map_err(|source| TelemetryError::Prometheus { source })?;
        Ok((
            Self {
                inner: Arc::new(Inner { registry, config }),
            },
            reader,
        ))
    }

    /// Its settings.
    pub fn config(&self) -> &PrometheusConfig {
        &self.inner.config
    }

    /// The exposition: every metric the meter provider holds now, in the text format.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let families = self.inner.registry.gather();
        prometheus::TextEncoder::new().encode_to_string(&families)
    }

    /// The scrape router: `GET /metrics` (and `HEAD`), with the auth rule.
    pub fn router(&self) -> Router {
        Router::new()
            .route(METRICS_PATH, axum::routing::get(scrape))
            .fallback(|| async { (StatusCode::NOT_FOUND, "not found; try GET /metrics\n") })
            .with_state(self.clone())
    }

    /// Bind the configured listen address.
    pub async fn bind(&self) -> Result<ScrapeListener, TelemetryError> {
        let addr = self.inner.config.listen;
        let listen_error = |source| TelemetryError::ScrapeListen { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(listen_error)?;
        let addr = listener.local_addr().map_err(listen_error)?;
        Ok(ScrapeListener {
            endpoint: self.clone(),
            listener,
            addr,
        })
    }

    /// Whether a request's headers satisfy the auth rule.
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let tokens = &self.inner.config.auth_tokens;
        if tokens.is_empty() {
            return true;
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Compare every token fully so the time taken does not reveal a matching prefix.
        tokens.iter().fold(false, |acc, t| {
            acc | tether_provider::util::constant_time_eq(t.as_bytes(), given.as_bytes())
        })
    }
}

// === impl ScrapeListener ===

impl ScrapeListener {
    /// The bound address (the real port when the config asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serve on `tasks` until `stop` completes (then finish in-flight scrapes and end).
    /// Returns the bound address.
    pub fn spawn(
        self,
        tasks: &TaskTracker,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> SocketAddr {
        let Self {
            endpoint,
            listener,
            addr,
        } = self;
        tracing::info!(listen = %addr, path = METRICS_PATH, "Serving the Prometheus scrape endpoint.");
        tasks.spawn(async move {
            let serve = axum::serve(listener, endpoint.router()).with_graceful_shutdown(stop);
            if let Err(error) = serve.await {
                tracing::error!(%error, "The Prometheus scrape endpoint stopped with an error.");
            }
        });
        addr
    }
}

async fn scrape(State(ep): State<ScrapeEndpoint>, headers: HeaderMap) -> Response {
    if !ep.authorized(&headers) {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "unauthorized: this endpoint needs Authorization: Bearer <one of telemetry.prometheus.auth_tokens>\n",
        )
            .into_response();
    }
    match ep.render() {
        Ok(body) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response(),
        Err(error) => {
            tracing::error!(%error, "Cannot encode the Prometheus exposition.");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal: cannot encode the metrics\n",
            )
                .into_response()
        }
    }
}
