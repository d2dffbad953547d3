//! tetherd with its telemetry installed for real and pointed at a collector that accepts
//! connections and never answers (the worst case: every export waits for its timeout).
//! Requests must still complete at their normal speed and succeed, and shutdown must stay
//! bounded.
//!
//! One test per binary: the global subscriber can be installed once per process.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use tether_daemon::telemetry::{self, OtlpProtocol, TelemetryConfig};
use tether_tests::TestDaemon;
use tokio::time::Instant;

/// Longer than any request here may take: a request that waited on an export once would
/// take at least this long.
const EXPORT_TIMEOUT_MS: u64 = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_slows_no_request() {
    // The silent collector: accept, hold, never answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let collector = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(s);
        }
    });

    let cfg = TelemetryConfig {
        otlp_endpoint: Some(endpoint),
        otlp_protocol: Some(OtlpProtocol::HttpProtobuf),
        export_timeout_ms: EXPORT_TIMEOUT_MS,
        metrics_interval_ms: 100,
        ..Default::default()
    };
    let env = HashMap::from([("RUST_LOG".to_owned(), "error".to_owned())]);
    let guard = telemetry::init(&cfg, &env).unwrap();

    // Fill one export batch (512 spans) so that a span export is stuck in flight while the
    // requests run; the 100 ms metric exports get stuck as well.
    for i in 0..600 {
        let _s = tracing::info_span!("warmup", i).entered();
    }

    // Explicit, so the test does not depend on `Config::default()` naming a provider.
    let d = TestDaemon::start_with(|c| c.default_provider = "local".to_owned()).await;
    let sid = d.new_session().await;
    let mut worst = Duration::ZERO;
    for i in 0..5 {
        let started = Instant::now();
        let (st, body) = d
            .post(
                &format!("/v1/sessions/{sid}/tool-calls"),
                json!({"calls": [{"id": format!("c{i}"), "name": "bash", "arguments": {"command": "echo ok"}}]}),
            )
            .await;
        worst = worst.max(started.elapsed());
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["results"][0]["is_error"], false, "{body}");
    }
    eprintln!("slowest tool-call request with a silent collector: {worst:?}");
    assert!(
        accepted.load(Ordering::SeqCst) > 0,
        "no export reached the collector while requests ran"
    );
    assert!(
        worst < Duration::from_millis(EXPORT_TIMEOUT_MS / 2),
        "a request took {worst:?}"
    );

    d.stop().await;
    let started = Instant::now();
    let flushed = guard.shutdown().await;
    let took = started.elapsed();
    eprintln!("telemetry shutdown with a silent collector: {took:?} (flushed: {flushed})");
    assert!(
        took < Duration::from_millis(EXPORT_TIMEOUT_MS + 1_500),
        "shutdown took {took:?}"
    );
    collector.abort();
}
