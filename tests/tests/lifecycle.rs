//! Session lifecycle across restarts, forks, failed starts and bad input: the typed
//! session parameters in the log header are what create, fork and recovery all read, and
//! the session log is the only lease record. Each test re-reads the log from disk.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tether_tests::{TestDaemon, TetherdChild, code, free_port, wait_healthy, wait_until};

/// The header and events of a session's log, read from disk.
fn read_log(state: &std::path::Path, id: &str) -> (Value, Vec<Value>) {
    let text = std::fs::read_to_string(state.join("sessions").join(id).join("events.jsonl"))
        .expect("events.jsonl");
    assert!(text.ends_with('\n'), "a log ends with a complete line");
    let mut lines = text.lines();
    let header: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    let events: Vec<Value> = lines.map(|l| serde_json::from_str(l).unwrap()).collect();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"].as_u64(), Some(i as u64), "seq contiguous from 0");
    }
    (header, events)
}

async fn state_of(d: &TestDaemon, id: &str) -> String {
    let (st, info) = d.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(st, 200, "{info}");
    info["state"].as_str().unwrap().to_owned()
}

/// Wait until session `id` reads as closed.
async fn wait_closed(d: &TestDaemon, id: &str, what: &str, within: Duration) {
    wait_until(
        what,
        within,
        || async move { state_of(d, id).await == "closed" },
    )
    .await;
}

async fn bash(d: &TestDaemon, sid: &str, command: &str) -> Value {
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": uuid::Uuid::new_v4().to_string(), "name": "bash", "arguments": {"command": command}}]}),
        )
        .await;
    assert_eq!(st, 200, "{body}");
    body["results"][0].clone()
}

/// `pasta` processes started by a local provider whose target sandbox pid is gone.
fn orphaned_nats() -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let ours = args.first().is_some_and(|p| p.ends_with("/pasta"))
            && args.iter().any(|a| a == "--no-map-gw")
            && args.iter().any(|a| a == "--runas");
        let target_gone = args
            .last()
            .and_then(|t| t.parse::<u32>().ok())
            .is_some_and(|t| !std::path::Path::new(&format!("/proc/{t}")).exists());
        if ours && target_gone {
            found.push(pid);
        }
    }
    found
}

/// Processes on this host whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline"))
            && String::from_utf8_lossy(&cmd).contains(marker)
        {
            found.push(pid);
        }
    }
    found
}

#[tokio::test]
async fn idle_expiry_survives_a_restart() {
    let d = TestDaemon::start().await;
    let (st, body) = d.post("/v1/sessions", json!({"ttl_s": 3})).await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    assert_eq!(state_of(&d, &sid).await, "active");
    // The expiry counts from the last activity before the restart, as without one.
    wait_closed(
        &d,
        &sid,
        "the session expires after the restart",
        Duration::from_secs(8),
    )
    .await;
    // "closed" shows as soon as closing starts; the log's last line follows.
    wait_until("the log records the close", Duration::from_secs(10), || {
        let dir = d.dir.path().to_owned();
        let sid = sid.clone();
        async move {
            read_log(&dir, &sid)
                .1
                .last()
                .is_some_and(|e| e["type"] == "session/closed")
        }
    })
    .await;
    let (header, events) = read_log(d.dir.path(), &sid);
    assert_eq!(
        header["params"]["expiry"],
        json!({"kind": "idle", "ttl_ms": 3000})
    );
    let last = events.last().unwrap();
    assert_eq!(last["type"], "session/closed");
    assert_eq!(last["data"]["reason"], "expired");
    assert!(events.iter().any(|e| e["type"] == "sandbox/released"));
    d.stop().await;
}

#[tokio::test]
async fn an_e2b_timeout_survives_a_restart() {
    let d = TestDaemon::start().await;
    let r = d
        .http
        .post(d.url("/sandboxes"))
        .header("x-api-key", "e2b_lifecycle_test_key")
        .json(&json!({"templateID": "base", "timeout": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let sid = r.json::<Value>().await.unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned();
    // set_timeout moves the end; the move is logged and survives the restart too.
    let r = d
        .http
        .post(d.url(&format!("/sandboxes/{sid}/timeout")))
        .header("x-api-key", "e2b_lifecycle_test_key")
        .json(&json!({"timeout": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    wait_closed(
        &d,
        &sid,
        "the E2B sandbox expires after the restart",
        Duration::from_secs(8),
    )
    .await;
    let (_, events) = read_log(d.dir.path(), &sid);
    assert!(events.iter().any(|e| e["type"] == "session/expiry"));
    d.stop().await;
}

#[tokio::test]
async fn e2b_access_and_private_ports_survive_a_restart() {
    let d = TestDaemon::start().await;
    let r = d
        .http
        .post(d.url("/v2/sandboxes"))
        .header("x-api-key", "e2b_lifecycle_test_key")
        .json(
            &json!({"templateID": "base", "timeout": 60, "network": {"allowPublicTraffic": false}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let body = r.json::<Value>().await.unwrap();
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    let token = body["trafficAccessToken"].as_str().unwrap().to_owned();
    let envd_token = body["envdAccessToken"].as_str().unwrap().to_owned();
    let envd_read = |d: &TestDaemon, token: &str| {
        d.http
            .get(d.url("/files?path=/etc/os-release"))
            .header("e2b-sandbox-id", sid.as_str())
            .header("x-access-token", token)
            .send()
    };
    let port_get = |d: &TestDaemon, token: Option<&str>| {
        let mut r = d
            .http
            .get(d.url("/"))
            .header("host", format!("8080-{sid}.localhost"));
        if let Some(t) = token {
            r = r.header("e2b-traffic-access-token", t);
        }
        r.send()
    };
    let status = |r: reqwest::Response| r.status().as_u16();
    // A mask that is no host is refused at create, not at every request.
    let r = d
        .http
        .post(d.url("/v2/sandboxes"))
        .header("x-api-key", "e2b_lifecycle_test_key")
        .json(&json!({"templateID": "base", "network": {"maskRequestHost": "bad\nhost"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 400);
    assert_eq!(status(port_get(&d, None).await.unwrap()), 403);
    // With the token the request reaches the sandbox, where nothing listens on 8080.
    assert_eq!(status(port_get(&d, Some(&token)).await.unwrap()), 502);
    assert_eq!(status(envd_read(&d, &envd_token).await.unwrap()), 200);
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    // Recovered from the log header: still private, the same token still admits.
    assert_eq!(status(port_get(&d, None).await.unwrap()), 403);
    assert_eq!(status(port_get(&d, Some(&token)).await.unwrap()), 502);
    // The envd access token handed out before the restart still admits (the secret both
    // derive from is kept in the state dir); another does not.
    assert_eq!(status(envd_read(&d, &envd_token).await.unwrap()), 200);
    assert_eq!(status(envd_read(&d, &"0".repeat(40)).await.unwrap()), 401);
    let (header, _) = read_log(d.dir.path(), &sid);
    assert_eq!(header["params"]["ports"]["public"], false, "{header}");
    d.stop().await;
}

#[tokio::test]
async fn a_fork_keeps_network_and_expiry() {
    let d = TestDaemon::start().await;
    let (st, body) = d
        .post(
            "/v1/sessions",
            json!({"network": true, "ttl_s": 4, "env": {"FORK_ENV": "kept"}}),
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let parent = body["id"].as_str().unwrap().to_owned();
    let (st, body) = d
        .post(&format!("/v1/sessions/{parent}/fork"), json!({}))
        .await;
    assert_eq!(st, 201, "{body}");
    let child = body["id"].as_str().unwrap().to_owned();
    // The child has the network the parent has: more interfaces than a lone loopback.
    let probe = "echo $FORK_ENV; tail -n +3 /proc/net/dev | wc -l";
    let parent_out = bash(&d, &parent, probe).await;
    let child_out = bash(&d, &child, probe).await;
    assert_eq!(child_out["content"], parent_out["content"], "{child_out}");
    let lines: Vec<&str> = child_out["content"].as_str().unwrap().lines().collect();
    assert!(lines.contains(&"kept"), "{child_out}");
    let ifaces: u32 = lines
        .iter()
        .rev()
        .find_map(|l| l.trim().parse().ok())
        .unwrap();
    assert!(
        ifaces >= 2,
        "a network sandbox has more than loopback: {child_out}"
    );
    // And the child expires as the parent does.
    wait_closed(&d, &child, "the fork expires", Duration::from_secs(10)).await;
    let (header, _) = read_log(d.dir.path(), &child);
    assert_eq!(header["params"]["network"], true);
    assert_eq!(header["params"]["env"]["FORK_ENV"], "kept");
    assert_eq!(header["parent_session"], parent.as_str());
    d.stop().await;
}

#[tokio::test]
async fn a_refused_process_start_runs_nothing() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let marker = format!("refused-start-{}", uuid::Uuid::new_v4().simple());
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            json!({"cmd": format!("sleep 600; : {marker}"), "command_id": "has space"}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        processes_with(&marker),
        Vec::<u32>::new(),
        "nothing may run"
    );
    let (_, events) = read_log(d.dir.path(), &sid);
    assert!(!events.iter().any(|e| e["type"] == "process/started"));
    d.stop().await;
}

#[tokio::test]
async fn a_download_through_a_symlink_is_refused_not_truncated() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let r = bash(
        &d,
        &sid,
        "seq 1 100000 > d.txt && ln -s d.txt l.txt && echo ok",
    )
    .await;
    assert_eq!(r["is_error"], false, "{r}");
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/files?path=/home/user/l.txt")))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (status, code(&body)),
        (409, "FS_NOT_REGULAR_FILE"),
        "{body}"
    );
    // HEAD says the same; the target itself downloads whole.
    let r = d
        .http
        .head(d.url(&format!("/v1/sessions/{sid}/files?path=/home/user/l.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/files?path=/home/user/d.txt")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let bytes = r.bytes().await.unwrap();
    let expected: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    assert_eq!(bytes.len(), expected.len());
    assert!(bytes == expected.as_bytes());
    read_log(d.dir.path(), &sid);
    d.stop().await;
}

#[tokio::test]
async fn a_path_that_is_not_utf8_is_refused() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    for q in ["path=%ff%fe", "path=/home/user/%C3%28"] {
        let (st, body) = d.get(&format!("/v1/sessions/{sid}/files?{q}")).await;
        assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{q}: {body}");
    }
    // A valid escape still works.
    let (st, body) = d
        .get(&format!(
            "/v1/sessions/{sid}/files?path=%2Fhome%2Fuser%2Fnope"
        ))
        .await;
    assert_eq!((st, code(&body)), (404, "FS_NOT_FOUND"), "{body}");
    read_log(d.dir.path(), &sid);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_by_shutdown_is_retryable_and_the_session_lives_on() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let http = d.http.clone();
    let url = d.url(&format!("/v1/sessions/{sid}/tool-calls"));
    let call = tokio::spawn(async move {
        let r = http
            .post(url)
            .json(&json!({"calls": [{"id": "c1", "name": "bash", "arguments": {"command": "sleep 30"}}]}))
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        (st, r.json::<Value>().await.unwrap_or(Value::Null))
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let dir = d.stop().await;
    let (st, body) = call.await.unwrap();
    // Either the whole request, or the call's result, says SHUTTING_DOWN (retryable).
    let c = if st == 200 {
        body["results"][0]["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    } else {
        assert_eq!(body["error"]["retryable"], true, "{body}");
        code(&body).to_owned()
    };
    assert_eq!(c, "SHUTTING_DOWN", "{st} {body}");
    let d = TestDaemon::start_in(dir, |_| {}).await;
    assert_eq!(state_of(&d, &sid).await, "active");
    let r = bash(&d, &sid, "echo again").await;
    assert_eq!(r["is_error"], false, "{r}");
    d.stop().await;
}

#[tokio::test]
async fn a_full_state_dir_is_storage_full() {
    let mnt = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "mounting a tmpfs needs root");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.path().to_owned());
    let state = mnt.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let d = TestDaemon::start_with(|c| c.server.state_dir = state.clone()).await;
    let sid = d.new_session().await;
    // Fill the file system.
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", mnt.path().join("fill").display()))
        .stderr(Stdio::null())
        .status();
    let (st, body) = d.post("/v1/sessions", json!({})).await;
    assert_eq!((st, code(&body)), (507, "STORAGE_FULL"), "{body}");
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/messages"),
            json!({"role": "user", "content": "x".repeat(200_000)}),
        )
        .await;
    assert_eq!((st, code(&body)), (507, "STORAGE_FULL"), "{body}");
    // Room again: the daemon works on, and the log it kept is intact.
    std::fs::remove_file(mnt.path().join("fill")).unwrap();
    let (st, body) = d.post("/v1/sessions", json!({})).await;
    assert_eq!(st, 201, "{body}");
    read_log(&state, &sid);
    d.stop().await;
}

// === kill -9 and restart ===

async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn session_state(http: &reqwest::Client, base: &str, id: &str) -> String {
    let r: Value = http
        .get(format!("{base}/v1/sessions/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["state"].as_str().unwrap_or("").to_owned()
}

/// kill -9, then restart on the same state dir: expiry and fork parameters come back from
/// the log; a garbage `leases.jsonl` (the old ledger) is irrelevant; a session whose log is
/// corrupt keeps its sandbox (never destroyed as an orphan) while the others recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_restart_recovers_params_expiry_and_never_fails_open() {
    let state = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut child = TetherdChild::spawn(state.path(), port);
    wait_healthy(&http, &base).await;

    let (st, a) = post(
        &http,
        format!("{base}/v1/sessions"),
        json!({"ttl_s": 4, "network": true}),
    )
    .await;
    assert_eq!(st, 201, "{a}");
    let expiring = a["id"].as_str().unwrap().to_owned();
    let (st, f) = post(
        &http,
        format!("{base}/v1/sessions/{expiring}/fork"),
        json!({}),
    )
    .await;
    assert_eq!(st, 201, "{f}");
    let fork = f["id"].as_str().unwrap().to_owned();
    let (st, k) = post(&http, format!("{base}/v1/sessions"), json!({})).await;
    assert_eq!(st, 201, "{k}");
    let kept = k["id"].as_str().unwrap().to_owned();
    let (st, c) = post(&http, format!("{base}/v1/sessions"), json!({})).await;
    assert_eq!(st, 201, "{c}");
    let corrupt = c["id"].as_str().unwrap().to_owned();
    let corrupt_sandbox = c["sandbox_id"].as_str().unwrap().to_owned();

    child.0.kill().unwrap();
    child.0.wait().unwrap();

    std::fs::write(state.path().join("leases.jsonl"), b"\x00garbage{{{\n").unwrap();
    let log = state
        .path()
        .join("sessions")
        .join(&corrupt)
        .join("events.jsonl");
    let text = std::fs::read_to_string(&log).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.insert(1, "{not json at all}");
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();

    let _child = TetherdChild::spawn(state.path(), port);
    wait_healthy(&http, &base).await;
    assert_eq!(session_state(&http, &base, &kept).await, "active");
    let (_, fork_header) = (0, read_log(state.path(), &fork).0);
    assert_eq!(fork_header["params"]["network"], true);
    assert_eq!(fork_header["params"]["expiry"]["kind"], "idle");
    for id in [&expiring, &fork] {
        wait_until("expiry after kill -9", Duration::from_secs(10), || {
            let http = &http;
            let base = &base;
            async move { session_state(http, base, id).await == "closed" }
        })
        .await;
    }
    // The killed daemon's network helpers (its two network sandboxes had one each) are
    // gone: nothing is left that no sandbox owns.
    assert_eq!(
        orphaned_nats(),
        Vec::<u32>::new(),
        "network helpers outlived their daemon"
    );
    // The unreadable session's sandbox is still there after a reconcile.
    let sandbox_dir = state
        .path()
        .join("sandboxes")
        .join("local")
        .join(&corrupt_sandbox);
    assert!(
        sandbox_dir.exists(),
        "a sandbox of an unreadable log is never destroyed"
    );
    let r = http
        .get(format!("{base}/v1/sessions/{kept}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (st, out) = post(
        &http,
        format!("{base}/v1/sessions/{kept}/tool-calls"),
        json!({"calls": [{"id": "k1", "name": "bash", "arguments": {"command": "echo alive"}}]}),
    )
    .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["results"][0]["is_error"], false, "{out}");
}

#[tokio::test]
async fn the_native_api_honours_an_inbound_deadline() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let started = tokio::time::Instant::now();
    let r = d
        .http
        .post(d.url(&format!("/v1/sessions/{sid}/tool-calls")))
        .header("tether-timeout-ms", "700")
        .json(&json!({"calls": [{"id": "slow", "name": "bash", "arguments": {"command": "sleep 20"}}]}))
        .send()
        .await
        .unwrap();
    let elapsed = started.elapsed();
    let st = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert!(elapsed < Duration::from_secs(8), "took {elapsed:?}");
    let c = if st == 200 {
        body["results"][0]["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    } else {
        code(&body).to_owned()
    };
    assert_eq!(c, "DEADLINE_EXCEEDED", "{st} {body}");
    for bad in ["0", "soon", "-5"] {
        let r = d
            .http
            .get(d.url(&format!("/v1/sessions/{sid}")))
            .header("tether-timeout-ms", bad)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let body: Value = r.json().await.unwrap();
        assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{bad}: {body}");
    }
    read_log(d.dir.path(), &sid);
    d.stop().await;
}

/// A native download from a backend that stalls mid-body (the transport idle limit set
/// far away) ends at the transfer deadline with a broken body, never a short success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_native_download_ends_at_its_transfer_deadline() {
    use tether_daemon::config::ProviderConfig;
    use tether_tests::fault_proxy::FaultProxy;
    let backend = TestDaemon::start().await;
    let upstream: std::net::SocketAddr =
        backend.base.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let d = TestDaemon::start_with(|c| {
        c.limits.transfer_timeout_ms = 2_000;
        c.providers.insert(
            "e2b".into(),
            ProviderConfig::E2b(tether_provider_e2b::E2bConfig {
                api_url: Some(backend.base.clone()),
                sandbox_url: Some(proxy.url()),
                api_key: Some("e2b_transfer_deadline_key".into()),
                inherit_env: false,
                transport_idle_ms: 60_000,
                ..Default::default()
            }),
        );
    })
    .await;
    let (st, body) = d.post("/v1/sessions", json!({"provider": "e2b"})).await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let data = vec![b'x'; 8 << 20];
    let r = d
        .http
        .put(d.url(&format!("/v1/sessions/{sid}/files?path=/home/user/big.bin")))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    proxy.stall_after(1 << 20);
    let started = tokio::time::Instant::now();
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/files?path=/home/user/big.bin")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let got = r.bytes().await;
    let took = started.elapsed();
    assert!(got.is_err(), "a stalled download must not end as a success");
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_secs(6),
        "ended after {took:?}, the transfer deadline is 2 s"
    );
    println!("stalled download ended after {took:?}");
    d.stop().await;
    backend.stop().await;
}

/// Closed sessions are not held in memory but stay readable; past the retention their
/// logs are removed at start.
#[tokio::test]
async fn closed_sessions_are_read_on_demand_and_removed_past_their_retention() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let r = bash(&d, &sid, "echo kept").await;
    assert_eq!(r["is_error"], false, "{r}");
    let r = d
        .http
        .delete(d.url(&format!("/v1/sessions/{sid}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let dir = d.stop().await;
    // Restarted with no retention: the closed session is listed and its log is readable.
    let d = TestDaemon::start_in(dir, |_| {}).await;
    let (st, list) = d.get("/v1/sessions").await;
    assert_eq!(st, 200);
    assert!(
        list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == sid.as_str() && s["state"] == "closed"),
        "{list}"
    );
    let r = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/events")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("tool/result") && text.contains("session/closed"),
        "{text}"
    );
    let dir = d.stop().await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    // With a 1 s retention, the next start removes it.
    let d = TestDaemon::start_in(dir, |c| c.server.closed_retention_s = 1).await;
    assert!(!d.dir.path().join("sessions").join(&sid).exists());
    let (st, body) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!((st, code(&body)), (404, "SESSION_NOT_FOUND"), "{body}");
    d.stop().await;
}

/// Per-session limits reach the sandbox; a command killed out of memory is reported as
/// such in its tool result and its `process/exited` event, and the session works on.
#[tokio::test]
async fn an_out_of_memory_kill_is_classified_in_the_tool_result_and_the_log() {
    let d = TestDaemon::start().await;
    let (st, body) = d
        .post(
            "/v1/sessions",
            json!({"limits": {"memory_bytes": 96 * 1024 * 1024}}),
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let r = bash(
        &d,
        &sid,
        "python3 -c 'b = bytearray(512 * 1024 * 1024); print(len(b))'",
    )
    .await;
    assert_eq!(r["is_error"], true, "{r}");
    assert_eq!(r["error"]["code"], "LIMIT_EXCEEDED", "{r}");
    assert!(
        r["content"].as_str().unwrap().contains("out of memory"),
        "{r}"
    );
    let (_, events) = read_log(d.dir.path(), &sid);
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "process/exited" && e["data"]["limit"] == "memory"),
        "the log records the limit"
    );
    let (header, _) = read_log(d.dir.path(), &sid);
    assert_eq!(header["params"]["limits"]["memory_bytes"], 96 * 1024 * 1024);
    let r = bash(&d, &sid, "echo still here").await;
    assert_eq!(r["is_error"], false, "{r}");
    d.stop().await;
}

/// Many readers of one closed session at once all get its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_of_a_closed_session_all_succeed() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let r = d
        .http
        .delete(d.url(&format!("/v1/sessions/{sid}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let mut readers = Vec::new();
    for _ in 0..16 {
        let (http, url) = (d.http.clone(), d.url(&format!("/v1/sessions/{sid}/events")));
        readers.push(tokio::spawn(async move {
            http.get(url).send().await.unwrap().status().as_u16()
        }));
    }
    for r in readers {
        assert_eq!(r.await.unwrap(), 200);
    }
    d.stop().await;
}

/// A session's output is capped: the command that passes the cap is ended with
/// LIMIT_EXCEEDED, what is stored stays near the cap, and later output is refused too.
#[tokio::test]
async fn a_session_output_cap_ends_the_command_that_passes_it() {
    const CAP: u64 = 256 * 1024;
    let d = TestDaemon::start_with(|c| c.limits.session_output_max_bytes = CAP).await;
    let sid = d.new_session().await;
    let r = bash(&d, &sid, "head -c 20000000 /dev/zero | tr '\\0' x; echo").await;
    assert_eq!(
        r["is_error"],
        true,
        "{}",
        &r.to_string()[..300.min(r.to_string().len())]
    );
    assert_eq!(r["error"]["code"], "LIMIT_EXCEEDED");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("output cap")
    );
    let stored: u64 = std::fs::read_dir(d.dir.path().join("sessions").join(&sid).join("output"))
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        stored <= 2 * CAP,
        "{stored} bytes stored for a cap of {CAP}"
    );
    let (_, events) = read_log(d.dir.path(), &sid);
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "process/exited" && e["data"]["limit"] == "disk")
    );
    let r = bash(&d, &sid, "echo more").await;
    assert_eq!(r["error"]["code"], "LIMIT_EXCEEDED", "{r}");
    d.stop().await;
}

/// Session `sid` is active and paused, and a tool call is refused at once (`409`).
async fn paused_and_refusing_calls(d: &TestDaemon, sid: &str) {
    let (_, info) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(info["paused"], json!(true), "{info}");
    assert_eq!(info["state"], "active", "{info}");
    let (st, _) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": "c2", "name": "bash", "arguments": {"command": "true"}}]}),
        )
        .await;
    assert_eq!(st, 409);
}

#[tokio::test]
async fn a_paused_session_stays_paused_across_a_restart_and_resumes_intact() {
    let d = TestDaemon::start().await;
    let (st, body) = d.post("/v1/sessions", json!({})).await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let r = bash(&d, &sid, "echo kept > /home/user/p.txt").await;
    assert_eq!(r["is_error"], json!(false), "{r}");
    let (st, body) = d
        .post(&format!("/v1/sessions/{sid}/pause"), json!({}))
        .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["paused"], json!(true));
    // Nothing runs in a paused sandbox: calls are refused at once, not left to wait.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": "c", "name": "bash", "arguments": {"command": "true"}}]}),
        )
        .await;
    assert_eq!(st, 409, "{body}");
    assert_eq!(body["error"]["code"], "CONFLICT");
    let (st, body) = d
        .post(&format!("/v1/sessions/{sid}/pause"), json!({}))
        .await;
    assert_eq!(
        (st, body["error"]["code"].clone()),
        (409, json!("CONFLICT"))
    );
    // A restart knows from the log that the sandbox is paused.
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    paused_and_refusing_calls(&d, &sid).await;
    let (st, body) = d
        .post(&format!("/v1/sessions/{sid}/resume"), json!({}))
        .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["paused"], json!(false));
    let r = bash(&d, &sid, "cat /home/user/p.txt").await;
    assert_eq!(r["is_error"], json!(false), "{r}");
    assert!(r["content"].to_string().contains("kept"), "{r}");
    let (_, events) = read_log(d.dir.path(), &sid);
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(kinds.contains(&"sandbox/paused") && kinds.contains(&"sandbox/resumed"));
    d.stop().await;
}

/// A pause without memory ends the sandbox's processes and keeps its files; a restart
/// knows from the log that it is stopped (it connects nothing), its resume boots it (a
/// new boot id), and a stopped sandbox's session closes and destroys it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paused_without_memory_stays_stopped_across_a_restart_and_boots_at_resume() {
    let d = TestDaemon::start().await;
    let (st, body) = d.post("/v1/sessions", json!({})).await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let sandbox = body["sandbox_id"].as_str().unwrap().to_owned();
    let boot_id = |r: &Value| {
        let text = r["content"].as_str().unwrap_or_default().to_owned();
        text.lines()
            .find(|l| l.len() == 36 && l.matches('-').count() == 4)
            .unwrap_or_else(|| panic!("no boot id in {r}"))
            .to_owned()
    };
    let r = bash(
        &d,
        &sid,
        "echo kept > /home/user/p.txt; cat /proc/sys/kernel/random/boot_id",
    )
    .await;
    assert_eq!(r["is_error"], json!(false), "{r}");
    let before = boot_id(&r);
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/pause"),
            json!({"kind": "filesystem"}),
        )
        .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["paused"], json!(true));
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/pause"),
            json!({"kind": "sideways"}),
        )
        .await;
    assert_eq!(
        (st, body["error"]["code"].clone()),
        (400, json!("INVALID_REQUEST")),
        "{body}"
    );
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    paused_and_refusing_calls(&d, &sid).await;
    let (st, body) = d
        .post(&format!("/v1/sessions/{sid}/resume"), json!({}))
        .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["paused"], json!(false));
    let r = bash(
        &d,
        &sid,
        "cat /home/user/p.txt /proc/sys/kernel/random/boot_id",
    )
    .await;
    assert_eq!(r["is_error"], json!(false), "{r}");
    assert!(r["content"].to_string().contains("kept"), "{r}");
    assert_ne!(boot_id(&r), before, "resume booted the sandbox again");
    let (_, events) = read_log(d.dir.path(), &sid);
    let paused: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "sandbox/paused")
        .collect();
    assert_eq!(paused.len(), 1);
    assert_eq!(paused[0]["data"]["kind"], "filesystem", "{}", paused[0]);
    // Stopped again and restarted, the session closes and takes the sandbox with it.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/pause"),
            json!({"kind": "filesystem"}),
        )
        .await;
    assert_eq!(st, 200, "{body}");
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    let sandbox_dir = d.dir.path().join("sandboxes").join("local").join(&sandbox);
    assert!(sandbox_dir.exists(), "a stopped sandbox is kept");
    let r = d
        .http
        .delete(d.url(&format!("/v1/sessions/{sid}")))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert!(!sandbox_dir.exists(), "closing its session destroyed it");
    d.stop().await;
}

/// Creates under one idempotency key make one sandbox, also when the retry arrives while
/// the first is still being made (a client whose answer was slow, retrying): it waits for
/// that sandbox instead of making a second. A key whose sandbox is gone makes a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_creates_under_one_idempotency_key_make_one_sandbox() {
    let d = TestDaemon::start().await;
    let create = |key: &'static str| {
        d.http
            .post(d.url("/v2/sandboxes"))
            .header("x-api-key", "e2b_lifecycle_test_key")
            .header("idempotency-key", key)
            .json(&json!({"templateID": "base", "timeout": 60}))
            .send()
    };
    let id_of = |r: reqwest::Response| async move {
        assert_eq!(r.status().as_u16(), 201);
        r.json::<Value>().await.unwrap()["sandboxID"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    // Four at once: one makes the sandbox, three join it.
    let (a, b, c, e) = tokio::join!(create("k1"), create("k1"), create("k1"), create("k1"));
    let mut ids = Vec::new();
    for r in [a, b, c, e] {
        ids.push(id_of(r.unwrap()).await);
    }
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    // After it is made, the key still names it.
    assert_eq!(id_of(create("k1").await.unwrap()).await, ids[0]);
    let list = |d: &TestDaemon| {
        d.http
            .get(d.url("/v2/sandboxes"))
            .header("x-api-key", "e2b_lifecycle_test_key")
            .send()
    };
    let listed: Vec<Value> = list(&d).await.unwrap().json().await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    // Killed, the key makes a new one.
    let r = d
        .http
        .delete(d.url(&format!("/sandboxes/{}", ids[0])))
        .header("x-api-key", "e2b_lifecycle_test_key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let fresh = id_of(create("k1").await.unwrap()).await;
    assert_ne!(fresh, ids[0]);
    d.stop().await;
}

/// `(status, body)` of an E2B control-plane call in development mode.
async fn e2b(
    d: &TestDaemon,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = d
        .http
        .request(method, d.url(path))
        .header("x-api-key", "e2b_lifecycle_test_key");
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn e2b_state(d: &TestDaemon, sid: &str) -> String {
    let (st, body) = e2b(d, reqwest::Method::GET, &format!("/sandboxes/{sid}"), None).await;
    assert_eq!(st, 200, "{body}");
    body["state"].as_str().unwrap().to_owned()
}

async fn wait_e2b_state(d: &TestDaemon, sid: &str, want: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let now = e2b_state(d, sid).await;
        if now == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{sid} is {now}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_sandbox_pauses_at_its_timeout_stays_paused_across_a_restart_and_resumes_on_traffic()
{
    use reqwest::Method;
    let d = TestDaemon::start().await;
    // autoResume without autoPause is refused, as the SDKs refuse it.
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/sandboxes",
        Some(json!({"templateID": "base", "autoResume": {"enabled": true}})),
    )
    .await;
    assert_eq!(st, 400, "{body}");
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/sandboxes",
        Some(json!({"templateID": "base", "timeout": 2, "autoPause": true, "autoResume": {"enabled": true}})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    let token = body["envdAccessToken"].as_str().unwrap().to_owned();
    bash(
        &d,
        &sid,
        "echo kept > /home/user/a; setsid sleep 3600 >/dev/null 2>&1 < /dev/null &",
    )
    .await;
    let (_, info) = e2b(&d, Method::GET, &format!("/sandboxes/{sid}"), None).await;
    assert_eq!(
        info["lifecycle"],
        json!({"autoResume": true, "onTimeout": "pause"})
    );
    // A second one pauses at its timeout too but resumes only on connect.
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/sandboxes",
        Some(json!({"templateID": "base", "timeout": 1, "autoPause": true})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let manual = body["sandboxID"].as_str().unwrap().to_owned();
    let manual_token = body["envdAccessToken"].as_str().unwrap().to_owned();
    // A third, killed at its timeout, is paused by hand: paused, it does not expire.
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/sandboxes",
        Some(json!({"templateID": "base", "timeout": 2})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let held = body["sandboxID"].as_str().unwrap().to_owned();
    let (st, _) = e2b(&d, Method::POST, &format!("/sandboxes/{held}/pause"), None).await;
    assert_eq!(st, 204);

    wait_e2b_state(&d, &sid, "paused", Duration::from_secs(10)).await;
    wait_e2b_state(&d, &manual, "paused", Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in [&sid, &manual, &held] {
        assert_eq!(
            e2b_state(&d, id).await,
            "paused",
            "{id} stays paused past its timeout"
        );
    }
    let read = |d: &TestDaemon, id: &str, token: &str| {
        d.http
            .get(d.url("/files?path=/home/user/a"))
            .header("e2b-sandbox-id", id)
            .header("x-access-token", token)
            .send()
    };
    // Traffic resumes the one that resumes on traffic, with its processes, for another
    // timeout: then it pauses again.
    let r = read(&d, &sid, &token).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "kept\n");
    assert_eq!(e2b_state(&d, &sid).await, "running");
    let r = bash(&d, &sid, "pgrep -c -f 'sleep 3600'").await;
    assert!(r["content"].as_str().unwrap().contains("\n1\n"), "{r}");
    wait_e2b_state(&d, &sid, "paused", Duration::from_secs(10)).await;
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    for id in [&sid, &manual, &held] {
        assert_eq!(
            e2b_state(&d, id).await,
            "paused",
            "{id} is paused after the restart"
        );
    }
    // After a restart too.
    let r = read(&d, &sid, &token).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "kept\n");
    assert_eq!(e2b_state(&d, &sid).await, "running");
    wait_e2b_state(&d, &sid, "paused", Duration::from_secs(10)).await;
    // The other is not resumed by traffic; connect resumes it.
    let r = read(&d, &manual, &manual_token).await.unwrap();
    assert_ne!(r.status().as_u16(), 200);
    assert_eq!(e2b_state(&d, &manual).await, "paused");
    let (st, body) = e2b(
        &d,
        Method::POST,
        &format!("/sandboxes/{manual}/connect"),
        Some(json!({"timeout": 60})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    assert_eq!(e2b_state(&d, &manual).await, "running");
    let (_, events) = read_log(d.dir.path(), &sid);
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(
        kinds.iter().filter(|k| **k == "sandbox/paused").count() >= 2,
        "{kinds:?}"
    );
    for id in [&sid, &manual, &held] {
        let (st, _) = e2b(&d, Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(st, 204);
    }
    d.stop().await;
}

/// E2B's rules for a pause without memory, as its API answers them: `autoPauseMemory:
/// false` only with `autoPause`, never with `autoResume`; `POST /pause {"memory": false}`
/// stops the sandbox, traffic does not resume it, connect boots it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_pauses_without_memory_follow_e2b_rules() {
    use reqwest::Method;
    let d = TestDaemon::start().await;
    for (body, why) in [
        (
            json!({"templateID": "base", "autoPauseMemory": false}),
            "autoPauseMemory=false only applies when autoPause is true",
        ),
        (
            json!({"templateID": "base", "autoPause": true, "autoPauseMemory": false,
                   "autoResume": {"enabled": true}}),
            "cannot be auto-resumed by traffic",
        ),
    ] {
        let (st, answer) = e2b(&d, Method::POST, "/v2/sandboxes", Some(body)).await;
        assert_eq!(st, 400, "{answer}");
        assert!(
            answer["message"].as_str().unwrap().contains(why),
            "{answer}"
        );
    }
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": "base", "timeout": 60})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    let (st, body) = e2b(
        &d,
        Method::POST,
        &format!("/sandboxes/{sid}/pause"),
        Some(json!({"memory": "no"})),
    )
    .await;
    assert_eq!(st, 400, "a bad body is refused: {body}");
    assert_eq!(e2b_state(&d, &sid).await, "running");
    let (st, body) = e2b(
        &d,
        Method::POST,
        &format!("/sandboxes/{sid}/pause"),
        Some(json!({"memory": false})),
    )
    .await;
    assert_eq!(st, 204, "{body}");
    assert_eq!(e2b_state(&d, &sid).await, "paused");
    let (st, _) = e2b(
        &d,
        Method::POST,
        &format!("/sandboxes/{sid}/pause"),
        Some(json!({"memory": false})),
    )
    .await;
    assert_eq!(st, 409);
    let (st, body) = e2b(
        &d,
        Method::POST,
        &format!("/v2/sandboxes/{sid}/connect"),
        Some(json!({"timeout": 60})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    assert_eq!(e2b_state(&d, &sid).await, "running");
    let (_, events) = read_log(d.dir.path(), &sid);
    let paused: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "sandbox/paused")
        .collect();
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert_eq!(paused[0]["data"]["kind"], "filesystem");
    let (st, _) = e2b(&d, Method::DELETE, &format!("/sandboxes/{sid}"), None).await;
    assert_eq!(st, 204);
    // Paused at its timeout, connected: it gets its new expiry before it runs, so the
    // expiry sweep (every second) never pauses it again at once.
    let (st, body) = e2b(
        &d,
        Method::POST,
        "/v2/sandboxes",
        Some(
            json!({"templateID": "base", "timeout": 1, "autoPause": true,
                    "autoPauseMemory": false}),
        ),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    for _ in 0..3 {
        wait_e2b_state(&d, &sid, "paused", Duration::from_secs(10)).await;
        let (st, body) = e2b(
            &d,
            Method::POST,
            &format!("/v2/sandboxes/{sid}/connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
        assert_eq!(st, 201, "{body}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(e2b_state(&d, &sid).await, "running");
        let (st, _) = e2b(
            &d,
            Method::POST,
            &format!("/sandboxes/{sid}/timeout"),
            Some(json!({"timeout": 1})),
        )
        .await;
        assert_eq!(st, 204);
    }
    let (st, _) = e2b(&d, Method::DELETE, &format!("/sandboxes/{sid}"), None).await;
    assert_eq!(st, 204);
    d.stop().await;
}
