//! envd served with no session layer at all: a [`SeamHost`] over a real local sandbox,
//! driven over HTTP as the E2B SDKs drive envd (REST files, Connect process and
//! filesystem services). What the server needs of its host is the seam and nothing of
//! tetherd's sessions.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether_envd_server::{Host, HostedCommand, HostedSandbox, Limits, SeamHost};
use tether_protocol::connect::{Decoder, FLAG_END_STREAM, Frame};
use tether_provider::{CallCtx, Provider, SandboxSpec};
use tether_provider_local::{LocalConfig, LocalProvider};

const ID: &str = "seam1";
const TOKEN: &str = "seam-token";

struct Served {
    host: Arc<SeamHost>,
    base: String,
    http: reqwest::Client,
    provider: Arc<LocalProvider>,
    sandbox_id: String,
    _dir: tempfile::TempDir,
}

/// The local provider's helper, built beside this test (`target/<profile>/`).
fn confine_helper() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let p = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .join(tether_provider_local::CONFINE_BINARY);
    assert!(
        p.is_file(),
        "{} is missing: build it first (cargo build -p tether-provider-local)",
        p.display()
    );
    p
}

async fn serve() -> Served {
    let dir = tempfile::Builder::new()
        .prefix("tether-seam-host-")
        .tempdir()
        .expect("tempdir");
    let mut cfg = LocalConfig::with_root(dir.path().join("sandboxes"));
    cfg.confine_helper = Some(confine_helper());
    let provider = Arc::new(LocalProvider::new(cfg).expect("provider"));
    let ctx = CallCtx::new("seam-test")
        .with_timeout(Duration::from_secs(60), tether_provider::Clock::Total);
    // The environment it is created with is the one `/envs` reports.
    let env = BTreeMap::from([("SEAM_VAR".to_owned(), "from-host".to_owned())]);
    let spec = SandboxSpec {
        env: env.clone(),
        ..SandboxSpec::default()
    };
    let sandbox = provider.create(&ctx, spec).await.expect("a local sandbox");
    let sandbox_id = sandbox.info().id.clone();
    let host = Arc::new(SeamHost::new(Limits {
        fs_op: Duration::from_secs(20),
        max_file_bytes: 1 << 20,
        kill_wait: Duration::from_secs(5),
    }));
    host.add(ID, sandbox, Some(TOKEN.into()), env);
    let app = tether_envd_server::router::<SeamHost>()
        .layer(axum::middleware::from_fn(
            tether_envd_server::call_ctx_layer,
        ))
        .with_state(Arc::clone(&host));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Served {
        host,
        base,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client"),
        provider,
        sandbox_id,
        _dir: dir,
    }
}

impl Served {
    fn req(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("e2b-sandbox-id", ID);
        if let Some(t) = token {
            rb = rb.header("x-access-token", t);
        }
        rb
    }

    async fn unary(&self, method: &str, body: Value) -> (u16, Value) {
        let r = self
            .req(reqwest::Method::POST, &format!("/{method}"), Some(TOKEN))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .send()
            .await
            .expect("send");
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    async fn stream(&self, method: &str, body: Value, timeout_ms: Option<u64>) -> Vec<(u8, Value)> {
        let mut rb = self
            .req(reqwest::Method::POST, &format!("/{method}"), Some(TOKEN))
            .header("content-type", "application/connect+json");
        if let Some(t) = timeout_ms {
            rb = rb.header("connect-timeout-ms", t.to_string());
        }
        let r = rb
            .body(tether_protocol::connect::message(&serde_json::to_vec(&body).unwrap()).unwrap())
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let bytes = r.bytes().await.expect("body");
        let mut d = Decoder::new(usize::MAX);
        d.push(&bytes);
        let mut out = Vec::new();
        while let Some(f) = d.next_frame().expect("a well-formed envelope") {
            out.push(match f {
                Frame::Message(m) => (0, serde_json::from_slice(&m).unwrap_or(Value::Null)),
                Frame::End(end) => (FLAG_END_STREAM, serde_json::to_value(end).unwrap()),
            });
        }
        out
    }
}

fn unb64(v: &Value) -> String {
    let raw = tether_protocol::b64::decode(v.as_str().unwrap_or("")).expect("base64");
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn envd_runs_over_a_bare_seam_host() {
    let s = serve().await;

    // Health and the access token.
    let r = s
        .req(reqwest::Method::GET, "/health", Some(TOKEN))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let r = s
        .req(reqwest::Method::GET, "/health", Some("wrong"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502, "a wrong token sees no sandbox");

    let r = s
        .req(reqwest::Method::GET, "/envs", Some(TOKEN))
        .send()
        .await
        .unwrap();
    let envs: Value = r.json().await.unwrap();
    assert_eq!(envs["SEAM_VAR"], "from-host", "{envs}");

    // Files: upload, download, refused without the token.
    let r = s
        .req(
            reqwest::Method::POST,
            "/files?path=/tmp/seam/a.txt",
            Some(TOKEN),
        )
        .header("content-type", "application/octet-stream")
        .body("hello seam")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let written: Value = r.json().await.unwrap();
    assert_eq!(written[0]["path"], "/tmp/seam/a.txt");
    let r = s
        .req(reqwest::Method::POST, "/files?path=/tmp/seam/b.txt", None)
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = s
        .req(
            reqwest::Method::GET,
            "/files?path=/tmp/seam/a.txt",
            Some(TOKEN),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "hello seam");
    let r = s
        .req(
            reqwest::Method::GET,
            "/files?path=/tmp/seam/none",
            Some(TOKEN),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);

    // The filesystem service.
    let (st, listed) = s
        .unary(
            "filesystem.Filesystem/ListDir",
            json!({"path": "/tmp/seam", "depth": 1}),
        )
        .await;
    assert_eq!(st, 200, "{listed}");
    let names: Vec<&str> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, ["a.txt"]);
    let (st, e) = s
        .unary(
            "filesystem.Filesystem/Stat",
            json!({"path": "/tmp/seam/none"}),
        )
        .await;
    assert_eq!((st, e["code"].as_str()), (404, Some("not_found")));

    // The process service: output, the host's environment, the exit status.
    let frames = s
        .stream(
            "process.Process/Start",
            json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo out $SEAM_VAR; echo err >&2; exit 3"]}}),
            None,
        )
        .await;
    let (mut out, mut err, mut end) = (String::new(), String::new(), None);
    for (_, f) in &frames {
        let ev = &f["event"];
        if let Some(d) = ev.get("data") {
            if let Some(v) = d.get("stdout") {
                out.push_str(&unb64(v));
            }
            if let Some(v) = d.get("stderr") {
                err.push_str(&unb64(v));
            }
        }
        if let Some(e) = ev.get("end") {
            end = Some(e.clone());
        }
    }
    assert!(
        frames[0].1["event"]["start"]["pid"].as_u64().is_some(),
        "{frames:?}"
    );
    assert_eq!((out.as_str(), err.as_str()), ("out from-host\n", "err\n"));
    let end = end.expect("an end event");
    assert_eq!(end["exitCode"], 3, "{end}");
    assert_eq!(frames.last().unwrap(), &(FLAG_END_STREAM, json!({})));

    // The call's timeout ends the stream and the host ends the process.
    let t0 = tokio::time::Instant::now();
    let frames = s
        .stream(
            "process.Process/Start",
            json!({"process": {"cmd": "/bin/sleep", "args": ["30"]}, "tag": "sleeper"}),
            Some(1_500),
        )
        .await;
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    let (flags, last) = frames.last().unwrap();
    assert_eq!(*flags, FLAG_END_STREAM);
    assert_eq!(last["error"]["code"], "deadline_exceeded", "{last}");
    let target = Host::find(&*s.host, ID).expect("served");
    let sleeper = target
        .sandbox
        .command("sleeper")
        .expect("the tagged process");
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        while sleeper.is_running() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ended.is_ok(), "the process outlived its deadline");

    // No longer served: as for a sandbox that does not exist.
    s.host.remove(ID).await;
    let r = s
        .req(reqwest::Method::GET, "/health", Some(TOKEN))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);

    let ctx = CallCtx::new("seam-test-end");
    s.provider
        .destroy(&ctx, &s.sandbox_id)
        .await
        .expect("destroy");
}
