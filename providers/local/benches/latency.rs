//! `bash true` through the local provider, cold (250 ms idle before each command) and
//! hot, next to a host fork/exec of `true` and `unshare -Urmn true`, interleaved in one
//! run; plus sandbox creation time and per-sandbox memory.
//!
//! `cargo bench -p tether-provider-local --bench latency` (root; prints medians and
//! p99 in milliseconds).

// Bench code: a failed unwrap is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_protocol::process::ProcessSpec;
use tether_provider::{CallCtx, Provider, Sandbox, SandboxSpec};
use tether_provider_local::{LocalConfig, LocalProvider};

const COLD_ROUNDS: usize = 40;
const HOT_ROUNDS: usize = 300;
const IDLE: Duration = Duration::from_millis(250);

fn summary(name: &str, mut v: Vec<f64>) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = v[v.len() / 2];
    let p99 = v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)];
    println!(
        "{name:<44} median {med:>7.2} ms   p99 {p99:>7.2} ms   (n={})",
        v.len()
    );
}

fn host(argv: &[&str]) -> f64 {
    let t = Instant::now();
    let s = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .status()
        .unwrap();
    assert!(s.success(), "{argv:?}");
    t.elapsed().as_secs_f64() * 1000.0
}

async fn provider(sb: &Arc<dyn Sandbox>, spec: ProcessSpec) -> f64 {
    let ctx = CallCtx::new("bench");
    let t = Instant::now();
    let h = sb.process().spawn(&ctx, spec).await.unwrap();
    let st = h.wait(&ctx).await.unwrap();
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert!(st.success());
    ms
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = LocalConfig::with_root(dir.path().join("sandboxes"));
    let helper = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("tether-confine"))
        .unwrap();
    cfg.confine_helper = Some(helper);
    let p = LocalProvider::new(cfg).unwrap();
    let ctx = CallCtx::new("bench");

    // Creation, and what an idle sandbox costs.
    let mut creates = Vec::new();
    let mut sandboxes = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let sb = p.create(&ctx, SandboxSpec::default()).await.unwrap();
        creates.push(t.elapsed().as_secs_f64() * 1000.0);
        sandboxes.push(sb);
    }
    summary("create a sandbox (host template)", creates);
    let sb = sandboxes.remove(0);
    for s in sandboxes {
        p.destroy(&ctx, &s.info().id).await.unwrap();
    }
    let m = p.metrics(&ctx, &sb.info().id).await.unwrap();
    let init = p.local(&sb.info().id).await.unwrap().init_pid();
    let rss = |pid: u32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let holder = std::fs::read_to_string(format!("/proc/{init}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0);
    println!(
        "idle sandbox: cgroup memory {:.1} MiB, init RSS {} KiB + holder RSS {} KiB, disk used {:.1} MiB",
        m.memory_bytes as f64 / (1 << 20) as f64,
        rss(init),
        rss(holder),
        m.disk_used_bytes as f64 / (1 << 20) as f64
    );

    let shell = || ProcessSpec::shell("true");
    let argv = || ProcessSpec::argv(["bash", "-c", "true"]);
    let (mut h_cold, mut u_cold, mut s_cold, mut a_cold) = (vec![], vec![], vec![], vec![]);
    let (mut b_cold, mut b_hot) = (vec![], vec![]);
    for _ in 0..COLD_ROUNDS {
        tokio::time::sleep(IDLE).await;
        h_cold.push(host(&["true"]));
        tokio::time::sleep(IDLE).await;
        b_cold.push(host(&["bash", "-c", "true"]));
        tokio::time::sleep(IDLE).await;
        u_cold.push(host(&["unshare", "-Urmn", "true"]));
        tokio::time::sleep(IDLE).await;
        a_cold.push(provider(&sb, argv()).await);
        tokio::time::sleep(IDLE).await;
        s_cold.push(provider(&sb, shell()).await);
    }
    let (mut h_hot, mut u_hot, mut s_hot, mut a_hot) = (vec![], vec![], vec![], vec![]);
    for _ in 0..HOT_ROUNDS {
        h_hot.push(host(&["true"]));
        b_hot.push(host(&["bash", "-c", "true"]));
        u_hot.push(host(&["unshare", "-Urmn", "true"]));
        a_hot.push(provider(&sb, argv()).await);
        s_hot.push(provider(&sb, shell()).await);
    }
    println!("--- cold (250 ms idle before each) ---");
    summary("host fork/exec `true`", h_cold);
    summary("host fork/exec `bash -c true`", b_cold);
    summary("host `unshare -Urmn true`", u_cold);
    summary("provider argv `bash -c true`", a_cold);
    summary("provider shell `true` (bash -lc true)", s_cold);
    println!("--- hot ---");
    summary("host fork/exec `true`", h_hot);
    summary("host fork/exec `bash -c true`", b_hot);
    summary("host `unshare -Urmn true`", u_hot);
    summary("provider argv `bash -c true`", a_hot);
    summary("provider shell `true` (bash -lc true)", s_hot);
    p.destroy(&ctx, &sb.info().id).await.unwrap();
}
