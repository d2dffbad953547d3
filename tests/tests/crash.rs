//! Crash safety: tetherd as a child process, 200 concurrent tool calls, `kill -9` in the
//! middle, restart on the same state dir. Every acknowledged result must be in the log,
//! the log must parse, every call must have exactly one result (real or repaired), and
//! seq must be contiguous. And a loop of such kills, round after round on the same state
//! dir, under tool calls, file uploads and session creates in flight, after which every
//! session still works, every acknowledged upload and create is there, and the local
//! provider holds no sandbox that no live session owns.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::{Value, json};
use tether_provider::Provider;
use tether_tests::{TetherdChild, free_port, wait_healthy, wait_until};

const SESSIONS: usize = 20;
const CALLS_PER_SESSION: usize = 10;

fn count_results(state: &std::path::Path, ids: &[String]) -> usize {
    ids.iter()
        .map(|id| {
            std::fs::read_to_string(state.join("sessions").join(id).join("events.jsonl"))
                .map(|t| t.matches("\"type\":\"tool/result\"").count())
                .unwrap_or(0)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_flight_loses_nothing_acknowledged() {
    let state = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut child = TetherdChild::spawn(state.path(), port);
    wait_healthy(&http, &base).await;

    let mut ids = Vec::new();
    for _ in 0..SESSIONS {
        let r: Value = http
            .post(format!("{base}/v1/sessions"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    // 200 requests in flight at once: each a one-call batch; batches of a session run in turn.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, String, Value)>();
    let mut handles = Vec::new();
    for (si, sid) in ids.iter().enumerate() {
        for ci in 0..CALLS_PER_SESSION {
            let http = http.clone();
            let url = format!("{base}/v1/sessions/{sid}/tool-calls");
            let tx = tx.clone();
            let sid = sid.clone();
            let call_id = format!("s{si}c{ci}");
            let args = if ci % 2 == 0 {
                json!({"command": format!("echo out-{call_id}; sleep 0.15")})
            } else {
                json!({"path": format!("f{ci}.txt"), "content": format!("content-{call_id}")})
            };
            let name = if ci % 2 == 0 { "bash" } else { "write_file" };
            handles.push(tokio::spawn(async move {
                let body = json!({"calls": [{"id": call_id, "name": name, "arguments": args}]});
                if let Ok(r) = http.post(url).json(&body).send().await
                    && r.status().is_success()
                    && let Ok(v) = r.json::<Value>().await
                {
                    let _ = tx.send((sid, call_id, v["results"][0].clone()));
                }
            }));
        }
    }
    drop(tx);
    // Kill once a good part (but not all) of the results are durable.
    let total = SESSIONS * CALLS_PER_SESSION;
    wait_until("some results logged", Duration::from_secs(60), || {
        let n = count_results(state.path(), &ids);
        async move { n >= total / 4 }
    })
    .await;
    child.kill_9();
    let mut acked: Vec<(String, String, Value)> = Vec::new();
    while let Some(a) = rx.recv().await {
        acked.push(a);
    }
    for h in handles {
        let _ = h.await;
    }
    assert!(
        acked.len() < total,
        "the kill must land mid-flight (all {total} were acknowledged)"
    );
    eprintln!("acknowledged before the kill: {} of {total}", acked.len());

    // Restart on the same state dir.
    let port2 = free_port();
    let base2 = format!("http://127.0.0.1:{port2}");
    let _child2 = TetherdChild::spawn(state.path(), port2);
    wait_healthy(&http, &base2).await;

    let (calls, repaired) = check_logs(&http, &base2, state.path(), &ids, &acked).await;
    eprintln!("calls logged: {calls}, repaired results: {repaired}");
}

/// Check the sessions' logs through a running daemon at `base`: seq contiguous, every line
/// parses (on disk too), no turn left open, every logged call has exactly one result, and
/// every acknowledged result is there, identical. Returns the calls logged and the
/// results repaired.
async fn check_logs(
    http: &reqwest::Client,
    base2: &str,
    state: &std::path::Path,
    ids: &[String],
    acked: &[(String, String, Value)],
) -> (usize, usize) {
    let mut results_by_call: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut calls_logged: BTreeSet<String> = BTreeSet::new();
    let mut repaired = 0;
    for sid in ids {
        let text = http
            .get(format!("{base2}/v1/sessions/{sid}/events"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let events: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("event parses"))
            .collect();
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["seq"].as_u64(), Some(i as u64), "seq contiguous in {sid}");
        }
        let mut open_turn = false;
        for e in &events {
            match e["type"].as_str().unwrap() {
                "tool/call" => {
                    assert!(
                        calls_logged.insert(e["data"]["call_id"].as_str().unwrap().to_owned()),
                        "a call logged twice"
                    );
                }
                "tool/result" => {
                    let cid = e["data"]["call_id"].as_str().unwrap().to_owned();
                    if matches!(
                        e["data"]["error"]["code"].as_str(),
                        Some("TOOL_OUTCOME_UNKNOWN" | "TOOL_NOT_STARTED")
                    ) {
                        repaired += 1;
                    }
                    results_by_call
                        .entry(cid)
                        .or_default()
                        .push(e["data"].clone());
                }
                "turn/start" => open_turn = true,
                "turn/end" => open_turn = false,
                _ => {}
            }
        }
        assert!(
            !open_turn,
            "an interrupted turn must be closed by repair in {sid}"
        );
        // The file on disk parses line by line too.
        let disk =
            std::fs::read_to_string(state.join("sessions").join(sid).join("events.jsonl")).unwrap();
        assert!(disk.ends_with('\n'));
        for l in disk.lines() {
            serde_json::from_str::<Value>(l).expect("disk line parses");
        }
    }
    // Every logged call has exactly one result.
    for c in &calls_logged {
        assert_eq!(
            results_by_call.get(c).map_or(0, Vec::len),
            1,
            "call {c} must have exactly one result"
        );
    }
    for (c, r) in &results_by_call {
        assert_eq!(r.len(), 1, "call {c} has {} results", r.len());
    }
    // Every acknowledged result is present, identical.
    for (_, cid, res) in acked {
        let logged = &results_by_call
            .get(cid)
            .unwrap_or_else(|| panic!("acknowledged call {cid} missing"))[0];
        assert_eq!(
            logged["content"], res["content"],
            "acknowledged result of {cid} differs"
        );
        assert_eq!(logged["is_error"], res["is_error"]);
    }
    (calls_logged.len(), repaired)
}

/// Session creates sent in each round of the crash loop.
const LOOP_CREATES: usize = 1;
/// Bytes of each upload in the crash loop (one per session and round).
const UPLOAD_BYTES: usize = 256 * 1024;

/// Rounds of the crash loop.
const LOOP_ROUNDS: usize = 20;
/// Sessions of the crash loop (created in the first round, used in every round).
const LOOP_SESSIONS: usize = 4;
/// Calls per session per round.
const LOOP_CALLS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_kill_9_rounds_lose_nothing_acknowledged_and_every_session_still_works() {
    let state = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut ids: Vec<String> = Vec::new();
    let mut acked: Vec<(String, String, Value)> = Vec::new();
    // Creates and uploads the daemon answered before it was killed.
    let mut created: Vec<String> = Vec::new();
    let mut uploaded: Vec<(String, String, Vec<u8>)> = Vec::new();
    let mut killed_mid_flight = 0;
    // Every sandbox id this test's state ever held (looked at after each kill).
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for round in 0..LOOP_ROUNDS {
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let mut child = TetherdChild::spawn(state.path(), port);
        wait_healthy(&http, &base).await;
        if ids.is_empty() {
            for _ in 0..LOOP_SESSIONS {
                ids.push(new_session(&http, &base).await);
            }
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, String, Value)>();
        let mut handles = Vec::new();
        let (ctx_tx, mut ctx_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        for _ in 0..LOOP_CREATES {
            let (http, tx, url) = (http.clone(), ctx_tx.clone(), format!("{base}/v1/sessions"));
            handles.push(tokio::spawn(async move {
                if let Ok(r) = http.post(url).json(&json!({})).send().await
                    && r.status().as_u16() == 201
                    && let Ok(v) = r.json::<Value>().await
                    && let Some(id) = v["id"].as_str()
                {
                    let _ = tx.send(id.to_owned());
                }
            }));
        }
        drop(ctx_tx);
        let (up_tx, mut up_rx) =
            tokio::sync::mpsc::unbounded_channel::<(String, String, Vec<u8>)>();
        for (si, sid) in ids.iter().enumerate() {
            let (http, tx, sid) = (http.clone(), up_tx.clone(), sid.clone());
            let path = format!("/home/user/up-r{round}s{si}.bin");
            let data: Vec<u8> = (0..UPLOAD_BYTES)
                .map(|i| (i as u64 * 31 + round as u64 * 7 + si as u64) as u8)
                .collect();
            let url = format!("{base}/v1/sessions/{sid}/files");
            handles.push(tokio::spawn(async move {
                if let Ok(r) = http
                    .put(url)
                    .query(&[("path", path.as_str())])
                    .body(data.clone())
                    .send()
                    .await
                    && r.status().is_success()
                {
                    let _ = tx.send((sid, path, data));
                }
            }));
        }
        drop(up_tx);
        for (si, sid) in ids.iter().enumerate() {
            for ci in 0..LOOP_CALLS {
                let (http, tx, sid) = (http.clone(), tx.clone(), sid.clone());
                let url = format!("{base}/v1/sessions/{sid}/tool-calls");
                let call_id = format!("r{round}s{si}c{ci}");
                let (name, args) = if ci % 2 == 0 {
                    (
                        "bash",
                        json!({"command": format!("echo out-{call_id}; sleep 0.1")}),
                    )
                } else {
                    (
                        "write_file",
                        json!({"path": format!("r{round}c{ci}.txt"), "content": call_id.clone()}),
                    )
                };
                handles.push(tokio::spawn(async move {
                    let body = json!({"calls": [{"id": call_id, "name": name, "arguments": args}]});
                    if let Ok(r) = http.post(url).json(&body).send().await
                        && r.status().is_success()
                        && let Ok(v) = r.json::<Value>().await
                    {
                        let _ = tx.send((sid, call_id, v["results"][0].clone()));
                    }
                }));
            }
        }
        drop(tx);
        // A different moment of the round each time: 30 to 300 ms in.
        tokio::time::sleep(Duration::from_millis(30 + (round as u64 * 137) % 270)).await;
        child.kill_9();
        seen.extend(sandbox_dirs(state.path()));
        let before = acked.len();
        while let Some(a) = rx.recv().await {
            acked.push(a);
        }
        for h in handles {
            let _ = h.await;
        }
        while let Some(id) = ctx_rx.recv().await {
            created.push(id);
        }
        while let Some(u) = up_rx.recv().await {
            uploaded.push(u);
        }
        if acked.len() - before < LOOP_SESSIONS * LOOP_CALLS {
            killed_mid_flight += 1;
        }
    }
    assert!(
        killed_mid_flight >= LOOP_ROUNDS / 2,
        "most kills must land mid-flight ({killed_mid_flight} of {LOOP_ROUNDS} did)"
    );
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _child = TetherdChild::spawn(state.path(), port);
    wait_healthy(&http, &base).await;
    let (calls, repaired) = check_logs(&http, &base, state.path(), &ids, &acked).await;
    // Every acknowledged upload is there, byte for byte.
    for (sid, path, data) in &uploaded {
        let got = http
            .get(format!("{base}/v1/sessions/{sid}/files"))
            .query(&[("path", path.as_str())])
            .send()
            .await
            .unwrap();
        assert_eq!(got.status().as_u16(), 200, "{sid} {path}");
        assert!(
            got.bytes().await.unwrap() == data[..],
            "{sid} {path} differs"
        );
    }
    // Every acknowledged create is a live session with its sandbox; the local provider
    // holds no sandbox that no live session owns (creates cut mid-flight included, once
    // the reconciler has run).
    let sessions: Value = http
        .get(format!("{base}/v1/sessions"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let live: BTreeMap<String, String> = sessions["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "active")
        .filter_map(|s| {
            Some((
                s["id"].as_str()?.to_owned(),
                s["sandbox_id"].as_str()?.to_owned(),
            ))
        })
        .collect();
    for id in &created {
        assert!(
            live.contains_key(id),
            "acknowledged create {id} is not a live session"
        );
    }
    let backend = tether_provider_local::LocalProvider::new(
        tether_provider_local::LocalConfig::with_root(state.path().join("sandboxes/local")),
    )
    .unwrap();
    let owned: BTreeSet<&String> = live.values().collect();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let listed: Vec<String> = loop {
        let listed: Vec<String> = backend
            .list(&tether_provider::CallCtx::new("crash-loop"))
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.id)
            .collect();
        if listed.iter().all(|id| owned.contains(id)) || tokio::time::Instant::now() > until {
            break listed;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let orphans: Vec<&String> = listed.iter().filter(|id| !owned.contains(id)).collect();
    assert!(
        orphans.is_empty(),
        "sandboxes no live session owns: {orphans:?}"
    );
    for sb in &owned {
        assert!(listed.contains(sb), "a live session's sandbox {sb} is gone");
    }
    // Counted with ps too: no process is left in a sandbox no live session owns, and
    // each owned one still has its processes (its init at least).
    seen.extend(sandbox_dirs(state.path()));
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    let (stray, kept) = loop {
        let by_sandbox = processes_by_sandbox(&seen);
        let stray: usize = by_sandbox
            .iter()
            .filter(|(id, _)| !owned.contains(id))
            .map(|(_, n)| n)
            .sum();
        if stray == 0 || tokio::time::Instant::now() > until {
            break (stray, by_sandbox);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(stray, 0, "processes of sandboxes no session owns: {kept:?}");
    for sb in &owned {
        assert!(
            kept.get(*sb).is_some_and(|n| *n > 0),
            "no process of the live sandbox {sb}"
        );
    }
    // Every session survived every kill and still runs a command.
    for sid in &ids {
        let r: Value = http
            .post(format!("{base}/v1/sessions/{sid}/tool-calls"))
            .json(&json!({"calls": [{"id": "after", "name": "bash", "arguments": {"command": "echo alive"}}]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["results"][0]["is_error"], json!(false), "{sid}: {r}");
        assert!(
            r["results"][0]["content"].to_string().contains("alive"),
            "{r}"
        );
    }
    eprintln!(
        "{LOOP_ROUNDS} rounds: {} acknowledged, {calls} calls logged, {repaired} repaired, {killed_mid_flight} kills mid-flight; {} creates and {} uploads acknowledged and found, {} sandboxes, each a live session's; {} sandbox ids seen, 0 processes outside live sessions' sandboxes, {} inside them",
        acked.len(),
        created.len(),
        uploaded.len(),
        listed.len(),
        seen.len(),
        kept.values().sum::<usize>()
    );
}

/// A new session through the native API; its id.
async fn new_session(http: &reqwest::Client, base: &str) -> String {
    let r: Value = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["id"].as_str().unwrap().to_owned()
}

/// The events of `sid` about the command `cid`, read through the native API.
async fn command_events(http: &reqwest::Client, base: &str, sid: &str, cid: &str) -> Vec<Value> {
    let text = http
        .get(format!("{base}/v1/sessions/{sid}/events"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["data"]["command_id"] == cid)
        .collect()
}

/// stdout of `cid` from offset 0, as the native API serves it (one stream, contiguous).
async fn stdout_of(http: &reqwest::Client, base: &str, sid: &str, cid: &str) -> String {
    let text = http
        .get(format!("{base}/v1/sessions/{sid}/processes/{cid}/output"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = Vec::new();
    for line in text.lines() {
        let e: Value = serde_json::from_str(line).unwrap();
        if e["type"] == "output" && e["stream"] == "stdout" {
            assert_eq!(e["offset"].as_u64(), Some(out.len() as u64), "contiguous");
            out.extend(tether_protocol::b64::decode(e["data"].as_str().unwrap()).unwrap());
        }
    }
    String::from_utf8(out).unwrap()
}

/// A client for the tests below.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `tetherd serve` over `state` (with `config`) on a free port, healthy: the child and
/// its base URL.
/// Start a command in session `sid` (the native API's `POST .../processes` with `body`),
/// which must be accepted (201).
async fn start_command(http: &reqwest::Client, base: &str, sid: &str, body: Value) {
    let r = http
        .post(format!("{base}/v1/sessions/{sid}/processes"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap());
}

async fn start(
    http: &reqwest::Client,
    state: &std::path::Path,
    config: Option<&std::path::Path>,
) -> (TetherdChild, String) {
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let child = TetherdChild::spawn_with(state, port, config);
    wait_healthy(http, &base).await;
    (child, base)
}

/// A command running on an SSH host when tetherd is killed with -9 runs on there; the
/// restarted daemon finds it again by its id and supervises it to its end: the wait
/// answers its real exit, its output is whole and in order (nothing lost, nothing twice),
/// and the log has one start and one end for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_running_at_a_kill_9_is_supervised_again_after_the_restart() {
    let host = tether_tests::ssh_host::SshHost::start().await;
    let state = tempfile::tempdir().unwrap();
    let mut cfg = tether_daemon::config::Config {
        default_provider: "ssh".into(),
        ..Default::default()
    };
    cfg.providers.insert(
        "ssh".into(),
        tether_daemon::config::ProviderConfig::Ssh(host.provider_config("h")),
    );
    let config = state.path().join("tetherd.toml");
    std::fs::write(&config, toml::to_string(&cfg).unwrap()).unwrap();
    let http = client();
    let (mut child, base) = start(&http, state.path(), Some(&config)).await;
    let sid = new_session(&http, &base).await;
    start_command(&http, &base, &sid, json!({"cmd": "for i in $(seq 1 40); do echo line$i; sleep 0.1; done", "command_id": "long", "timeout_ms": 120000})).await;
    wait_until("output under way", Duration::from_secs(30), || async {
        stdout_of(&http, &base, &sid, "long")
            .await
            .contains("line3\n")
    })
    .await;
    child.kill_9();
    let (_child, base) = start(&http, state.path(), Some(&config)).await;
    let w: Value = http
        .post(format!("{base}/v1/sessions/{sid}/processes/long/wait"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        w["status"]["code"], 0,
        "the real exit after the restart: {w}"
    );
    let want: String = (1..=40).map(|i| format!("line{i}\n")).collect();
    assert_eq!(stdout_of(&http, &base, &sid, "long").await, want);
    let evs = command_events(&http, &base, &sid, "long").await;
    let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["process/started", "process/exited"], "{evs:?}");
}

/// Local sandboxes outlive a daemon killed with -9: a command running at the kill runs
/// on in its sandbox, its output spooled meanwhile by the sandbox's init, and one that
/// ends while no daemon is there is remembered with its status. The restarted daemon
/// takes the sandbox over: each wait answers the real exit, each output is whole and in
/// order, and the log has one start and one end for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_commands_run_on_through_a_kill_9_and_are_supervised_again() {
    let state = tempfile::tempdir().unwrap();
    let http = client();
    let (mut child, base) = start(&http, state.path(), None).await;
    let sid = new_session(&http, &base).await;
    for (id, cmd) in [
        // Still running when the daemon is back.
        (
            "kept",
            "echo begun; sleep 5; seq 1 2000; echo done >&2; exit 7",
        ),
        // Ends while no daemon is there.
        ("ended", "echo a; sleep 1; echo b; exit 3"),
    ] {
        start_command(
            &http,
            &base,
            &sid,
            json!({"cmd": cmd, "command_id": id, "timeout_ms": 120000}),
        )
        .await;
    }
    wait_until("output under way", Duration::from_secs(30), || async {
        stdout_of(&http, &base, &sid, "kept")
            .await
            .contains("begun")
            && stdout_of(&http, &base, &sid, "ended").await.contains('a')
    })
    .await;
    child.kill_9();
    // Longer than "ended" has left to run.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (_child, base) = start(&http, state.path(), None).await;
    for (id, code, out) in [
        (
            "kept",
            7,
            format!(
                "begun\n{}",
                (1..=2000).map(|i| format!("{i}\n")).collect::<String>()
            ),
        ),
        ("ended", 3, "a\nb\n".to_owned()),
    ] {
        let w: Value = http
            .post(format!("{base}/v1/sessions/{sid}/processes/{id}/wait"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            w["status"]["code"], code,
            "{id}: the real exit after the restart: {w}"
        );
        assert_eq!(stdout_of(&http, &base, &sid, id).await, out, "{id}");
        let evs = command_events(&http, &base, &sid, id).await;
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["process/started", "process/exited"],
            "{id}: {evs:?}"
        );
        assert_eq!(evs[1]["data"]["status"]["code"], code, "{id}: {evs:?}");
    }
    // The sandbox is the same machine: it goes on serving commands.
    let r: Value = http
        .post(format!("{base}/v1/sessions/{sid}/tool-calls"))
        .json(&json!({"calls": [{"id": "after", "name": "bash", "arguments": {"command": "echo still here"}}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(r.to_string().contains("still here"), "{r}");
}

/// A paused local sandbox (its init frozen with it) is taken over after a `kill -9` too,
/// and stays paused until resumed: then its command finishes with all its output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_local_sandbox_is_taken_over_paused_after_a_kill_9() {
    let state = tempfile::tempdir().unwrap();
    let http = client();
    let (mut child, base) = start(&http, state.path(), None).await;
    let sid = new_session(&http, &base).await;
    start_command(&http, &base, &sid, json!({"cmd": "for i in $(seq 1 15); do echo t$i; sleep 0.1; done", "command_id": "ticks", "timeout_ms": 120000})).await;
    wait_until("output under way", Duration::from_secs(30), || async {
        stdout_of(&http, &base, &sid, "ticks")
            .await
            .contains("t2\n")
    })
    .await;
    let r = http
        .post(format!("{base}/v1/sessions/{sid}/pause"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    child.kill_9();
    let (_child, base) = start(&http, state.path(), None).await;
    // Still paused: nothing more is printed.
    let before = stdout_of(&http, &base, &sid, "ticks").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        stdout_of(&http, &base, &sid, "ticks").await,
        before,
        "paused"
    );
    let r = http
        .post(format!("{base}/v1/sessions/{sid}/resume"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let w: Value = http
        .post(format!("{base}/v1/sessions/{sid}/processes/ticks/wait"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(w["status"]["code"], 0, "{w}");
    let want: String = (1..=15).map(|i| format!("t{i}\n")).collect();
    assert_eq!(stdout_of(&http, &base, &sid, "ticks").await, want);
}

/// The sandbox ids whose directories the local provider holds under `state` now.
fn sandbox_dirs(state: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(state.join("sandboxes/local"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("sandbox.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// How many host processes run in each sandbox of `ids`, by the sandbox cgroup named
/// after the id that each is in (`/proc/<pid>/cgroup`).
fn processes_by_sandbox(ids: &BTreeSet<String>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if e.file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
            .is_none()
        {
            continue;
        }
        let Ok(cg) = std::fs::read_to_string(e.path().join("cgroup")) else {
            continue;
        };
        let id = cg.lines().find_map(|l| {
            let path = l.splitn(3, ':').nth(2)?;
            let mut parts = path.split('/');
            parts.find(|p| *p == "tether")?;
            parts.next().filter(|id| ids.contains(*id))
        });
        if let Some(id) = id {
            *out.entry(id.to_owned()).or_insert(0) += 1;
        }
    }
    out
}

/// Host pids of processes whose command line is exactly `argv`.
fn pids_of(argv: &[&str]) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
        if args.len() == argv.len() && args.iter().zip(argv).all(|(a, b)| *a == b.as_bytes()) {
            out.push(pid);
        }
    }
    out
}

/// Whether a sandbox init's control socket (`SOCK_SEQPACKET`) at `path` takes connections.
fn listens(path: &std::path::Path) -> bool {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let Ok(fd) = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr).is_ok()
}

/// A local sandbox whose daemon was killed and never comes back does not run forever:
/// after `orphan_grace_ms` its init ends it, and every process in it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_sandbox_whose_daemon_never_returns_ends_after_its_orphan_grace() {
    let state = tempfile::tempdir().unwrap();
    let mut cfg = tether_daemon::config::Config::default();
    cfg.providers.insert(
        "local".into(),
        tether_daemon::config::ProviderConfig::Local(tether_provider_local::LocalConfig {
            orphan_grace_ms: 1500,
            ..Default::default()
        }),
    );
    let config = state.path().join("tetherd.toml");
    std::fs::write(&config, toml::to_string(&cfg).unwrap()).unwrap();
    let http = client();
    let (mut child, base) = start(&http, state.path(), Some(&config)).await;
    let sid = new_session(&http, &base).await;
    let argv = ["sleep", "613.25"];
    start_command(
        &http,
        &base,
        &sid,
        json!({"argv": argv, "command_id": "long"}),
    )
    .await;
    wait_until("the command runs", Duration::from_secs(30), || async {
        !pids_of(&argv).is_empty()
    })
    .await;
    let pids = pids_of(&argv);
    child.kill_9();
    // Within the grace it runs on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        pids.iter()
            .all(|p| std::path::Path::new(&format!("/proc/{p}")).exists()),
        "the command outlives its daemon for the grace"
    );
    wait_until(
        "the sandbox ends after its grace",
        Duration::from_secs(20),
        || async {
            pids.iter()
                .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
        },
    )
    .await;
    let sockets: Vec<_> = std::fs::read_dir(state.path().join("sandboxes/local"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("state/init.sock"))
        .filter(|p| listens(p))
        .collect();
    assert!(sockets.is_empty(), "an init still listens: {sockets:?}");
    // Stopping the test's daemon also removes the cgroups the ended sandbox left.
    let ids: Vec<String> = std::fs::read_dir(state.path().join("sandboxes/local"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| n.len() == 32)
        .collect();
    assert!(!ids.is_empty());
    drop(child);
    let left: Vec<_> = ids.iter().flat_map(|id| cgroup_dirs(id)).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
}

/// Directories named `name` in the cgroup hierarchies (a few levels deep).
fn cgroup_dirs(name: &str) -> Vec<std::path::PathBuf> {
    fn walk(d: &std::path::Path, name: &str, depth: usize, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(d) else { return };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let p = e.path();
            if e.file_name() == name {
                out.push(p.clone());
            }
            if depth > 0 {
                walk(&p, name, depth - 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(std::path::Path::new("/sys/fs/cgroup"), name, 6, &mut out);
    out
}
