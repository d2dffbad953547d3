//! tetherd in-process with its telemetry installed for real (`telemetry::init`: global
//! subscriber, propagator and meter provider) and pointed at the real OTLP receiver: a
//! request carrying `traceparent` creates a session and runs a `bash` tool call; the trace
//! must continue the caller's, reach the command as `TRACEPARENT`, and arrive with the
//! documented span names, parents and attributes, next to the tool-latency metrics.
//!
//! One test per binary: the global subscriber can be installed once per process.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use tether_daemon::telemetry::{self, TelemetryConfig, names};
use tether_tests::TestDaemon;
use tether_tests::otlp::{OtlpReceiver, metric_point, span};

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

async fn post_traced(d: &TestDaemon, path: &str, body: Value) -> (u16, Value) {
    let r = d
        .http
        .post(d.url(path))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", "caller=1")
        .json(&body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

fn spans_named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_request_is_continued_into_the_sandbox_and_exported() {
    let rx = OtlpReceiver::start();
    let cfg = TelemetryConfig {
        metrics_interval_ms: 60_000,
        ..Default::default()
    };
    let env: HashMap<String, String> = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", rx.http_endpoint()),
        ("OTEL_SERVICE_NAME", "tetherd-e2e".to_owned()),
        ("RUST_LOG", "warn".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let guard = telemetry::init(&cfg, &env).unwrap();
    assert!(guard.exports_traces() && guard.exports_metrics());

    // Explicit, so the test does not depend on `Config::default()` naming a provider.
    let d = TestDaemon::start_with(|c| c.default_provider = "local".to_owned()).await;
    let (st, body) = post_traced(&d, "/v1/sessions", json!({})).await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let (st, body) = post_traced(
        &d,
        &format!("/v1/sessions/{sid}/tool-calls"),
        json!({"calls": [{"id": "c1", "name": "bash", "arguments": {"command": "echo \"tp=$TRACEPARENT ts=$TRACESTATE\""}}]}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let out = body["results"][0]["content"].as_str().unwrap().to_owned();
    assert_eq!(body["results"][0]["is_error"], false, "{body}");
    // A call whose command outlives its deadline: the spans must name the clock that fired.
    let (st, body) = post_traced(
        &d,
        &format!("/v1/sessions/{sid}/tool-calls"),
        json!({"calls": [{"id": "slow", "name": "bash", "arguments": {"command": "echo begun; sleep 30", "timeout_ms": 400}}]}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        body["results"][0]["error"]["code"], "DEADLINE_EXCEEDED",
        "{body}"
    );
    // Pause and resume go through the operation layer: a span and a metric each.
    for op in ["pause", "resume"] {
        let (st, body) = post_traced(&d, &format!("/v1/sessions/{sid}/{op}"), json!({})).await;
        assert_eq!(st, 200, "{op}: {body}");
    }
    d.stop().await;
    assert!(
        guard.shutdown().await,
        "telemetry flush failed; receiver log:\n{}",
        rx.log()
    );

    // The command saw the caller's trace (a span of tetherd's as its parent) and state.
    let tp = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("tp="))
        .unwrap_or_default()
        .to_owned();
    assert!(
        tp.starts_with(&format!("00-{TRACE}-")) && tp.ends_with("-01"),
        "TRACEPARENT in the sandbox: {out:?}"
    );
    assert!(
        !tp.contains(CALLER_SPAN),
        "the command's parent must be a tetherd span: {tp}"
    );
    assert!(
        out.contains("ts=caller=1"),
        "TRACESTATE in the sandbox: {out:?}"
    );

    let spans = rx
        .wait_for_spans(
            |s| {
                [
                    names::TOOL_CALL,
                    names::SANDBOX_CREATE,
                    names::PROCESS_START,
                    names::SANDBOX_PAUSE,
                    names::SANDBOX_RESUME,
                ]
                .iter()
                .all(|n| span(s, n).is_some())
            },
            Duration::from_secs(20),
        )
        .await;
    for s in &spans {
        assert_eq!(s["service"], "tetherd-e2e");
        assert_eq!(s["scope"], "tether");
    }
    // Every request continues the caller's trace, as server spans whose parent is the
    // caller: the create, two tool-call batches, the pause and the resume.
    let requests: Vec<&Value> = spans_named(&spans, names::HTTP_REQUEST)
        .into_iter()
        .filter(|s| s["trace_id"] == TRACE)
        .collect();
    assert_eq!(requests.len(), 5, "{spans:#?}");
    for r in &requests {
        assert_eq!(r["parent_span_id"], CALLER_SPAN);
        assert_eq!(r["span_kind"], 2, "SPAN_KIND_SERVER");
    }
    let span_ids: Vec<&str> = spans
        .iter()
        .map(|s| s["span_id"].as_str().unwrap())
        .collect();
    // The command's TRACEPARENT names a span that was exported in this trace.
    let tp_span = tp.split('-').nth(2).unwrap();
    assert!(
        span_ids.contains(&tp_span),
        "TRACEPARENT span {tp_span} was not exported"
    );

    let create = span(&spans, names::SANDBOX_CREATE).unwrap();
    assert_eq!(create["trace_id"], TRACE);
    assert_eq!(create["attributes"]["session.id"], sid.as_str());
    assert_eq!(create["attributes"]["provider.kind"], "local");
    assert_eq!(create["attributes"]["outcome"], "ok");

    let call = spans
        .iter()
        .find(|s| s["name"] == names::TOOL_CALL && s["attributes"]["tool.call_id"] == "c1")
        .expect("tool.call c1 exported");
    assert_eq!(call["trace_id"], TRACE);
    assert_eq!(call["attributes"]["tool.name"], "bash");
    assert_eq!(call["attributes"]["tool.call_id"], "c1");
    assert_eq!(call["attributes"]["outcome"], "ok");
    // tool.call -> tool.batch -> http.request (the tool-calls request).
    let batch = spans
        .iter()
        .find(|s| s["span_id"] == call["parent_span_id"])
        .expect("tool.call's parent exported");
    assert_eq!(batch["name"], names::TOOL_BATCH);
    let req = spans
        .iter()
        .find(|s| s["span_id"] == batch["parent_span_id"])
        .expect("tool.batch's parent exported");
    assert_eq!(req["name"], names::HTTP_REQUEST);
    assert_eq!(req["parent_span_id"], CALLER_SPAN);

    let start = span(&spans, names::PROCESS_START).unwrap();
    assert_eq!(start["trace_id"], TRACE);
    assert_eq!(start["attributes"]["outcome"], "ok");

    // The timed-out call: tool.call and process.stream carry the code and the clock.
    let spans = rx
        .wait_for_spans(
            |s| {
                s.iter().any(|x| {
                    x["name"] == names::TOOL_CALL && x["attributes"]["tool.call_id"] == "slow"
                })
            },
            Duration::from_secs(20),
        )
        .await;
    let slow = spans
        .iter()
        .find(|s| s["name"] == names::TOOL_CALL && s["attributes"]["tool.call_id"] == "slow")
        .unwrap();
    assert_eq!(
        slow["attributes"]["outcome"], "DEADLINE_EXCEEDED",
        "{slow:#}"
    );
    assert_eq!(
        slow["attributes"]["error.code"], "DEADLINE_EXCEEDED",
        "{slow:#}"
    );
    assert_eq!(slow["attributes"]["timeout.clock"], "total", "{slow:#}");
    let stream = spans
        .iter()
        .find(|s| s["name"] == names::PROCESS_STREAM && s["attributes"]["timeout.clock"] == "total")
        .unwrap_or_else(|| panic!("a process.stream span with timeout.clock=total: {spans:#?}"));
    assert_eq!(stream["attributes"]["outcome"], "DEADLINE_EXCEEDED");
    assert_eq!(stream["trace_id"], TRACE);

    // Metrics from the same run (the shutdown flush exported them).
    let points = rx
        .wait_for_metrics(
            |p| metric_point(p, "tether.tool.duration", &[("tool.name", "bash")]).is_some(),
            Duration::from_secs(20),
        )
        .await;
    let tool = metric_point(
        &points,
        "tether.tool.duration",
        &[
            ("tool.name", "bash"),
            ("provider.kind", "local"),
            ("outcome", "ok"),
        ],
    )
    .unwrap_or_else(|| panic!("{points:#?}"));
    assert_eq!(tool["count"], 1);
    assert!(tool["sum"].as_f64().unwrap() > 0.0);
    let create_op = metric_point(
        &points,
        "tether.remote_op.duration",
        &[("remote.op", "sandbox.create"), ("outcome", "ok")],
    );
    assert!(create_op.is_some(), "{points:#?}");
    for op in [names::SANDBOX_PAUSE, names::SANDBOX_RESUME] {
        let point = metric_point(
            &points,
            "tether.remote_op.duration",
            &[
                ("remote.op", op),
                ("provider.kind", "local"),
                ("outcome", "ok"),
            ],
        )
        .unwrap_or_else(|| panic!("{op}: {points:#?}"));
        assert_eq!(point["count"], 1, "{op}");
        let sp = span(&spans, op).unwrap();
        assert_eq!(sp["attributes"]["session.id"], json!(sid), "{sp:#}");
        assert_eq!(sp["attributes"]["outcome"], "ok", "{sp:#}");
        assert_eq!(sp["trace_id"], TRACE, "{sp:#}");
    }
    assert!(
        metric_point(&points, "tether.sessions.live", &[]).is_some(),
        "{points:#?}"
    );
    let timeouts = metric_point(
        &points,
        "tether.timeouts",
        &[("timeout.clock", "total"), ("provider.kind", "local")],
    )
    .unwrap_or_else(|| panic!("timeouts by clock: {points:#?}"));
    assert_eq!(timeouts["value"], 1, "{timeouts:#}");
}
