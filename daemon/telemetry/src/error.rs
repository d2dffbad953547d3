//! Why telemetry could not be set up. Every variant is a start-up failure: once running,
//! telemetry never fails a request (exports are batched off the request path and their
//! errors only logged).

use thiserror::Error;

/// A telemetry set-up failure; the daemon reports it and exits with `EX_USAGE`.
#[derive(Debug, Error)]
pub enum TelemetryError {
    /// A `[telemetry]` config value is out of range or malformed.
    #[error("invalid telemetry config `{field}`: {reason}")]
    InvalidConfig {
        /// The config key.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An `OTEL_*` (or `RUST_LOG`) environment variable has a value telemetry cannot use.
    #[error("invalid value {value:?} for {var}: {reason}")]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// The value found.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The log filter does not parse.
    #[error("invalid log filter {filter:?}")]
    LogFilter {
        /// The filter string.
        filter: String,
        /// The parser's complaint.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// The gRPC exporter has to be built inside a Tokio runtime.
    #[error("the OTLP gRPC exporter must be set up inside a Tokio runtime")]
    NoRuntime,
    /// The OTLP exporter for a signal could not be built.
    #[error("cannot build the OTLP {signal} exporter")]
    Exporter {
        /// `traces` or `metrics`.
        signal: &'static str,
        /// The exporter's error.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// The Prometheus exporter could not be registered.
    #[error("cannot build the Prometheus exporter")]
    Prometheus {
        /// The SDK's error.
        #[source]
        source: opentelemetry_sdk::error::OTelSdkError,
    },
    /// The scrape endpoint's listen address cannot be bound.
    #[error("cannot listen on {addr} (telemetry.prometheus.listen)")]
    ScrapeListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// A global tracing subscriber is already installed.
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
}
