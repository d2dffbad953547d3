//! Tool-call latency through the daemon versus calling the local provider directly, in one
//! run, side by side: `bash true`, `read_file` and `write_file`.
//!
//! `cargo bench -p tether-tests --bench tool_latency`

// A benchmark: a panic is how it reports a failed setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use futures_util::StreamExt;
use serde_json::json;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::{CallCtx, Provider, SandboxSpec, StreamOffsets, util};
use tether_tests::TestDaemon;
use tokio::time::Instant;

const N: usize = 200;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    // Both sides use the same confinement trampoline binary.
    let helper = tether_tests::workspace_bin("tetherd");
    let cfg = tether_provider_local::LocalConfig {
        root: dir.path().join("direct"),
        confine_helper: Some(helper.clone()),
        ..Default::default()
    };
    let provider = Arc::new(tether_provider_local::LocalProvider::new(cfg).unwrap());
    let ctx = CallCtx::new("bench");
    let sb = provider.create(&ctx, SandboxSpec::default()).await.unwrap();

    let d = TestDaemon::start_with(|c| {
        let local = tether_provider_local::LocalConfig {
            confine_helper: Some(helper.clone()),
            ..Default::default()
        };
        c.providers.insert(
            "local".into(),
            tether_daemon::config::ProviderConfig::Local(local),
        );
    })
    .await;
    let sid = d.new_session().await;
    let url = d.url(&format!("/v1/sessions/{sid}/tool-calls"));

    let mut rows = Vec::new();
    // bash true
    let mut direct = Vec::new();
    let mut daemon = Vec::new();
    for i in 0..N {
        let t = Instant::now();
        let h = sb
            .process()
            .spawn(&ctx, ProcessSpec::shell("true"))
            .await
            .unwrap();
        let mut ev = h.events(StreamOffsets::default());
        while let Some(e) = ev.next().await {
            if matches!(e.unwrap(), ProcessEvent::Exited { .. }) {
                break;
            }
        }
        direct.push(t.elapsed());
        let t = Instant::now();
        let r = d.http.post(&url).json(&json!({"calls": [{"id": format!("b{i}"), "name": "bash", "arguments": {"command": "true"}}]})).send().await.unwrap();
        assert!(r.status().is_success());
        let _ = r.bytes().await.unwrap();
        daemon.push(t.elapsed());
    }
    rows.push((
        "bash true",
        tether_tests::latency_ms(direct),
        tether_tests::latency_ms(daemon),
    ));
    // write_file / read_file of 4 KiB
    let payload = "x".repeat(4096);
    let mut direct_w = Vec::new();
    let mut daemon_w = Vec::new();
    let mut direct_r = Vec::new();
    let mut daemon_r = Vec::new();
    for i in 0..N {
        let t = Instant::now();
        sb.fs()
            .write(
                &ctx,
                "f.txt",
                util::once_bytes(payload.clone()),
                WriteGuard::None,
            )
            .await
            .unwrap();
        direct_w.push(t.elapsed());
        let t = Instant::now();
        let s = sb
            .fs()
            .read(&ctx, "f.txt", ByteRange::default())
            .await
            .unwrap();
        util::collect(&ctx, "f.txt", s, 1 << 20).await.unwrap();
        direct_r.push(t.elapsed());
        let t = Instant::now();
        let r = d.http.post(&url).json(&json!({"calls": [{"id": format!("w{i}"), "name": "write_file", "arguments": {"path": "f.txt", "content": payload}}]})).send().await.unwrap();
        let _ = r.bytes().await.unwrap();
        daemon_w.push(t.elapsed());
        let t = Instant::now();
        let r = d.http.post(&url).json(&json!({"calls": [{"id": format!("r{i}"), "name": "read_file", "arguments": {"path": "f.txt"}}]})).send().await.unwrap();
        let _ = r.bytes().await.unwrap();
        daemon_r.push(t.elapsed());
    }
    rows.push((
        "write_file 4 KiB",
        tether_tests::latency_ms(direct_w),
        tether_tests::latency_ms(daemon_w),
    ));
    rows.push((
        "read_file 4 KiB",
        tether_tests::latency_ms(direct_r),
        tether_tests::latency_ms(daemon_r),
    ));

    println!("tool-call latency, {N} calls each (ms; p50 / p95 / mean)");
    println!(
        "{:<18} {:>26} {:>26} {:>12}",
        "operation", "provider direct", "through tetherd", "ratio p50"
    );
    for (name, a, b) in rows {
        println!(
            "{:<18} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>11.2}x",
            name,
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2,
            b.0 / a.0
        );
    }
    provider.destroy(&ctx, &sb.info().id).await.unwrap();
    d.stop().await;
}
