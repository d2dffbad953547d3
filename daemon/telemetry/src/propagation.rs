//! W3C trace context in and out: continuing an inbound request's trace, and rendering a
//! span's context as `traceparent`/`tracestate` for a remote command's environment.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tether_provider::TraceContext;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C `traceparent` header (and the `TRACEPARENT` variable's value).
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate` header.
pub const TRACESTATE: &str = "tracestate";
/// The environment variable a remote command receives the trace parent in.
pub const TRACEPARENT_ENV: &str = "TRACEPARENT";
/// The environment variable a remote command receives the trace state in.
pub const TRACESTATE_ENV: &str = "TRACESTATE";

/// Install the W3C TraceContext propagator as the global one. `init` calls it; it is
/// idempotent, so tests that exercise propagation without `init` may call it too.
pub fn install_propagator() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
}

/// The OpenTelemetry context an inbound request asks to continue (its `traceparent` and
/// `tracestate`), via the global propagator. Without a valid `traceparent`, an empty
/// context: the request starts a new trace.
pub fn extract_parent(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// Make `span` a child of the trace the request's headers carry, if they carry one.
///
/// Call it right after creating the request's root span and before entering it: a span
/// that has started cannot change its parent. Returns whether a parent was set.
pub fn set_parent(span: &tracing::Span, headers: &http::HeaderMap) -> bool {
    let cx = extract_parent(headers);
    if !cx.span().span_context().is_valid() {
        return false;
    }
    match span.set_parent(cx) {
        Ok(()) => true,
        Err(error) => {
            // Telemetry off (no OpenTelemetry layer) or the span is filtered out: nothing to link.
            tracing::debug!(%error, "Trace parent not applied.");
            false
        }
    }
}

/// `span`'s OpenTelemetry context rendered as W3C strings, for injection into a remote
/// command's environment as `TRACEPARENT`/`TRACESTATE`. Both are `None` when the span is not
/// recorded by OpenTelemetry (telemetry off).
///
/// The rendering always uses the W3C format, whatever the global propagator: the variables
/// are defined by that format.
pub fn current_trace_context(span: &tracing::Span) -> TraceContext {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return TraceContext::default();
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    TraceContext {
        traceparent: carrier.remove(TRACEPARENT),
        tracestate: carrier.remove(TRACESTATE).filter(|s| !s.is_empty()),
    }
}

/// The environment variables that carry `trace` into a remote command.
pub fn trace_env(trace: &TraceContext) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if let Some(tp) = &trace.traceparent {
        env.push((TRACEPARENT_ENV, tp.clone()));
        if let Some(ts) = &trace.tracestate {
            env.push((TRACESTATE_ENV, ts.clone()));
        }
    }
    env
}

/// Reads W3C headers out of an `http::HeaderMap` (values that are not visible ASCII are
/// ignored, as the W3C spec requires).
struct HeaderExtractor<'a>(&'a http::HeaderMap);

// === impl HeaderExtractor ===

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn subscriber(provider: &SdkTracerProvider) -> impl tracing::Subscriber + Send + Sync {
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
    }

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, http::HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn traceparent_round_trips_through_a_span() {
        install_propagator();
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::AlwaysOn)
            .build();
        tracing::subscriber::with_default(subscriber(&provider), || {
            let h = headers(&[(TRACEPARENT, PARENT), (TRACESTATE, "vendor=abc")]);
            let span = tracing::info_span!("http.request");
            assert!(set_parent(&span, &h));
            let child = span.in_scope(|| tracing::info_span!("tool.call"));
            let tc = current_trace_context(&child);
            let tp = tc.traceparent.expect("a traceparent");
            let parts: Vec<&str> = tp.split('-').collect();
            assert_eq!(parts.len(), 4, "{tp}");
            assert_eq!(parts[0], "00");
            // Same trace, a new span of ours, sampled.
            assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736");
            assert_ne!(parts[2], "00f067aa0ba902b7");
            assert_eq!(parts[3], "01");
            assert_eq!(tc.tracestate.as_deref(), Some("vendor=abc"));
            // The root span's own id is the child's parent: the whole chain is continued.
            let root = current_trace_context(&span).traceparent.unwrap();
            assert_eq!(&root[..35], &tp[..35]);
            assert_ne!(root, tp);
        });
    }

    #[test]
    fn the_parents_sampling_decision_is_followed() {
        install_propagator();
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .build();
        tracing::subscriber::with_default(subscriber(&provider), || {
            let unsampled = PARENT.replace("-01", "-00");
            let span = tracing::info_span!("http.request");
            assert!(set_parent(&span, &headers(&[(TRACEPARENT, &unsampled)])));
            let tp = current_trace_context(&span).traceparent.unwrap();
            assert!(tp.ends_with("-00"), "{tp}");
        });
    }

    #[test]
    fn no_or_bad_traceparent_starts_a_new_trace() {
        install_propagator();
        let provider = SdkTracerProvider::builder().build();
        tracing::subscriber::with_default(subscriber(&provider), || {
            for h in [headers(&[]), headers(&[(TRACEPARENT, "00-zz-11-01")])] {
                let span = tracing::info_span!("http.request");
                assert!(!set_parent(&span, &h));
                let tp = current_trace_context(&span).traceparent.unwrap();
                assert!(!tp.contains("4bf92f3577b34da6a3ce929d0e0e4736"));
            }
        });
    }

    #[test]
    fn without_the_otel_layer_there_is_no_context() {
        install_propagator();
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let span = tracing::info_span!("http.request");
            assert!(!set_parent(&span, &headers(&[(TRACEPARENT, PARENT)])));
            assert_eq!(current_trace_context(&span), TraceContext::default());
            assert!(trace_env(&current_trace_context(&span)).is_empty());
        });
    }

    #[test]
    fn trace_env_names_the_variables() {
        let tc = TraceContext {
            traceparent: Some(PARENT.into()),
            tracestate: Some("a=b".into()),
        };
        assert_eq!(
            trace_env(&tc),
            vec![
                ("TRACEPARENT", PARENT.to_owned()),
                ("TRACESTATE", "a=b".to_owned())
            ]
        );
    }

    #[tokio::test]
    async fn context_survives_instrumented_awaits() {
        install_propagator();
        let provider = SdkTracerProvider::builder().build();
        let _g = tracing::subscriber::set_default(subscriber(&provider));
        let span = tracing::info_span!("http.request");
        set_parent(&span, &headers(&[(TRACEPARENT, PARENT)]));
        let tc = async {
            tokio::task::yield_now().await;
            current_trace_context(&tracing::Span::current())
        }
        .instrument(span)
        .await;
        assert!(
            tc.traceparent
                .unwrap()
                .contains("4bf92f3577b34da6a3ce929d0e0e4736")
        );
    }
}
