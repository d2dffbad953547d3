//! Telemetry: the log, OpenTelemetry traces and metrics over OTLP, a Prometheus scrape
//! endpoint, and W3C trace context.
//!
//! This is the only place in tether that installs a `tracing` subscriber or an OpenTelemetry
//! exporter; everything else only creates spans and records metrics. [`init`] installs:
//!
//! - an fmt layer writing text or JSON lines to stderr, filtered by `log_filter`/`RUST_LOG`;
//! - when an OTLP endpoint is configured (config or `OTEL_*` variables, see [`config`]): the
//!   `tracing-opentelemetry` layer feeding an OTLP span exporter (HTTP/protobuf through the
//!   blocking reqwest client, or gRPC through tonic) behind the SDK's batch processor, and an
//!   OTLP metric exporter behind a periodic reader, set as the global meter provider;
//! - when `[telemetry.prometheus]` is on: a Prometheus reader on that same meter provider,
//!   and the [`scrape`] endpoint the daemon serves on its own listener;
//! - the W3C TraceContext propagator, used by [`extract_parent`] for inbound requests.
//!
//! Exports never sit on a request's path: spans are queued to the batch processor's own
//! thread (a full queue drops spans rather than wait), and metrics are read by the periodic
//! reader's thread (or, for the scrape endpoint, by the scrape). A dead or slow collector
//! costs log lines, never latency or errors.
//! [`TelemetryGuard::shutdown`] flushes both at exit, off the async worker threads.
//!
//! Span names and attribute keys live in [`names`]; the metric instruments in [`Metrics`].

pub mod config;
pub mod env;
mod error;
mod metrics;
pub mod names;
mod propagation;
pub mod scrape;

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{EnvFilter, Registry};

pub use config::{
    LogFormat, OtlpProtocol, PrometheusConfig, ResolvedTelemetry, SamplerKind, TelemetryConfig,
};
pub use env::{EnvSource, ProcessEnv};
pub use error::TelemetryError;
pub use metrics::{
    DURATION_BUCKETS_S, INSTRUMENTS, InstrumentKind, InstrumentSpec, METER_NAME, Metrics,
    REMOTE_OP_DURATION, SANDBOXES_LIVE, SESSIONS_LIVE, TIMEOUTS, TOOL_DURATION,
};
pub use propagation::{
    TRACEPARENT_ENV, TRACESTATE_ENV, current_trace_context, extract_parent, install_propagator,
    set_parent, trace_env,
};

/// The instrumentation scope name of tether's tracer.
pub const TRACER_NAME: &str = "tether";

/// Targets whose spans are never exported: the exporters' own HTTP/gRPC stacks and the
/// OpenTelemetry SDK. Exporting them would make every export produce more telemetry.
const UNEXPORTED_TARGETS: &[&str] = &[
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
    "opentelemetry-otlp",
    "h2",
    "hyper",
    "hyper_util",
    "tonic",
    "tower",
    "reqwest",
];

/// A built but not yet installed telemetry pipeline: the subscriber as a `Dispatch`, and
/// the guard that owns the exporters. [`init`] installs it globally; tests may instead use
/// the dispatch in a scope (`tracing::dispatcher::with_default`).
#[derive(Debug)]
pub struct Telemetry {
    /// The subscriber: fmt layer, plus the OpenTelemetry layer when exporting.
    pub dispatch: tracing::Dispatch,
    /// The exporters' owner.
    pub guard: TelemetryGuard,
}

/// Owns the tracer and meter providers. Call [`TelemetryGuard::shutdown`] before exit to
/// flush what is still queued.
#[derive(Debug)]
pub struct TelemetryGuard {
    resolved: ResolvedTelemetry,
    tracer_provider: Option<SdkTracerProvider>,
    meter_provider: Option<SdkMeterProvider>,
    scrape: Option<scrape::ScrapeEndpoint>,
}

/// Set up telemetry from the `[telemetry]` config and the environment, and install it as
/// the process's global subscriber, propagator and meter provider, and the scrape endpoint
/// ([`scrape::installed`]) the daemon then serves.
///
/// Must run inside a Tokio runtime when the gRPC transport is configured. Fails with
/// [`TelemetryError::AlreadyInitialized`] if a global subscriber exists.
pub fn init(cfg: &TelemetryConfig, env: &dyn EnvSource) -> Result<TelemetryGuard, TelemetryError> {
    let Telemetry { dispatch, guard } = build(cfg, env)?;
    tracing::dispatcher::set_global_default(dispatch)
        .map_err(|_| TelemetryError::AlreadyInitialized)?;
    install_propagator();
    if let Some(mp) = &guard.meter_provider {
        opentelemetry::global::set_meter_provider(mp.clone());
    }
    if let Some(ep) = &guard.scrape {
        scrape::install(ep);
    }
    let r = &guard.resolved;
    tracing::info!(
        traces_endpoint = r.traces_endpoint.as_deref().unwrap_or("none"),
        metrics_endpoint = r.metrics_endpoint.as_deref().unwrap_or("none"),
        prometheus_listen = r
            .prometheus
            .as_ref()
            .map_or_else(|| "none".to_owned(), |p| p.listen.to_string()),
        protocol = %r.protocol,
        service_name = r.service_name(),
        "Telemetry initialised."
    );
    Ok(guard)
}

/// Build the pipeline without installing anything globally.
pub fn build(cfg: &TelemetryConfig, env: &dyn EnvSource) -> Result<Telemetry, TelemetryError> {
    let resolved = cfg.resolve(env)?;
    build_resolved(resolved)
}

/// Build the pipeline from already-resolved settings.
pub fn build_resolved(resolved: ResolvedTelemetry) -> Result<Telemetry, TelemetryError> {
    if resolved.protocol == OtlpProtocol::Grpc
        && resolved.exports()
        && tokio::runtime::Handle::try_current().is_err()
    {
        return Err(TelemetryError::NoRuntime);
    }
    let resource = resource(&resolved);

    let tracer_provider = match &resolved.traces_endpoint {
        None => None,
        Some(endpoint) => {
            let exporter = span_exporter(resolved.protocol, endpoint, resolved.export_timeout)
                .map_err(|source| TelemetryError::Exporter {
                    signal: "traces",
                    source,
                })?;
            Some(
                SdkTracerProvider::builder()
                    .with_resource(resource.clone())
                    .with_sampler(resolved.sampler.build(resolved.sampler_ratio))
                    // The default batch processor runs on its own thread with a bounded
                    // queue: recording a span never waits on the network.
                    .with_batch_exporter(exporter)
                    .build(),
            )
        }
    };

    // One meter provider with a reader per path (OTLP push, Prometheus pull): the same
    // instruments and aggregations reach both.
    let (scrape, scrape_reader) = match &resolved.prometheus {
        Some(p) => {
            let (ep, reader) = scrape::ScrapeEndpoint::new(p.clone())?;
            (Some(ep), Some(reader))
        }
        None => (None, None),
    };
    let meter_provider = if resolved.keeps_metrics() {
        let mut builder = SdkMeterProvider::builder().with_resource(resource);
        if let Some(endpoint) = &resolved.metrics_endpoint {
            let exporter = metric_exporter(resolved.protocol, endpoint, resolved.export_timeout)
                .map_err(|source| TelemetryError::Exporter {
                    signal: "metrics",
                    source,
                })?;
            builder = builder.with_reader(
                PeriodicReader::builder(exporter)
                    .with_interval(resolved.metrics_interval)
                    .build(),
            );
        }
        if let Some(reader) = scrape_reader {
            builder = builder.with_reader(reader);
        }
        Some(builder.build())
    } else {
        None
    };

    let log_filter = EnvFilter::builder()
        .parse(&resolved.log_filter)
        .map_err(|source| TelemetryError::LogFilter {
            filter: resolved.log_filter.clone(),
            source,
        })?;
    let mut layers: Vec<Box<dyn tracing_subscriber::Layer<Registry> + Send + Sync>> = Vec::new();
    // Colour only for a terminal: journald, files and log shippers get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    layers.push(match resolved.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_filter(log_filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(log_filter)
            .boxed(),
    });
    if let Some(tp) = &tracer_provider {
        // Spans are exported at INFO and above whatever the log filter says: quieting the
        // log must not blind the traces.
        let mut otel_filter =
            tracing_subscriber::filter::Targets::new().with_default(tracing::Level::INFO);
        for t in UNEXPORTED_TARGETS {
            otel_filter = otel_filter.with_target(*t, tracing_subscriber::filter::LevelFilter::OFF);
        }
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(tp.tracer(TRACER_NAME))
                // Per-span extras the vocabulary does not use: busy/idle timing, thread ids
                // and source locations cost time on every span of the hot path.
                .with_tracked_inactivity(false)
                .with_threads(false)
                .with_location(false)
                .with_filter(otel_filter)
                .boxed(),
        );
    }
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(layers));

    Ok(Telemetry {
        dispatch,
        guard: TelemetryGuard {
            resolved,
            tracer_provider,
            meter_provider,
            scrape,
        },
    })
}

fn resource(r: &ResolvedTelemetry) -> Resource {
    let mut attrs: Vec<KeyValue> = r
        .resource
        .iter()
        .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
        .collect();
    if !r.resource.contains_key("service.version") {
        attrs.push(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    }
    // `builder_empty`: the default builder would read OTEL_* from the process environment
    // behind our back; everything here was already resolved through the EnvSource.
    Resource::builder_empty()
        .with_detector(Box::new(
            opentelemetry_sdk::resource::TelemetryResourceDetector,
        ))
        .with_attributes(attrs)
        .build()
}

fn span_exporter(
    protocol: OtlpProtocol,
    endpoint: &str,
    timeout: Duration,
) -> Result<opentelemetry_otlp::SpanExporter, opentelemetry_otlp::ExporterBuildError> {
    // An endpoint set in code is used verbatim (config resolution appended /v1/traces).
    match protocol {
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(timeout)
            .build(),
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_protocol(Protocol::Grpc)
            .with_endpoint(endpoint)
            .with_timeout(timeout)
            .build(),
    }
}

fn metric_exporter(
    protocol: OtlpProtocol,
    endpoint: &str,
    timeout: Duration,
) -> Result<opentelemetry_otlp::MetricExporter, opentelemetry_otlp::ExporterBuildError> {
    match protocol {
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(timeout)
            .build(),
        OtlpProtocol::Grpc => opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .with_protocol(Protocol::Grpc)
            .with_endpoint(endpoint)
            .with_timeout(timeout)
            .build(),
    }
}

// === impl TelemetryGuard ===

impl TelemetryGuard {
    /// The settings in force.
    pub fn resolved(&self) -> &ResolvedTelemetry {
        &self.resolved
    }

    /// Whether spans are exported.
    pub fn exports_traces(&self) -> bool {
        self.tracer_provider.is_some()
    }

    /// Whether metrics are pushed over OTLP.
    pub fn exports_metrics(&self) -> bool {
        self.resolved.metrics_endpoint.is_some()
    }

    /// The scrape endpoint, when `[telemetry.prometheus]` is on.
    pub fn scrape_endpoint(&self) -> Option<&scrape::ScrapeEndpoint> {
        self.scrape.as_ref()
    }

    /// tether's instruments on this pipeline's meter provider (the no-op meter when metrics
    /// are off). After [`init`], [`Metrics::new`] gives the same instruments.
    pub fn metrics(&self) -> Metrics {
        match &self.meter_provider {
            Some(mp) => {
                use opentelemetry::metrics::MeterProvider as _;
                let scope = opentelemetry::InstrumentationScope::builder(METER_NAME)
                    .with_version(env!("CARGO_PKG_VERSION"))
                    .build();
                Metrics::from_meter(&mp.meter_with_scope(scope))
            }
            None => Metrics::from_meter(&opentelemetry::metrics::MeterProvider::meter(
                &opentelemetry::metrics::NoopMeterProvider::new(),
                METER_NAME,
            )),
        }
    }

    /// Flush queued spans and a last metric collection, then stop the exporters.
    ///
    /// Runs both providers' blocking shutdowns side by side on the blocking pool (on a
    /// current-thread runtime a direct call would starve the gRPC exporter of the only
    /// thread) and stops waiting after the export timeout plus a second, so a dead collector
    /// delays exit by at most that. Returns whether everything was flushed; failures are
    /// logged.
    pub async fn shutdown(self) -> bool {
        let Self {
            resolved,
            tracer_provider,
            meter_provider,
            scrape: _,
        } = self;
        let timeout = resolved.export_timeout;
        let traces = tracer_provider.map(|tp| {
            tokio::task::spawn_blocking(move || {
                tp.shutdown_with_timeout(timeout)
                    .map_err(|error| tracing::warn!(%error, "Span exporter shutdown failed; queued spans may be lost."))
                    .is_ok()
            })
        });
        let metrics = meter_provider.map(|mp| {
            tokio::task::spawn_blocking(move || {
                mp.shutdown_with_timeout(timeout)
                    .map_err(|error| tracing::warn!(%error, "Metric exporter shutdown failed; the last metrics may be lost."))
                    .is_ok()
            })
        });
        let joined = async {
            let mut ok = true;
            for task in [traces, metrics].into_iter().flatten() {
                ok &= task
                    .await
                    .map_err(|error| tracing::warn!(%error, "Telemetry shutdown task failed."))
                    .unwrap_or(false);
            }
            ok
        };
        match tokio::time::timeout(timeout + Duration::from_secs(1), joined).await {
            Ok(ok) => ok,
            Err(_) => {
                tracing::warn!(
                    ?timeout,
                    "Telemetry shutdown timed out; queued telemetry is dropped."
                );
                false
            }
        }
    }
}

#[cfg(test)]
mod tests;
