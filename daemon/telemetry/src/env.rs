//! The environment variables telemetry honours, and the seam they are read through.
//!
//! Every variable is a named constant here, and every read goes through [`EnvSource`] so
//! that tests hand in a map instead of mutating the process environment.

use std::collections::{BTreeMap, HashMap};

/// Base OTLP endpoint for every signal; for HTTP, `/v1/traces` and `/v1/metrics` are appended.
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// OTLP endpoint for traces only, used exactly as given.
pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// OTLP endpoint for metrics only, used exactly as given.
pub const OTEL_EXPORTER_OTLP_METRICS_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT";
/// `http/protobuf` or `grpc`.
pub const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
/// Export timeout in milliseconds.
pub const OTEL_EXPORTER_OTLP_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
/// The `service.name` resource attribute; wins over every other source.
pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
/// Extra resource attributes: `key=value,key2=value2`, values percent-encoded.
pub const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
/// The trace sampler (`always_on`, `always_off`, `traceidratio`, `parentbased_*`).
pub const OTEL_TRACES_SAMPLER: &str = "OTEL_TRACES_SAMPLER";
/// The sampler's argument (the ratio for the `*traceidratio` samplers).
pub const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
/// `true` turns every exporter off (logs still go to stderr).
pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
/// Interval between metric exports, in milliseconds.
pub const OTEL_METRIC_EXPORT_INTERVAL: &str = "OTEL_METRIC_EXPORT_INTERVAL";
/// The log filter (`tracing_subscriber::EnvFilter` syntax); wins over the config's `log_filter`.
pub const RUST_LOG: &str = "RUST_LOG";

/// Where environment variables come from.
///
/// The daemon passes [`ProcessEnv`]; tests pass a `HashMap`, so no test ever mutates the
/// process environment.
pub trait EnvSource {
    /// The variable's value, if set and valid UTF-8.
    fn get(&self, key: &str) -> Option<String>;

    /// The variable's value, treating an empty or blank value as unset (as the
    /// OpenTelemetry specification asks).
    fn get_nonempty(&self, key: &str) -> Option<String> {
        self.get(key)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

// === impl ProcessEnv ===

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

// === impl EnvSource for maps ===

impl EnvSource for HashMap<String, String> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).cloned()
    }
}

impl EnvSource for HashMap<&str, &str> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).map(|v| (*v).to_owned())
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn get(&self, key: &str) -> Option<String> {
        BTreeMap::get(self, key).cloned()
    }
}

impl<T: EnvSource + ?Sized> EnvSource for &T {
    fn get(&self, key: &str) -> Option<String> {
        (**self).get(key)
    }
}
