//! The E2B provider's public API against small in-test backends: a control plane and an
//! envd whose every answer the test chooses, for what a real backend does not do on
//! demand (an older API without v2 routes, rate limits, a stream that breaks at a chosen
//! byte, an envd that drops a stream's tail, a backend that never answers). The provider
//! against a real backend (tetherd's E2B front) is in the workspace's end-to-end tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tether_protocol::ErrorCode;
use tether_protocol::connect::FLAG_END_STREAM;
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::{CallCtx, PauseKind, Provider, SandboxSpec, StreamOffsets};
use tether_provider_e2b::{E2bConfig, E2bProvider, RetryConfig, WRAPPER};
use tokio::time::Instant;

/// What the fake saw and what it should answer.
#[derive(Default)]
struct Fake {
    /// Requests by route name.
    hits: RwLock<BTreeMap<String, usize>>,
    /// Request bodies and headers by route name (the last one).
    seen: RwLock<BTreeMap<String, (HeaderMap, Value)>>,
    /// Idempotency keys of v2 creates, in order.
    keys: RwLock<Vec<String>>,
    /// Behaviour switches.
    v2: bool,
    rate_limit_first: bool,
    should_not_retry: bool,
    pause_status: u16,
    /// envd: what the copies hold, and how the live stream behaves.
    out_copy: RwLock<Vec<u8>>,
    live: RwLock<Vec<Vec<u8>>>,
    live_end: RwLock<Option<Value>>,
    connect_end: RwLock<Option<Value>>,
    start_error: RwLock<Option<Value>>,
    dir: RwLock<String>,
    creates: AtomicUsize,
    /// The Start stream sends its head and then nothing.
    stall_start: bool,
    /// The create (v2 or v1) with this index (from 0) makes its sandbox and never answers.
    stall_create: Option<usize>,
    /// Sandboxes made by creates whose answer stalled, as `list` shows them.
    stalled_creates: RwLock<Vec<Value>>,
    /// The last wrapped start (its `process` and `tag`), for `List`.
    started: RwLock<Option<Value>>,
    /// In-sandbox SHA-256 checks fail.
    sha_mismatch: bool,
    /// `List` does not show the started command yet (its start is still on its way).
    hide_started: bool,
    /// `GET /files` answers 503 this many times first.
    files_unavailable: AtomicUsize,
    /// `GET /files` cuts its body after this many bytes, once.
    files_cut_at: RwLock<Option<usize>>,
}

type Shared = Arc<Fake>;

impl Fake {
    fn hit(&self, route: &str, headers: &HeaderMap, body: Value) {
        *self
            .hits
            .write()
            .unwrap()
            .entry(route.to_owned())
            .or_default() += 1;
        self.seen
            .write()
            .unwrap()
            .insert(route.to_owned(), (headers.clone(), body));
    }

    fn hits(&self, route: &str) -> usize {
        self.hits.read().unwrap().get(route).copied().unwrap_or(0)
    }

    fn seen(&self, route: &str) -> (HeaderMap, Value) {
        self.seen
            .read()
            .unwrap()
            .get(route)
            .cloned()
            .expect("the route was called")
    }
}

fn sandbox_json(id: &str) -> Value {
    json!({"templateID": "base", "sandboxID": id, "clientID": "fake", "envdVersion": "0.6.4", "envdAccessToken": "tok-1", "trafficAccessToken": null, "domain": null})
}

fn listed(id: &str, meta: Value) -> Value {
    json!({"templateID": "base", "sandboxID": id, "clientID": "fake", "startedAt": "2026-11-30T08:00:00Z", "endAt": "2026-11-30T09:00:00Z",
           "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 1024, "state": "running", "envdVersion": "0.6.4", "metadata": meta})
}

fn detail(id: &str) -> Value {
    let mut v = listed(id, json!({"tether.session": "s1"}));
    v["envdAccessToken"] = json!("tok-detail");
    v
}

fn body_json(b: &Bytes) -> Value {
    serde_json::from_slice(b).unwrap_or(Value::Null)
}

fn api_error(status: u16, msg: &str) -> Response {
    (
        StatusCode::from_u16(status).unwrap(),
        axum::Json(json!({"code": status, "message": msg})),
    )
        .into_response()
}

async fn create_v2(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    f.hit("create_v2", &headers, body_json(&body));
    if !f.v2 {
        return StatusCode::NOT_FOUND.into_response();
    }
    if let Some(k) = headers.get("idempotency-key") {
        f.keys.write().unwrap().push(k.to_str().unwrap().to_owned());
    }
    let n = f.creates.fetch_add(1, Ordering::SeqCst);
    if f.stall_create == Some(n) {
        return stall_create(&f, &body).await;
    }
    if f.should_not_retry {
        let mut r = api_error(503, "busy");
        r.headers_mut()
            .insert("should-retry", "false".parse().unwrap());
        return r;
    }
    if f.rate_limit_first && n == 0 {
        let mut r = api_error(429, "slow down");
        r.headers_mut()
            .insert("retry-after", "0.3".parse().unwrap());
        return r;
    }
    (StatusCode::CREATED, axum::Json(sandbox_json("isbx1"))).into_response()
}

async fn create_v1(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    f.hit("create_v1", &headers, body_json(&body));
    if f.stall_create.is_some() && f.stall_create == Some(f.creates.fetch_add(1, Ordering::SeqCst))
    {
        return stall_create(&f, &body).await;
    }
    (StatusCode::CREATED, axum::Json(sandbox_json("isbx1"))).into_response()
}

/// A create that makes its sandbox (`isbx-stalled`, listed with the request's metadata)
/// and then holds its answer far past any limit of the tests.
async fn stall_create(f: &Fake, body: &Bytes) -> Response {
    let meta = body_json(body)["metadata"].clone();
    f.stalled_creates
        .write()
        .unwrap()
        .push(listed("isbx-stalled", meta));
    tokio::time::sleep(Duration::from_secs(120)).await;
    (
        StatusCode::CREATED,
        axum::Json(sandbox_json("isbx-stalled")),
    )
        .into_response()
}

async fn list_v2(
    State(f): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    f.hit("list_v2", &headers, json!(q));
    match q.get("nextToken").map(String::as_str) {
        None => {
            let mut page = vec![listed("ia", json!({"tether.session": "s1"}))];
            page.extend(f.stalled_creates.read().unwrap().iter().cloned());
            let mut r = axum::Json(json!(page)).into_response();
            r.headers_mut()
                .insert("x-next-token", "page2".parse().unwrap());
            r
        }
        Some("page2") => axum::Json(json!([listed("ib", json!({}))])).into_response(),
        Some(_) => api_error(400, "bad token"),
    }
}

async fn kill(State(f): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    f.hit("kill", &headers, json!(id));
    api_error(404, "sandbox not found")
}

async fn get_detail(
    State(f): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    f.hit("detail", &headers, json!(id));
    if id == "igone" {
        api_error(404, "sandbox not found")
    } else {
        axum::Json(detail(&id)).into_response()
    }
}

async fn no_route(
    State(f): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    f.hit(
        "connect",
        &headers,
        json!({"id": id, "body": body_json(&body)}),
    );
    StatusCode::NOT_FOUND.into_response()
}

async fn pause(
    State(f): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    f.hit(
        "pause",
        &headers,
        json!({"id": id, "body": body_json(&body)}),
    );
    match f.pause_status {
        204 => StatusCode::NO_CONTENT.into_response(),
        404 => StatusCode::NOT_FOUND.into_response(),
        s => api_error(s, "pause is not supported"),
    }
}

/// A Connect stream answer: the given envelopes, then either an end frame or (when
/// `end` is `None`) a broken connection.
fn stream_answer(frames: Vec<Bytes>, end: Option<Bytes>) -> Response {
    let items: Vec<Result<Bytes, std::io::Error>> = frames.into_iter().map(Ok).collect();
    // The last item comes a moment later, so the head and the frames are on the wire first.
    let last = futures_util::stream::once(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        end.ok_or_else(|| std::io::Error::other("the connection broke"))
    });
    let body = Body::from_stream(futures_util::stream::iter(items).chain(last));
    (
        StatusCode::OK,
        [("content-type", "application/connect+json")],
        body,
    )
        .into_response()
}

/// One Connect envelope, by the codec the provider and tetherd share.
fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    tether_protocol::connect::encode(flags, payload).unwrap()
}

fn msg(v: Value) -> Bytes {
    envelope(0, &serde_json::to_vec(&v).unwrap())
}

async fn rpc(
    State(f): State<Shared>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let streaming = headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/connect+json"));
    let payload: Value = if streaming {
        serde_json::from_slice(&body[5..]).unwrap_or(Value::Null)
    } else {
        body_json(&body)
    };
    f.hit(&method, &headers, payload.clone());
    match method.as_str() {
        "process.Process/Start" => {
            if let Some(e) = f.start_error.read().unwrap().clone() {
                return stream_answer(
                    vec![],
                    Some(envelope(FLAG_END_STREAM, &serde_json::to_vec(&e).unwrap())),
                );
            }
            let args = payload["process"]["args"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if payload["process"]["cmd"] != json!("/bin/bash") {
                // A control command of the provider: it succeeds, except a failing checksum.
                let script = args.get(1).and_then(Value::as_str).unwrap_or_default();
                let code = if f.sha_mismatch && script.contains("sha256sum") {
                    1
                } else {
                    0
                };
                return stream_answer(
                    vec![
                        msg(json!({"event": {"start": {"pid": 7}}})),
                        msg(
                            json!({"event": {"end": {"exitCode": code, "exited": true, "status": format!("exit status {code}")}}}),
                        ),
                    ],
                    Some(envelope(FLAG_END_STREAM, b"{}")),
                );
            }
            *f.dir.write().unwrap() = args[4].as_str().unwrap().to_owned();
            *f.started.write().unwrap() =
                Some(json!({"config": payload["process"], "pid": 42, "tag": payload["tag"]}));
            if f.stall_start {
                let body = Body::from_stream(futures_util::stream::pending::<
                    Result<Bytes, std::io::Error>,
                >());
                return (
                    StatusCode::OK,
                    [("content-type", "application/connect+json")],
                    body,
                )
                    .into_response();
            }
            let mut frames = vec![msg(json!({"event": {"start": {"pid": 42}}}))];
            for chunk in f.live.read().unwrap().iter() {
                frames.push(msg(
                    json!({"event": {"data": {"stdout": base64_of(chunk)}}}),
                ));
            }
            let live_end = f.live_end.read().unwrap().clone();
            match live_end {
                Some(end) => {
                    frames.push(msg(json!({"event": {"end": end}})));
                    stream_answer(frames, Some(envelope(FLAG_END_STREAM, b"{}")))
                }
                None => stream_answer(frames, None),
            }
        }
        "process.Process/Connect" => {
            let end = f
                .connect_end
                .read()
                .unwrap()
                .clone()
                .unwrap_or(json!({"exited": true, "status": "exit status 0"}));
            stream_answer(
                vec![
                    msg(json!({"event": {"start": {"pid": 42}}})),
                    msg(json!({"event": {"end": end}})),
                ],
                Some(envelope(FLAG_END_STREAM, b"{}")),
            )
        }
        "filesystem.Filesystem/ListDir" => {
            let dir = f.dir.read().unwrap().clone();
            let size = f.out_copy.read().unwrap().len();
            let entry = |name: &str, size: usize| {
                json!({"name": name, "type": "FILE_TYPE_FILE", "path": format!("{dir}/{name}"), "size": size.to_string(), "mode": 420,
                       "permissions": "-rw-r--r--", "owner": "user", "group": "user", "modifiedTime": "2026-11-30T08:00:00Z"})
            };
            axum::Json(json!({"entries": [entry("out", size), entry("err", 0), entry("out.done", 0), entry("err.done", 0)]})).into_response()
        }
        "process.Process/List" => {
            let started = f
                .started
                .read()
                .unwrap()
                .clone()
                .filter(|_| !f.hide_started);
            axum::Json(json!({"processes": started.into_iter().collect::<Vec<_>>()}))
                .into_response()
        }
        "filesystem.Filesystem/Remove" => axum::Json(json!({})).into_response(),
        "filesystem.Filesystem/Move" => {
            let to = payload["destination"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            axum::Json(json!({"entry": {"name": "f", "type": "FILE_TYPE_FILE", "path": to, "size": "3", "mode": 420,
                "permissions": "-rw-r--r--", "owner": "user", "group": "user", "modifiedTime": "2026-11-30T08:00:00Z"}}))
            .into_response()
        }
        "filesystem.Filesystem/Stat" => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"code": "not_found", "message": "no such file"})),
        )
            .into_response(),
        _ => (
            StatusCode::NOT_IMPLEMENTED,
            axum::Json(json!({"code": "unimplemented", "message": method})),
        )
            .into_response(),
    }
}

fn base64_of(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(b)
}

async fn files(
    State(f): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    f.hit("files_get", &headers, json!(q));
    let copy = f.out_copy.read().unwrap().clone();
    let from: usize = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes=")?.split('-').next()?.parse().ok())
        .unwrap_or(0);
    if from >= copy.len() {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    if f.files_unavailable
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response();
    }
    if let Some(cut) = f.files_cut_at.write().unwrap().take() {
        // Send `cut` bytes, then break the connection mid-body.
        let head = Bytes::from(copy[from..from + cut].to_vec());
        let body = futures_util::stream::iter(vec![
            Ok::<_, std::io::Error>(head),
            Err(std::io::Error::other("reset mid-body")),
        ]);
        return (StatusCode::PARTIAL_CONTENT, Body::from_stream(body)).into_response();
    }
    (StatusCode::PARTIAL_CONTENT, copy[from..].to_vec()).into_response()
}

async fn upload(
    State(f): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
    body: Bytes,
) -> Response {
    f.hit(
        "files_post",
        &headers,
        json!({"query": q, "len": body.len()}),
    );
    axum::Json(json!([{"path": q.get("path"), "name": "f", "type": "file"}])).into_response()
}

async fn serve(fake: Fake) -> (SocketAddr, Shared) {
    let shared = Arc::new(fake);
    let app = Router::new()
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes", post(create_v1))
        .route("/sandboxes/{id}", get(get_detail).delete(kill))
        .route("/v2/sandboxes/{id}/connect", post(no_route))
        .route("/sandboxes/{id}/connect", post(no_route))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/files", get(files).post(upload))
        .route("/{*method}", post(rpc))
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, shared)
}

fn config(addr: SocketAddr) -> E2bConfig {
    E2bConfig {
        api_url: Some(format!("http://{addr}")),
        sandbox_url: Some(format!("http://{addr}")),
        api_key: Some("e2b_fake".into()),
        inherit_env: false,
        retry: RetryConfig {
            max_times: 3,
            min_delay_ms: 10,
            max_delay_ms: 1000,
        },
        drain_after_exit_ms: 200,
        ..E2bConfig::default()
    }
}

fn ctx() -> CallCtx {
    CallCtx::new("fake-backend-test")
}

#[tokio::test]
async fn create_falls_back_to_v1_once_and_sends_what_v1_needs() {
    let (addr, fake) = serve(Fake::default()).await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let mut spec = SandboxSpec {
        ttl: Some(Duration::from_millis(90_500)),
        ..SandboxSpec::default()
    };
    spec.metadata.insert("tether.session".into(), "s1".into());
    spec.env.insert("A".into(), "1".into());
    let sb = p.create(&ctx(), spec.clone()).await.expect("create");
    assert_eq!(sb.info().id, "isbx1");
    assert_eq!(
        sb.info().metadata.get("tether.session").map(String::as_str),
        Some("s1")
    );
    let (headers, body) = fake.seen("create_v1");
    assert_eq!(headers.get("x-api-key").unwrap(), "e2b_fake");
    assert_eq!(
        body["secure"],
        json!(true),
        "v1 needs secure for an access token"
    );
    assert_eq!(
        body["timeout"],
        json!(91),
        "an explicit timeout, rounded up (v1's default is 15 s)"
    );
    assert_eq!(body["autoPause"], json!(false), "auto_pause is always sent");
    assert_eq!(body["envVars"]["A"], json!("1"));
    assert_eq!(body["metadata"]["tether.session"], json!("s1"));
    assert!(body["metadata"][tether_provider_e2b::CREATE_MARKER].is_string());
    // The probe is remembered: v2 is not tried again.
    p.create(&ctx(), spec).await.expect("second create");
    assert_eq!((fake.hits("create_v2"), fake.hits("create_v1")), (1, 2));
}

/// Rules that deny every address are E2B's `allow_internet_access: false`, with the
/// admitted networks as `allowOut`; other rules go as they are.
#[tokio::test]
async fn denying_every_address_is_sent_as_no_internet_access() {
    use tether_protocol::network::{Cidr, Egress};
    let (addr, fake) = serve(Fake {
        v2: true,
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let ok: Cidr = "192.0.2.7/32".parse().unwrap();
    let mut deny = Cidr::everything().to_vec();
    deny.push("198.51.100.0/24".parse().unwrap());
    let spec = SandboxSpec {
        network: true,
        egress: Egress {
            allow: vec![ok],
            deny,
        },
        ..SandboxSpec::default()
    };
    p.create(&ctx(), spec).await.expect("create");
    let (_, body) = fake.seen("create_v2");
    assert_eq!(body["allow_internet_access"], json!(false), "{body}");
    assert_eq!(
        body["network"]["allowOut"],
        json!(["192.0.2.7/32"]),
        "{body}"
    );
    assert_eq!(
        body["network"]["denyOut"],
        json!(["198.51.100.0/24"]),
        "{body}"
    );
    // Open network with a rule of its own: sent as it is.
    let spec = SandboxSpec {
        network: true,
        egress: Egress {
            allow: Vec::new(),
            deny: vec!["198.51.100.0/24".parse().unwrap()],
        },
        ..SandboxSpec::default()
    };
    p.create(&ctx(), spec).await.expect("create");
    let (_, body) = fake.seen("create_v2");
    assert_eq!(body["allow_internet_access"], json!(true), "{body}");
    assert_eq!(
        body["network"]["denyOut"],
        json!(["198.51.100.0/24"]),
        "{body}"
    );
}

#[tokio::test]
async fn a_rate_limited_create_is_retried_after_the_advised_delay_with_the_same_key() {
    let (addr, fake) = serve(Fake {
        v2: true,
        rate_limit_first: true,
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let t = Instant::now();
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create");
    let took = t.elapsed();
    assert_eq!(sb.info().id, "isbx1");
    assert_eq!(fake.hits("create_v2"), 2);
    assert!(
        took >= Duration::from_millis(300),
        "Retry-After was not honoured: {took:?}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let keys = fake.keys.read().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert_eq!(
        keys[0], keys[1],
        "a retried create carries the same idempotency key"
    );
    // A backend that says not to retry is not retried.
    let (addr, fake) = serve(Fake {
        v2: true,
        should_not_retry: true,
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let e = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .map(|_| ())
        .expect_err("create");
    assert_eq!(e.code(), ErrorCode::ProviderError);
    assert_eq!(fake.hits("create_v2"), 1);
}

/// A create whose answer never comes (the backend made the sandbox) ends on the connect
/// clock and is retried within the call's budget: on a backend known to have v2, with the
/// same idempotency key, so the backend answers for the one sandbox; otherwise (v1 has no
/// key, and the first create on a backend not probed yet may have fallen back to it) by
/// finding the sandbox the lost answer made (its marker) instead of making a second one.
#[tokio::test]
async fn a_create_whose_answer_stalls_is_retried_and_makes_one_sandbox() {
    for v2 in [true, false] {
        let (addr, fake) = serve(Fake {
            v2,
            // On v2, the second create: the first one has probed v2.
            stall_create: Some(usize::from(v2)),
            ..Fake::default()
        })
        .await;
        let mut cfg = config(addr);
        cfg.connect_timeout_ms = 300;
        let p = E2bProvider::new(cfg).unwrap();
        if v2 {
            p.create(&ctx(), SandboxSpec::default())
                .await
                .expect("probe");
        }
        let t = Instant::now();
        let sb = p
            .create(&ctx(), SandboxSpec::default())
            .await
            .expect("the retried create succeeds");
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "v2={v2}: took {took:?}"
        );
        if v2 {
            assert_eq!(sb.info().id, "isbx1");
            assert_eq!(fake.hits("create_v2"), 3);
            let keys = fake.keys.read().unwrap().clone();
            assert_eq!(keys.len(), 3);
            assert_eq!(keys[1], keys[2], "the retry carries the same key");
            assert_ne!(keys[0], keys[1]);
        } else {
            assert_eq!(
                sb.info().id,
                "isbx-stalled",
                "the lost answer's sandbox is adopted"
            );
            assert_eq!(fake.hits("create_v1"), 1, "no second sandbox is made");
            assert!(fake.hits("list_v2") >= 1);
        }
    }
}

#[tokio::test]
async fn list_pages_destroy_of_a_gone_sandbox_and_connect_without_a_connect_route() {
    let (addr, fake) = serve(Fake::default()).await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let all = p.list(&ctx()).await.expect("list");
    assert_eq!(
        all.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["ia", "ib"],
        "both pages"
    );
    assert_eq!(
        all[0].metadata.get("tether.session").map(String::as_str),
        Some("s1"),
        "metadata is listed for the reconciler"
    );
    assert_eq!(all[0].created_ms, 1_796_025_600_000);
    assert_eq!(all[0].expires_ms, Some(1_796_029_200_000));
    assert_eq!(fake.hits("list_v2"), 2);
    p.destroy(&ctx(), "igone")
        .await
        .expect("a 404 on kill means already gone");
    // No connect route at all: the details' token is used.
    let sb = p.connect(&ctx(), "ia").await.expect("connect");
    assert_eq!(
        sb.info().metadata.get("tether.session").map(String::as_str),
        Some("s1")
    );
    assert_eq!(fake.hits("connect"), 2, "v2, then v1");
    let e = p
        .connect(&ctx(), "igone")
        .await
        .map(|_| ())
        .expect_err("connect to a gone sandbox");
    assert_eq!(e.code(), ErrorCode::SandboxNotFound);
}

/// A pause without memory is E2B's `{"memory": false}`; a pause with it sends E2B's
/// default (no field).
#[tokio::test]
async fn a_pause_without_memory_is_sent_as_e2b_names_it() {
    let (addr, fake) = serve(Fake {
        pause_status: 204,
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    assert!(p.capabilities().pause_filesystem);
    p.pause(&ctx(), "ia", PauseKind::Filesystem)
        .await
        .expect("pause without memory");
    assert_eq!(
        fake.seen("pause").1,
        json!({"id": "ia", "body": {"memory": false}})
    );
    // Its resume asks for a boot; this fake has no connect route, so it ends there.
    let _ = p.resume(&ctx(), "ia").await;
    assert_eq!(
        fake.seen("connect").1["body"],
        json!({"timeout": 300, "memory": false})
    );
    p.pause(&ctx(), "ib", PauseKind::Memory)
        .await
        .expect("pause");
    assert_eq!(fake.seen("pause").1, json!({"id": "ib", "body": {}}));
    let _ = p.resume(&ctx(), "ib").await;
    assert_eq!(fake.seen("connect").1["body"], json!({"timeout": 300}));
}

#[tokio::test]
async fn pause_is_probed_once() {
    for (status, expect) in [
        (501u16, ErrorCode::Unsupported),
        (404, ErrorCode::Unsupported),
    ] {
        let (addr, fake) = serve(Fake {
            pause_status: status,
            ..Fake::default()
        })
        .await;
        let p = E2bProvider::new(config(addr)).unwrap();
        assert_eq!(
            p.pause(&ctx(), "ia", PauseKind::Memory)
                .await
                .expect_err("pause")
                .code(),
            expect,
            "status {status}"
        );
        assert!(!p.capabilities().pause);
        assert!(!p.capabilities().pause_filesystem);
        assert_eq!(
            p.pause(&ctx(), "ia", PauseKind::Memory)
                .await
                .expect_err("pause")
                .code(),
            ErrorCode::Unsupported
        );
        assert_eq!(fake.hits("pause"), 1, "the second pause made no request");
    }
    // A 404 for a sandbox that does not exist is a missing sandbox, not a missing route.
    let (addr, _) = serve(Fake {
        pause_status: 404,
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    assert_eq!(
        p.pause(&ctx(), "igone", PauseKind::Memory)
            .await
            .expect_err("pause")
            .code(),
        ErrorCode::SandboxNotFound
    );
    assert!(
        p.capabilities().pause,
        "nothing was learned about the route"
    );
}

async fn collect(h: &dyn tether_provider::ProcessHandle) -> (Vec<u8>, Option<i32>) {
    let mut out = Vec::new();
    let mut code = None;
    let mut events = h.events(StreamOffsets::default());
    while let Some(ev) = events.next().await {
        match ev.expect("event") {
            ProcessEvent::Output { offset, data, .. } => {
                assert_eq!(offset, out.len() as u64);
                out.extend_from_slice(&data);
            }
            ProcessEvent::Exited {
                status,
                stdout_bytes,
                ..
            } => {
                assert_eq!(stdout_bytes, out.len() as u64);
                code = status.code;
            }
            ProcessEvent::Started { .. } => {}
        }
    }
    (out, code)
}

#[tokio::test]
async fn a_broken_start_stream_is_resumed_from_the_copy() {
    let fake = Fake {
        v2: true,
        ..Fake::default()
    };
    *fake.live.write().unwrap() = vec![b"hello ".to_vec()];
    *fake.out_copy.write().unwrap() = b"hello world\n".to_vec();
    *fake.connect_end.write().unwrap() =
        Some(json!({"exitCode": 3, "exited": true, "status": "exit status 3"}));
    let (addr, fake) = serve(fake).await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let mut spec = ProcessSpec::shell("echo hello world");
    spec.command_id = Some("cmd-1".into());
    let h = sb.process().spawn(&ctx(), spec).await.expect("spawn");
    assert_eq!(h.pid(), 42);
    let (out, code) = tokio::time::timeout(Duration::from_secs(10), collect(h.as_ref()))
        .await
        .expect("output ends");
    assert_eq!(
        out, b"hello world\n",
        "the live part, then exactly the rest from the copy"
    );
    assert_eq!(
        code,
        Some(3),
        "the status comes from the re-attached stream"
    );
    assert_eq!(fake.hits("process.Process/Connect"), 1);
    // What the start looked like on the wire.
    let (headers, body) = fake.seen("process.Process/Start");
    assert_eq!(headers.get("x-access-token").unwrap(), "tok-1");
    assert_eq!(headers.get("e2b-sandbox-id").unwrap(), "isbx1");
    assert_eq!(headers.get("e2b-sandbox-port").unwrap(), "49983");
    assert_eq!(headers.get("connect-protocol-version").unwrap(), "1");
    assert!(headers.get("keepalive-ping-interval").is_some());
    assert!(
        headers.get("connect-timeout-ms").is_none(),
        "no deadline: envd would kill the command at it"
    );
    assert_eq!(body["tag"], json!("cmd-1"));
    assert_eq!(body["stdin"], json!(false));
    assert_eq!(body["process"]["cmd"], json!("/bin/bash"));
    assert_eq!(body["process"]["args"][1], json!(WRAPPER));
    assert_eq!(body["process"]["cwd"], json!("/home/user"));
    let (_, connect) = fake.seen("process.Process/Connect");
    assert_eq!(
        connect["process"]["tag"],
        json!("cmd-1"),
        "re-attached by tag"
    );
}

#[tokio::test]
async fn a_tail_the_stream_dropped_is_read_from_the_copy() {
    let fake = Fake {
        v2: true,
        ..Fake::default()
    };
    *fake.live.write().unwrap() = vec![b"abc".to_vec()];
    *fake.live_end.write().unwrap() = Some(json!({"exited": true, "status": "exit status 0"}));
    *fake.out_copy.write().unwrap() = b"abcdef".to_vec();
    let (addr, fake) = serve(fake).await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::argv(["printf", "abcdef"]))
        .await
        .expect("spawn");
    let (out, code) = tokio::time::timeout(Duration::from_secs(10), collect(h.as_ref()))
        .await
        .expect("output ends");
    assert_eq!(out, b"abcdef");
    assert_eq!(code, Some(0));
    assert_eq!(
        fake.hits("process.Process/Connect"),
        0,
        "the stream ended normally: no re-attach"
    );
    let (headers, _) = fake.seen("files_get");
    assert_eq!(
        headers.get("range").unwrap(),
        "bytes=3-5",
        "only the missing bytes are fetched"
    );
}

#[tokio::test]
async fn a_refused_start_is_a_spawn_failure() {
    let fake = Fake {
        v2: true,
        ..Fake::default()
    };
    *fake.start_error.write().unwrap() = Some(
        json!({"error": {"code": "invalid_argument", "message": "cwd '/nope' does not exist"}}),
    );
    let (addr, _) = serve(fake).await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let e = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("true"))
        .await
        .map(|_| ())
        .expect_err("spawn");
    assert_eq!(e.code(), ErrorCode::SpawnFailed);
}

#[tokio::test]
async fn a_backend_that_accepts_and_never_answers_is_a_connect_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let mut cfg = config(addr);
    cfg.connect_timeout_ms = 200;
    cfg.retry.max_times = 0;
    let p = E2bProvider::new(cfg).unwrap();
    let t = Instant::now();
    let e = p.healthcheck(&ctx()).await.expect_err("healthcheck");
    assert_eq!(e.code(), ErrorCode::ConnectTimeout);
    assert!(
        t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_millis(900),
        "took {:?}",
        t.elapsed()
    );
    held.abort();
}

#[tokio::test]
async fn a_start_whose_answer_is_lost_is_looked_up_never_run_twice() {
    let (addr, fake) = serve(Fake {
        v2: true,
        stall_start: true,
        ..Fake::default()
    })
    .await;
    let mut cfg = config(addr);
    cfg.connect_timeout_ms = 300;
    let p = E2bProvider::new(cfg).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let mut spec = ProcessSpec::shell("echo once");
    spec.command_id = Some("cmd-once".into());
    let t = Instant::now();
    let h = sb
        .process()
        .spawn(&ctx(), spec)
        .await
        .expect("the running command is adopted");
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "the start waited for its first event"
    );
    assert_eq!((h.command_id(), h.pid()), ("cmd-once", 42));
    assert_eq!(
        fake.hits("process.Process/Start"),
        1,
        "the start was not sent again"
    );
    assert_eq!(
        fake.hits("process.Process/List"),
        1,
        "it was looked up by its tag"
    );
    let st = tokio::time::timeout(Duration::from_secs(10), h.wait(&ctx()))
        .await
        .expect("wait")
        .expect("status");
    assert_eq!(st.code, Some(0));
}

#[tokio::test]
async fn a_start_that_reached_the_backend_unanswered_is_an_unknown_outcome() {
    let (addr, fake) = serve(Fake {
        v2: true,
        stall_start: true,
        hide_started: true,
        ..Fake::default()
    })
    .await;
    let mut cfg = config(addr);
    cfg.connect_timeout_ms = 300;
    let p = E2bProvider::new(cfg).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let mut spec = ProcessSpec::shell("echo once");
    spec.command_id = Some("cmd-unknown".into());
    let e = sb
        .process()
        .spawn(&ctx(), spec)
        .await
        .expect_err("the start's answer never came");
    // It may be running: never reported as a retryable timeout (a retry would run it
    // twice); the caller re-attaches by its id instead.
    assert_eq!(e.code(), ErrorCode::OutcomeUnknown);
    assert!(!e.retryable());
    assert_eq!(fake.hits("process.Process/Start"), 1, "never re-sent");
}

#[tokio::test]
async fn a_read_survives_one_overload_and_one_reset_mid_body() {
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let (addr, fake) = serve(Fake {
        v2: true,
        files_unavailable: AtomicUsize::new(1),
        files_cut_at: RwLock::new(Some(300_000)),
        out_copy: RwLock::new(data.clone()),
        ..Fake::default()
    })
    .await;
    let p = E2bProvider::new(config(addr)).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let stream = sb
        .fs()
        .read(
            &ctx(),
            "/home/user/big",
            tether_protocol::fs::ByteRange::default(),
        )
        .await
        .expect("a 503 is retried");
    let got: Vec<u8> = stream
        .map(|c| c.expect("the cut body is resumed").to_vec())
        .concat()
        .await;
    assert_eq!(got.len(), data.len());
    assert!(got == data, "every byte once, in order");
    // 503, the cut answer, and the resumed range read.
    assert_eq!(fake.hits("files_get"), 3);
}

#[tokio::test]
async fn a_write_whose_checksum_differs_is_not_published() {
    let (addr, fake) = serve(Fake {
        v2: true,
        sha_mismatch: true,
        ..Fake::default()
    })
    .await;
    let mut cfg = config(addr);
    cfg.verify_writes = true;
    let p = E2bProvider::new(cfg).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let data = tether_provider::util::once_bytes(&b"abc"[..]);
    let e = sb
        .fs()
        .write(&ctx(), "a.txt", data, tether_protocol::fs::WriteGuard::None)
        .await
        .expect_err("write");
    assert_eq!(e.code(), ErrorCode::FsIoError);
    assert_eq!(
        fake.hits("filesystem.Filesystem/Move"),
        0,
        "nothing was published"
    );
    // The temporary file is removed in the background.
    let t = Instant::now();
    while fake.hits("filesystem.Filesystem/Remove") == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the temporary file was never removed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (_, removed) = fake.seen("filesystem.Filesystem/Remove");
    assert!(
        removed["path"]
            .as_str()
            .unwrap()
            .contains(tether_provider_e2b::TEMP_PREFIX)
    );
    let (_, upload) = fake.seen("files_post");
    assert_eq!(upload["len"], json!(3));
    assert!(
        upload["query"]["path"]
            .as_str()
            .unwrap()
            .contains(tether_provider_e2b::TEMP_PREFIX),
        "uploaded next to the target first"
    );
    // With a matching checksum the same write is published.
    let (addr, fake) = serve(Fake {
        v2: true,
        ..Fake::default()
    })
    .await;
    let mut cfg = config(addr);
    cfg.verify_writes = true;
    let p = E2bProvider::new(cfg).unwrap();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let w = sb
        .fs()
        .write(
            &ctx(),
            "a.txt",
            tether_provider::util::once_bytes(&b"abc"[..]),
            tether_protocol::fs::WriteGuard::None,
        )
        .await
        .expect("write");
    assert_eq!(
        (w.path.as_str(), w.size, w.created),
        ("/home/user/a.txt", 3, true)
    );
    assert_eq!(fake.hits("filesystem.Filesystem/Move"), 1);
    let (headers, _) = fake.seen("files_post");
    assert!(
        headers.get("x-metadata-tether-version").is_some(),
        "each write stores a version id"
    );
}

#[tokio::test]
async fn debug_mode_skips_the_control_plane() {
    let (addr, fake) = serve(Fake::default()).await;
    let cfg = E2bConfig {
        debug: Some(true),
        api_url: None,
        api_key: None,
        ..config(addr)
    };
    let p = E2bProvider::new(cfg).unwrap();
    p.healthcheck(&ctx()).await.expect("envd health");
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create");
    assert_eq!(sb.info().id, "debug_sandbox_id");
    assert_eq!(fake.hits("create_v2") + fake.hits("create_v1"), 0);
    assert!(p.list(&ctx()).await.unwrap().is_empty());
    p.destroy(&ctx(), "debug_sandbox_id")
        .await
        .expect("destroy is a no-op");
    let caps = p.capabilities();
    assert!(!caps.pause && !caps.renew);
    assert_eq!(
        p.renew(&ctx(), "debug_sandbox_id", Duration::from_secs(1))
            .await
            .expect_err("renew")
            .code(),
        ErrorCode::Unsupported
    );
}
