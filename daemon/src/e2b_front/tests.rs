//! Tests of the E2B front against a real daemon (local provider, real processes and
//! files) on an ephemeral loopback port, spoken to exactly as the SDKs speak: REST with
//! `X-API-Key`, envd with `E2b-Sandbox-Id` + `X-Access-Token`, Connect JSON envelopes.

use std::io::{Read as _, Write as _};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether_protocol::events::EventBody;

use crate::config::{ApiKey, Config};
use crate::server::{Daemon, RunningDaemon};
use crate::session_manager::Scope;
use tether_provider::Clock;

const KEY_A: &str = "e2b_key_tenant_a";
const KEY_B: &str = "e2b_key_tenant_b";

struct Front {
    daemon: Option<RunningDaemon>,
    _dir: tempfile::TempDir,
    base: String,
    http: reqwest::Client,
}

impl Front {
    async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    async fn start_with(f: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config {
            default_provider: "local".into(),
            ..Config::default()
        };
        cfg.server.state_dir = dir.path().to_owned();
        cfg.server.shutdown_grace_ms = 3_000;
        cfg.e2b_front.api_keys = vec![
            ApiKey {
                key: KEY_A.into(),
                tenant: Some("a".into()),
            },
            ApiKey {
                key: KEY_B.into(),
                tenant: Some("b".into()),
            },
        ];
        f(&mut cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let daemon = Daemon::start_on(cfg, listener).await.expect("daemon");
        let base = daemon.base_url();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client");
        Self {
            daemon: Some(daemon),
            _dir: dir,
            base,
            http,
        }
    }

    fn d(&self) -> &RunningDaemon {
        self.daemon.as_ref().expect("running")
    }

    fn url(&self, p: &str) -> String {
        format!("{}{p}", self.base)
    }

    async fn api(
        &self,
        method: reqwest::Method,
        p: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rb = self.http.request(method, self.url(p));
        if let Some(k) = key {
            rb = rb.header("X-API-KEY", k);
        }
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let r = rb.send().await.expect("send");
        let st = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        (st, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn create(&self, key: &str) -> (String, String) {
        let (st, b) = self
            .api(
                reqwest::Method::POST,
                "/v2/sandboxes",
                Some(key),
                Some(json!({"templateID": "base", "metadata": {}, "envVars": {"SBX_VAR": "sbx"}})),
            )
            .await;
        assert_eq!(st, 201, "{b}");
        (
            b["sandboxID"].as_str().expect("id").to_owned(),
            b["envdAccessToken"].as_str().expect("token").to_owned(),
        )
    }

    fn envd(
        &self,
        method: reqwest::Method,
        p: &str,
        id: &str,
        token: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, self.url(p))
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", "49983")
            .header("X-Access-Token", token)
    }

    async fn unary(&self, id: &str, token: &str, rpc: &str, msg: Value) -> (u16, Value) {
        let r = self
            .envd(reqwest::Method::POST, &format!("/{rpc}"), id, token)
            .header("Content-Type", "application/json")
            .header("Connect-Protocol-Version", "1")
            .body(msg.to_string())
            .send()
            .await
            .expect("send");
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    /// A streaming call: the frames (flags, JSON) of the answer.
    async fn stream(
        &self,
        id: &str,
        token: &str,
        rpc: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> (u16, String, Vec<(u8, Value)>) {
        let mut rb = self
            .envd(reqwest::Method::POST, &format!("/{rpc}"), id, token)
            .header("Content-Type", "application/connect+json")
            .header("Connect-Protocol-Version", "1");
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        let r = rb.body(body).send().await.expect("send");
        let st = r.status().as_u16();
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let bytes = r.bytes().await.expect("body");
        (st, ct, frames(&bytes))
    }

    /// The session's events as they are on disk (live or closed).
    fn session_events(&self, id: &str) -> Vec<EventBody> {
        let path = self
            .d()
            .state
            .config
            .server
            .state_dir
            .join("sessions")
            .join(id)
            .join("events.jsonl");
        std::fs::read_to_string(&path)
            .expect("events.jsonl")
            .lines()
            .skip(1)
            .map(|l| {
                serde_json::from_str::<tether_protocol::events::Event>(l)
                    .expect("event")
                    .body
            })
            .collect()
    }

    async fn stop(mut self) {
        if let Some(d) = self.daemon.take() {
            d.shutdown().await;
        }
    }
}

async fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn envelope(flags: u8, v: &Value) -> Vec<u8> {
    tether_protocol::connect::encode(flags, v.to_string().as_bytes())
        .unwrap()
        .to_vec()
}

/// The envelopes of a whole stream body: each frame's flags and JSON.
fn frames(b: &[u8]) -> Vec<(u8, Value)> {
    use tether_protocol::connect::{Decoder, FLAG_END_STREAM, Frame};
    let mut d = Decoder::new(usize::MAX);
    d.push(b);
    let mut out = Vec::new();
    while let Some(f) = d.next_frame().expect("a well-formed envelope") {
        out.push(match f {
            Frame::Message(m) => (0, serde_json::from_slice(&m).unwrap_or(Value::Null)),
            Frame::End(end) => (FLAG_END_STREAM, serde_json::to_value(end).unwrap()),
        });
    }
    assert!(d.finish().is_ok(), "trailing bytes after the last envelope");
    out
}

fn b64(s: &str) -> String {
    tether_protocol::b64::encode(s.as_bytes())
}

fn unb64(v: &Value) -> Vec<u8> {
    tether_protocol::b64::decode(v.as_str().unwrap_or("")).expect("base64")
}

/// stdout, stderr and the end event of a process stream.
fn outputs(frames: &[(u8, Value)]) -> (String, String, Option<Value>) {
    let (mut out, mut err, mut end) = (Vec::new(), Vec::new(), None);
    for (_, f) in frames {
        let ev = &f["event"];
        if let Some(d) = ev.get("data") {
            if let Some(s) = d.get("stdout") {
                out.extend(unb64(s));
            }
            if let Some(s) = d.get("stderr") {
                err.extend(unb64(s));
            }
        }
        if let Some(e) = ev.get("end") {
            end = Some(e.clone());
        }
    }
    (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
        end,
    )
}

fn start_body(cmd: &str, stdin: bool) -> Vec<u8> {
    envelope(
        0,
        &json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {"REQ_VAR": "req"}}, "stdin": stdin}),
    )
}

// === control plane ===

#[tokio::test]
async fn control_plane_scopes_sandboxes_by_api_key() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        "DNS-label id: {id}"
    );
    assert!(!token.is_empty());
    let (st, info) = f
        .api(
            reqwest::Method::GET,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200, "{info}");
    for field in [
        "templateID",
        "sandboxID",
        "clientID",
        "startedAt",
        "endAt",
        "envdVersion",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "state",
    ] {
        assert!(
            info.get(field).is_some(),
            "SandboxDetail lacks {field}: {info}"
        );
    }
    assert_eq!(info["state"], "running");
    // Another tenant sees nothing of it.
    let (st, body) = f
        .api(
            reqwest::Method::GET,
            &format!("/sandboxes/{id}"),
            Some(KEY_B),
            None,
        )
        .await;
    assert_eq!((st, body["code"].as_u64()), (404, Some(404)), "{body}");
    let (st, body) = f
        .api(
            reqwest::Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_B),
            None,
        )
        .await;
    assert_eq!((st, body["code"].as_u64()), (404, Some(404)));
    let (_, list_b) = f
        .api(reqwest::Method::GET, "/v2/sandboxes", Some(KEY_B), None)
        .await;
    assert_eq!(list_b.as_array().map(Vec::len), Some(0));
    let (_, list_a) = f
        .api(reqwest::Method::GET, "/v2/sandboxes", Some(KEY_A), None)
        .await;
    assert_eq!(list_a[0]["sandboxID"], id.as_str());
    // Kill: 204, then the sandbox is gone for the control plane and for envd.
    let (st, _) = f
        .api(
            reqwest::Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 204);
    let (st, body) = f
        .api(
            reqwest::Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(
        (st, body["code"].as_u64()),
        (404, Some(404)),
        "a second kill is a JSON 404"
    );
    let r = f
        .envd(reqwest::Method::GET, "/health", &id, &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("was not found"),
        "{body}"
    );
    assert!(
        f.session_events(&id)
            .iter()
            .any(|e| matches!(e, EventBody::SessionClosed { reason } if reason == "killed"))
    );
    f.stop().await;
}

#[tokio::test]
async fn control_plane_errors_have_the_sdk_error_shape() {
    let f = Front::start().await;
    let post = |key: Option<&'static str>, body: Value| {
        f.api(reqwest::Method::POST, "/v2/sandboxes", key, Some(body))
    };
    let (st, b) = post(None, json!({"templateID": "base"})).await;
    assert_eq!(
        (st, b["code"].as_u64()),
        (401, Some(401)),
        "missing key: {b}"
    );
    let (st, b) = post(Some("e2b_wrong"), json!({"templateID": "base"})).await;
    assert_eq!((st, b["code"].as_u64()), (401, Some(401)), "wrong key: {b}");
    assert!(b["message"].is_string());
    let (st, b) = post(Some(KEY_A), json!({"timeout": 10})).await;
    assert_eq!(
        (st, b["code"].as_u64()),
        (400, Some(400)),
        "no template: {b}"
    );
    let (st, b) = post(
        Some(KEY_A),
        json!({"templateID": "base", "timeout": 10_000_000}),
    )
    .await;
    assert_eq!(
        (st, b["code"].as_u64()),
        (400, Some(400)),
        "timeout over the max: {b}"
    );
    let r = f
        .http
        .post(f.url("/sandboxes"))
        .header("X-API-KEY", KEY_A)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], 400);
    // v1 create answers 201 with the same shape.
    let (st, b) = f
        .api(
            reqwest::Method::POST,
            "/sandboxes",
            Some(KEY_A),
            Some(json!({"templateID": "base", "timeout": 60, "secure": true, "allow_internet_access": true})),
        )
        .await;
    assert_eq!(st, 201, "{b}");
    let id = b["sandboxID"].as_str().unwrap().to_owned();
    assert!(b["clientID"].is_string() && b["envdVersion"].is_string());
    // The local provider pauses (freezer): 204, and connect then resumes it (201).
    let (st, b) = f
        .api(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/pause"),
            Some(KEY_A),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, 204, "{b}");
    let (st, b) = f
        .api(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(KEY_A),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, 201, "a paused sandbox is resumed by connect: {b}");
    let (st, b) = f
        .api(
            reqwest::Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(KEY_A),
            Some(json!({"denyOut": ["example.com"]})),
        )
        .await;
    assert_eq!((st, b["code"].as_u64()), (400, Some(400)), "{b}");
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            &format!("/v2/sandboxes/{id}/logs"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!((st, b["code"].as_u64()), (501, Some(501)), "{b}");
    // Metrics: one sample of the sandbox, every field of E2B's `SandboxMetric`.
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            &format!("/sandboxes/{id}/metrics"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200, "{b}");
    let m = &b[0];
    for k in [
        "timestamp",
        "timestampUnix",
        "cpuCount",
        "cpuUsedPct",
        "memUsed",
        "memTotal",
        "memCache",
        "diskUsed",
        "diskTotal",
    ] {
        assert!(!m[k].is_null(), "{k} missing: {b}");
    }
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={id},inotthere"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["sandboxes"].as_object().map(|o| o.len()), Some(1), "{b}");
    assert!(b["sandboxes"][&id]["memTotal"].as_u64() > Some(0), "{b}");
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            &format!("/sandboxes/{id}/metrics"),
            Some(KEY_B),
            None,
        )
        .await;
    assert_eq!(
        (st, b["code"].as_u64()),
        (404, Some(404)),
        "another tenant's: {b}"
    );
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            "/sandboxes/inotthere",
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!((st, b["code"].as_u64()), (404, Some(404)));
    // Connect to a running sandbox: 200 with its token.
    let (st, b) = f
        .api(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(KEY_A),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(
        b["envdAccessToken"],
        f.d().state.e2b.access_token(&id).as_str()
    );
    f.stop().await;
}

#[tokio::test]
async fn set_timeout_ends_the_sandbox() {
    let f = Front::start().await;
    let (id, _) = f.create(KEY_A).await;
    let (st, _) = f
        .api(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(KEY_A),
            Some(json!({"timeout": 1})),
        )
        .await;
    assert_eq!(st, 204);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (st, _) = f
            .api(
                reqwest::Method::GET,
                &format!("/sandboxes/{id}"),
                Some(KEY_A),
                None,
            )
            .await;
        if st == 404 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sandbox outlived its timeout"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The close is under way once the sandbox reads as gone; its record follows.
    wait_for("session/closed (expired)", Duration::from_secs(20), || {
        f.session_events(&id)
            .iter()
            .any(|e| matches!(e, EventBody::SessionClosed { reason } if reason == "expired"))
    })
    .await;
    f.stop().await;
}

#[tokio::test]
async fn list_filters_by_metadata_and_pages() {
    let f = Front::start().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let (st, b) = f
            .api(
                reqwest::Method::POST,
                "/v2/sandboxes",
                Some(KEY_A),
                Some(
                    json!({"templateID": "base", "metadata": {"suite": "x y", "n": i.to_string()}}),
                ),
            )
            .await;
        assert_eq!(st, 201);
        ids.push(b["sandboxID"].as_str().unwrap().to_owned());
    }
    // The SDK's double encoding: urlencode({quote(k): quote(v)}) as one parameter.
    let (st, b) = f
        .api(
            reqwest::Method::GET,
            "/v2/sandboxes?metadata=suite%3Dx%2520y%26n%3D1&state=running,paused",
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200, "{b}");
    let found: Vec<&str> = b
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(found, vec![ids[1].as_str()]);
    let r = f
        .http
        .get(f.url("/v2/sandboxes?limit=2&order=asc"))
        .header("X-API-KEY", KEY_A)
        .send()
        .await
        .unwrap();
    let next = r
        .headers()
        .get("x-next-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .expect("a next token");
    let page1: Value = r.json().await.unwrap();
    let r = f
        .http
        .get(f.url(&format!("/v2/sandboxes?limit=2&order=asc&nextToken={next}")))
        .header("X-API-KEY", KEY_A)
        .send()
        .await
        .unwrap();
    assert!(
        r.headers().get("x-next-token").is_none(),
        "the last page has no token"
    );
    let page2: Value = r.json().await.unwrap();
    let all: Vec<String> = page1
        .as_array()
        .unwrap()
        .iter()
        .chain(page2.as_array().unwrap())
        .map(|s| s["sandboxID"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(all, ids, "ascending pages cover every sandbox once");
    f.stop().await;
}

// === envd routing, auth and the Connect codec ===

#[tokio::test]
async fn envd_routing_and_access_token() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let (st, _) = f
        .unary(&id, &token, "process.Process/List", json!({}))
        .await;
    assert_eq!(st, 200);
    // Wrong token: envd's plain 401 JSON, with an integer code (SDK: AuthenticationException).
    let (st, b) = f
        .unary(&id, "wrong", "process.Process/List", json!({}))
        .await;
    assert_eq!((st, b["code"].as_u64()), (401, Some(401)), "{b}");
    // A token of one sandbox does not open another.
    let (other, other_token) = f.create(KEY_B).await;
    let (st, _) = f
        .unary(&other, &token, "process.Process/List", json!({}))
        .await;
    assert_eq!(st, 401);
    let (st, _) = f
        .unary(&other, &other_token, "process.Process/List", json!({}))
        .await;
    assert_eq!(st, 200);
    // Unknown sandbox: the edge proxy's 502 answer.
    let (st, b) = f
        .unary("inosuchsandbox", &token, "process.Process/List", json!({}))
        .await;
    assert_eq!(st, 502);
    assert!(b["message"].as_str().unwrap().contains("was not found"));
    // No routing at all.
    let r = f
        .http
        .post(f.url("/process.Process/List"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    // Routing by host: 49983-<id>.<domain>.
    let r = f
        .http
        .post(f.url("/process.Process/List"))
        .header("Host", format!("49983-{id}.localhost"))
        .header("X-Access-Token", &token)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // envd health: 204 for a live sandbox to its token holder, without the token what a
    // missing sandbox gets; the control plane's health without routing.
    let r = f
        .envd(reqwest::Method::GET, "/health", &id, &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let r = f
        .envd(reqwest::Method::GET, "/health", &id, "")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let r = f.http.get(f.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    f.stop().await;
}

#[tokio::test]
async fn bad_connect_input_gets_connect_errors_and_the_daemon_keeps_serving() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let (st, b) = f
        .unary(&id, &token, "process.Process/Nope", json!({}))
        .await;
    assert_eq!(
        (st, b["code"].as_str()),
        (501, Some("unimplemented")),
        "{b}"
    );
    let (st, b) = f
        .unary(&id, &token, "filesystem.Filesystem/Nope", json!({}))
        .await;
    assert_eq!((st, b["code"].as_str()), (501, Some("unimplemented")));
    let r = f
        .envd(
            reqwest::Method::POST,
            "/filesystem.Filesystem/Stat",
            &id,
            &token,
        )
        .header("content-type", "application/json")
        .body("{\"path\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "invalid_argument");
    let r = f
        .envd(
            reqwest::Method::POST,
            "/filesystem.Filesystem/Stat",
            &id,
            &token,
        )
        .header("content-type", "application/proto")
        .body(vec![0x0a, 0x01, b'x'])
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "unimplemented");
    let r = f
        .envd(reqwest::Method::POST, "/process.Process/List", &id, &token)
        .header("content-type", "application/json")
        .header("connect-timeout-ms", "soon")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "invalid_argument");
    // Streaming: a truncated envelope, a compressed flag, two messages, bad JSON.
    let mut truncated = start_body("echo hi", false);
    truncated.truncate(truncated.len() - 3);
    let mut two = start_body("echo a", false);
    two.extend(start_body("echo b", false));
    let mut compressed = start_body("echo hi", false);
    compressed[0] = 0x01;
    let bad_json = {
        let mut v = vec![0u8];
        v.extend_from_slice(&5u32.to_be_bytes());
        v.extend_from_slice(b"{nope");
        v
    };
    for body in [truncated, two, compressed, bad_json, Vec::new()] {
        let (st, ct, fr) = f
            .stream(&id, &token, "process.Process/Start", body, &[])
            .await;
        assert_eq!((st, ct.as_str()), (200, "application/connect+json"));
        assert_eq!(fr.len(), 1, "only the end frame: {fr:?}");
        assert_eq!(fr[0].0, 0x02);
        assert_eq!(fr[0].1["error"]["code"], "invalid_argument", "{fr:?}");
    }
    // Unknown process for every selector-taking method.
    for rpc in [
        "process.Process/SendSignal",
        "process.Process/SendInput",
        "process.Process/CloseStdin",
    ] {
        let (st, b) = f
            .unary(
                &id,
                &token,
                rpc,
                json!({"process": {"pid": 999_999}, "signal": "SIGNAL_SIGKILL", "input": {"stdin": b64("x")}}),
            )
            .await;
        assert_eq!(
            (st, b["code"].as_str()),
            (404, Some("not_found")),
            "{rpc}: {b}"
        );
    }
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Connect",
            envelope(0, &json!({"process": {"pid": 999_999}})),
            &[],
        )
        .await;
    assert_eq!(fr.last().unwrap().1["error"]["code"], "not_found");
    // And the daemon still serves.
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("echo still-here", false),
            &[],
        )
        .await;
    assert_eq!(outputs(&fr).0, "still-here\n");
    f.stop().await;
}

// === process.Process ===

#[tokio::test]
async fn start_streams_output_and_the_end_and_logs_it() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let body = start_body("echo out-$SBX_VAR-$REQ_VAR; echo err >&2; exit 3", false);
    let (st, ct, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            body,
            &[
                ("Authorization", "Basic cm9vdDo="),
                ("Connect-Timeout-Ms", "30000"),
            ],
        )
        .await;
    assert_eq!((st, ct.as_str()), (200, "application/connect+json"));
    let pid = fr[0].1["event"]["start"]["pid"]
        .as_u64()
        .expect("start{pid} comes first");
    assert!(pid > 0);
    let (out, err, end) = outputs(&fr);
    assert_eq!(
        out, "out-sbx-req\n",
        "sandbox env and request env both apply"
    );
    assert_eq!(err, "err\n");
    let end = end.expect("an end event");
    assert_eq!(
        (end["exitCode"].as_i64(), end["exited"].as_bool()),
        (Some(3), Some(true)),
        "{end}"
    );
    assert_eq!(end["status"], "exit status 3");
    assert_eq!(fr.last().unwrap(), &(0x02, json!({})), "a clean end frame");
    // The session log holds the command, with the requested user.
    let events = f.session_events(&id);
    let spec = events
        .iter()
        .find_map(|e| match e {
            EventBody::ProcessStarted { spec, .. } => Some(spec.clone()),
            _ => None,
        })
        .expect("process/started");
    assert_eq!(spec.user.as_deref(), Some("root"));
    assert!(
        events.iter().any(
            |e| matches!(e, EventBody::ProcessExited { status, .. } if status.code == Some(3))
        )
    );
    // An unknown user is refused as envd does.
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("true", false),
            &[("Authorization", "Basic bm9ib2R5Og==")],
        )
        .await;
    assert_eq!(fr.last().unwrap().1["error"]["code"], "unauthenticated");
    // A working directory that does not exist.
    let body = envelope(
        0,
        &json!({"process": {"cmd": "/bin/pwd", "cwd": "/home/user/missing-dir"}}),
    );
    let (_, _, fr) = f
        .stream(&id, &token, "process.Process/Start", body, &[])
        .await;
    assert_eq!(fr.last().unwrap().1["error"]["code"], "invalid_argument");
    f.stop().await;
}

#[tokio::test]
async fn the_call_timeout_kills_the_process_and_keepalives_flow() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let started = tokio::time::Instant::now();
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("sleep 30", false),
            &[("Connect-Timeout-Ms", "500")],
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the deadline ended the call"
    );
    // As envd: the stream ends with the call's `deadline_exceeded`, never with the end
    // event of the process the deadline killed.
    let (_, _, end) = outputs(&fr);
    assert_eq!(end, None, "{fr:?}");
    assert_eq!(
        fr.last().unwrap().1["error"]["code"],
        "deadline_exceeded",
        "{fr:?}"
    );
    // The process was killed by its deadline (E2B semantics), as the log shows.
    wait_for(
        "the deadline's kill in the log",
        Duration::from_secs(10),
        || {
            f.session_events(&id).iter().any(|e| {
                matches!(
                    e,
                    EventBody::ProcessExited {
                        clock: Some(Clock::Total),
                        ..
                    }
                )
            })
        },
    )
    .await;
    // Keepalives while the process is silent.
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("sleep 2.5; echo done", false),
            &[("Keepalive-Ping-Interval", "1")],
        )
        .await;
    let keepalives = fr
        .iter()
        .filter(|(_, v)| v["event"].get("keepalive").is_some())
        .count();
    assert!(keepalives >= 1, "no keepalive in {fr:?}");
    assert_eq!(outputs(&fr).0, "done\n");
    f.stop().await;
}

#[tokio::test]
async fn stdin_connect_list_and_signals() {
    let f = Arc::new(Front::start().await);
    let (id, token) = f.create(KEY_A).await;
    // A background `cat` with stdin: started in its own task, read as it streams.
    let body = envelope(
        0,
        &json!({"process": {"cmd": "/bin/cat"}, "stdin": true, "tag": "cat-1"}),
    );
    let f2 = Arc::clone(&f);
    let (id2, token2) = (id.clone(), token.clone());
    let reader = tokio::spawn(async move {
        f2.stream(&id2, &token2, "process.Process/Start", body, &[])
            .await
    });
    let mut pid = None;
    for _ in 0..200 {
        let (_, list) = f
            .unary(&id, &token, "process.Process/List", json!({}))
            .await;
        if let Some(p) = list["processes"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["tag"] == "cat-1"))
        {
            assert_eq!(p["config"]["cmd"], "/bin/cat");
            pid = p["pid"].as_u64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let pid = pid.expect("the tagged process is listed");
    let (st, b) = f
        .unary(
            &id,
            &token,
            "process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"stdin": b64("hello\n")}}),
        )
        .await;
    assert_eq!(st, 200, "{b}");
    let (st, _) = f
        .unary(
            &id,
            &token,
            "process.Process/SendInput",
            json!({"process": {"tag": "cat-1"}, "input": {"stdin": b64("by tag\n")}}),
        )
        .await;
    assert_eq!(st, 200);
    let (st, _) = f
        .unary(
            &id,
            &token,
            "process.Process/CloseStdin",
            json!({"process": {"pid": pid}}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, _, fr) = reader.await.unwrap();
    let (out, _, end) = outputs(&fr);
    assert_eq!(out, "hello\nby tag\n");
    assert_eq!(end.unwrap()["exited"], true);
    // SIGKILL ends a running process with `signal: killed`; it is then gone for envd.
    let f3 = Arc::clone(&f);
    let (id3, token3) = (id.clone(), token.clone());
    let sleeper = tokio::spawn(async move {
        f3.stream(
            &id3,
            &token3,
            "process.Process/Start",
            start_body("sleep 60", false),
            &[],
        )
        .await
    });
    let mut spid = None;
    for _ in 0..200 {
        let (_, list) = f
            .unary(&id, &token, "process.Process/List", json!({}))
            .await;
        if let Some(p) = list["processes"].as_array().and_then(|a| a.first()) {
            spid = p["pid"].as_u64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let spid = spid.expect("sleep is listed");
    let (st, _) = f
        .unary(
            &id,
            &token,
            "process.Process/SendSignal",
            json!({"process": {"pid": spid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, _, fr) = sleeper.await.unwrap();
    assert_eq!(outputs(&fr).2.unwrap()["status"], "signal: killed");
    let (st, b) = f
        .unary(
            &id,
            &token,
            "process.Process/SendSignal",
            json!({"process": {"pid": spid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(
        (st, b["code"].as_str()),
        (404, Some("not_found")),
        "a finished process is not found"
    );
    // StreamInput: client-streaming envelopes.
    let f4 = Arc::clone(&f);
    let (id4, token4) = (id.clone(), token.clone());
    let body = envelope(
        0,
        &json!({"process": {"cmd": "/bin/cat"}, "stdin": true, "tag": "cat-2"}),
    );
    let reader = tokio::spawn(async move {
        f4.stream(&id4, &token4, "process.Process/Start", body, &[])
            .await
    });
    let mut cpid = None;
    for _ in 0..200 {
        let (_, list) = f
            .unary(&id, &token, "process.Process/List", json!({}))
            .await;
        if let Some(p) = list["processes"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["tag"] == "cat-2"))
        {
            cpid = p["pid"].as_u64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let cpid = cpid.expect("cat-2 is listed");
    let mut input = envelope(0, &json!({"start": {"process": {"pid": cpid}}}));
    input.extend(envelope(
        0,
        &json!({"data": {"input": {"stdin": b64("streamed\n")}}}),
    ));
    input.extend(envelope(0, &json!({"keepalive": {}})));
    input.extend(envelope(0x02, &json!({})));
    let (st, _, fr) = f
        .stream(&id, &token, "process.Process/StreamInput", input, &[])
        .await;
    assert_eq!(st, 200);
    assert_eq!(fr, vec![(0, json!({})), (2, json!({}))]);
    let (st, _) = f
        .unary(
            &id,
            &token,
            "process.Process/CloseStdin",
            json!({"process": {"tag": "cat-2"}}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, _, fr) = reader.await.unwrap();
    assert_eq!(outputs(&fr).0, "streamed\n");
    match Arc::try_unwrap(f) {
        Ok(f) => f.stop().await,
        Err(_) => panic!("a reader still holds the front"),
    }
}

// === files ===

#[tokio::test]
async fn files_round_trip_in_every_encoding_and_are_logged() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    // Octet-stream, gzip-encoded.
    let data: Vec<u8> = (0..300_000u32)
        .flat_map(|i| (i % 251).to_le_bytes())
        .collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&data).unwrap();
    let r = f
        .envd(
            reqwest::Method::POST,
            "/files?path=%2Fhome%2Fuser%2Fdeep%2Fdir%2Fdata.bin",
            &id,
            &token,
        )
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .header("X-Metadata-Owner", "tests")
        .body(gz.finish().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let w: Value = r.json().await.unwrap();
    assert_eq!(
        w,
        json!([{"path": "/home/user/deep/dir/data.bin", "name": "data.bin", "type": "file", "metadata": {"owner": "tests"}}])
    );
    // Download plain, then gzip-encoded.
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/deep/dir/data.bin",
            &id,
            &token,
        )
        .header("accept-encoding", "identity")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.bytes().await.unwrap().as_ref(), data.as_slice());
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=deep/dir/data.bin",
            &id,
            &token,
        )
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers().get("content-encoding").unwrap(), "gzip");
    let mut back = Vec::new();
    flate2::read::GzDecoder::new(r.bytes().await.unwrap().as_ref())
        .read_to_end(&mut back)
        .unwrap();
    assert_eq!(back, data, "relative paths are relative to /home/user");
    // Incompressible bytes are served as they are, gzip asked for or not.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let noise: Vec<u8> = (0..200_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let r = f
        .envd(
            reqwest::Method::POST,
            "/files?path=/home/user/noise.bin",
            &id,
            &token,
        )
        .header("content-type", "application/octet-stream")
        .body(noise.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/noise.bin",
            &id,
            &token,
        )
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        r.headers().get("content-encoding").is_none(),
        "random bytes were gzip-encoded"
    );
    assert_eq!(r.bytes().await.unwrap().as_ref(), noise.as_slice());
    // A byte range.
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/deep/dir/data.bin",
            &id,
            &token,
        )
        .header("range", "bytes=4-11")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 206);
    assert_eq!(r.bytes().await.unwrap().as_ref(), &data[4..12]);
    // Multipart, two files named by their filenames (no path parameter).
    let boundary = "tetherBoundary42";
    let mut mp = Vec::new();
    for (name, content) in [
        ("/home/user/m/one.txt", "first"),
        ("/home/user/m/two.txt", "second\r\n--almost"),
    ] {
        mp.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: text/plain\r\n\r\n{content}\r\n").as_bytes());
    }
    mp.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let r = f
        .envd(reqwest::Method::POST, "/files?username=user", &id, &token)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(mp)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let w: Value = r.json().await.unwrap();
    assert_eq!(w.as_array().unwrap().len(), 2);
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/m/two.txt",
            &id,
            &token,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "second\r\n--almost");
    // A process sees what was written.
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("cat /home/user/m/one.txt", false),
            &[],
        )
        .await;
    assert_eq!(outputs(&fr).0, "first");
    let writes = f
        .session_events(&id)
        .iter()
        .filter(|e| matches!(e, EventBody::FsOp { op, outcome, .. } if op == "write" && outcome == "ok"))
        .count();
    assert_eq!(writes, 4, "every upload is in the session log");
    f.stop().await;
}

#[tokio::test]
async fn file_errors_and_path_escapes() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let get = |p: &str| {
        f.envd(
            reqwest::Method::GET,
            &format!("/files?path={p}"),
            &id,
            &token,
        )
        .send()
    };
    let r = get("/home/user/missing.txt").await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], 404);
    let r = get("/home/user").await.unwrap();
    assert_eq!(r.status().as_u16(), 400, "a directory");
    // Escapes never read the host: refused, or resolved inside the sandbox's own view.
    let host_secret = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    for p in [
        "../../../../etc/hostname",
        "/home/user/../../../etc/hostname",
    ] {
        let r = get(p).await.unwrap();
        let st = r.status().as_u16();
        let body = r.text().await.unwrap();
        if st == 200 {
            assert!(
                host_secret.is_empty() || body != host_secret,
                "{p} read the host's file"
            );
        } else {
            assert!((400..500).contains(&st), "{p}: {st} {body}");
            let v: Value = serde_json::from_str(&body).expect("JSON error body");
            assert_eq!(v["code"].as_u64(), Some(u64::from(st)));
        }
    }
    let r = f
        .envd(reqwest::Method::POST, "/files", &id, &token)
        .header("content-type", "application/octet-stream")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "octet-stream needs a path");
    let r = f
        .envd(reqwest::Method::POST, "/files?path=a.txt", &id, &token)
        .header("content-type", "text/html")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "unsupported content type");
    let r = f
        .envd(reqwest::Method::POST, "/files?path=a.txt", &id, &token)
        .header("content-type", "multipart/form-data; boundary=zz")
        .body("--zz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nunterminated")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "truncated multipart");
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/x",
            &id,
            "bad-token",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = f
        .envd(
            reqwest::Method::GET,
            "/files?path=/home/user/x&username=mallory",
            &id,
            &token,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "unknown user");
    f.stop().await;
}

#[tokio::test]
async fn signed_urls_work_without_routing_headers() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let path = "/home/user/signed.txt";
    let sig = tether_envd_server::auth::file_signature(path, "write", "", &token, None)
        .replace('+', "%2B")
        .replace('/', "%2F");
    let r = f
        .http
        .post(f.url(&format!("/files?path={path}&signature={sig}")))
        .header("content-type", "application/octet-stream")
        .body("signed body")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
    let exp = crate::leases::now_ms() / 1000 + 60;
    let sig = tether_envd_server::auth::file_signature(path, "read", "", &token, Some(exp));
    let sig_q = sig.replace('+', "%2B").replace('/', "%2F");
    let r = f
        .http
        .get(f.url(&format!(
            "/files?path={path}&signature={sig_q}&signature_expiration={exp}"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "signed body");
    let expired = crate::leases::now_ms() / 1000 - 1;
    let sig = tether_envd_server::auth::file_signature(path, "read", "", &token, Some(expired));
    let r = f
        .http
        .get(f.url(&format!(
            "/files?path={path}&signature={}&signature_expiration={expired}",
            sig.replace('+', "%2B").replace('/', "%2F")
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "expired signature");
    let r = f
        .http
        .get(f.url(&format!("/files?path={path}&signature=v1_forged")))
        .header("E2b-Sandbox-Id", &id)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "forged signature");
    f.stop().await;
}

// === filesystem.Filesystem ===

#[tokio::test]
async fn filesystem_rpcs_and_watchers() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let call = |rpc: &'static str, msg: Value| f.unary(&id, &token, rpc, msg);
    let (st, b) = call(
        "filesystem.Filesystem/MakeDir",
        json!({"path": "/home/user/a/b"}),
    )
    .await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["entry"]["type"], "FILE_TYPE_DIRECTORY");
    let (st, b) = call(
        "filesystem.Filesystem/MakeDir",
        json!({"path": "/home/user/a/b"}),
    )
    .await;
    assert_eq!((st, b["code"].as_str()), (409, Some("already_exists")));
    let (st, b) = call(
        "filesystem.Filesystem/Stat",
        json!({"path": "/home/user/nope"}),
    )
    .await;
    assert_eq!((st, b["code"].as_str()), (404, Some("not_found")));
    // A watcher sees a file created after it.
    let (st, w) = call(
        "filesystem.Filesystem/CreateWatcher",
        json!({"path": "/home/user/a", "recursive": false, "includeEntry": true}),
    )
    .await;
    assert_eq!(st, 200, "{w}");
    let wid = w["watcherId"].as_str().unwrap().to_owned();
    let r = f
        .envd(
            reqwest::Method::POST,
            "/files?path=/home/user/a/f.txt",
            &id,
            &token,
        )
        .header("content-type", "application/octet-stream")
        .body("12345")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut seen = Vec::new();
    for _ in 0..100 {
        let (st, ev) = call(
            "filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": wid}),
        )
        .await;
        assert_eq!(st, 200, "{ev}");
        seen.extend(ev["events"].as_array().cloned().unwrap_or_default());
        if seen
            .iter()
            .any(|e| e["name"] == "f.txt" && e["type"] == "EVENT_TYPE_CREATE")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        seen.iter()
            .any(|e| e["name"] == "f.txt" && e["type"] == "EVENT_TYPE_CREATE"),
        "{seen:?}"
    );
    let (st, _) = call(
        "filesystem.Filesystem/RemoveWatcher",
        json!({"watcherId": wid}),
    )
    .await;
    assert_eq!(st, 200);
    let (st, b) = call(
        "filesystem.Filesystem/GetWatcherEvents",
        json!({"watcherId": wid}),
    )
    .await;
    assert_eq!((st, b["code"].as_str()), (404, Some("not_found")));
    // List, with int64 sizes as strings.
    let (st, b) = call(
        "filesystem.Filesystem/ListDir",
        json!({"path": "/home/user/a", "depth": 2}),
    )
    .await;
    assert_eq!(st, 200);
    let entries = b["entries"].as_array().unwrap();
    let file = entries
        .iter()
        .find(|e| e["name"] == "f.txt")
        .expect("f.txt listed");
    assert_eq!(
        (file["size"].as_str(), file["type"].as_str()),
        (Some("5"), Some("FILE_TYPE_FILE"))
    );
    assert!(entries.iter().any(|e| e["path"] == "/home/user/a/b"));
    let (st, b) = call(
        "filesystem.Filesystem/ListDir",
        json!({"path": "/home/user/a/f.txt"}),
    )
    .await;
    assert_eq!(
        (st, b["code"].as_str()),
        (400, Some("invalid_argument")),
        "not a directory"
    );
    // Move and remove, logged.
    let (st, b) = call(
        "filesystem.Filesystem/Move",
        json!({"source": "/home/user/a/f.txt", "destination": "/home/user/a/g.txt"}),
    )
    .await;
    assert_eq!(
        (st, b["entry"]["name"].as_str()),
        (200, Some("g.txt")),
        "{b}"
    );
    let (st, _) = call(
        "filesystem.Filesystem/Remove",
        json!({"path": "/home/user/a"}),
    )
    .await;
    assert_eq!(st, 200);
    let (st, _) = call(
        "filesystem.Filesystem/Stat",
        json!({"path": "/home/user/a"}),
    )
    .await;
    assert_eq!(st, 404);
    let ops: Vec<String> = f
        .session_events(&id)
        .into_iter()
        .filter_map(|e| match e {
            EventBody::FsOp { op, outcome, .. } => Some(format!("{op}:{outcome}")),
            _ => None,
        })
        .collect();
    for want in [
        "mkdir:ok",
        "mkdir:FS_ALREADY_EXISTS",
        "write:ok",
        "rename:ok",
        "remove:ok",
    ] {
        assert!(ops.iter().any(|o| o == want), "{want} not in {ops:?}");
    }
    // WatchDir streams: start first, then the event.
    let f2 = &f;
    let (id2, token2) = (id.clone(), token.clone());
    let watch = async move {
        f2.stream(
            &id2,
            &token2,
            "filesystem.Filesystem/WatchDir",
            envelope(0, &json!({"path": "/home/user"})),
            &[("Connect-Timeout-Ms", "1500")],
        )
        .await
    };
    let poke = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        f.envd(
            reqwest::Method::POST,
            "/files?path=/home/user/watched.txt",
            &id,
            &token,
        )
        .header("content-type", "application/octet-stream")
        .body("x")
        .send()
        .await
        .unwrap();
    };
    let ((st, _, fr), ()) = tokio::join!(watch, poke);
    assert_eq!(st, 200);
    assert_eq!(fr[0].1, json!({"start": {}}));
    assert!(
        fr.iter()
            .any(|(_, v)| v["filesystem"]["name"] == "watched.txt"),
        "{fr:?}"
    );
    assert_eq!(
        fr.last().unwrap().1["error"]["code"],
        "deadline_exceeded",
        "the call's timeout ends the watch"
    );
    f.stop().await;
}

#[test]
fn recipe_names_the_sdk_variables() {
    let mut cfg = crate::config::E2bFrontConfig::default();
    let r = super::recipe("127.0.0.1:7420".parse().unwrap(), &cfg, false);
    for want in [
        "E2B_API_URL=http://127.0.0.1:7420",
        "E2B_SANDBOX_URL=http://127.0.0.1:7420",
        "E2B_API_KEY=",
        "unset E2B_DEBUG",
    ] {
        assert!(r.contains(want), "{want} not in {r}");
    }
    // Any value of E2B_DEBUG, `false` included, sends E2B's own test suites down their
    // debug branches.
    assert!(!r.contains("E2B_DEBUG="), "{r}");
    cfg.api_keys.push(ApiKey {
        key: "k".into(),
        tenant: None,
    });
    let r = super::recipe("0.0.0.0:9000".parse().unwrap(), &cfg, false);
    assert!(r.contains("E2B_API_URL=http://127.0.0.1:9000"));
    assert!(!r.contains("development mode"));
    // Tokens and no keys: the front accepts no key, and says so.
    cfg.api_keys.clear();
    let r = super::recipe("127.0.0.1:7420".parse().unwrap(), &cfg, true);
    assert!(!r.contains("development mode"), "{r}");
    assert!(r.contains("no API key is accepted"), "{r}");
}

#[tokio::test]
async fn init_authenticates_itself_and_sets_sandbox_defaults() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let init = |body: Value, header_token: Option<&str>| {
        let mut rb = f
            .http
            .post(f.url("/init"))
            .header("E2b-Sandbox-Id", &id)
            .json(&body);
        if let Some(t) = header_token {
            rb = rb.header("X-Access-Token", t);
        }
        rb.send()
    };
    let r = init(json!({"envVars": {"FROM_INIT": "1"}}), None)
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "no token at all");
    let r = init(json!({"accessToken": "not-it"}), None).await.unwrap();
    assert_eq!(r.status().as_u16(), 401, "a token mismatch");
    let (st, _) = f
        .unary(
            &id,
            &token,
            "filesystem.Filesystem/MakeDir",
            json!({"path": "/home/user/wd"}),
        )
        .await;
    assert_eq!(st, 200);
    let r = init(
        json!({"accessToken": token, "envVars": {"FROM_INIT": "yes"}, "defaultUser": "root", "defaultWorkdir": "wd"}),
        None,
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    assert_eq!(
        r.headers().get("x-envd-version").unwrap(),
        tether_protocol::e2b::ENVD_VERSION
    );
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            start_body("echo $FROM_INIT; pwd", false),
            // As `user` (the default is now root): a relative default workdir is under
            // the home of the user each process runs as.
            &[("Authorization", "Basic dXNlcjo=")],
        )
        .await;
    assert_eq!(
        outputs(&fr).0,
        "yes\n/home/user/wd\n",
        "init's env and workdir apply to later processes: {fr:?}"
    );
    // Without a user asked for, the init default user runs it (here with a cwd of its own).
    let (_, _, fr) = f
        .stream(
            &id,
            &token,
            "process.Process/Start",
            envelope(
                0,
                &json!({"process": {"cmd": "/bin/bash", "args": ["-c", "pwd"], "cwd": "/home/user/wd"}}),
            ),
            &[],
        )
        .await;
    assert_eq!(outputs(&fr).0, "/home/user/wd\n", "{fr:?}");
    let users: Vec<Option<String>> = f
        .session_events(&id)
        .into_iter()
        .filter_map(|e| match e {
            EventBody::ProcessStarted { spec, .. } => Some(spec.user),
            _ => None,
        })
        .collect();
    assert_eq!(
        users,
        [Some("user".to_owned()), Some("root".to_owned())],
        "the user asked for, then the init default user, are recorded"
    );
    let r = f
        .envd(reqwest::Method::GET, "/envs", &id, &token)
        .send()
        .await
        .unwrap();
    let envs: Value = r.json().await.unwrap();
    assert_eq!(
        (envs["FROM_INIT"].as_str(), envs["SBX_VAR"].as_str()),
        (Some("yes"), Some("sbx"))
    );
    // v1 connect needs its timeout; refreshes only extend.
    let before = f
        .d()
        .state
        .sessions
        .get(&id, Scope::Any)
        .unwrap()
        .expires_ms();
    let (st, _) = f
        .api(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/refreshes"),
            Some(KEY_A),
            Some(json!({"duration": 1})),
        )
        .await;
    assert_eq!(st, 204);
    assert_eq!(
        f.d()
            .state
            .sessions
            .get(&id, Scope::Any)
            .unwrap()
            .expires_ms(),
        before,
        "a shorter refresh does not shorten"
    );
    let (st, b) = f
        .api(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/connect"),
            Some(KEY_A),
            Some(json!({"timeout": 900})),
        )
        .await;
    assert_eq!(st, 200, "{b}");
    assert!(
        f.d()
            .state
            .sessions
            .get(&id, Scope::Any)
            .unwrap()
            .expires_ms()
            > before,
        "connect extends the life"
    );
    f.stop().await;
}

/// The answer of a raw HTTP/1.1 exchange: the status line, or the I/O error that ended it.
async fn raw_exchange(addr: &str, head: &[u8], body: &[u8]) -> Result<String, std::io::Error> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.write_all(head).await?;
    // The body goes in pieces, as a client streaming a file sends it.
    for piece in body.chunks(16 * 1024) {
        sock.write_all(piece).await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::other("closed before an answer"));
        }
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_multipart_upload_refused_part_way_is_answered_not_reset() {
    let f = Front::start().await;
    let (id, token) = f.create(KEY_A).await;
    let addr = f.base.trim_start_matches("http://").to_owned();
    let boundary = "tether-refused-part-way";
    let mut body = Vec::new();
    // The second part repeats the first's path: refused there, with 200 KiB still to come.
    for (name, data) in [
        ("same.txt", vec![b'a'; 10]),
        ("same.txt", vec![b'b'; 10]),
        ("after.bin", vec![b'c'; 200 * 1024]),
    ] {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(&data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let head = format!(
        "POST /files HTTP/1.1\r\nHost: {addr}\r\nE2b-Sandbox-Id: {id}\r\nE2b-Sandbox-Port: 49983\r\nX-Access-Token: {token}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let status = tokio::time::timeout(
        Duration::from_secs(20),
        raw_exchange(&addr, head.as_bytes(), &body),
    )
    .await
    .expect("the exchange hung");
    match status {
        Ok(line) => assert!(line.starts_with("HTTP/1.1 400"), "{line}"),
        Err(e) => panic!("the client got {e} instead of the refusal"),
    }
    f.stop().await;
}

// === guest-agent mode ===

/// A home directory of a guest-mode test, removed at the end (homes may not live under
/// system directories such as /tmp).
struct HomeDir(std::path::PathBuf);

impl Drop for HomeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A daemon in guest-agent mode: envd for one sandbox, the machine itself (here the
/// test host, so the home is a temporary directory and the clock is left alone).
async fn start_guest() -> (Front, HomeDir) {
    let home = HomeDir(std::path::PathBuf::from(format!(
        "/home/tether-guest-test-{}",
        uuid::Uuid::new_v4().simple()
    )));
    let home_path = home.0.join("user");
    let front = Front::start_with(move |cfg| {
        cfg.e2b_front.api_keys.clear();
        cfg.e2b_front.guest = Some(crate::config::GuestConfig { set_clock: false });
        cfg.default_provider = "machine".into();
        cfg.e2b_front.provider = Some("machine".into());
        let local = tether_provider_local::LocalConfig {
            isolation: tether_provider_local::Isolation::None,
            workspace_path: home_path,
            ..Default::default()
        };
        cfg.providers.insert(
            "machine".into(),
            crate::config::ProviderConfig::Local(local),
        );
    })
    .await;
    (front, home)
}

#[tokio::test]
async fn a_guest_agent_serves_envd_for_its_one_sandbox_with_the_token_init_sets() {
    let (f, _home) = start_guest().await;
    let post_init = |body: Value, header: Option<&str>| {
        let mut rb = f
            .http
            .post(f.url("/init"))
            .header("Content-Type", "application/json");
        if let Some(t) = header {
            rb = rb.header("X-Access-Token", t);
        }
        rb.body(body.to_string()).send()
    };
    // Health is envd's: unauthenticated.
    let r = f.http.get(f.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 204);
    // The native API and the control plane are not served.
    let (st, _) = f
        .api(reqwest::Method::GET, "/v1/sessions", None, None)
        .await;
    assert_eq!(st, 404);
    let (st, _) = f.api(reqwest::Method::GET, "/sandboxes", None, None).await;
    assert_eq!(st, 404);
    // Before the first /init no token is needed (as envd); the sandbox id sent is
    // ignored: there is one sandbox.
    let (st, _) = f
        .unary(
            "any-id",
            "",
            "filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!(st, 200);
    let t1 = "guest-token-aaaaaaaaaaaaaaaa";
    let entropy = tether_protocol::b64::encode(&[7u8; 32]);
    let r = post_init(
        json!({"accessToken": t1, "envVars": {"GUEST_VAR": "g1"}, "tetherEntropy": entropy}),
        None,
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    // Now the token is required.
    let (st, _) = f
        .unary(
            "x",
            "wrong",
            "filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!(st, 401);
    let (st, _) = f
        .unary("x", t1, "filesystem.Filesystem/Stat", json!({"path": "/"}))
        .await;
    assert_eq!(st, 200);
    // Another token without the current one: envd's 409.
    let r = post_init(json!({"accessToken": "guest-token-bbbbbbbbbbbbbbbb"}), None)
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    // Too little entropy is refused.
    let r = post_init(
        json!({"tetherEntropy": tether_protocol::b64::encode(&[1u8; 4])}),
        Some(t1),
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    // The holder of the current token may rotate it (a restored clone gets its own).
    let t2 = "guest-token-cccccccccccccccc";
    let r = post_init(json!({"accessToken": t2}), Some(t1))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let (st, _) = f
        .unary("x", t1, "filesystem.Filesystem/Stat", json!({"path": "/"}))
        .await;
    assert_eq!(st, 401);
    // A command runs on the machine itself, with /init's environment.
    let start = envelope(
        0,
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo $GUEST_VAR; cat /proc/1/comm >/dev/null && echo sees-pid1"]}}),
    );
    let (st, _, frames) = f.stream("x", t2, "process.Process/Start", start, &[]).await;
    assert_eq!(st, 200);
    let (out, _, end) = outputs(&frames);
    assert_eq!(out, "g1\nsees-pid1\n", "{frames:?}");
    assert_eq!(end.expect("end")["exitCode"].as_i64().unwrap_or(0), 0);
    // Files through /files with the token, on the machine's own root.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("up.txt");
    let r = f
        .http
        .post(f.url(&format!("/files?path={}", path.display())))
        .header("X-Access-Token", t2)
        .header("Content-Type", "application/octet-stream")
        .body("guest bytes")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "guest bytes");
    f.stop().await;
}

#[tokio::test]
async fn a_restarted_guest_agent_keeps_its_sandbox() {
    let (f, home) = start_guest().await;
    let dir = f.d().state.config.server.state_dir.clone();
    let first = f.d().state.e2b.guest_id().expect("guest id").to_owned();
    let cfg = (*f.d().state.config).clone();
    // The state dir stays (it goes with `_state`).
    let Front {
        daemon,
        _dir: _state,
        ..
    } = f;
    daemon.expect("running").shutdown().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let d = Daemon::start_on(cfg, listener).await.expect("restart");
    assert_eq!(d.state.config.server.state_dir, dir);
    assert_eq!(d.state.e2b.guest_id(), Some(first.as_str()));
    d.shutdown().await;
    drop(home);
}
