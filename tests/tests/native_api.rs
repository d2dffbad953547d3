//! End-to-end tests of the native API: tetherd in-process on an ephemeral port, the real
//! local provider, every endpoint, and bad input of every kind. Each refusal is checked
//! for its status and stable code, and the session log is checked to be intact after.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use tether_tests::{TestDaemon, code, wait_until};

/// Read a session's events.jsonl from disk and check it: header, parseable lines,
/// contiguous seq from 0.
fn assert_log_intact(d: &TestDaemon, id: &str) -> Vec<Value> {
    let path = d.dir.path().join("sessions").join(id).join("events.jsonl");
    let text = std::fs::read_to_string(&path).expect("events.jsonl");
    assert!(
        text.ends_with('\n'),
        "the log must end with a complete line"
    );
    let mut lines = text.lines();
    let header: Value = serde_json::from_str(lines.next().expect("header")).expect("header parses");
    assert_eq!(header["type"], "session");
    assert_eq!(header["id"], id);
    let events: Vec<Value> = lines
        .map(|l| serde_json::from_str(l).expect("event line parses"))
        .collect();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e["seq"].as_u64(),
            Some(i as u64),
            "seq must be contiguous from 0"
        );
    }
    events
}

async fn calls(d: &TestDaemon, sid: &str, calls: Value) -> Vec<Value> {
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({ "calls": calls }),
        )
        .await;
    assert_eq!(st, 200, "tool-calls: {body}");
    body["results"].as_array().expect("results").clone()
}

#[tokio::test]
async fn health_and_session_lifecycle() {
    let d = TestDaemon::start().await;
    let (st, h) = d.get("/v1/health").await;
    assert_eq!(st, 200);
    assert_eq!(h["status"], "ok");
    assert!(
        h["providers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == "local")
    );

    let sid = d.new_session().await;
    let (st, info) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(st, 200);
    assert_eq!(info["state"], "active");
    assert_eq!(info["provider"], "local");
    assert_eq!(
        info["enforcement"], "full",
        "the local provider must report full isolation here"
    );
    let (_, list) = d.get("/v1/sessions").await;
    assert!(
        list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == sid.as_str())
    );

    let r = d
        .http
        .delete(d.url(&format!("/v1/sessions/{sid}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let (_, info) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(info["state"], "closed");
    let events = assert_log_intact(&d, &sid);
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"sandbox/leased"));
    assert!(types.contains(&"sandbox/released"));
    assert_eq!(types.last(), Some(&"session/closed"));
    // A closed session's sandbox is gone: tool calls are refused with a stable code.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": []}),
        )
        .await;
    assert_eq!((st, code(&body)), (404, "SANDBOX_NOT_FOUND"), "{body}");
    d.stop().await;
}

#[tokio::test]
async fn bad_input_gets_stable_codes_and_leaves_the_log_intact() {
    let d = TestDaemon::start_with(|c| c.server.max_body_bytes = 64 * 1024).await;
    let sid = d.new_session().await;
    let tc = d.url(&format!("/v1/sessions/{sid}/tool-calls"));

    // Malformed JSON.
    let r = d
        .http
        .post(&tc)
        .header("content-type", "application/json")
        .body("{\"calls\": [")
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    assert!(body["error"]["request_id"].is_string());
    // Unknown field.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [], "extra": 1}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    let (st, body) = d
        .post("/v1/sessions", json!({"provider": "local", "bogus": true}))
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    // Unknown provider.
    let (st, body) = d.post("/v1/sessions", json!({"provider": "nope"})).await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    // Unknown session.
    let (st, body) = d
        .post("/v1/sessions/inope/tool-calls", json!({"calls": []}))
        .await;
    assert_eq!((st, code(&body)), (404, "SESSION_NOT_FOUND"));
    let (st, body) = d.get("/v1/sessions/inope/events").await;
    assert_eq!((st, code(&body)), (404, "SESSION_NOT_FOUND"));
    // Oversized body.
    let big = "x".repeat(200 * 1024);
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/messages"),
            json!({"role": "user", "content": big}),
        )
        .await;
    assert_eq!((st, code(&body)), (413, "PAYLOAD_TOO_LARGE"), "{body}");
    // Unknown route and wrong method.
    let (st, body) = d.get("/v1/nothing-here").await;
    assert_eq!((st, code(&body)), (404, "NOT_FOUND"));
    let r = d.http.put(d.url("/v1/sessions")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let body: Value = r.json().await.unwrap();
    assert_eq!(code(&body), "METHOD_NOT_ALLOWED");
    // Bad query.
    let (st, body) = d
        .get(&format!("/v1/sessions/{sid}/events?after=notanumber"))
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    // Paths are the sandbox's own (its root, not the host's): the daemon's state dir,
    // with a secret in it, is not there however the path is spelt.
    let secret = d.dir.path().join("host-secret.txt");
    std::fs::write(&secret, "root:x:0:0 host secret").unwrap();
    let shown = secret.display().to_string();
    let dotted = format!("../..{shown}");
    let nested = format!("/home/user/../..{shown}");
    for p in [shown.as_str(), dotted.as_str(), nested.as_str()] {
        let r = d
            .http
            .get(d.url(&format!("/v1/sessions/{sid}/files")))
            .query(&[("path", p)])
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert!(!text.contains("root:x:0:0"), "host content leaked for {p}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert!(
            matches!(
                (st, code(&body)),
                (403, "FS_PERMISSION_DENIED") | (400, "INVALID_REQUEST") | (404, "FS_NOT_FOUND")
            ),
            "{p}: {st} {body}"
        );
    }
    // Duplicate call ids are refused before anything is logged.
    let before = assert_log_intact(&d, &sid).len();
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": "a", "name": "bash", "arguments": {"command": "true"}}, {"id": "a", "name": "bash", "arguments": {"command": "true"}}]}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    assert_eq!(
        assert_log_intact(&d, &sid).len(),
        before,
        "a refused batch must log nothing"
    );
    // The daemon keeps serving, and the log is intact.
    let r = calls(
        &d,
        &sid,
        json!([{"id": "ok1", "name": "bash", "arguments": {"command": "echo still-here"}}]),
    )
    .await;
    assert!(r[0]["content"].as_str().unwrap().contains("still-here"));
    assert_log_intact(&d, &sid);
    d.stop().await;
}

#[tokio::test]
async fn a_token_is_required_when_configured() {
    let token = "0123456789abcdef-token";
    let d = TestDaemon::start_with(|c| c.server.auth_tokens = vec![token.into()]).await;
    let (st, body) = d.get("/v1/sessions").await;
    assert_eq!((st, code(&body)), (401, "UNAUTHORIZED"));
    let r = d
        .http
        .get(d.url("/v1/sessions"))
        .bearer_auth("wrong-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = d
        .http
        .get(d.url("/v1/sessions"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Health stays open for probes.
    assert_eq!(d.get("/v1/health").await.0, 200);
    d.stop().await;
}

#[tokio::test]
async fn tools_run_in_the_sandbox_and_results_are_logged_in_model_order() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let r = calls(
        &d,
        &sid,
        json!([
            {"id": "c1", "name": "write_file", "arguments": {"path": "notes/a.txt", "content": "alpha\nbeta\n"}},
            {"id": "c2", "name": "read_file", "arguments": {"path": "/home/user/notes/a.txt"}},
            {"id": "c3", "name": "edit_file", "arguments": {"path": "notes/a.txt", "old_string": "beta", "new_string": "gamma"}},
            {"id": "c4", "name": "bash", "arguments": {"command": "cat notes/a.txt; pwd; echo err >&2; exit 3"}},
            {"id": "c5", "name": "list_dir", "arguments": {"path": "/home/user", "depth": 2}},
            {"id": "c6", "name": "no_such_tool", "arguments": {}},
            {"id": "c7", "name": "read_file", "arguments": {"path": "../../etc/shadow"}},
            {"id": "c8", "name": "edit_file", "arguments": {"path": "notes/a.txt", "old_string": "zzz", "new_string": "y"}},
        ]),
    )
    .await;
    let ids: Vec<&str> = r.iter().map(|x| x["call_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8"]);
    assert_eq!(r[0]["is_error"], false, "{}", r[0]);
    assert!(
        r[1]["content"].as_str().unwrap().contains("beta"),
        "{}",
        r[1]
    );
    assert_eq!(r[2]["is_error"], false, "{}", r[2]);
    let bash = r[3]["content"].as_str().unwrap();
    assert!(
        bash.contains("gamma")
            && bash.contains("/home/user")
            && bash.contains("err")
            && bash.contains('3'),
        "{bash}"
    );
    assert!(
        r[4]["content"].as_str().unwrap().contains("a.txt"),
        "{}",
        r[4]
    );
    assert_eq!(r[5]["error"]["code"], "UNKNOWN_TOOL");
    assert_eq!(r[6]["is_error"], true);
    assert!(
        matches!(
            r[6]["error"]["code"].as_str(),
            Some("FS_PERMISSION_DENIED" | "INVALID_REQUEST" | "FS_NOT_FOUND")
        ),
        "{}",
        r[6]
    );
    assert_eq!(r[7]["error"]["code"], "FS_EDIT_NOT_FOUND");

    // Logged: one tool/call and one tool/result per call; results in model order.
    let events = assert_log_intact(&d, &sid);
    let results: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "tool/result")
        .map(|e| e["data"]["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(results, ids);
    // The derived history equals what was returned.
    let (_, msgs) = d.get(&format!("/v1/sessions/{sid}/messages")).await;
    let tool_msgs: Vec<&Value> = msgs["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_msgs.len(), 8);
    assert_eq!(tool_msgs[3]["content"], r[3]["content"]);
    d.stop().await;
}

#[tokio::test]
async fn bash_deadline_returns_partial_output_and_the_clock() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let t0 = tokio::time::Instant::now();
    let r = calls(
        &d,
        &sid,
        json!([{"id": "slow", "name": "bash", "arguments": {"command": "echo started; sleep 30; echo never", "timeout_ms": 800}}]),
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the deadline must end the call"
    );
    let res = &r[0];
    assert_eq!(res["is_error"], true);
    assert!(
        matches!(
            res["error"]["code"].as_str(),
            Some("DEADLINE_EXCEEDED" | "TOOL_TIMEOUT")
        ),
        "{res}"
    );
    assert!(
        res["content"].as_str().unwrap().contains("started"),
        "partial output must be kept: {res}"
    );
    assert!(!res["content"].as_str().unwrap().contains("never"));
    d.stop().await;
}

#[tokio::test]
async fn events_after_and_follow() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let (st, _) = d
        .post(
            &format!("/v1/sessions/{sid}/messages"),
            json!({"role": "user", "content": "hello"}),
        )
        .await;
    assert_eq!(st, 204);
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/messages"),
            json!({"role": "robot", "content": "x"}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    let text = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/events?after=0")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let evs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(evs.iter().all(|e| e["seq"].as_u64().unwrap() > 0));
    assert!(evs.iter().any(|e| e["type"] == "user/message"));

    // Follow: a live append arrives on the open stream.
    let resp = d
        .http
        .get(d.url(&format!("/v1/sessions/{sid}/events?follow=true")))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let poster = {
        let http = d.http.clone();
        let url = d.url(&format!("/v1/sessions/{sid}/messages"));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            http.post(url)
                .json(&json!({"role": "assistant", "content": "live!"}))
                .send()
                .await
                .unwrap();
        })
    };
    let mut buf = String::new();
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = body.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if buf.contains("live!") {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(
        found,
        "the followed stream must deliver the live event: {buf}"
    );
    poster.await.unwrap();
    let (_, msgs) = d.get(&format!("/v1/sessions/{sid}/messages")).await;
    let m = msgs["messages"].as_array().unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!(m[0]["role"], "user");
    assert_eq!(m[1]["content"], "live!");
    d.stop().await;
}

#[tokio::test]
async fn fork_copies_the_prefix_and_gets_its_own_sandbox() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    calls(
        &d,
        &sid,
        json!([{"id": "f1", "name": "bash", "arguments": {"command": "echo one"}}]),
    )
    .await;
    let (st, child) = d.post(&format!("/v1/sessions/{sid}/fork"), json!({})).await;
    assert_eq!(st, 201, "{child}");
    let cid = child["id"].as_str().unwrap();
    assert_ne!(cid, sid);
    assert_eq!(child["parent_session"], sid.as_str());
    assert_ne!(child["sandbox_id"], Value::Null);
    let events = assert_log_intact(&d, cid);
    assert!(events.iter().any(|e| e["type"] == "session/end-seed"));
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "tool/result" && e["data"]["call_id"] == "f1")
    );
    let (_, msgs) = d.get(&format!("/v1/sessions/{cid}/messages")).await;
    assert_eq!(msgs["messages"].as_array().unwrap().len(), 1);
    // A boundary beyond the end is refused.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/fork"),
            json!({"at_seq": 100000}),
        )
        .await;
    assert!(
        matches!(
            (st, code(&body)),
            (400, "INVALID_REQUEST") | (409, "CONFLICT")
        ),
        "{st} {body}"
    );
    d.stop().await;
}

#[tokio::test]
async fn processes_stream_resume_stdin_signal_wait() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let base = format!("/v1/sessions/{sid}/processes");
    let (st, p) = d.post(&base, json!({"cmd": "for i in 1 2 3 4 5; do echo line$i; sleep 0.05; done", "command_id": "loop"})).await;
    assert_eq!(st, 201, "{p}");
    assert_eq!(p["command_id"], "loop");
    let (st, w) = d.post(&format!("{base}/loop/wait"), json!({})).await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(w["status"]["code"], 0);
    assert_eq!(w["stdout_bytes"], 30);
    // The whole output, then a resume from offset 12 gives exactly the suffix.
    let all = output_bytes(&d, &sid, "loop", 0).await;
    assert_eq!(all, b"line1\nline2\nline3\nline4\nline5\n");
    let tail = output_bytes(&d, &sid, "loop", 12).await;
    assert_eq!(tail, &all[12..]);
    // Same id again: conflict.
    let (st, body) = d
        .post(&base, json!({"cmd": "true", "command_id": "loop"}))
        .await;
    assert_eq!((st, code(&body)), (409, "CONFLICT"));

    // stdin pipe.
    let (st, _) = d
        .post(
            &base,
            json!({"argv": ["cat"], "stdin": {"mode": "pipe"}, "command_id": "cat"}),
        )
        .await;
    assert_eq!(st, 201);
    let (st, _) = d
        .post(
            &format!("{base}/cat/stdin"),
            json!({"data": "aGVsbG8K", "eof": true}),
        )
        .await;
    assert_eq!(st, 204);
    let (_, w) = d.post(&format!("{base}/cat/wait"), json!({})).await;
    assert_eq!(w["status"]["code"], 0);
    assert_eq!(output_bytes(&d, &sid, "cat", 0).await, b"hello\n");

    // Signal: terminate a sleeper; the wait reports it did not exit 0.
    let (st, _) = d
        .post(&base, json!({"cmd": "sleep 60", "command_id": "sl"}))
        .await;
    assert_eq!(st, 201);
    let (st, body) = d
        .post(&format!("{base}/sl/signal"), json!({"signal": "BOGUS"}))
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    let (st, _) = d
        .post(&format!("{base}/sl/signal"), json!({"signal": "TERM"}))
        .await;
    assert_eq!(st, 204);
    let (_, w) = d.post(&format!("{base}/sl/wait"), json!({})).await;
    assert_ne!(w["status"]["code"], 0, "{w}");

    // Idle timeout: no output for longer than the limit ends the command with the clock.
    let (st, _) = d.post(&base, json!({"cmd": "echo x; sleep 30", "idle_timeout_ms": 300, "timeout_ms": 20000, "command_id": "idle"})).await;
    assert_eq!(st, 201);
    let t0 = tokio::time::Instant::now();
    let (_, w) = d.post(&format!("{base}/idle/wait"), json!({})).await;
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(w["clock"], "output_idle", "{w}");
    assert_eq!(output_bytes(&d, &sid, "idle", 0).await, b"x\n");

    // Unknown command.
    let (st, body) = d.post(&format!("{base}/nope/wait"), json!({})).await;
    assert_eq!((st, code(&body)), (404, "COMMAND_NOT_FOUND"));
    // Neither cmd nor argv.
    let (st, body) = d.post(&base, json!({"cwd": "/home/user"})).await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    // The log records starts and exits.
    let events = assert_log_intact(&d, &sid);
    let exits = events
        .iter()
        .filter(|e| e["type"] == "process/exited")
        .count();
    assert_eq!(exits, 4);
    d.stop().await;
}

async fn output_bytes(d: &TestDaemon, sid: &str, cid: &str, offset: u64) -> Vec<u8> {
    let text = d
        .http
        .get(d.url(&format!(
            "/v1/sessions/{sid}/processes/{cid}/output?offset={offset}"
        )))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut expect = offset;
    for line in text.lines() {
        let e: Value = serde_json::from_str(line).unwrap();
        if e["type"] == "output" && e["stream"] == "stdout" {
            assert_eq!(
                e["offset"].as_u64().unwrap(),
                expect,
                "offsets must be contiguous"
            );
            let data = tether_protocol::b64::decode(e["data"].as_str().unwrap()).unwrap();
            expect += data.len() as u64;
            out.extend(data);
        }
    }
    out
}

#[tokio::test]
async fn files_with_etags_and_guards() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let url = d.url(&format!("/v1/sessions/{sid}/files"));
    let r = d
        .http
        .put(&url)
        .query(&[("path", "dir/f.bin")])
        .body(vec![7u8; 300_000])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let etag = r.headers()["etag"].to_str().unwrap().to_owned();
    let r = d
        .http
        .get(&url)
        .query(&[("path", "dir/f.bin")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["etag"].to_str().unwrap(), etag);
    assert_eq!(r.bytes().await.unwrap().as_ref(), &vec![7u8; 300_000][..]);
    // Range.
    let r = d
        .http
        .get(&url)
        .query(&[("path", "dir/f.bin"), ("offset", "299990")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().len(), 10);
    // Conditional GET.
    let r = d
        .http
        .get(&url)
        .query(&[("path", "dir/f.bin")])
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 304);
    // If-None-Match: * on an existing file.
    let r = d
        .http
        .put(&url)
        .query(&[("path", "dir/f.bin")])
        .header("if-none-match", "*")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    assert_eq!(code(&r.json().await.unwrap()), "FS_ALREADY_EXISTS");
    // If-Match with a stale version.
    let r = d
        .http
        .put(&url)
        .query(&[("path", "dir/f.bin")])
        .header("if-match", "\"stale\"")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 412);
    assert_eq!(code(&r.json().await.unwrap()), "FS_VERSION_MISMATCH");
    // If-Match with the right version.
    let r = d
        .http
        .put(&url)
        .query(&[("path", "dir/f.bin")])
        .header("if-match", &etag)
        .body("new")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_ne!(r.headers()["etag"].to_str().unwrap(), etag);
    // Dirs.
    let (st, list) = d
        .get(&format!("/v1/sessions/{sid}/dirs?path=/home/user&depth=2"))
        .await;
    assert_eq!(st, 200);
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|e| e["path"] == "/home/user/dir/f.bin"),
        "{list}"
    );
    let (st, body) = d
        .get(&format!("/v1/sessions/{sid}/dirs?path=/home/user&depth=0"))
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    // Missing file; delete.
    let r = d
        .http
        .get(&url)
        .query(&[("path", "nope.txt")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(code(&r.json().await.unwrap()), "FS_NOT_FOUND");
    let r = d
        .http
        .delete(&url)
        .query(&[("path", "dir/f.bin")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let r = d
        .http
        .get(&url)
        .query(&[("path", "dir/f.bin")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // Writes are logged as fs/op events.
    let events = assert_log_intact(&d, &sid);
    assert!(events.iter().filter(|e| e["type"] == "fs/op").count() >= 4);
    d.stop().await;
}

#[tokio::test]
async fn sessions_cannot_reach_each_other() {
    let d = TestDaemon::start().await;
    let a = d.new_session().await;
    let b = d.new_session().await;
    calls(&d, &a, json!([{"id": "w", "name": "write_file", "arguments": {"path": "secret.txt", "content": "A-only"}}])).await;
    let r = calls(&d, &b, json!([{"id": "r", "name": "bash", "arguments": {"command": "cat /home/user/secret.txt; ls /home"}}])).await;
    assert!(
        !r[0]["content"].as_str().unwrap().contains("A-only"),
        "{}",
        r[0]
    );
    d.stop().await;
}

#[tokio::test]
async fn restart_resumes_sessions_and_reconnects_sandboxes() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    calls(&d, &sid, json!([{"id": "w1", "name": "write_file", "arguments": {"path": "keep.txt", "content": "kept"}}])).await;
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    let (st, info) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(st, 200);
    assert_eq!(info["state"], "active", "{info}");
    let r = calls(
        &d,
        &sid,
        json!([{"id": "r1", "name": "read_file", "arguments": {"path": "keep.txt"}}]),
    )
    .await;
    assert!(
        r[0]["content"].as_str().unwrap().contains("kept"),
        "{}",
        r[0]
    );
    // Call ids stay unique across the restart.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": "w1", "name": "bash", "arguments": {"command": "true"}}]}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"));
    assert_log_intact(&d, &sid);
    wait_until("nothing", Duration::from_millis(1), || async { true }).await;
    d.stop().await;
}

/// The events of `sid` on disk, read apart from the daemon.
fn events_on_disk(dir: &std::path::Path, sid: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("sessions").join(sid).join("events.jsonl"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn events_served(d: &TestDaemon, sid: &str, after: Option<u64>) -> Vec<Value> {
    let q = after.map(|a| format!("?after={a}")).unwrap_or_default();
    d.http
        .get(d.url(&format!("/v1/sessions/{sid}/events{q}")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// What the long session serves: its events equal the file's, its history starts at its
/// first message, an old call id is refused. Returns the events on disk.
async fn check_long_session(d: &TestDaemon, sid: &str) -> Vec<Value> {
    let disk = events_on_disk(d.dir.path(), sid);
    assert_eq!(events_served(d, sid, None).await, disk);
    assert_eq!(events_served(d, sid, Some(5)).await, disk[6..]);
    let (st, m) = d.get(&format!("/v1/sessions/{sid}/messages")).await;
    assert_eq!(st, 200, "{m}");
    let messages = m["messages"].as_array().unwrap();
    assert_eq!(
        messages.first().unwrap()["content"],
        format!("m0 {}", "x".repeat(100))
    );
    // 120 messages, and each call's assistant message and result.
    assert!(messages.len() >= 130, "{} messages", messages.len());
    // A call id used long ago (outside the window) is still refused.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": "call-0", "name": "bash", "arguments": {"command": "true"}}]}),
        )
        .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{body}");
    disk
}

/// A session far longer than the memory a live log keeps (4 KiB here): its events,
/// history, call-id book and fork are served from the log file, the same before and after
/// a restart, and memory holds only the newest events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_session_is_served_from_its_log_beyond_the_memory_window() {
    let window = |cfg: &mut tether_daemon::config::Config| {
        cfg.server.session_log_memory_bytes = 4096;
    };
    let d = TestDaemon::start_with(window).await;
    let sid = d.new_session().await;
    let pad = "x".repeat(100);
    for i in 0..120 {
        let (st, body) = d
            .post(
                &format!("/v1/sessions/{sid}/messages"),
                json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i} {pad}")}),
            )
            .await;
        assert_eq!(st, 204, "{body}");
    }
    for i in 0..10 {
        let (st, body) = d
            .post(
                &format!("/v1/sessions/{sid}/tool-calls"),
                json!({"calls": [{"id": format!("call-{i}"), "name": "bash", "arguments": {"command": format!("echo out-{i}")}}]}),
            )
            .await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["results"][0]["is_error"], false, "{body}");
    }
    let s = d
        .daemon
        .as_ref()
        .unwrap()
        .state
        .sessions
        .lookup(&sid, tether_daemon::session_manager::Scope::Any)
        .await
        .unwrap();
    let stats = s.log.stats();
    assert!(stats.held_bytes <= 4096, "{stats:?}");
    assert!(
        stats.held_events * 4 < stats.durable_events,
        "most events are not held in memory: {stats:?}"
    );
    drop(s);
    let before = check_long_session(&d, &sid).await;
    // A fork at seq 10 copies the first eleven events from the file.
    let (st, child) = d
        .post(&format!("/v1/sessions/{sid}/fork"), json!({"at_seq": 10}))
        .await;
    assert_eq!(st, 201, "{child}");
    let child_id = child["id"].as_str().unwrap().to_owned();
    let seed = events_on_disk(d.dir.path(), &child_id);
    assert_eq!(seed[..11], before[..11]);
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, window).await;
    let after = check_long_session(&d, &sid).await;
    assert_eq!(after[..before.len()], before[..]);
}

/// Regular files under `dir` whose path contains `part` and whose name is `name`, with
/// their length and the bytes allocated to them on disk.
fn files_named(
    dir: &std::path::Path,
    part: &str,
    name: &str,
) -> Vec<(std::path::PathBuf, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                todo.push(e.path());
            } else if m.is_file()
                && e.file_name() == name
                && e.path().to_string_lossy().contains(part)
            {
                out.push((e.path(), m.len(), m.blocks() * 512));
            }
        }
    }
    out
}

/// A long command's output is on disk once: as the journal takes it, the local
/// provider's spool of it is freed (a hole), and all of it is still served from offset 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_commands_output_is_stored_once() {
    let d = TestDaemon::start().await;
    let sid = d.new_session().await;
    let base = format!("/v1/sessions/{sid}/processes");
    let size: u64 = 40 << 20;
    let (st, p) = d
        .post(
            &base,
            json!({"cmd": format!("yes 0123456789abcdef | head -c {size}; sleep 60"), "command_id": "big", "timeout_ms": 120000}),
        )
        .await;
    assert_eq!(st, 201, "{p}");
    let journal = d.dir.path().join("sessions").join(&sid).join("output");
    wait_until("40 MiB journaled", Duration::from_secs(60), || async {
        files_named(&journal, "", "big.stdout")
            .first()
            .is_some_and(|f| f.1 == size)
    })
    .await;
    let spools = files_named(d.dir.path(), "/cmd/", "stdout");
    assert_eq!(spools.len(), 1, "{spools:?}");
    let (path, len, allocated) = &spools[0];
    assert_eq!(*len, size, "{}", path.display());
    assert!(
        *allocated < 16 << 20,
        "the spool still holds {allocated} bytes of {len} on disk"
    );
    let journaled = files_named(&journal, "", "big.stdout");
    assert!(journaled[0].2 >= size, "{journaled:?}");
    let out = output_bytes(&d, &sid, "big", 0).await;
    assert_eq!(out.len() as u64, size);
    assert!(
        out.chunks(17)
            .all(|c| c == &b"0123456789abcdef\n"[..c.len()])
    );
    let (st, _) = d
        .post(&format!("{base}/big/signal"), json!({"signal": "KILL"}))
        .await;
    assert_eq!(st, 204);
    d.stop().await;
}
