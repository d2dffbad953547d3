//! tether's metric instruments, built from the global meter provider.
//!
//! Every label comes from a bounded set (tool names, provider kinds, `ok` or an
//! `ErrorCode`, remote-op span names, clock names) so that the series count stays bounded
//! no matter what the sandboxes do. [`INSTRUMENTS`] describes each instrument; the
//! Prometheus names a collector derives from them are computed by
//! [`InstrumentSpec::prometheus_series`] (the dashboards in `deploy/` are checked against it).

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};

use super::names;

/// The instrumentation scope of every tether instrument.
pub const METER_NAME: &str = "tether";

/// `tool.call` duration, by tool, provider and outcome.
pub const TOOL_DURATION: &str = "tether.tool.duration";
/// Remote (provider) operation duration, by operation, provider and outcome.
pub const REMOTE_OP_DURATION: &str = "tether.remote_op.duration";
/// Expired clocks, by clock and provider.
pub const TIMEOUTS: &str = "tether.timeouts";
/// Sandboxes currently leased, by provider.
pub const SANDBOXES_LIVE: &str = "tether.sandboxes.live";
/// Sessions currently open.
pub const SESSIONS_LIVE: &str = "tether.sessions.live";

/// Histogram bucket bounds for durations, in seconds: from a 5 ms file stat to a
/// 10 minute build, the range tool calls and remote operations actually span.
pub const DURATION_BUCKETS_S: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// The kind of an instrument, which decides its Prometheus shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstrumentKind {
    /// A histogram: `_bucket`, `_sum`, `_count` series.
    Histogram,
    /// A monotonic counter: a `_total` series.
    Counter,
    /// An up-down counter: a gauge-like series with no suffix.
    UpDownCounter,
}

/// The description of one instrument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstrumentSpec {
    /// The OTel instrument name.
    pub name: &'static str,
    /// The UCUM unit (`s`, or an annotation such as `{timeout}`).
    pub unit: &'static str,
    /// Its kind.
    pub kind: InstrumentKind,
    /// Its description.
    pub description: &'static str,
    /// Its attribute keys.
    pub labels: &'static [&'static str],
}

/// Every instrument tether exports.
pub const INSTRUMENTS: &[InstrumentSpec] = &[
    InstrumentSpec {
        name: TOOL_DURATION,
        unit: "s",
        kind: InstrumentKind::Histogram,
        description: "Duration of tool calls, from dispatch to result.",
        labels: &[names::TOOL_NAME, names::PROVIDER_KIND, names::OUTCOME],
    },
    InstrumentSpec {
        name: REMOTE_OP_DURATION,
        unit: "s",
        kind: InstrumentKind::Histogram,
        description: "Duration of remote (provider) operations.",
        labels: &[names::REMOTE_OP, names::PROVIDER_KIND, names::OUTCOME],
    },
    InstrumentSpec {
        name: TIMEOUTS,
        unit: "{timeout}",
        kind: InstrumentKind::Counter,
        description: "Expired clocks (connect, transport idle, output idle, total).",
        labels: &[names::TIMEOUT_CLOCK, names::PROVIDER_KIND],
    },
    InstrumentSpec {
        name: SANDBOXES_LIVE,
        unit: "{sandbox}",
        kind: InstrumentKind::UpDownCounter,
        description: "Sandboxes currently leased.",
        labels: &[names::PROVIDER_KIND],
    },
    InstrumentSpec {
        name: SESSIONS_LIVE,
        unit: "{session}",
        kind: InstrumentKind::UpDownCounter,
        description: "Sessions currently open.",
        labels: &[],
    },
];

// === impl InstrumentSpec ===

impl InstrumentSpec {
    /// The base Prometheus metric name the OpenTelemetry Collector's `prometheus` exporter
    /// gives this instrument (its default translation: non-alphanumerics become `_`, the
    /// unit is appended as a word, annotations in braces are dropped, and monotonic counters
    /// get `_total`).
    pub fn prometheus_name(&self) -> String {
        let mut name: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        if let Some(unit) = prometheus_unit(self.unit)
            && !name.ends_with(&format!("_{unit}"))
        {
            name.push('_');
            name.push_str(unit);
        }
        if self.kind == InstrumentKind::Counter {
            name.push_str("_total");
        }
        name
    }

    /// Every series name the instrument produces in Prometheus.
    pub fn prometheus_series(&self) -> Vec<String> {
        let base = self.prometheus_name();
        match self.kind {
            InstrumentKind::Histogram => {
                vec![
                    format!("{base}_bucket"),
                    format!("{base}_sum"),
                    format!("{base}_count"),
                ]
            }
            InstrumentKind::Counter | InstrumentKind::UpDownCounter => vec![base],
        }
    }

    /// The Prometheus label names of its attributes.
    pub fn prometheus_labels(&self) -> Vec<String> {
        self.labels.iter().map(|l| l.replace('.', "_")).collect()
    }
}

/// The word the collector appends for a UCUM unit; `None` for annotations and `1`.
fn prometheus_unit(unit: &str) -> Option<&'static str> {
    match unit {
        "s" => Some("seconds"),
        "ms" => Some("milliseconds"),
        "By" => Some("bytes"),
        _ => None,
    }
}

/// tether's instruments. Cheap to clone; recording is lock-free.
///
/// Build it after `telemetry::init` (it binds to the global meter provider at
/// construction); when telemetry is off the global provider is a no-op and so is every
/// recording.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Instruments>,
}

#[derive(Debug)]
struct Instruments {
    tool_duration: Histogram<f64>,
    remote_op_duration: Histogram<f64>,
    timeouts: Counter<u64>,
    sandboxes_live: UpDownCounter<i64>,
    sessions_live: UpDownCounter<i64>,
}

// === impl Metrics ===

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Instruments from the global meter provider.
    pub fn new() -> Self {
        let scope = opentelemetry::InstrumentationScope::builder(METER_NAME)
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        Self::from_meter(&opentelemetry::global::meter_with_scope(scope))
    }

    /// Instruments from a given meter (tests use a local provider).
    pub fn from_meter(meter: &Meter) -> Self {
        let spec = |name: &str| INSTRUMENTS.iter().find(|s| s.name == name).copied();
        let describe =
            |name: &'static str| spec(name).map_or(("", ""), |s| (s.unit, s.description));
        let histogram = |name: &'static str| {
            let (unit, description) = describe(name);
            meter
                .f64_histogram(name)
                .with_unit(unit)
                .with_description(description)
                .with_boundaries(DURATION_BUCKETS_S.to_vec())
                .build()
        };
        let updown = |name: &'static str| {
            let (unit, description) = describe(name);
            meter
                .i64_up_down_counter(name)
                .with_unit(unit)
                .with_description(description)
                .build()
        };
        let (timeout_unit, timeout_description) = describe(TIMEOUTS);
        Self {
            inner: Arc::new(Instruments {
                tool_duration: histogram(TOOL_DURATION),
                remote_op_duration: histogram(REMOTE_OP_DURATION),
                timeouts: meter
                    .u64_counter(TIMEOUTS)
                    .with_unit(timeout_unit)
                    .with_description(timeout_description)
                    .build(),
                sandboxes_live: updown(SANDBOXES_LIVE),
                sessions_live: updown(SESSIONS_LIVE),
            }),
        }
    }

    /// Record one tool call. `outcome` is `"ok"` or an `ErrorCode` string.
    pub fn tool_call(&self, tool: &str, provider: &str, outcome: &str, dur: Duration) {
        self.inner.tool_duration.record(
            dur.as_secs_f64(),
            &[
                KeyValue::new(names::TOOL_NAME, tool.to_owned()),
                KeyValue::new(names::PROVIDER_KIND, provider.to_owned()),
                KeyValue::new(names::OUTCOME, outcome.to_owned()),
            ],
        );
    }

    /// Record one remote operation. `op` is one of [`names::REMOTE_OPS`].
    pub fn remote_op(&self, op: &str, provider: &str, outcome: &str, dur: Duration) {
        self.inner.remote_op_duration.record(
            dur.as_secs_f64(),
            &[
                KeyValue::new(names::REMOTE_OP, op.to_owned()),
                KeyValue::new(names::PROVIDER_KIND, provider.to_owned()),
                KeyValue::new(names::OUTCOME, outcome.to_owned()),
            ],
        );
    }

    /// Count one expired clock.
    pub fn timeout(&self, clock: tether_provider::Clock, provider: &str) {
        self.inner.timeouts.add(
            1,
            &[
                KeyValue::new(names::TIMEOUT_CLOCK, clock.name()),
                KeyValue::new(names::PROVIDER_KIND, provider.to_owned()),
            ],
        );
    }

    /// A sandbox was leased (`+1`) or released (`-1`).
    pub fn sandboxes_live(&self, delta: i64, provider: &str) {
        self.inner.sandboxes_live.add(
            delta,
            &[KeyValue::new(names::PROVIDER_KIND, provider.to_owned())],
        );
    }

    /// A session was opened (`+1`) or ended (`-1`).
    pub fn sessions_live(&self, delta: i64) {
        self.inner.sessions_live.add(delta, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_names_follow_the_collector_translation() {
        let series: Vec<String> = INSTRUMENTS
            .iter()
            .flat_map(InstrumentSpec::prometheus_series)
            .collect();
        assert_eq!(
            series,
            [
                "tether_tool_duration_seconds_bucket",
                "tether_tool_duration_seconds_sum",
                "tether_tool_duration_seconds_count",
                "tether_remote_op_duration_seconds_bucket",
                "tether_remote_op_duration_seconds_sum",
                "tether_remote_op_duration_seconds_count",
                "tether_timeouts_total",
                "tether_sandboxes_live",
                "tether_sessions_live",
            ]
        );
        assert_eq!(
            INSTRUMENTS[0].prometheus_labels(),
            ["tool_name", "provider_kind", "outcome"]
        );
    }

    #[test]
    fn recording_without_a_provider_is_a_noop() {
        // The global provider is the no-op one unless init ran: recording must not panic.
        let m = Metrics::new();
        m.tool_call("bash", "local", "ok", Duration::from_millis(3));
        m.remote_op(
            names::FS_READ,
            "local",
            "FS_NOT_FOUND",
            Duration::from_millis(1),
        );
        m.timeout(tether_provider::Clock::OutputIdle, "local");
        m.sandboxes_live(1, "local");
        m.sessions_live(-1);
    }
}
