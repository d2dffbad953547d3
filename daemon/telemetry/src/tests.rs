//! Pipeline tests: what gets installed for which settings, and that a dead or silent
//! collector never slows a request down.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument as _;

use super::*;

fn env(pairs: &[(&'static str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A simulated request: a root span, a batch, 50 tool calls each with a remote op and
/// metrics, all awaited under `instrument`.
async fn request(metrics: &Metrics) {
    let root = tracing::info_span!("http.request", request.id = "r1", session.id = "s1");
    async {
        for i in 0..50 {
            let call = tracing::info_span!(
                "tool.call",
                tool.name = "bash",
                tool.call_id = i,
                outcome = tracing::field::Empty
            );
            async {
                let op = tracing::info_span!("process.start", provider.kind = "local");
                async { tokio::task::yield_now().await }
                    .instrument(op)
                    .await;
                tracing::Span::current().record("outcome", "ok");
            }
            .instrument(call)
            .await;
            metrics.tool_call("bash", "local", "ok", Duration::from_millis(2));
            metrics.remote_op(
                names::PROCESS_START,
                "local",
                "ok",
                Duration::from_millis(1),
            );
        }
        metrics.timeout(tether_provider::Clock::Total, "local");
    }
    .instrument(root)
    .await;
}

#[test]
fn nothing_configured_installs_no_exporter() {
    let t = build(&TelemetryConfig::default(), &env(&[])).unwrap();
    assert!(!t.guard.exports_traces());
    assert!(!t.guard.exports_metrics());
    // No OTel layer: spans carry no OTel context.
    tracing::dispatcher::with_default(&t.dispatch, || {
        let span = tracing::info_span!("tool.call");
        assert_eq!(
            current_trace_context(&span),
            tether_provider::TraceContext::default()
        );
    });
}

#[test]
fn sdk_disabled_installs_no_exporter_even_with_an_endpoint() {
    let cfg = TelemetryConfig {
        otlp_endpoint: Some("http://127.0.0.1:4318".into()),
        ..Default::default()
    };
    let t = build(&cfg, &env(&[("OTEL_SDK_DISABLED", "true")])).unwrap();
    assert!(!t.guard.exports_traces() && !t.guard.exports_metrics());
}

#[test]
fn grpc_outside_a_runtime_is_refused_not_a_panic() {
    let cfg = TelemetryConfig {
        otlp_endpoint: Some("http://127.0.0.1:4317".into()),
        otlp_protocol: Some(OtlpProtocol::Grpc),
        ..Default::default()
    };
    assert!(matches!(
        build(&cfg, &env(&[])),
        Err(TelemetryError::NoRuntime)
    ));
}

#[tokio::test]
async fn an_endpoint_installs_both_exporters_and_the_otel_layer() {
    let cfg = TelemetryConfig {
        otlp_endpoint: Some("http://127.0.0.1:9".into()),
        ..Default::default()
    };
    let t = build(&cfg, &env(&[])).unwrap();
    assert!(t.guard.exports_traces() && t.guard.exports_metrics());
    tracing::dispatcher::with_default(&t.dispatch, || {
        let span = tracing::info_span!("tool.call");
        assert!(current_trace_context(&span).traceparent.is_some());
    });
}

/// A collector that accepts connections and never answers: the worst kind, one that
/// makes every export wait for its timeout. Counts the connections it holds.
struct SilentCollector {
    url: String,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl SilentCollector {
    async fn start() -> Self {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        Self {
            url,
            connections,
            task,
        }
    }
}

impl Drop for SilentCollector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A port with nothing listening: every export is refused at once.
async fn dead_collector() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

/// Runs request rounds while exports are failing or stuck, and returns once done; `exports_attempted`
/// (when given) must become true while the requests run, proving exports were in flight.
async fn assert_requests_are_not_slowed(
    endpoint: String,
    protocol: OtlpProtocol,
    attempted: Option<Arc<AtomicUsize>>,
) {
    let cfg = TelemetryConfig {
        otlp_endpoint: Some(endpoint.clone()),
        otlp_protocol: Some(protocol),
        export_timeout_ms: 400,
        metrics_interval_ms: 50,
        ..Default::default()
    };
    let t = build(&cfg, &env(&[])).unwrap();
    let metrics = t.guard.metrics();
    let _sub = tracing::dispatcher::set_default(&t.dispatch);

    // Several rounds, so exports are in flight (and failing or stuck) while requests run:
    // 750 spans overflow the 512-span export batch, and metrics export every 50 ms.
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let started = Instant::now();
        request(&metrics).await;
        worst = worst.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    eprintln!("{protocol} {endpoint}: slowest request {worst:?}");
    if let Some(n) = attempted {
        assert!(
            n.load(Ordering::SeqCst) > 0,
            "no export reached the collector during the requests"
        );
    }
    // 50 tool calls with ~150 spans: microseconds of work each. A request that waited on
    // the collector even once would take at least the 400 ms export timeout.
    assert!(
        worst < Duration::from_millis(250),
        "{protocol} {endpoint}: a request took {worst:?}"
    );

    let started = Instant::now();
    let _flushed = t.guard.shutdown().await;
    let took = started.elapsed();
    eprintln!("{protocol} {endpoint}: shutdown took {took:?}");
    assert!(
        took < Duration::from_millis(400 + 1000 + 500),
        "{protocol}: shutdown took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_does_not_slow_requests_http() {
    assert_requests_are_not_slowed(dead_collector().await, OtlpProtocol::HttpProtobuf, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_does_not_slow_requests_grpc() {
    assert_requests_are_not_slowed(dead_collector().await, OtlpProtocol::Grpc, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_does_not_slow_requests_http() {
    let c = SilentCollector::start().await;
    assert_requests_are_not_slowed(
        c.url.clone(),
        OtlpProtocol::HttpProtobuf,
        Some(c.connections.clone()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_does_not_slow_requests_grpc() {
    let c = SilentCollector::start().await;
    assert_requests_are_not_slowed(
        c.url.clone(),
        OtlpProtocol::Grpc,
        Some(c.connections.clone()),
    )
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_on_a_current_thread_runtime_does_not_deadlock() {
    let c = SilentCollector::start().await;
    let cfg = TelemetryConfig {
        otlp_endpoint: Some(c.url.clone()),
        otlp_protocol: Some(OtlpProtocol::Grpc),
        export_timeout_ms: 300,
        ..Default::default()
    };
    let t = build(&cfg, &env(&[])).unwrap();
    tracing::dispatcher::with_default(&t.dispatch, || {
        let _s = tracing::info_span!("tool.call").entered();
    });
    let started = Instant::now();
    let _ = t.guard.shutdown().await;
    assert!(started.elapsed() < Duration::from_millis(300 + 1000 + 500));
}

// === the Prometheus scrape endpoint ===

const SCRAPE_TOKEN: &str = "scrape-token-0123456789";

fn scrape_config(tokens: &[&str]) -> TelemetryConfig {
    TelemetryConfig {
        prometheus: Some(PrometheusConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            auth_tokens: tokens.iter().map(|t| (*t).to_owned()).collect(),
            allow_unauthenticated: false,
        }),
        ..Default::default()
    }
}

#[test]
fn the_exposition_names_every_instrument_as_the_collector_does() {
    let t = build(&scrape_config(&[]), &env(&[])).unwrap();
    assert!(!t.guard.exports_metrics(), "nothing is pushed");
    let ep = t
        .guard
        .scrape_endpoint()
        .expect("a scrape endpoint")
        .clone();
    let m = t.guard.metrics();
    m.tool_call("bash", "local", "ok", Duration::from_millis(30));
    m.remote_op(
        names::FS_READ,
        "local",
        "FS_NOT_FOUND",
        Duration::from_millis(2),
    );
    m.timeout(tether_provider::Clock::OutputIdle, "local");
    m.sandboxes_live(1, "local");
    m.sessions_live(1);
    let text = ep.render().unwrap();
    for spec in INSTRUMENTS {
        for series in spec.prometheus_series() {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("{series}{{")))
                .unwrap_or_else(|| panic!("no {series} in\n{text}"));
            for label in spec.prometheus_labels() {
                assert!(line.contains(&format!("{label}=\"")), "{label} on {line}");
            }
            assert!(line.contains("otel_scope_name=\"tether\""), "{line}");
        }
    }
    // The buckets are the instruments' own.
    assert!(
        text.contains("le=\"0.025\""),
        "duration buckets in seconds:\n{text}"
    );
    assert!(
        text.contains("# TYPE tether_timeouts_total counter"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE tether_sandboxes_live gauge"),
        "{text}"
    );
    assert!(text.contains("target_info{"), "{text}");
    assert!(text.contains("service_name=\"tetherd\""), "{text}");
}

#[test]
fn sdk_disabled_turns_the_scrape_endpoint_off_too() {
    let t = build(&scrape_config(&[]), &env(&[("OTEL_SDK_DISABLED", "true")])).unwrap();
    assert!(t.guard.scrape_endpoint().is_none());
}

#[tokio::test]
async fn the_scrape_listener_enforces_its_token_and_stops_on_shutdown() {
    let t = build(&scrape_config(&[SCRAPE_TOKEN]), &env(&[])).unwrap();
    let ep = t.guard.scrape_endpoint().unwrap().clone();
    t.guard.metrics().sessions_live(1);
    let tasks = tokio_util::task::TaskTracker::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let addr = ep
        .bind()
        .await
        .unwrap()
        .spawn(&tasks, async move { s.cancelled().await });
    let url = format!("http://{addr}{}", scrape::METRICS_PATH);
    let http = reqwest::Client::new();

    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let r = http
        .get(&url)
        .bearer_auth("wrong-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(&url)
        .bearer_auth(SCRAPE_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/plain; version=0.0.4");
    let body = r.text().await.unwrap();
    assert!(body.contains("tether_sessions_live{"), "{body}");
    let r = http
        .head(&url)
        .bearer_auth(SCRAPE_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http
        .get(format!("http://{addr}/other"))
        .bearer_auth(SCRAPE_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .post(&url)
        .bearer_auth(SCRAPE_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // A second bind of a taken address is a start-up error naming the address.
    let taken = scrape::ScrapeEndpoint::new(PrometheusConfig {
        listen: addr,
        ..Default::default()
    })
    .unwrap()
    .0;
    assert!(matches!(
        taken.bind().await,
        Err(TelemetryError::ScrapeListen { addr: a, .. }) if a == addr
    ));

    drop(http);
    stop.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .expect("the scrape listener stops on shutdown");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "nothing listens after shutdown"
    );
}

#[tokio::test]
async fn scrape_and_otlp_push_read_the_same_meter_provider() {
    let cfg = TelemetryConfig {
        otlp_endpoint: Some("http://127.0.0.1:9".into()),
        export_timeout_ms: 200,
        ..scrape_config(&[])
    };
    let t = build(&cfg, &env(&[])).unwrap();
    assert!(t.guard.exports_metrics() && t.guard.exports_traces());
    let ep = t.guard.scrape_endpoint().unwrap().clone();
    t.guard
        .metrics()
        .tool_call("read_file", "local", "ok", Duration::from_millis(4));
    let text = ep.render().unwrap();
    assert!(
        text.contains("tether_tool_duration_seconds_count{")
            && text.contains("tool_name=\"read_file\""),
        "{text}"
    );
    // The last push goes to a dead collector: it fails, and is only logged.
    let _ = t.guard.shutdown().await;
}
