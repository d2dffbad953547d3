//! The `[telemetry]` config section and its resolution against the standard `OTEL_*`
//! environment variables.
//!
//! The config file gives defaults; the environment overrides or extends them, following the
//! OpenTelemetry specification, so that the same binary can be pointed at any collector
//! without editing its config. [`TelemetryConfig::resolve`] does all of the merging in one
//! place and yields a [`ResolvedTelemetry`] whose every value is final: exporters built from
//! it never consult the process environment for endpoints, protocol, sampler or resource.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::env::{
    EnvSource, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_TIMEOUT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_METRIC_EXPORT_INTERVAL, OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED, OTEL_SERVICE_NAME,
    OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, RUST_LOG,
};
use super::error::TelemetryError;

/// Default `service.name`.
pub const DEFAULT_SERVICE_NAME: &str = "tetherd";
/// Default interval between metric exports (the OpenTelemetry default).
pub const DEFAULT_METRICS_INTERVAL_MS: u64 = 60_000;
/// Default timeout of one export request (the OpenTelemetry default).
pub const DEFAULT_EXPORT_TIMEOUT_MS: u64 = 10_000;
/// Default log filter.
pub const DEFAULT_LOG_FILTER: &str = "info";
/// Path appended to a base endpoint for OTLP/HTTP traces.
pub const HTTP_TRACES_PATH: &str = "/v1/traces";
/// Path appended to a base endpoint for OTLP/HTTP metrics.
pub const HTTP_METRICS_PATH: &str = "/v1/metrics";
/// Default port of the Prometheus scrape endpoint (the port OpenTelemetry's Prometheus
/// exporters use).
pub const DEFAULT_PROMETHEUS_PORT: u16 = 9464;
/// Shortest accepted scrape bearer token.
pub const MIN_SCRAPE_TOKEN_LEN: usize = 16;

/// The `[telemetry]` section of `tetherd.toml`.
///
/// With neither `otlp_endpoint` nor an `OTEL_EXPORTER_OTLP_*ENDPOINT` variable, nothing is
/// exported and only the stderr log runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Base OTLP endpoint, e.g. `http://127.0.0.1:4318` (HTTP) or `http://127.0.0.1:4317`
    /// (gRPC). For HTTP, `/v1/traces` and `/v1/metrics` are appended. Overridden by
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` and the per-signal variables. Default: none.
    pub otlp_endpoint: Option<String>,
    /// `"http/protobuf"` or `"grpc"`. Overridden by `OTEL_EXPORTER_OTLP_PROTOCOL`.
    /// Default: `"http/protobuf"`.
    pub otlp_protocol: Option<OtlpProtocol>,
    /// The `service.name` resource attribute. Overridden by `OTEL_SERVICE_NAME`, then by
    /// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`. Default: `"tetherd"`.
    pub service_name: String,
    /// Extra resource attributes (e.g. `deployment.environment.name`). Keys in
    /// `OTEL_RESOURCE_ATTRIBUTES` override these. Default: none.
    pub resource_attributes: BTreeMap<String, String>,
    /// The trace sampler. Overridden by `OTEL_TRACES_SAMPLER`.
    /// Default: `"parentbased_always_on"`.
    pub sampler: SamplerKind,
    /// The ratio for the `traceidratio` samplers, in `[0, 1]`. Overridden by
    /// `OTEL_TRACES_SAMPLER_ARG`. Default: 1.0.
    pub sampler_arg: Option<f64>,
    /// Export metrics (to the same collector as traces). Default: true.
    pub metrics: bool,
    /// Interval between metric exports, in milliseconds. Overridden by
    /// `OTEL_METRIC_EXPORT_INTERVAL`. Default: 60000.
    pub metrics_interval_ms: u64,
    /// Timeout of one export request, in milliseconds. Overridden by
    /// `OTEL_EXPORTER_OTLP_TIMEOUT`. Default: 10000.
    pub export_timeout_ms: u64,
    /// `"text"` or `"json"` lines on stderr. Default: `"text"`.
    pub log_format: LogFormat,
    /// The log filter, in `RUST_LOG` syntax. Overridden by `RUST_LOG`. Default: `"info"`.
    pub log_filter: String,
    /// The Prometheus scrape endpoint (`[telemetry.prometheus]`). Default: off.
    pub prometheus: Option<PrometheusConfig>,
}

/// The `[telemetry.prometheus]` section: `GET /metrics` in the Prometheus text format, on
/// a listener of its own, serving the same instruments as the OTLP metric export.
///
/// Auth: on a loopback address no token is needed. Any other address needs either
/// `auth_tokens` (a scrape then presents `Authorization: Bearer <token>`) or an explicit
/// `allow_unauthenticated = true`; otherwise the config is refused. Tokens, when set, are
/// required on loopback too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrometheusConfig {
    /// Listen address of the scrape endpoint. Default: `127.0.0.1:9464`.
    pub listen: SocketAddr,
    /// Bearer tokens a scrape may present (at least 16 characters each). Default: none.
    pub auth_tokens: Vec<String>,
    /// Serve a non-loopback address without a token (for a network that is already
    /// closed to everyone but Prometheus). Default: false.
    pub allow_unauthenticated: bool,
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies.
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    /// OTLP/gRPC.
    #[serde(rename = "grpc")]
    Grpc,
}

/// The trace sampler, named as in `OTEL_TRACES_SAMPLER`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SamplerKind {
    /// Sample every trace.
    #[serde(rename = "always_on")]
    AlwaysOn,
    /// Sample nothing.
    #[serde(rename = "always_off")]
    AlwaysOff,
    /// Sample a fraction of traces, by trace id.
    #[serde(rename = "traceidratio")]
    TraceIdRatio,
    /// Follow the caller's decision; sample every root.
    #[serde(rename = "parentbased_always_on")]
    ParentBasedAlwaysOn,
    /// Follow the caller's decision; sample no root.
    #[serde(rename = "parentbased_always_off")]
    ParentBasedAlwaysOff,
    /// Follow the caller's decision; sample a fraction of roots.
    #[serde(rename = "parentbased_traceidratio")]
    ParentBasedTraceIdRatio,
}

/// The stderr log's line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Telemetry settings after merging the config with the environment: final values only.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedTelemetry {
    /// The full URL (HTTP) or authority (gRPC) spans go to; `None`: no trace export.
    pub traces_endpoint: Option<String>,
    /// The full URL (HTTP) or authority (gRPC) metrics go to; `None`: no metric export.
    pub metrics_endpoint: Option<String>,
    /// The transport of both signals.
    pub protocol: OtlpProtocol,
    /// All resource attributes, `service.name` included.
    pub resource: BTreeMap<String, String>,
    /// The sampler.
    pub sampler: SamplerKind,
    /// Its ratio (used by the ratio samplers only).
    pub sampler_ratio: f64,
    /// Interval between metric exports.
    pub metrics_interval: Duration,
    /// Timeout of one export request.
    pub export_timeout: Duration,
    /// The stderr log's format.
    pub log_format: LogFormat,
    /// The log filter.
    pub log_filter: String,
    /// The Prometheus scrape endpoint; `None`: not served (not configured, or
    /// `OTEL_SDK_DISABLED`).
    pub prometheus: Option<PrometheusConfig>,
}

// === impl PrometheusConfig ===

impl Default for PrometheusConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_PROMETHEUS_PORT)),
            auth_tokens: Vec::new(),
            allow_unauthenticated: false,
        }
    }
}

impl PrometheusConfig {
    /// The auth rule: tokens of at least [`MIN_SCRAPE_TOKEN_LEN`] characters, and a
    /// non-loopback address only with tokens or `allow_unauthenticated`.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        if self
            .auth_tokens
            .iter()
            .any(|t| t.len() < MIN_SCRAPE_TOKEN_LEN)
        {
            return Err(TelemetryError::InvalidConfig {
                field: "prometheus.auth_tokens",
                reason: format!("every token must be at least {MIN_SCRAPE_TOKEN_LEN} characters"),
            });
        }
        if !self.listen.ip().is_loopback()
            && self.auth_tokens.is_empty()
            && !self.allow_unauthenticated
        {
            return Err(TelemetryError::InvalidConfig {
                field: "prometheus.listen",
                reason: format!(
                    "{} is not loopback: set prometheus.auth_tokens, or allow_unauthenticated = true",
                    self.listen
                ),
            });
        }
        Ok(())
    }
}

// === impl TelemetryConfig ===

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            otlp_protocol: None,
            service_name: DEFAULT_SERVICE_NAME.to_owned(),
            resource_attributes: BTreeMap::new(),
            sampler: SamplerKind::ParentBasedAlwaysOn,
            sampler_arg: None,
            metrics: true,
            metrics_interval_ms: DEFAULT_METRICS_INTERVAL_MS,
            export_timeout_ms: DEFAULT_EXPORT_TIMEOUT_MS,
            log_format: LogFormat::Text,
            log_filter: DEFAULT_LOG_FILTER.to_owned(),
            prometheus: None,
        }
    }
}

impl TelemetryConfig {
    /// Check the values the type system does not: called at config load, so that
    /// `tetherd validate-config` rejects what `init` would.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        if let Some(r) = self.sampler_arg {
            check_ratio(r).map_err(|reason| TelemetryError::InvalidConfig {
                field: "sampler_arg",
                reason,
            })?;
        }
        if self.service_name.trim().is_empty() {
            return Err(TelemetryError::InvalidConfig {
                field: "service_name",
                reason: "must not be empty".into(),
            });
        }
        if self.metrics_interval_ms == 0 {
            return Err(TelemetryError::InvalidConfig {
                field: "metrics_interval_ms",
                reason: "must be > 0".into(),
            });
        }
        if self.export_timeout_ms == 0 {
            return Err(TelemetryError::InvalidConfig {
                field: "export_timeout_ms",
                reason: "must be > 0".into(),
            });
        }
        if let Some(e) = &self.otlp_endpoint {
            check_endpoint(e).map_err(|reason| TelemetryError::InvalidConfig {
                field: "otlp_endpoint",
                reason,
            })?;
        }
        tracing_subscriber::EnvFilter::builder()
            .parse(&self.log_filter)
            .map_err(|source| TelemetryError::LogFilter {
                filter: self.log_filter.clone(),
                source,
            })?;
        if let Some(p) = &self.prometheus {
            p.validate()?;
        }
        Ok(())
    }

    /// Merge the config with the environment (which wins), per the OpenTelemetry spec:
    ///
    /// - traces go to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as given, else to
    ///   `OTEL_EXPORTER_OTLP_ENDPOINT`, else to `otlp_endpoint`, the last two with
    ///   `/v1/traces` appended for HTTP; metrics likewise with the `METRICS` variable and
    ///   `/v1/metrics`, and only when `metrics` is on;
    /// - `OTEL_SDK_DISABLED=true` turns both exports off, and the scrape endpoint;
    /// - `service.name` is `OTEL_SERVICE_NAME`, else `service.name` from
    ///   `OTEL_RESOURCE_ATTRIBUTES`, else `service_name`.
    pub fn resolve(&self, env: &dyn EnvSource) -> Result<ResolvedTelemetry, TelemetryError> {
        self.validate()?;

        let protocol = match env.get_nonempty(OTEL_EXPORTER_OTLP_PROTOCOL) {
            Some(v) => OtlpProtocol::parse(&v).ok_or_else(|| TelemetryError::InvalidEnv {
                var: OTEL_EXPORTER_OTLP_PROTOCOL,
                value: v.clone(),
                reason: "expected `http/protobuf` or `grpc`".into(),
            })?,
            None => self.otlp_protocol.unwrap_or(OtlpProtocol::HttpProtobuf),
        };

        let disabled = match env.get_nonempty(OTEL_SDK_DISABLED) {
            Some(v) => parse_bool(&v).ok_or_else(|| TelemetryError::InvalidEnv {
                var: OTEL_SDK_DISABLED,
                value: v.clone(),
                reason: "expected `true` or `false`".into(),
            })?,
            None => false,
        };

        let base = match env.get_nonempty(OTEL_EXPORTER_OTLP_ENDPOINT) {
            Some(v) => {
                check_endpoint(&v).map_err(|reason| TelemetryError::InvalidEnv {
                    var: OTEL_EXPORTER_OTLP_ENDPOINT,
                    value: v.clone(),
                    reason,
                })?;
                Some(v)
            }
            None => self.otlp_endpoint.clone(),
        };
        let signal = |var: &'static str, path: &str| -> Result<Option<String>, TelemetryError> {
            if disabled {
                return Ok(None);
            }
            if let Some(v) = env.get_nonempty(var) {
                check_endpoint(&v).map_err(|reason| TelemetryError::InvalidEnv {
                    var,
                    value: v.clone(),
                    reason,
                })?;
                return Ok(Some(v));
            }
            Ok(base.as_deref().map(|b| match protocol {
                OtlpProtocol::HttpProtobuf => format!("{}{path}", b.trim_end_matches('/')),
                OtlpProtocol::Grpc => b.to_owned(),
            }))
        };
        let traces_endpoint = signal(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, HTTP_TRACES_PATH)?;
        let metrics_endpoint = if self.metrics {
            signal(OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, HTTP_METRICS_PATH)?
        } else {
            None
        };

        let sampler = match env.get_nonempty(OTEL_TRACES_SAMPLER) {
            Some(v) => SamplerKind::parse(&v).ok_or_else(|| TelemetryError::InvalidEnv {
                var: OTEL_TRACES_SAMPLER,
                value: v.clone(),
                reason:
                    "expected always_on, always_off, traceidratio or parentbased_{always_on,always_off,traceidratio}"
                        .into(),
            })?,
            None => self.sampler,
        };
        let sampler_ratio = match env.get_nonempty(OTEL_TRACES_SAMPLER_ARG) {
            Some(v) => v
                .parse::<f64>()
                .map_err(|e| e.to_string())
                .and_then(|r| check_ratio(r).map(|()| r))
                .map_err(|reason| TelemetryError::InvalidEnv {
                    var: OTEL_TRACES_SAMPLER_ARG,
                    value: v.clone(),
                    reason,
                })?,
            None => self.sampler_arg.unwrap_or(1.0),
        };

        let mut resource = self.resource_attributes.clone();
        let mut service_name = self.service_name.clone();
        if let Some(v) = env.get_nonempty(OTEL_RESOURCE_ATTRIBUTES) {
            let parsed =
                parse_resource_attributes(&v).map_err(|reason| TelemetryError::InvalidEnv {
                    var: OTEL_RESOURCE_ATTRIBUTES,
                    value: v.clone(),
                    reason,
                })?;
            for (k, val) in parsed {
                if k == "service.name" {
                    service_name = val;
                } else {
                    resource.insert(k, val);
                }
            }
        }
        if let Some(v) = env.get_nonempty(OTEL_SERVICE_NAME) {
            service_name = v;
        }
        resource.insert("service.name".to_owned(), service_name);

        let metrics_interval = Duration::from_millis(
            env_millis(env, OTEL_METRIC_EXPORT_INTERVAL)?.unwrap_or(self.metrics_interval_ms),
        );
        let export_timeout = Duration::from_millis(
            env_millis(env, OTEL_EXPORTER_OTLP_TIMEOUT)?.unwrap_or(self.export_timeout_ms),
        );

        let log_filter = env
            .get_nonempty(RUST_LOG)
            .unwrap_or_else(|| self.log_filter.clone());
        tracing_subscriber::EnvFilter::builder()
            .parse(&log_filter)
            .map_err(|source| TelemetryError::LogFilter {
                filter: log_filter.clone(),
                source,
            })?;

        Ok(ResolvedTelemetry {
            traces_endpoint,
            metrics_endpoint,
            protocol,
            resource,
            sampler,
            sampler_ratio,
            metrics_interval,
            export_timeout,
            log_format: self.log_format,
            log_filter,
            prometheus: if disabled {
                None
            } else {
                self.prometheus.clone()
            },
        })
    }
}

// === impl OtlpProtocol ===

impl OtlpProtocol {
    /// Parse the `OTEL_EXPORTER_OTLP_PROTOCOL` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "http/protobuf" => Some(Self::HttpProtobuf),
            "grpc" => Some(Self::Grpc),
            _ => None,
        }
    }

    /// The `OTEL_EXPORTER_OTLP_PROTOCOL` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }
}

impl fmt::Display for OtlpProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl SamplerKind ===

impl SamplerKind {
    /// Parse the `OTEL_TRACES_SAMPLER` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "always_on" => Some(Self::AlwaysOn),
            "always_off" => Some(Self::AlwaysOff),
            "traceidratio" => Some(Self::TraceIdRatio),
            "parentbased_always_on" => Some(Self::ParentBasedAlwaysOn),
            "parentbased_always_off" => Some(Self::ParentBasedAlwaysOff),
            "parentbased_traceidratio" => Some(Self::ParentBasedTraceIdRatio),
            _ => None,
        }
    }

    /// The SDK sampler.
    pub fn build(self, ratio: f64) -> opentelemetry_sdk::trace::Sampler {
        use opentelemetry_sdk::trace::Sampler;
        match self {
            Self::AlwaysOn => Sampler::AlwaysOn,
            Self::AlwaysOff => Sampler::AlwaysOff,
            Self::TraceIdRatio => Sampler::TraceIdRatioBased(ratio),
            Self::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            Self::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
            Self::ParentBasedTraceIdRatio => {
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
            }
        }
    }
}

// === impl ResolvedTelemetry ===

impl ResolvedTelemetry {
    /// Whether anything is pushed over OTLP.
    pub fn exports(&self) -> bool {
        self.traces_endpoint.is_some() || self.metrics_endpoint.is_some()
    }

    /// Whether metrics are kept at all: pushed over OTLP, or served for scraping.
    pub fn keeps_metrics(&self) -> bool {
        self.metrics_endpoint.is_some() || self.prometheus.is_some()
    }

    /// The `service.name` resource attribute.
    pub fn service_name(&self) -> &str {
        self.resource
            .get("service.name")
            .map_or(DEFAULT_SERVICE_NAME, String::as_str)
    }
}

// === parsing helpers ===

fn check_ratio(r: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&r) {
        Ok(())
    } else {
        Err("must be a number in [0, 1]".into())
    }
}

/// An endpoint must be an absolute http(s) URL: a typo here would otherwise only show as
/// export errors in the log, long after start-up.
fn check_endpoint(e: &str) -> Result<(), String> {
    let uri: http::Uri = e
        .parse()
        .map_err(|err: http::uri::InvalidUri| err.to_string())?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http" | "https"), Some(_)) => Ok(()),
        _ => Err("expected an absolute http:// or https:// URL".into()),
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

fn env_millis(env: &dyn EnvSource, var: &'static str) -> Result<Option<u64>, TelemetryError> {
    match env.get_nonempty(var) {
        None => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(TelemetryError::InvalidEnv {
                var,
                value: v,
                reason: "expected milliseconds > 0".into(),
            }),
        },
    }
}

/// Parse `OTEL_RESOURCE_ATTRIBUTES`: comma-separated `key=value` pairs, values
/// percent-encoded (W3C Baggage octet rules). Any malformed pair rejects the whole value.
pub(crate) fn parse_resource_attributes(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("`{pair}` is not key=value"))?;
        let k = k.trim();
        if k.is_empty() {
            return Err(format!("`{pair}` has an empty key"));
        }
        out.push((k.to_owned(), percent_decode(v.trim())?));
    }
    Ok(out)
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .ok_or_else(|| format!("truncated escape in `{s}`"))?;
            let hex = std::str::from_utf8(hex).map_err(|e| e.to_string())?;
            out.push(
                u8::from_str_radix(hex, 16).map_err(|_| format!("bad escape `%{hex}` in `{s}`"))?,
            );
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("`{s}` is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn nothing_configured_exports_nothing() {
        let r = TelemetryConfig::default().resolve(&env(&[])).unwrap();
        assert_eq!(r.traces_endpoint, None);
        assert_eq!(r.metrics_endpoint, None);
        assert!(!r.exports());
        assert_eq!(r.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(r.service_name(), "tetherd");
        assert_eq!(r.sampler, SamplerKind::ParentBasedAlwaysOn);
        assert_eq!(r.metrics_interval, Duration::from_secs(60));
        assert_eq!(r.log_filter, "info");
    }

    #[test]
    fn config_endpoint_gets_signal_paths_for_http() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://collector:4318/".into()),
            ..Default::default()
        };
        let r = cfg.resolve(&env(&[])).unwrap();
        assert_eq!(
            r.traces_endpoint.as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(
            r.metrics_endpoint.as_deref(),
            Some("http://collector:4318/v1/metrics")
        );
    }

    #[test]
    fn endpoint_precedence_signal_then_generic_then_config() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://from-config:4318".into()),
            ..Default::default()
        };
        let generic = env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4318")]);
        let r = cfg.resolve(&generic).unwrap();
        assert_eq!(
            r.traces_endpoint.as_deref(),
            Some("http://generic:4318/v1/traces")
        );
        assert_eq!(
            r.metrics_endpoint.as_deref(),
            Some("http://generic:4318/v1/metrics")
        );

        let both = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://traces:9999/custom",
            ),
        ]);
        let r = cfg.resolve(&both).unwrap();
        // The per-signal variable is used verbatim, with no path appended.
        assert_eq!(
            r.traces_endpoint.as_deref(),
            Some("http://traces:9999/custom")
        );
        assert_eq!(
            r.metrics_endpoint.as_deref(),
            Some("http://generic:4318/v1/metrics")
        );

        // An empty variable counts as unset.
        let empty = env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]);
        let r = cfg.resolve(&empty).unwrap();
        assert_eq!(
            r.traces_endpoint.as_deref(),
            Some("http://from-config:4318/v1/traces")
        );
    }

    #[test]
    fn traces_only_variable_exports_no_metrics() {
        let r = TelemetryConfig::default()
            .resolve(&env(&[(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://t:4318/v1/traces",
            )]))
            .unwrap();
        assert!(r.traces_endpoint.is_some());
        assert_eq!(r.metrics_endpoint, None);
    }

    #[test]
    fn protocol_from_env_overrides_config_and_grpc_takes_no_path() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://c:4317".into()),
            otlp_protocol: Some(OtlpProtocol::HttpProtobuf),
            ..Default::default()
        };
        let r = cfg
            .resolve(&env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]))
            .unwrap();
        assert_eq!(r.protocol, OtlpProtocol::Grpc);
        assert_eq!(r.traces_endpoint.as_deref(), Some("http://c:4317"));
        assert_eq!(r.metrics_endpoint.as_deref(), Some("http://c:4317"));

        let err = cfg
            .resolve(&env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]))
            .unwrap_err();
        assert!(matches!(
            err,
            TelemetryError::InvalidEnv {
                var: "OTEL_EXPORTER_OTLP_PROTOCOL",
                ..
            }
        ));
    }

    #[test]
    fn sdk_disabled_turns_exports_off() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://c:4318".into()),
            ..Default::default()
        };
        for v in ["true", "TRUE", " true "] {
            let r = cfg.resolve(&env(&[("OTEL_SDK_DISABLED", v)])).unwrap();
            assert!(!r.exports(), "{v}");
        }
        assert!(
            cfg.resolve(&env(&[("OTEL_SDK_DISABLED", "false")]))
                .unwrap()
                .exports()
        );
        let err = cfg
            .resolve(&env(&[("OTEL_SDK_DISABLED", "yes")]))
            .unwrap_err();
        assert!(matches!(
            err,
            TelemetryError::InvalidEnv {
                var: "OTEL_SDK_DISABLED",
                ..
            }
        ));
    }

    #[test]
    fn metrics_off_in_config_means_no_metric_endpoint() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://c:4318".into()),
            metrics: false,
            ..Default::default()
        };
        let r = cfg
            .resolve(&env(&[(
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                "http://m:1/v1/metrics",
            )]))
            .unwrap();
        assert_eq!(r.metrics_endpoint, None);
        assert!(r.traces_endpoint.is_some());
    }

    #[test]
    fn sampler_from_env_and_config() {
        let cfg = TelemetryConfig {
            sampler: SamplerKind::TraceIdRatio,
            sampler_arg: Some(0.25),
            ..Default::default()
        };
        let r = cfg.resolve(&env(&[])).unwrap();
        assert_eq!(
            (r.sampler, r.sampler_ratio),
            (SamplerKind::TraceIdRatio, 0.25)
        );

        let r = cfg
            .resolve(&env(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
            ]))
            .unwrap();
        assert_eq!(
            (r.sampler, r.sampler_ratio),
            (SamplerKind::ParentBasedTraceIdRatio, 0.5)
        );

        for (var, bad) in [
            ("OTEL_TRACES_SAMPLER", "sometimes"),
            ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
            ("OTEL_TRACES_SAMPLER_ARG", "half"),
        ] {
            let err = cfg.resolve(&env(&[(var, bad)])).unwrap_err();
            assert!(
                matches!(err, TelemetryError::InvalidEnv { var: v, .. } if v == var),
                "{var}={bad}"
            );
        }
        let bad_cfg = TelemetryConfig {
            sampler_arg: Some(-0.1),
            ..Default::default()
        };
        assert!(matches!(
            bad_cfg.validate(),
            Err(TelemetryError::InvalidConfig {
                field: "sampler_arg",
                ..
            })
        ));
    }

    #[test]
    fn sampler_config_spellings_deserialize() {
        #[derive(Deserialize)]
        struct W {
            telemetry: TelemetryConfig,
        }
        let w: W = toml::from_str(
            "[telemetry]\nsampler = \"parentbased_traceidratio\"\nsampler_arg = 0.1\notlp_protocol = \"grpc\"\nlog_format = \"json\"\n",
        )
        .unwrap();
        assert_eq!(w.telemetry.sampler, SamplerKind::ParentBasedTraceIdRatio);
        assert_eq!(w.telemetry.otlp_protocol, Some(OtlpProtocol::Grpc));
        assert_eq!(w.telemetry.log_format, LogFormat::Json);
        assert!(toml::from_str::<W>("[telemetry]\nsampler = \"sometimes\"\n").is_err());
        assert!(
            toml::from_str::<W>("[telemetry]\nendpoint = \"http://x\"\n").is_err(),
            "unknown fields are refused"
        );
    }

    #[test]
    fn resource_attributes_merge_and_service_name_precedence() {
        let mut attrs = BTreeMap::new();
        attrs.insert(
            "deployment.environment.name".to_owned(),
            "staging".to_owned(),
        );
        attrs.insert("team".to_owned(), "infra".to_owned());
        let cfg = TelemetryConfig {
            service_name: "from-config".into(),
            resource_attributes: attrs,
            ..Default::default()
        };

        let r = cfg.resolve(&env(&[])).unwrap();
        assert_eq!(r.service_name(), "from-config");
        assert_eq!(r.resource["team"], "infra");

        let e = env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=prod, host.name=a%2Cb%20c ,service.name=from-attrs",
        )]);
        let r = cfg.resolve(&e).unwrap();
        assert_eq!(r.resource["deployment.environment.name"], "prod");
        assert_eq!(r.resource["host.name"], "a,b c");
        assert_eq!(r.resource["team"], "infra");
        assert_eq!(r.service_name(), "from-attrs");

        let mut e2 = e.clone();
        e2.insert("OTEL_SERVICE_NAME", "from-env");
        assert_eq!(cfg.resolve(&e2).unwrap().service_name(), "from-env");

        for bad in ["novalue", "=x", "k=%zz", "k=%4"] {
            let err = cfg
                .resolve(&env(&[("OTEL_RESOURCE_ATTRIBUTES", bad)]))
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    TelemetryError::InvalidEnv {
                        var: "OTEL_RESOURCE_ATTRIBUTES",
                        ..
                    }
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn intervals_timeouts_and_filter_from_env() {
        let r = TelemetryConfig::default()
            .resolve(&env(&[
                ("OTEL_METRIC_EXPORT_INTERVAL", "250"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "1500"),
                ("RUST_LOG", "tether_daemon=debug,warn"),
            ]))
            .unwrap();
        assert_eq!(r.metrics_interval, Duration::from_millis(250));
        assert_eq!(r.export_timeout, Duration::from_millis(1500));
        assert_eq!(r.log_filter, "tether_daemon=debug,warn");

        let err = TelemetryConfig::default()
            .resolve(&env(&[("OTEL_METRIC_EXPORT_INTERVAL", "0")]))
            .unwrap_err();
        assert!(matches!(
            err,
            TelemetryError::InvalidEnv {
                var: "OTEL_METRIC_EXPORT_INTERVAL",
                ..
            }
        ));
        let err = TelemetryConfig::default()
            .resolve(&env(&[("RUST_LOG", "a=notalevel")]))
            .unwrap_err();
        assert!(matches!(err, TelemetryError::LogFilter { .. }));
    }

    #[test]
    fn the_prometheus_section_and_its_auth_rule() {
        #[derive(Deserialize)]
        struct W {
            telemetry: TelemetryConfig,
        }
        let parse = |text: &str| toml::from_str::<W>(text).map(|w| w.telemetry);
        assert_eq!(
            TelemetryConfig::default().prometheus,
            None,
            "off by default"
        );
        let on = parse("[telemetry.prometheus]\n").unwrap();
        let p = on.prometheus.clone().unwrap();
        assert_eq!(p.listen, "127.0.0.1:9464".parse().unwrap());
        assert!(on.validate().is_ok(), "loopback needs no token");
        assert!(parse("[telemetry.prometheus]\nlisten = \"127.0.0.1:9\"\nport = 1\n").is_err());

        let open = parse("[telemetry.prometheus]\nlisten = \"0.0.0.0:9464\"\n").unwrap();
        assert!(matches!(
            open.validate(),
            Err(TelemetryError::InvalidConfig {
                field: "prometheus.listen",
                ..
            })
        ));
        for ok in [
            "[telemetry.prometheus]\nlisten = \"0.0.0.0:9464\"\nauth_tokens = [\"0123456789abcdef\"]\n",
            "[telemetry.prometheus]\nlisten = \"[::]:9464\"\nallow_unauthenticated = true\n",
        ] {
            parse(ok).unwrap().validate().unwrap();
        }
        let short = parse("[telemetry.prometheus]\nauth_tokens = [\"short\"]\n").unwrap();
        assert!(matches!(
            short.validate(),
            Err(TelemetryError::InvalidConfig {
                field: "prometheus.auth_tokens",
                ..
            })
        ));
        // Resolution carries it, unless the SDK is disabled.
        assert_eq!(on.resolve(&env(&[])).unwrap().prometheus, Some(p));
        let off = on.resolve(&env(&[("OTEL_SDK_DISABLED", "true")])).unwrap();
        assert_eq!(off.prometheus, None);
        assert!(!off.keeps_metrics());
    }

    #[test]
    fn malformed_endpoints_are_refused() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("collector:4318".into()),
            ..Default::default()
        };
        assert!(matches!(
            cfg.validate(),
            Err(TelemetryError::InvalidConfig {
                field: "otlp_endpoint",
                ..
            })
        ));
        let err = TelemetryConfig::default()
            .resolve(&env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "not a url")]))
            .unwrap_err();
        assert!(matches!(
            err,
            TelemetryError::InvalidEnv {
                var: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                ..
            }
        ));
    }
}
