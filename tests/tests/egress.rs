//! Egress rules of local sandboxes, against a test host in a network namespace this test
//! makes (two addresses, one server): an allowed address is reached, a denied one is
//! refused at once, a sandbox without rules reaches both, nothing the sandbox's root
//! does undoes the rules, and the rules hold for a fork, after a restart and through the
//! E2B front's `allowOut` / `denyOut`; the rules of a running sandbox are replaced
//! through either API and stay replaced.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tether_tests::{TestDaemon, code};

/// A test host: namespace `ns` behind a veth pair, at `<net>.2` and `<net>.3`, serving
/// `hello` on port 8000; the host side is `<net>.1`.
struct TestHost {
    ns: String,
    link: String,
    net: String,
    server: std::process::Child,
}

fn run(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).status().unwrap();
    assert!(st.success(), "{args:?}: {st}");
}

impl TestHost {
    fn start() -> Self {
        let tag = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let octet = 10 + (u32::from_str_radix(&tag[..2], 16).unwrap() % 200);
        let (ns, link, net) = (
            format!("tether-eg-{tag}"),
            format!("teg{tag}"),
            format!("10.214.{octet}"),
        );
        let peer = format!("{link}p");
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &link, "type", "veth", "peer", "name", &peer,
        ]);
        run(&["ip", "link", "set", &peer, "netns", &ns]);
        run(&["ip", "addr", "add", &format!("{net}.1/24"), "dev", &link]);
        run(&["ip", "link", "set", &link, "up"]);
        for a in ["2", "3"] {
            run(&[
                "ip",
                "netns",
                "exec",
                &ns,
                "ip",
                "addr",
                "add",
                &format!("{net}.{a}/24"),
                "dev",
                &peer,
            ]);
        }
        run(&["ip", "netns", "exec", &ns, "ip", "link", "set", &peer, "up"]);
        run(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        let server = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c"])
            .arg(
                "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
                 s.bind(('0.0.0.0',8000))\ns.listen()\nwhile True:\n c,_=s.accept()\n c.sendall(b'hello\\n')\n c.close()\n",
            )
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let host = Self {
            ns,
            link,
            net,
            server,
        };
        // Up when the host side reaches both addresses.
        for a in ["2", "3"] {
            let addr = format!("{}.{a}:8000", host.net);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect_timeout(
                &addr.parse().unwrap(),
                Duration::from_millis(200),
            )
            .is_err()
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "test host {addr} never answered"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        host
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// The bash tool's text of `command` in session `sid`.
async fn bash(d: &TestDaemon, sid: &str, command: &str) -> String {
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            json!({"calls": [{"id": uuid::Uuid::new_v4().to_string(), "name": "bash", "arguments": {"command": command}}]}),
        )
        .await;
    assert_eq!(st, 200, "{body}");
    body["results"][0]["content"].as_str().unwrap().to_owned()
}

/// What a connection from the sandbox to `addr` port 8000 gets: `hello`, or `refused`
/// (within two seconds: a refusal is at once, not a silent drop).
async fn reach(d: &TestDaemon, sid: &str, addr: &str) -> &'static str {
    let out = bash(
        d,
        sid,
        &format!("timeout 2 bash -c 'exec 3<>/dev/tcp/{addr}/8000 && cat <&3' 2>/dev/null || echo refused-$?"),
    )
    .await;
    if out.contains("hello") {
        "hello"
    } else if out.contains("refused-1") {
        "refused"
    } else {
        panic!("{addr}: neither answered nor refused at once: {out}")
    }
}

/// PUT, return (status, JSON body or Null).
async fn put(d: &TestDaemon, path: &str, body: Value, key: Option<&str>) -> (u16, Value) {
    let mut r = d.http.put(d.url(path)).json(&body);
    if let Some(k) = key {
        r = r.header("x-api-key", k);
    }
    let r = r.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

/// The `sandbox/network` events of a session's log, in order.
fn network_events(d: &TestDaemon, sid: &str) -> Vec<Value> {
    std::fs::read_to_string(d.dir.path().join("sessions").join(sid).join("events.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "sandbox/network")
        .collect()
}

/// An E2B sandbox made with `key`; its id.
async fn e2b_create(d: &TestDaemon, key: &str, body: Value) -> String {
    let r = d
        .http
        .post(d.url("/v2/sandboxes"))
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    r.json::<Value>().await.unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn create(d: &TestDaemon, body: Value) -> String {
    let (st, b) = d.post("/v1/sessions", body).await;
    assert_eq!(st, 201, "{b}");
    b["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_rules_hold_against_the_sandboxs_root_across_a_fork_and_a_restart() {
    let host = TestHost::start();
    let (ok, denied) = (format!("{}.2", host.net), format!("{}.3", host.net));
    let d = TestDaemon::start().await;
    let open = create(&d, json!({"network": true})).await;
    let ruled = create(
        &d,
        json!({"network": true, "egress": {"allow": [format!("{ok}/32")], "deny": [format!("{}.0/24", host.net)]}}),
    )
    .await;
    // Without rules the test host is reached at both addresses: what the rules refuse is
    // theirs.
    assert_eq!(reach(&d, &open, &ok).await, "hello");
    assert_eq!(reach(&d, &open, &denied).await, "hello");
    assert_eq!(reach(&d, &ruled, &ok).await, "hello");
    assert_eq!(reach(&d, &ruled, &denied).await, "refused");
    // The sandbox's root cannot change its network: not the rules, not the links, not
    // the routes.
    let out = bash(
        &d,
        &ruled,
        "id -u; nft flush ruleset; echo nft=$?; ip link set lo down; echo link=$?; ip route del default; echo route=$?",
    )
    .await;
    assert!(out.contains("\n0\n"), "root inside: {out}");
    for refused in ["nft=0", "link=0", "route=0"] {
        assert!(!out.contains(refused), "{refused}: {out}");
    }
    assert_eq!(reach(&d, &ruled, &denied).await, "refused");
    assert_eq!(reach(&d, &ruled, &ok).await, "hello");

    // A fork has the rules of its parent.
    let (st, body) = d
        .post(&format!("/v1/sessions/{ruled}/fork"), json!({}))
        .await;
    assert_eq!(st, 201, "{body}");
    let child = body["id"].as_str().unwrap().to_owned();
    assert_eq!(reach(&d, &child, &denied).await, "refused");
    assert_eq!(reach(&d, &child, &ok).await, "hello");

    // A restarted daemon takes the sandbox over with its rules and its network.
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    assert_eq!(reach(&d, &ruled, &denied).await, "refused");
    assert_eq!(reach(&d, &ruled, &ok).await, "hello");

    // Rules that are no networks are refused, never dropped.
    let (st, body) = d
        .post(
            "/v1/sessions",
            json!({"network": true, "egress": {"deny": ["example.com"]}}),
        )
        .await;
    assert_eq!(st, 400, "{body}");

    // The E2B front: allowOut wins over denyOut; a host name is refused.
    let e2b = |body: Value| {
        d.http
            .post(d.url("/v2/sandboxes"))
            .header("x-api-key", "e2b_egress_test_key")
            .json(&body)
            .send()
    };
    let r = e2b(json!({"templateID": "base", "network": {"denyOut": ["example.com"]}}))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let sbx = e2b_create(
        &d,
        "e2b_egress_test_key",
        json!({"templateID": "base", "network": {"allowOut": [ok.clone()], "denyOut": ["0.0.0.0/0"]}}),
    )
    .await;
    assert_eq!(reach(&d, &sbx, &ok).await, "hello");
    assert_eq!(reach(&d, &sbx, &denied).await, "refused");
    let header: Value = serde_json::from_str(
        std::fs::read_to_string(
            d.dir
                .path()
                .join("sessions")
                .join(&sbx)
                .join("events.jsonl"),
        )
        .unwrap()
        .lines()
        .next()
        .unwrap(),
    )
    .unwrap();
    assert_eq!(
        header["params"]["egress"],
        json!({"allow": [format!("{ok}/32")], "deny": ["0.0.0.0/0"]})
    );
    d.stop().await;
    drop(host);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_rules_change_on_a_running_sandbox_and_stay_changed() {
    let host = TestHost::start();
    let (ok, denied) = (format!("{}.2", host.net), format!("{}.3", host.net));
    let net = format!("{}.0/24", host.net);
    let d = TestDaemon::start().await;
    let sid = create(&d, json!({"network": true})).await;
    assert_eq!(reach(&d, &sid, &denied).await, "hello");
    // A command that runs across the change (it connects once told to): the rules hold
    // for what it opens after.
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            json!({"cmd": "while [ ! -e go ]; do sleep 0.05; done; { timeout 2 bash -c 'exec 3<>/dev/tcp/DENIED/8000 && cat <&3' 2>/dev/null || echo refused-$?; } > late.txt".replace("DENIED", &denied)}),
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let cid = body["command_id"].as_str().unwrap().to_owned();

    // Native API: the body is the rules; the session reports them.
    let rules = json!({"allow": [format!("{ok}/32")], "deny": [net.clone()]});
    let (st, info) = put(
        &d,
        &format!("/v1/sessions/{sid}/network"),
        rules.clone(),
        None,
    )
    .await;
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["egress"], rules);
    assert_eq!(reach(&d, &sid, &denied).await, "refused");
    assert_eq!(reach(&d, &sid, &ok).await, "hello");
    bash(&d, &sid, "touch go").await;
    let (st, w) = d
        .post(
            &format!("/v1/sessions/{sid}/processes/{cid}/wait"),
            json!({}),
        )
        .await;
    assert_eq!(st, 200, "{w}");
    let out = bash(&d, &sid, "cat late.txt").await;
    assert!(
        out.contains("refused-1"),
        "the running command reached a denied address: {out}"
    );
    // The sandbox's root cannot undo them.
    bash(&d, &sid, "nft flush ruleset 2>/dev/null; true").await;
    assert_eq!(reach(&d, &sid, &denied).await, "refused");
    // Durable: in the log, kept by a fork and by a restarted daemon.
    let events = network_events(&d, &sid);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["data"]["egress"], rules);
    let (st, body) = d.post(&format!("/v1/sessions/{sid}/fork"), json!({})).await;
    assert_eq!(st, 201, "{body}");
    let child = body["id"].as_str().unwrap().to_owned();
    assert_eq!(body["egress"], rules, "{body}");
    assert_eq!(reach(&d, &child, &denied).await, "refused");
    assert_eq!(reach(&d, &child, &ok).await, "hello");
    let dir = d.stop().await;
    let d = TestDaemon::start_in(dir, |_| {}).await;
    let (st, info) = d.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["egress"], rules);
    assert_eq!(reach(&d, &sid, &denied).await, "refused");
    assert_eq!(reach(&d, &sid, &ok).await, "hello");

    // Bad rules are refused and the rules in force stay.
    let (st, body) = put(
        &d,
        &format!("/v1/sessions/{sid}/network"),
        json!({"deny": ["example.com"]}),
        None,
    )
    .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{body}");
    assert_eq!(reach(&d, &sid, &denied).await, "refused");
    // A session without network has no egress to rule.
    let closed = create(&d, json!({})).await;
    let (st, body) = put(
        &d,
        &format!("/v1/sessions/{closed}/network"),
        json!({"deny": [net.clone()]}),
        None,
    )
    .await;
    assert_eq!((st, code(&body)), (400, "INVALID_REQUEST"), "{body}");

    // The E2B front: `allow_internet_access: false` denies all but `allowOut`; an empty
    // body lifts every rule; a host name is refused.
    let key = "e2b_egress_test_key";
    let sbx = e2b_create(&d, key, json!({"templateID": "base"})).await;
    let path = format!("/sandboxes/{sbx}/network");
    assert_eq!(reach(&d, &sbx, &denied).await, "hello");
    let (st, body) = put(
        &d,
        &path,
        json!({"allowOut": [ok.clone()], "allow_internet_access": false}),
        Some(key),
    )
    .await;
    assert_eq!(st, 204, "{body}");
    assert_eq!(reach(&d, &sbx, &ok).await, "hello");
    assert_eq!(reach(&d, &sbx, &denied).await, "refused");
    let (st, body) = put(&d, &path, json!({"denyOut": ["example.com"]}), Some(key)).await;
    assert_eq!(st, 400, "{body}");
    assert_eq!(reach(&d, &sbx, &denied).await, "refused");
    let (st, body) = put(&d, &path, json!({}), Some(key)).await;
    assert_eq!(st, 204, "{body}");
    assert_eq!(reach(&d, &sbx, &denied).await, "hello");
    let events = network_events(&d, &sbx);
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[1]["data"]["egress"], json!({}));
    // Another tenant's sandbox is not found.
    let (st, _) = put(&d, &path, json!({}), Some("e2b_someone_else")).await;
    assert_eq!(st, 404);
    // Made with `allow_internet_access: false`, a sandbox reaches nothing but `allowOut`,
    // and, as on E2B, a network update opens it later.
    let shut = e2b_create(
        &d,
        key,
        json!({"templateID": "base", "allow_internet_access": false, "network": {"allowOut": [ok.clone()]}}),
    )
    .await;
    assert_eq!(reach(&d, &shut, &ok).await, "hello");
    assert_eq!(reach(&d, &shut, &denied).await, "refused");
    let r = d
        .http
        .get(d.url(&format!("/sandboxes/{shut}")))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let info = r.json::<Value>().await.unwrap();
    assert_eq!(info["allowInternetAccess"], false, "{info}");
    let (st, body) = put(
        &d,
        &format!("/sandboxes/{shut}/network"),
        json!({}),
        Some(key),
    )
    .await;
    assert_eq!(st, 204, "{body}");
    assert_eq!(reach(&d, &shut, &denied).await, "hello");
    d.stop().await;
    drop(host);
}
