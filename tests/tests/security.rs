//! Identity on every surface: two tenants (E2B API keys) and strangers against an
//! in-process tetherd on loopback. Tenant B and an unauthenticated caller cannot list,
//! read, exec in, fork, follow or delete tenant A's sessions through `/v1`, the E2B
//! control plane, or envd (sandbox id in `E2b-Sandbox-Id` or in `Host`); A can. Short
//! credentials are refused at config load; envd `/health` tells nothing to a prober; with
//! only `[server] auth_tokens` the E2B front accepts no key.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tether_daemon::config::{ApiKey, Config, ConfigError};
use tether_tests::{TestDaemon, code, workspace_bin};

const KEY_A: &str = "tenant-a-key-0123456789";
const KEY_B: &str = "tenant-b-key-0123456789";

async fn two_tenants() -> TestDaemon {
    TestDaemon::start_with(|c| {
        c.e2b_front.api_keys = vec![
            ApiKey {
                key: KEY_A.into(),
                tenant: Some("a".into()),
            },
            ApiKey {
                key: KEY_B.into(),
                tenant: Some("b".into()),
            },
        ];
    })
    .await
}

/// One request with an optional API key (sent as `X-API-Key`, or as a bearer token when
/// `bearer`), returning status and JSON body (Null when not JSON).
async fn call(
    d: &TestDaemon,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = d.http.request(method, d.url(path));
    if let Some(k) = key {
        r = r.header("x-api-key", k);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.expect("send");
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

/// A creates a session through `/v1` (owned by A) with a file in it.
async fn a_session(d: &TestDaemon) -> String {
    let (st, b) = call(
        d,
        Method::POST,
        "/v1/sessions",
        Some(KEY_A),
        Some(json!({})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    let sid = b["id"].as_str().unwrap().to_owned();
    let r = d
        .http
        .put(d.url(&format!("/v1/sessions/{sid}/files")))
        .query(&[("path", "secret.txt")])
        .header("authorization", format!("Bearer {KEY_A}"))
        .body("tenant-a-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    sid
}

fn ids(list: &Value) -> Vec<String> {
    list["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_on_the_native_api() {
    let d = two_tenants().await;
    let sid = a_session(&d).await;
    let (st, b_sid) = {
        let (st, b) = call(
            &d,
            Method::POST,
            "/v1/sessions",
            Some(KEY_B),
            Some(json!({})),
        )
        .await;
        (st, b["id"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(st, 201);
    let mut cases = 0;
    let routes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/v1/sessions/{sid}"), None),
        (
            Method::GET,
            format!("/v1/sessions/{sid}/files?path=secret.txt"),
            None,
        ),
        (Method::GET, format!("/v1/sessions/{sid}/dirs?path=."), None),
        (
            Method::POST,
            format!("/v1/sessions/{sid}/processes"),
            Some(json!({"cmd": "echo pwned"})),
        ),
        (
            Method::POST,
            format!("/v1/sessions/{sid}/tool-calls"),
            Some(json!({"calls": []})),
        ),
        (Method::POST, format!("/v1/sessions/{sid}/fork"), None),
        (
            Method::GET,
            format!("/v1/sessions/{sid}/events?follow=true"),
            None,
        ),
        (Method::GET, format!("/v1/sessions/{sid}/messages"), None),
        (Method::DELETE, format!("/v1/sessions/{sid}"), None),
    ];
    // A stranger: 401 UNAUTHORIZED on everything, the list included; a wrong key too.
    for key in [None, Some("not-a-key-but-long-enough")] {
        let (st, b) = call(&d, Method::GET, "/v1/sessions", key, None).await;
        assert_eq!((st, code(&b)), (401, "UNAUTHORIZED"), "list with {key:?}");
        cases += 1;
        for (m, p, body) in &routes {
            let (st, b) = call(&d, m.clone(), p, key, body.clone()).await;
            assert_eq!(
                (st, code(&b)),
                (401, "UNAUTHORIZED"),
                "{m} {p} with {key:?}"
            );
            cases += 1;
        }
    }
    // Tenant B: A's session does not exist for it; its list holds only its own.
    let (st, b) = call(&d, Method::GET, "/v1/sessions", Some(KEY_B), None).await;
    assert_eq!(st, 200);
    assert_eq!(ids(&b), vec![b_sid.clone()]);
    cases += 1;
    for (m, p, body) in &routes {
        let (st, b) = call(&d, m.clone(), p, Some(KEY_B), body.clone()).await;
        assert_eq!((st, code(&b)), (404, "SESSION_NOT_FOUND"), "B: {m} {p}");
        cases += 1;
    }
    // Tenant A can do all of it (bearer form), and B's session is not in A's list.
    let (st, b) = call(&d, Method::GET, "/v1/sessions", Some(KEY_A), None).await;
    assert_eq!(st, 200);
    assert_eq!(ids(&b), vec![sid.clone()]);
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/files")))
        .query(&[("path", "secret.txt")])
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "tenant-a-secret");
    let (st, b) = call(
        &d,
        Method::POST,
        &format!("/v1/sessions/{sid}/processes"),
        Some(KEY_A),
        Some(json!({"cmd": "echo mine", "command_id": "c1"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    let (st, b) = call(
        &d,
        Method::POST,
        &format!("/v1/sessions/{sid}/processes/c1/wait"),
        Some(KEY_A),
        Some(json!({})),
    )
    .await;
    assert_eq!((st, b["status"]["code"].as_i64()), (200, Some(0)), "{b}");
    let (st, child) = call(
        &d,
        Method::POST,
        &format!("/v1/sessions/{sid}/fork"),
        Some(KEY_A),
        None,
    )
    .await;
    assert_eq!(st, 201, "{child}");
    let child = child["id"].as_str().unwrap().to_owned();
    // The fork is A's too: B cannot see it.
    let (st, b) = call(
        &d,
        Method::GET,
        &format!("/v1/sessions/{child}"),
        Some(KEY_B),
        None,
    )
    .await;
    assert_eq!((st, code(&b)), (404, "SESSION_NOT_FOUND"));
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/events?follow=true")))
        .header("x-api-key", KEY_A)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    drop(r);
    for id in [&child, &sid] {
        let (st, b) = call(
            &d,
            Method::DELETE,
            &format!("/v1/sessions/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
        assert_eq!(st, 204, "{b}");
    }
    println!("native API tenancy: {cases} refused cases");
    d.stop().await;
}

/// Create an E2B sandbox for `key`: (id, envd access token).
async fn e2b_create(d: &TestDaemon, key: &str) -> (String, String) {
    let (st, b) = call(
        d,
        Method::POST,
        "/sandboxes",
        Some(key),
        Some(json!({"templateID": "base"})),
    )
    .await;
    assert_eq!(st, 201, "{b}");
    (
        b["sandboxID"].as_str().unwrap().to_owned(),
        b["envdAccessToken"].as_str().unwrap().to_owned(),
    )
}

/// An envd request for sandbox `id`, addressed by header or by host.
fn envd(
    d: &TestDaemon,
    method: Method,
    path: &str,
    id: &str,
    token: Option<&str>,
    by_host: bool,
) -> reqwest::RequestBuilder {
    let mut r = d.http.request(method, d.url(path));
    r = if by_host {
        r.header("host", format!("49983-{id}.localhost"))
    } else {
        r.header("e2b-sandbox-id", id)
    };
    if let Some(t) = token {
        r = r.header("x-access-token", t);
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_on_the_e2b_front() {
    let d = two_tenants().await;
    let (a_id, a_token) = e2b_create(&d, KEY_A).await;
    let (_b_id, b_token) = e2b_create(&d, KEY_B).await;
    // A session A made through /v1 is A's sandbox on the front too.
    let v1_sid = a_session(&d).await;
    let mut cases = 0;
    // Control plane: B gets 404 for A's sandboxes, a stranger 401.
    for id in [&a_id, &v1_sid] {
        for (m, p, body) in [
            (Method::GET, format!("/sandboxes/{id}"), None),
            (
                Method::POST,
                format!("/sandboxes/{id}/connect"),
                Some(json!({"timeout": 60})),
            ),
            (
                Method::POST,
                format!("/sandboxes/{id}/timeout"),
                Some(json!({"timeout": 60})),
            ),
            (Method::DELETE, format!("/sandboxes/{id}"), None),
        ] {
            let (st, _) = call(&d, m.clone(), &p, Some(KEY_B), body.clone()).await;
            assert_eq!(st, 404, "B: {m} {p}");
            let (st, _) = call(&d, m.clone(), &p, None, body.clone()).await;
            assert_eq!(st, 401, "stranger: {m} {p}");
            let (st, _) = call(&d, m.clone(), &p, Some("wrong-key-0123456789"), body).await;
            assert_eq!(st, 401, "wrong key: {m} {p}");
            cases += 3;
        }
    }
    let (st, list) = call(&d, Method::GET, "/v2/sandboxes", Some(KEY_B), None).await;
    assert_eq!(st, 200);
    let listed: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sandboxID"].as_str())
        .collect();
    assert!(!listed.contains(&a_id.as_str()), "{listed:?}");
    assert!(!listed.contains(&v1_sid.as_str()), "{listed:?}");
    let (st, _) = call(&d, Method::GET, "/v2/sandboxes", None, None).await;
    assert_eq!(st, 401);
    cases += 2;
    // envd, by header and by host: no token, or B's token, is refused.
    for by_host in [false, true] {
        for token in [None, Some(b_token.as_str())] {
            let r = envd(
                &d,
                Method::POST,
                "/process.Process/List",
                &a_id,
                token,
                by_host,
            )
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
            assert_eq!(r.status().as_u16(), 401, "List host={by_host} {token:?}");
            let r = envd(
                &d,
                Method::GET,
                "/files?path=secret.txt",
                &a_id,
                token,
                by_host,
            )
            .send()
            .await
            .unwrap();
            assert_eq!(r.status().as_u16(), 401, "files host={by_host} {token:?}");
            cases += 2;
        }
    }
    // A can: connect to its /v1 session (its envd token comes back), list, exec, read.
    let (st, b) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{v1_sid}/connect"),
        Some(KEY_A),
        Some(json!({"timeout": 60})),
    )
    .await;
    assert!(st == 200 || st == 201, "{st} {b}");
    let v1_token = b["envdAccessToken"].as_str().unwrap().to_owned();
    let r = envd(
        &d,
        Method::GET,
        "/files?path=secret.txt",
        &v1_sid,
        Some(&v1_token),
        true,
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "tenant-a-secret");
    for by_host in [false, true] {
        let r = envd(
            &d,
            Method::POST,
            "/process.Process/List",
            &a_id,
            Some(&a_token),
            by_host,
        )
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
        assert_eq!(r.status().as_u16(), 200, "A List host={by_host}");
    }
    let (st, list) = call(&d, Method::GET, "/v2/sandboxes", Some(KEY_A), None).await;
    assert_eq!(st, 200);
    assert!(list.as_array().unwrap().len() >= 2, "{list}");
    for id in [&a_id, &v1_sid] {
        let (st, _) = call(
            &d,
            Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
        assert_eq!(st, 204);
    }
    println!("E2B front tenancy: {cases} refused cases");
    d.stop().await;
}

#[tokio::test]
async fn envd_health_tells_a_prober_nothing() {
    let d = two_tenants().await;
    let (a_id, a_token) = e2b_create(&d, KEY_A).await;
    let (_b_id, b_token) = e2b_create(&d, KEY_B).await;
    let missing = "i0000000000000000000000000";
    let probe = |id: String, token: Option<String>| {
        let r = envd(&d, Method::GET, "/health", &id, token.as_deref(), false);
        async move {
            let r = r.send().await.unwrap();
            let st = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            // The id is echoed back either way; compare the rest.
            let mut body = body;
            if let Some(o) = body.as_object_mut() {
                o.remove("sandboxId");
            }
            (st, body)
        }
    };
    let nothing = probe(missing.into(), None).await;
    assert_eq!(nothing.0, 502, "{nothing:?}");
    assert_eq!(probe(a_id.clone(), None).await, nothing, "no token");
    assert_eq!(
        probe(a_id.clone(), Some(b_token.clone())).await,
        nothing,
        "another tenant's token"
    );
    assert_eq!(probe(missing.into(), Some(b_token)).await, nothing);
    // The owner, with its token, sees its sandbox alive.
    assert_eq!(probe(a_id, Some(a_token)).await.0, 204);
    d.stop().await;
}

#[tokio::test]
async fn with_only_auth_tokens_the_e2b_front_accepts_no_key() {
    let token = "admin-token-0123456789";
    let d = TestDaemon::start_with(|c| c.server.auth_tokens = vec![token.into()]).await;
    for key in [
        "anything-at-all-0123456789",
        "e2b_0123456789abcdef",
        "x",
        token,
    ] {
        let (st, b) = call(
            &d,
            Method::POST,
            "/sandboxes",
            Some(key),
            Some(json!({"templateID": "base"})),
        )
        .await;
        assert_eq!(st, 401, "{key}: {b}");
        let (st, _) = call(&d, Method::GET, "/v2/sandboxes", Some(key), None).await;
        assert_eq!(st, 401, "{key}");
    }
    // The token itself works on the native API, and sees every session.
    let (st, b) = call(&d, Method::GET, "/v1/sessions", None, None).await;
    assert_eq!((st, code(&b)), (401, "UNAUTHORIZED"));
    let r = d
        .http
        .get(d.url("/v1/sessions"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    d.stop().await;
}

#[tokio::test]
async fn short_keys_and_tokens_are_refused_by_config_validation() {
    for toml in [
        "[server]\nauth_tokens = [\"x\"]\n",
        "[e2b_front]\napi_keys = [{key = \"k\", tenant = \"a\"}]\n",
        "[e2b_front]\napi_keys = [{key = \"fifteen-chars-k\"}]\n",
    ] {
        assert!(
            matches!(Config::from_toml_str(toml), Err(ConfigError::Invalid(_))),
            "{toml}"
        );
    }
    assert!(
        Config::from_toml_str("[e2b_front]\napi_keys = [{key = \"sixteen-chars-ok\"}]\n").is_ok()
    );
    // `tetherd validate-config` exits 64 (EX_USAGE).
    let dir = tempfile::tempdir().unwrap();
    let bin = workspace_bin("tetherd");
    for (i, toml) in [
        "[server]\nauth_tokens = [\"x\"]\n",
        "[e2b_front]\napi_keys = [{key = \"k\"}]\n",
    ]
    .iter()
    .enumerate()
    {
        let path = dir.path().join(format!("c{i}.toml"));
        std::fs::write(&path, toml).unwrap();
        let o = std::process::Command::new(&bin)
            .arg("validate-config")
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(64), "{toml}: {o:?}");
    }
}
