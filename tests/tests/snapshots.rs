//! Snapshots and forks on the local provider, through the E2B API and the native API: a
//! snapshot outlives its sandbox and a restart, belongs to its tenant, is a template to
//! create sandboxes from, is deleted once, and a fork (one snapshot, then each fork from
//! it) copies the parent's file system and leaves no snapshot behind.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use reqwest::Method;
use serde_json::{Value, json};
use tether_daemon::config::ApiKey;
use tether_tests::{TestDaemon, code};

const KEY_A: &str = "snapshot-tenant-a-0123456789";
const KEY_B: &str = "snapshot-tenant-b-0123456789";

fn tenants(c: &mut tether_daemon::config::Config) {
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
}

async fn call(
    d: &TestDaemon,
    method: Method,
    path: &str,
    key: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = d
        .http
        .request(method, d.url(path))
        .header("x-api-key", key)
        .bearer_auth(key);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn create(d: &TestDaemon, key: &str, template: &str) -> (u16, Value) {
    call(
        d,
        Method::POST,
        "/v2/sandboxes",
        key,
        Some(json!({"templateID": template, "timeout": 120})),
    )
    .await
}

/// Run `command` in session `sid` (as tenant `key`), return its stdout.
async fn sh(d: &TestDaemon, key: &str, sid: &str, command: &str) -> String {
    let (st, body) = call(
        d,
        Method::POST,
        &format!("/v1/sessions/{sid}/tool-calls"),
        key,
        Some(json!({"calls": [{"id": uuid::Uuid::new_v4().to_string(), "name": "bash", "arguments": {"command": command}}]})),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let r = &body["results"][0];
    assert_eq!(r["is_error"], json!(false), "{r}");
    // The bash tool's text: the exit code, then each stream under its label.
    let text = r["content"].as_str().unwrap();
    let rest = text
        .strip_prefix("exit code: 0\n")
        .unwrap_or_else(|| panic!("{command}: {text}"));
    match rest.strip_prefix("--- stdout ---\n") {
        Some(out) => out.split("--- stderr ---\n").next().unwrap().to_owned(),
        None => String::new(),
    }
}

/// The provider's snapshots on disk (each a directory with a `snapshot.json`).
fn provider_snapshots(state: &std::path::Path) -> usize {
    snapshot_dirs(state).len()
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshotID"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_outlives_its_sandbox_and_a_restart_and_is_its_tenants_only() {
    let d = TestDaemon::start_with(tenants).await;
    let (st, body) = create(&d, KEY_A, "base").await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    sh(
        &d,
        KEY_A,
        &sid,
        "echo kept > /home/user/f.txt; mkdir -p /tmp/app; echo cfg > /tmp/app/c",
    )
    .await;

    // A bad name is refused; a good one names the snapshot.
    let path = format!("/sandboxes/{sid}/snapshots");
    let (st, body) = call(
        &d,
        Method::POST,
        &path,
        KEY_A,
        Some(json!({"name": "no spaces"})),
    )
    .await;
    assert_eq!(st, 400, "{body}");
    let (st, body) = call(
        &d,
        Method::POST,
        &path,
        KEY_A,
        Some(json!({"name": "keep"})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    assert_eq!(
        body,
        json!({"snapshotID": "keep:default", "names": ["keep:default"]})
    );
    let (st, unnamed) = call(&d, Method::POST, &path, KEY_A, None).await;
    assert_eq!(st, 201, "{unnamed}");
    let unnamed = unnamed["snapshotID"].as_str().unwrap().to_owned();
    assert!(
        unnamed.ends_with(":default") && unnamed != "keep:default",
        "{unnamed}"
    );
    assert_eq!(provider_snapshots(d.dir.path()), 2);

    // Another tenant sees none of it and cannot use it.
    let (st, _) = call(&d, Method::POST, &path, KEY_B, None).await;
    assert_eq!(st, 404);
    let (st, body) = call(&d, Method::GET, "/snapshots", KEY_B, None).await;
    assert_eq!((st, body), (200, json!([])));
    let (st, body) = create(&d, KEY_B, "keep:default").await;
    assert_eq!(st, 404, "{body}");
    let (st, _) = call(&d, Method::DELETE, "/templates/keep:default", KEY_B, None).await;
    assert_eq!(st, 404);
    let (st, body) = call(&d, Method::GET, "/v1/snapshots", KEY_B, None).await;
    assert_eq!(
        (st, body["snapshots"].as_array().map(Vec::len)),
        (200, Some(0))
    );

    // Its tenant lists both, by sandbox and by name; the page size is honoured.
    let (st, body) = call(
        &d,
        Method::GET,
        &format!("/snapshots?sandboxID={sid}"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(ids(&body), vec!["keep:default".to_owned(), unnamed.clone()]);
    let (_, body) = call(&d, Method::GET, "/snapshots?name=keep", KEY_A, None).await;
    assert_eq!(ids(&body), vec!["keep:default".to_owned()]);
    let (_, body) = call(&d, Method::GET, "/snapshots?name=nope", KEY_A, None).await;
    assert_eq!(body, json!([]));
    let r = d
        .http
        .get(d.url("/snapshots?limit=1"))
        .header("x-api-key", KEY_A)
        .send()
        .await
        .unwrap();
    let next = r.headers()["x-next-token"].to_str().unwrap().to_owned();
    assert_eq!(
        r.json::<Value>().await.unwrap().as_array().unwrap().len(),
        1
    );
    let (_, body) = call(
        &d,
        Method::GET,
        &format!("/snapshots?limit=1&nextToken={next}"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(ids(&body), vec![unnamed.clone()]);

    // The sandbox goes; its snapshots stay, across a restart.
    let (st, _) = call(
        &d,
        Method::DELETE,
        &format!("/sandboxes/{sid}"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 204);
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, tenants).await;
    let (_, body) = call(&d, Method::GET, "/snapshots", KEY_A, None).await;
    assert_eq!(ids(&body), vec!["keep:default".to_owned(), unnamed.clone()]);

    // A sandbox created from it starts with its files, anywhere in the machine.
    let (st, body) = create(&d, KEY_A, "keep:default").await;
    assert_eq!(st, 201, "{body}");
    assert_eq!(body["templateID"], "keep:default");
    let child = body["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(
        sh(&d, KEY_A, &child, "cat /home/user/f.txt /tmp/app/c").await,
        "kept\ncfg\n"
    );
    let (st, body) = call(
        &d,
        Method::GET,
        &format!("/v1/sessions/{child}"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    let header: Value = serde_json::from_str(
        std::fs::read_to_string(
            d.dir
                .path()
                .join("sessions")
                .join(&child)
                .join("events.jsonl"),
        )
        .unwrap()
        .lines()
        .next()
        .unwrap(),
    )
    .unwrap();
    assert!(
        header["params"]["snapshot"]
            .as_str()
            .is_some_and(|s| s.starts_with('s')),
        "{header}"
    );

    // A new snapshot under the same name takes it over: the old one is deleted.
    sh(&d, KEY_A, &child, "echo newer > /home/user/f.txt").await;
    let (st, _) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{child}/snapshots"),
        KEY_A,
        Some(json!({"name": "keep"})),
    )
    .await;
    assert_eq!(st, 201);
    let (_, body) = call(&d, Method::GET, "/snapshots", KEY_A, None).await;
    assert_eq!(ids(&body), vec![unnamed.clone(), "keep:default".to_owned()]);
    assert_eq!(provider_snapshots(d.dir.path()), 2);
    let (st, body) = create(&d, KEY_A, "keep").await;
    assert_eq!(st, 201, "{body}");
    let grandchild = body["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(
        sh(&d, KEY_A, &grandchild, "cat /home/user/f.txt").await,
        "newer\n"
    );

    // Deleted once: 204, then 404; a configured template is not deletable.
    let (st, _) = call(&d, Method::DELETE, "/templates/keep:default", KEY_A, None).await;
    assert_eq!(st, 204);
    let (st, _) = call(&d, Method::DELETE, "/templates/keep:default", KEY_A, None).await;
    assert_eq!(st, 404);
    let (st, _) = call(&d, Method::DELETE, "/templates/base", KEY_A, None).await;
    assert_eq!(st, 400);
    let (st, body) = call(
        &d,
        Method::DELETE,
        &format!("/v1/snapshots/{}", unnamed.trim_end_matches(":default")),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 204, "{body}");
    let (st, body) = call(&d, Method::DELETE, "/v1/snapshots/nope", KEY_A, None).await;
    assert_eq!((st, code(&body)), (404, "SNAPSHOT_NOT_FOUND"));
    assert_eq!(provider_snapshots(d.dir.path()), 0);
    let (st, _) = create(&d, KEY_A, "keep:default").await;
    assert_eq!(st, 404);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_copies_the_file_system_once_for_every_fork_and_keeps_no_snapshot() {
    let d = TestDaemon::start_with(tenants).await;
    let (st, body) = create(&d, KEY_A, "base").await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    sh(
        &d,
        KEY_A,
        &sid,
        "echo before > /home/user/state.txt; echo t > /tmp/t",
    )
    .await;
    let fork = format!("/sandboxes/{sid}/fork");
    for bad in [
        json!({"count": 0}),
        json!({"count": 21}),
        json!({"timeout": 0}),
    ] {
        let (st, body) = call(&d, Method::POST, &fork, KEY_A, Some(bad.clone())).await;
        assert_eq!(st, 400, "{bad}: {body}");
    }
    let (st, _) = call(&d, Method::POST, &fork, KEY_B, None).await;
    assert_eq!(st, 404);
    let (st, body) = call(
        &d,
        Method::POST,
        &fork,
        KEY_A,
        Some(json!({"count": 2, "timeout": 60})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let forks: Vec<String> = body
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["sandbox"]["sandboxID"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(forks.len(), 2);
    assert!(forks[0] != forks[1] && !forks.contains(&sid), "{forks:?}");
    for f in &forks {
        assert_eq!(
            sh(&d, KEY_A, f, "cat /home/user/state.txt /tmp/t").await,
            "before\nt\n"
        );
    }
    // Independent: a fork's change is its own.
    sh(&d, KEY_A, &forks[0], "echo changed > /home/user/state.txt").await;
    assert_eq!(
        sh(&d, KEY_A, &sid, "cat /home/user/state.txt").await,
        "before\n"
    );
    assert_eq!(
        sh(&d, KEY_A, &forks[1], "cat /home/user/state.txt").await,
        "before\n"
    );
    // The snapshot taken for the forks is gone; the parent runs on.
    assert_eq!(provider_snapshots(d.dir.path()), 0);
    let (st, body) = call(&d, Method::GET, &format!("/sandboxes/{sid}"), KEY_A, None).await;
    assert_eq!((st, body["state"].as_str()), (200, Some("running")));
    // A fork expires by its own timeout, not the parent's.
    let (_, info) = call(
        &d,
        Method::GET,
        &format!("/sandboxes/{}", forks[1]),
        KEY_A,
        None,
    )
    .await;
    let (_, pinfo) = call(&d, Method::GET, &format!("/sandboxes/{sid}"), KEY_A, None).await;
    assert_ne!(info["endAt"], pinfo["endAt"]);

    // The native fork copies the file system the same way.
    let (st, body) = call(
        &d,
        Method::POST,
        &format!("/v1/sessions/{sid}/fork"),
        KEY_A,
        Some(json!({})),
    )
    .await;
    assert_eq!(st, 201, "{body}");
    let native = body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        sh(&d, KEY_A, &native, "cat /home/user/state.txt").await,
        "before\n"
    );
    assert_eq!(provider_snapshots(d.dir.path()), 0);

    // A paused sandbox is not forked behind its back; a killed one is not found.
    let (st, _) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{sid}/pause"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 204);
    let (st, body) = call(&d, Method::POST, &fork, KEY_A, None).await;
    assert_eq!(st, 409, "{body}");
    let (st, body) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{sid}/snapshots"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 409, "{body}");
    let (st, _) = call(
        &d,
        Method::DELETE,
        &format!("/sandboxes/{sid}"),
        KEY_A,
        None,
    )
    .await;
    assert_eq!(st, 204);
    let (st, _) = call(&d, Method::POST, &fork, KEY_A, None).await;
    assert_eq!(st, 404);
    d.stop().await;
}

/// Every directory under the local provider's storage holding a `snapshot.json`.
fn snapshot_dirs(state: &std::path::Path) -> Vec<std::path::PathBuf> {
    fn walk(p: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(p) else { return };
        for e in rd.flatten() {
            let path = e.path();
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() && !t.is_symlink() {
                if path.join("snapshot.json").is_file() {
                    out.push(path);
                } else if path
                    .file_name()
                    .is_some_and(|f| f != "store" && f != "rootfs")
                {
                    walk(&path, out);
                }
            }
        }
    }
    let mut v = Vec::new();
    walk(&state.join("sandboxes"), &mut v);
    v
}

/// A crash between a provider's snapshot and the daemon's record of it (here: the
/// record is gone), or in the middle of a copy (a directory without `snapshot.json`),
/// leaves bytes nothing names: the next daemon deletes them at start and keeps the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_no_record_names_is_deleted_at_start() {
    let d = TestDaemon::start_with(tenants).await;
    let (st, body) = create(&d, KEY_A, "base").await;
    assert_eq!(st, 201, "{body}");
    let sid = body["sandboxID"].as_str().unwrap().to_owned();
    sh(&d, KEY_A, &sid, "echo kept > /home/user/f.txt").await;
    let path = format!("/sandboxes/{sid}/snapshots");
    for name in ["kept", "lost"] {
        let (st, body) = call(&d, Method::POST, &path, KEY_A, Some(json!({"name": name}))).await;
        assert_eq!(st, 201, "{body}");
    }
    let dirs = snapshot_dirs(d.dir.path());
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    let dir = d.stop().await;

    // The record of `lost` goes, as if the daemon had died before writing it.
    let records = dir.path().join("snapshots");
    let mut lost = None;
    for e in std::fs::read_dir(&records).unwrap().flatten() {
        let rec: Value = serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
        if rec["name"] == "lost" {
            lost = Some(rec["provider_snapshot"].as_str().unwrap().to_owned());
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let lost = lost.expect("the record of `lost`");
    // A copy cut short: the directory, no `snapshot.json`.
    let parent = dirs[0].parent().unwrap().to_owned();
    let torn = parent.join(uuid::Uuid::new_v4().simple().to_string());
    std::fs::create_dir_all(torn.join("upper/home")).unwrap();

    let d = TestDaemon::start_in(dir, tenants).await;
    let left = snapshot_dirs(d.dir.path());
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        !left[0].ends_with(&lost),
        "the unrecorded snapshot survived"
    );
    assert!(!parent.join(&lost).exists());
    assert!(!torn.exists(), "the torn copy survived");
    // What a record names is untouched and still starts sandboxes.
    let (st, body) = create(&d, KEY_A, "kept").await;
    assert_eq!(st, 201, "{body}");
    let child = body["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(
        sh(&d, KEY_A, &child, "cat /home/user/f.txt").await,
        "kept\n"
    );
    let (_, body) = call(&d, Method::GET, "/snapshots", KEY_A, None).await;
    assert_eq!(ids(&body), vec!["kept:default".to_owned()]);
    d.stop().await;
}
