//! Leases end to end, with a real remote backend: tetherd A serves the E2B front (local
//! provider behind it); tetherd B uses A through its E2B provider. B renews the sandbox of
//! a live session at A while the session is idle (think-time counts), a B that stops
//! renewing leaves the sandbox to A's TTL, and on start B destroys sandboxes stamped with
//! its id that no session owns.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{Value, json};
use tether_daemon::config::ProviderConfig;
use tether_tests::{TestDaemon, wait_until};

const KEY: &str = "lease-test-key";

fn e2b_cfg(front: &str) -> tether_provider_e2b::E2bConfig {
    tether_provider_e2b::E2bConfig {
        api_url: Some(front.to_owned()),
        sandbox_url: Some(front.to_owned()),
        api_key: Some(KEY.to_owned()),
        inherit_env: false,
        ttl_ms: 3_000,
        ..Default::default()
    }
}

async fn front_status(a: &TestDaemon, sandbox: &str) -> u16 {
    a.http
        .get(a.url(&format!("/sandboxes/{sandbox}")))
        .header("x-api-key", KEY)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_an_idle_session_alive_and_stops_with_the_daemon() {
    let a = TestDaemon::start().await;
    let front = a.base.clone();
    let b = TestDaemon::start_with(|c| {
        c.providers
            .insert("e2b".into(), ProviderConfig::E2b(e2b_cfg(&front)));
        c.leases.renew_interval_s = 1;
        c.leases.renew_ttl_s = 3;
    })
    .await;
    let (st, s) = b.post("/v1/sessions", json!({"provider": "e2b"})).await;
    assert_eq!(st, 201, "{s}");
    let sid = s["id"].as_str().unwrap().to_owned();
    let sandbox = s["sandbox_id"].as_str().unwrap().to_owned();
    assert_eq!(front_status(&a, &sandbox).await, 200);
    // Think time: no call for twice the backend TTL. Renewals keep the sandbox.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        front_status(&a, &sandbox).await,
        200,
        "renewal must keep the sandbox alive"
    );
    let (st, r) = b
        .post(&format!("/v1/sessions/{sid}/tool-calls"), json!({"calls": [{"id": "c1", "name": "bash", "arguments": {"command": "echo alive"}}]}))
        .await;
    assert_eq!(st, 200);
    assert!(
        r["results"][0]["content"]
            .as_str()
            .unwrap()
            .contains("alive"),
        "{r}"
    );
    // B stops without releasing (as a crash would): nothing renews, A's TTL ends it.
    b.stop().await;
    assert_eq!(
        front_status(&a, &sandbox).await,
        200,
        "keep-on-shutdown leaves the sandbox"
    );
    wait_until(
        "the unrenewed sandbox to expire",
        Duration::from_secs(15),
        || {
            let a = &a;
            let sandbox = sandbox.clone();
            async move { front_status(a, &sandbox).await == 404 }
        },
    )
    .await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_stamped_with_this_daemon_are_destroyed_at_start() {
    let a = TestDaemon::start().await;
    let front = a.base.clone();
    let cfg = |c: &mut tether_daemon::config::Config| {
        c.providers
            .insert("e2b".into(), ProviderConfig::E2b(e2b_cfg(&front)));
    };
    let b = TestDaemon::start_with(cfg).await;
    let daemon_id = std::fs::read_to_string(b.dir.path().join("daemon-id")).unwrap();
    // A session B owns, and a sandbox stamped with B's id that no session owns (as after a
    // crash between create and record).
    let (st, owned) = b.post("/v1/sessions", json!({"provider": "e2b"})).await;
    assert_eq!(st, 201);
    let owned_sandbox = owned["sandbox_id"].as_str().unwrap().to_owned();
    let dir = b.stop().await;
    let r = a
        .http
        .post(a.url("/sandboxes"))
        .header("x-api-key", KEY)
        .json(&json!({"templateID": "base", "timeout": 300, "metadata": {"tether.daemon": daemon_id.trim(), "tether.session": "ghost"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let orphan: Value = r.json().await.unwrap();
    let orphan = orphan["sandboxID"].as_str().unwrap().to_owned();
    // Another daemon's sandbox must be left alone.
    let r = a
        .http
        .post(a.url("/sandboxes"))
        .header("x-api-key", KEY)
        .json(&json!({"templateID": "base", "timeout": 300, "metadata": {"tether.daemon": "someone-else", "tether.session": "x"}}))
        .send()
        .await
        .unwrap();
    let foreign: Value = r.json().await.unwrap();
    let foreign = foreign["sandboxID"].as_str().unwrap().to_owned();
    let b = TestDaemon::start_in(dir, cfg).await;
    let report = &b.daemon.as_ref().unwrap().recovery;
    assert!(report.orphans_destroyed.contains(&orphan), "{report:?}");
    assert_eq!(
        front_status(&a, &orphan).await,
        404,
        "the orphan must be destroyed"
    );
    assert_eq!(
        front_status(&a, &owned_sandbox).await,
        200,
        "an owned sandbox must survive the restart"
    );
    assert_eq!(
        front_status(&a, &foreign).await,
        200,
        "another daemon's sandbox must be left alone"
    );
    let (_, info) = b
        .get(&format!("/v1/sessions/{}", owned["id"].as_str().unwrap()))
        .await;
    assert_eq!(
        info["state"], "active",
        "the owned session reconnects: {info}"
    );
    b.stop().await;
    a.stop().await;
}
