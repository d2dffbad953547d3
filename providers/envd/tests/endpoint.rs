//! The envd client's public constructor against a small in-test envd: the endpoint's
//! headers and access token reach every call, `POST /init` carries its request, and the
//! readiness probe is one attempt bounded by its own limit while `health` retries. The
//! whole client (files, commands, resumption) against in-test and real envd backends is
//! in `tether-provider-e2b`'s tests and the workspace's end-to-end tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use reqwest::Url;
use reqwest::header::{HeaderName, HeaderValue};
use tether_envd_client::{
    EnvdClientConfig, EnvdEndpoint, EnvdSandboxClient, EnvdVersion, RetryConfig,
};
use tether_protocol::ErrorCode;
use tether_protocol::e2b::InitRequest;
use tether_provider::CallCtx;
use tokio::time::Instant;

/// What the in-test envd saw, and the status its `/health` answers.
#[derive(Default)]
struct Seen {
    health: AtomicUsize,
    health_status: RwLock<Option<u16>>,
    init: RwLock<Option<(HeaderMap, InitRequest)>>,
    health_headers: RwLock<Option<HeaderMap>>,
}

async fn serve(seen: Arc<Seen>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    async fn health(State(s): State<Arc<Seen>>, headers: HeaderMap) -> StatusCode {
        s.health.fetch_add(1, Ordering::SeqCst);
        *s.health_headers.write().unwrap() = Some(headers);
        let status = s.health_status.read().unwrap().unwrap_or(204);
        StatusCode::from_u16(status).unwrap()
    }
    async fn init(State(s): State<Arc<Seen>>, headers: HeaderMap, body: Bytes) -> StatusCode {
        let req: InitRequest = serde_json::from_slice(&body).unwrap();
        *s.init.write().unwrap() = Some((headers, req));
        StatusCode::NO_CONTENT
    }
    let app = Router::new()
        .route("/health", get(health))
        .route("/init", post(init))
        .with_state(seen);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

fn endpoint(addr: SocketAddr, token: Option<&str>) -> EnvdEndpoint {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        HeaderName::from_static("e2b-sandbox-id"),
        HeaderValue::from_static("vm-1"),
    );
    EnvdEndpoint {
        base_url: Url::parse(&format!("http://{addr}")).unwrap(),
        access_token: token.map(str::to_owned),
        headers,
        version: EnvdVersion(0, 6, 4),
    }
}

fn config(health_timeout_ms: u64) -> EnvdClientConfig {
    EnvdClientConfig {
        health_timeout_ms,
        retry: RetryConfig {
            max_times: 2,
            min_delay_ms: 10,
            max_delay_ms: 20,
        },
        ..EnvdClientConfig::default()
    }
}

#[tokio::test]
async fn the_endpoint_headers_and_token_reach_init_and_health() {
    let seen = Arc::new(Seen::default());
    let (addr, server) = serve(seen.clone()).await;
    let client = EnvdSandboxClient::new(
        "microvm",
        "vm-1",
        endpoint(addr, Some("tok-1")),
        &config(1_000),
        reqwest::Client::new(),
    )
    .unwrap();
    assert_eq!(client.id(), "vm-1");
    assert_eq!(client.version(), EnvdVersion(0, 6, 4));
    let ctx = CallCtx::new("t");
    let req = InitRequest {
        env_vars: Some(BTreeMap::from([("A".to_owned(), "1".to_owned())])),
        access_token: Some("tok-1".into()),
        default_user: Some("root".into()),
        default_workdir: Some("/work".into()),
        timestamp: None,
        tether_entropy: Some("00".repeat(32)),
    };
    client.init(&ctx, &req).await.unwrap();
    client.probe_health(&ctx).await.unwrap();

    let (headers, got) = seen.init.write().unwrap().take().unwrap();
    assert_eq!(got, req);
    assert_eq!(headers["x-access-token"], "tok-1");
    assert_eq!(headers["e2b-sandbox-id"], "vm-1");
    let headers = seen.health_headers.write().unwrap().take().unwrap();
    assert_eq!(headers["x-access-token"], "tok-1");
    assert_eq!(headers["e2b-sandbox-id"], "vm-1");
    assert_eq!(seen.health.load(Ordering::SeqCst), 1);

    // Closing ends the sandbox's background work; the handle says so.
    assert!(!client.is_closed());
    client.close();
    assert!(client.is_closed());
    server.abort();
}

#[tokio::test]
async fn the_probe_is_one_attempt_where_health_retries() {
    let seen = Arc::new(Seen::default());
    *seen.health_status.write().unwrap() = Some(503);
    let (addr, server) = serve(seen.clone()).await;
    let client = EnvdSandboxClient::new(
        "microvm",
        "vm-1",
        endpoint(addr, None),
        &config(1_000),
        reqwest::Client::new(),
    )
    .unwrap();
    let ctx = CallCtx::new("t");
    let e = client.probe_health(&ctx).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::ProviderUnavailable);
    assert_eq!(
        seen.health.load(Ordering::SeqCst),
        1,
        "the probe does not retry"
    );

    let e = client.health(&ctx).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::ProviderUnavailable);
    assert_eq!(
        seen.health.load(Ordering::SeqCst),
        1 + 3,
        "health is retried by the policy (2 retries)"
    );
    // No access token configured: none is sent.
    let headers = seen.health_headers.write().unwrap().take().unwrap();
    assert!(headers.get("x-access-token").is_none());
    server.abort();
}

#[tokio::test]
async fn a_probe_of_an_envd_that_never_answers_ends_at_its_own_limit() {
    // A listener that accepts and never answers (a guest whose agent is not up yet
    // behind a forwarded port).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let client = EnvdSandboxClient::new(
        "microvm",
        "vm-1",
        endpoint(addr, None),
        &config(300),
        reqwest::Client::new(),
    )
    .unwrap();
    let started = Instant::now();
    let e = client.probe_health(&CallCtx::new("t")).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.code(), ErrorCode::DeadlineExceeded);
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "the probe took {took:?}, not its 300 ms limit"
    );
    held.abort();
}

#[tokio::test]
async fn a_probe_of_a_closed_port_is_unavailable_at_once() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = EnvdSandboxClient::new(
        "microvm",
        "vm-1",
        endpoint(addr, None),
        &config(2_000),
        reqwest::Client::new(),
    )
    .unwrap();
    let started = Instant::now();
    let e = client.probe_health(&CallCtx::new("t")).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::ProviderUnavailable);
    assert!(e.retryable());
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn an_access_token_that_is_not_a_header_value_is_refused() {
    let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let e = EnvdSandboxClient::new(
        "microvm",
        "vm-1",
        endpoint(addr, Some("bad\ntoken")),
        &EnvdClientConfig::default(),
        reqwest::Client::new(),
    )
    .unwrap_err();
    assert_eq!(e.code(), ErrorCode::ProviderError);
}
