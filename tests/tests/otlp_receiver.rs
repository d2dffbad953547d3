//! The daemon's telemetry pipeline (`tether_daemon::telemetry`, i.e. opentelemetry-otlp
//! over HTTP/protobuf and gRPC) against the real OTLP receiver: span names, parent links,
//! attributes, status, trace-context continuation, resource, and metrics.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use tether_daemon::telemetry::{self, OtlpProtocol, TelemetryConfig};
use tether_tests::otlp::{OtlpReceiver, metric_point, span};
use tracing::Instrument as _;

const WAIT: Duration = Duration::from_secs(20);
const INBOUND_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const INBOUND_SPAN: &str = "00f067aa0ba902b7";

/// Emit one request's worth of telemetry through a pipeline pointed at `rx`, flush it,
/// and return the trace context the tool call would inject into a remote command.
async fn emit(rx: &OtlpReceiver, protocol: OtlpProtocol) -> tether_provider::TraceContext {
    let endpoint = match protocol {
        OtlpProtocol::HttpProtobuf => rx.http_endpoint(),
        OtlpProtocol::Grpc => rx.grpc_endpoint(),
    };
    let cfg = TelemetryConfig {
        otlp_endpoint: Some(endpoint),
        otlp_protocol: Some(protocol),
        export_timeout_ms: 5_000,
        ..Default::default()
    };
    // Service name and resource come from the standard variables, as in production.
    let env: HashMap<String, String> = [
        ("OTEL_SERVICE_NAME", "tetherd-test"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=ci,service.namespace=tether",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let t = telemetry::build(&cfg, &env).unwrap();
    telemetry::install_propagator();
    let metrics = t.guard.metrics();

    let injected = {
        let _sub = tracing::dispatcher::set_default(&t.dispatch);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            "traceparent",
            format!("00-{INBOUND_TRACE}-{INBOUND_SPAN}-01")
                .parse()
                .unwrap(),
        );
        let root = tracing::info_span!(
            "http.request",
            http.route = "/v1/sessions/{id}/tool-calls",
            request.id = "req-1"
        );
        assert!(telemetry::set_parent(&root, &headers));
        async {
            let call = tracing::info_span!(
                "tool.call",
                session.id = "sess-1",
                tool.name = "bash",
                tool.call_id = "call-1",
                provider.kind = "local",
                outcome = tracing::field::Empty,
            );
            let injected = async {
                let op = tracing::info_span!(
                    "process.start",
                    sandbox.id = "sbx-1",
                    provider.kind = "local"
                );
                let injected =
                    async { telemetry::current_trace_context(&tracing::Span::current()) }
                        .instrument(op)
                        .await;
                let stream = tracing::info_span!(
                    "process.stream",
                    bytes.out = 42_i64,
                    exit_code = tracing::field::Empty,
                    timeout.clock = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                    error.code = tracing::field::Empty,
                );
                async {
                    let s = tracing::Span::current();
                    s.record("timeout.clock", "output_idle");
                    s.record("error.code", "IDLE_TIMEOUT");
                    s.record("otel.status_code", "ERROR");
                }
                .instrument(stream)
                .await;
                tracing::Span::current().record("outcome", "IDLE_TIMEOUT");
                injected
            }
            .instrument(call)
            .await;
            metrics.tool_call("bash", "local", "IDLE_TIMEOUT", Duration::from_millis(250));
            metrics.tool_call("bash", "local", "IDLE_TIMEOUT", Duration::from_millis(750));
            metrics.remote_op("process.start", "local", "ok", Duration::from_millis(20));
            metrics.timeout(tether_protocol::Clock::OutputIdle, "local");
            metrics.sandboxes_live(1, "local");
            metrics.sessions_live(1);
            injected
        }
        .instrument(root)
        .await
    };
    assert!(
        t.guard.shutdown().await,
        "flush failed; receiver log:\n{}",
        rx.log()
    );
    injected
}

async fn assert_exported(protocol: OtlpProtocol) {
    let rx = OtlpReceiver::start();
    let injected = emit(&rx, protocol).await;
    let transport = match protocol {
        OtlpProtocol::HttpProtobuf => "http",
        OtlpProtocol::Grpc => "grpc",
    };

    let spans = rx
        .wait_for_spans(
            |s| {
                [
                    "http.request",
                    "tool.call",
                    "process.start",
                    "process.stream",
                ]
                .iter()
                .all(|n| span(s, n).is_some())
            },
            WAIT,
        )
        .await;
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let root = span(&spans, "http.request").unwrap();
    let call = span(&spans, "tool.call").unwrap();
    let start = span(&spans, "process.start").unwrap();
    let stream = span(&spans, "process.stream").unwrap();

    for s in &spans {
        assert_eq!(s["transport"], transport);
        assert_eq!(s["service"], "tetherd-test");
        assert_eq!(s["scope"], "tether");
        assert_eq!(s["resource"]["deployment.environment.name"], "ci");
        assert_eq!(s["resource"]["service.namespace"], "tether");
        // The inbound request's trace is continued all the way down.
        assert_eq!(s["trace_id"], INBOUND_TRACE);
    }
    // Parent links: inbound caller -> http.request -> tool.call -> process.{start,stream}.
    assert_eq!(root["parent_span_id"], INBOUND_SPAN);
    assert_eq!(call["parent_span_id"], root["span_id"]);
    assert_eq!(start["parent_span_id"], call["span_id"]);
    assert_eq!(stream["parent_span_id"], call["span_id"]);

    // Fields, including ones recorded after creation, are attributes with their types.
    assert_eq!(call["attributes"]["tool.name"], "bash");
    assert_eq!(call["attributes"]["tool.call_id"], "call-1");
    assert_eq!(call["attributes"]["session.id"], "sess-1");
    assert_eq!(call["attributes"]["outcome"], "IDLE_TIMEOUT");
    assert_eq!(start["attributes"]["sandbox.id"], "sbx-1");
    assert_eq!(stream["attributes"]["bytes.out"], 42);
    assert_eq!(stream["attributes"]["timeout.clock"], "output_idle");
    assert_eq!(stream["attributes"]["error.code"], "IDLE_TIMEOUT");
    // otel.status_code = "ERROR" sets the span status (2 = STATUS_CODE_ERROR), others unset.
    assert_eq!(stream["status_code"], 2);
    assert_eq!(call["status_code"], 0);
    assert!(stream["duration_ns"].as_u64().unwrap() > 0);

    // What a remote command gets in TRACEPARENT names the process.start span.
    let tp = injected.traceparent.expect("traceparent");
    assert_eq!(
        tp,
        format!(
            "00-{INBOUND_TRACE}-{}-01",
            start["span_id"].as_str().unwrap()
        )
    );

    // Metrics: the shutdown flush exported one collection.
    let points = rx
        .wait_for_metrics(
            |p| metric_point(p, "tether.sessions.live", &[]).is_some(),
            WAIT,
        )
        .await;
    let tool = metric_point(
        &points,
        "tether.tool.duration",
        &[
            ("tool.name", "bash"),
            ("provider.kind", "local"),
            ("outcome", "IDLE_TIMEOUT"),
        ],
    )
    .unwrap_or_else(|| panic!("no tool duration point in {points:#?}"));
    assert_eq!(tool["transport"], transport);
    assert_eq!(tool["type"], "histogram");
    assert_eq!(tool["unit"], "s");
    assert_eq!(tool["count"], 2);
    assert!((tool["sum"].as_f64().unwrap() - 1.0).abs() < 1e-9, "{tool}");
    assert_eq!(
        tool["explicit_bounds"],
        json!(telemetry::DURATION_BUCKETS_S)
    );
    // 0.25 s lands in the (0.1, 0.25] bucket, 0.75 s in (0.5, 1.0].
    let buckets: Vec<u64> = tool["bucket_counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(buckets.iter().sum::<u64>(), 2);
    assert_eq!(buckets[5], 1, "{buckets:?}");
    assert_eq!(buckets[7], 1, "{buckets:?}");

    let op = metric_point(
        &points,
        "tether.remote_op.duration",
        &[
            ("remote.op", "process.start"),
            ("provider.kind", "local"),
            ("outcome", "ok"),
        ],
    )
    .unwrap();
    assert_eq!(op["count"], 1);

    let timeouts = metric_point(
        &points,
        "tether.timeouts",
        &[("timeout.clock", "output_idle"), ("provider.kind", "local")],
    )
    .unwrap();
    assert_eq!(
        (
            timeouts["type"].clone(),
            timeouts["monotonic"].clone(),
            timeouts["value"].clone()
        ),
        (json!("sum"), json!(true), json!(1))
    );

    let sandboxes = metric_point(
        &points,
        "tether.sandboxes.live",
        &[("provider.kind", "local")],
    )
    .unwrap();
    assert_eq!(
        (sandboxes["monotonic"].clone(), sandboxes["value"].clone()),
        (json!(false), json!(1))
    );
    let sessions = metric_point(&points, "tether.sessions.live", &[]).unwrap();
    assert_eq!(sessions["value"], 1);
    for p in &points {
        assert_eq!(p["service"], "tetherd-test", "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_and_metrics_arrive_over_http_protobuf() {
    assert_exported(OtlpProtocol::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_and_metrics_arrive_over_grpc() {
    assert_exported(OtlpProtocol::Grpc).await;
}

/// The receiver's own OTLP/JSON path (hex ids) and its refusal of garbage, as a collector
/// would answer.
#[tokio::test]
async fn receiver_takes_otlp_json_and_refuses_garbage() {
    let rx = OtlpReceiver::start();
    let http = reqwest::Client::new();
    let base = rx.http_endpoint();

    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    let body = json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-client"}}]},
        "scopeSpans": [{"scope": {"name": "s"}, "spans": [{
            "traceId": INBOUND_TRACE, "spanId": INBOUND_SPAN, "name": "from-json",
            "startTimeUnixNano": "1000", "endTimeUnixNano": "3000",
            "attributes": [{"key": "n", "value": {"intValue": "7"}}]
        }]}]
    }]});
    let r = http
        .post(format!("{base}/v1/traces"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let metrics_body = json!({"resourceMetrics": [{"scopeMetrics": [{"metrics": [{
        "name": "m", "unit": "1", "gauge": {"dataPoints": [{"asDouble": 2.5}]}
    }]}]}]});
    let r = http
        .post(format!("{base}/v1/metrics"))
        .json(&metrics_body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let bad = http
        .post(format!("{base}/v1/traces"))
        .header("content-type", "application/x-protobuf")
        .body(vec![0xff_u8, 0xff, 0xff])
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let nowhere = http
        .post(format!("{base}/v1/logs"))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(nowhere.status(), 404);

    let spans = rx.wait_for_spans(|s| !s.is_empty(), WAIT).await;
    assert_eq!(
        spans.len(),
        1,
        "the garbage body must not have produced a span: {spans:?}"
    );
    let s: &Value = &spans[0];
    assert_eq!(
        (
            s["name"].as_str(),
            s["trace_id"].as_str(),
            s["span_id"].as_str()
        ),
        (Some("from-json"), Some(INBOUND_TRACE), Some(INBOUND_SPAN))
    );
    assert_eq!(s["attributes"]["n"], 7);
    assert_eq!(s["duration_ns"], 2000);
    assert_eq!(s["service"], "json-client");
    let m = rx.wait_for_metrics(|p| !p.is_empty(), WAIT).await;
    assert_eq!(
        (
            m[0]["name"].as_str(),
            m[0]["type"].as_str(),
            m[0]["value"].as_f64()
        ),
        (Some("m"), Some("gauge"), Some(2.5))
    );
}
