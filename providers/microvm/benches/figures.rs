//! The microVM provider's figures from one run: a cold boot (template boot, save, first
//! restore) to the first command, restore to first command, `exec true`, a 64 MiB write and
//! read, and the memory of an idle VM, side by side with the local provider on the same
//! `base` template (create to first command, `exec true`, 64 MiB, idle memory) and the
//! host's fork/exec of `true`, interleaved in one run.
//!
//! `cargo bench -p tether-provider-microvm --bench figures` (root; needs what the
//! integration tests need: qemu, the guest agent, the base template). The guest image
//! comes from the tests' cache (`target/microvm-test/image`); the template is booted
//! afresh in a temporary state directory, so the cold figure is a real boot.

// Bench code: a failed unwrap is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_types)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::ProcessSpec;
use tether_provider::{CallCtx, Provider, Sandbox, SandboxSpec};
use tether_provider_local::{LocalConfig, LocalProvider};
use tether_provider_microvm::{MicrovmConfig, MicrovmProvider};

const RESTORES: usize = 5;
const EXECS: usize = 20;
const MIB_64: usize = 64 << 20;

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn summary(name: &str, mut v: Vec<f64>) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = v[v.len() / 2];
    let p99 = v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)];
    println!(
        "{name:<44} median {med:>8.1} ms   p99 {p99:>8.1} ms   (n={})",
        v.len()
    );
}

/// [`summary`] with the ratio of the median to `floor`'s.
fn summary_vs(name: &str, v: Vec<f64>, floor: &[f64]) {
    let ratio = median(&v) / median(floor);
    summary(name, v);
    println!("{:<44} {ratio:>8.1}x the host floor", "");
}

/// The local provider over the same `base` template, or `None` (said) where its confine
/// helper is not built.
fn local_provider(ws: &std::path::Path, state: &std::path::Path) -> Option<Arc<dyn Provider>> {
    let helper = std::env::var_os("TETHER_CONFINE_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            [
                "target/debug/tether-confine",
                "target/release/tether-confine",
            ]
            .into_iter()
            .map(|p| ws.join(p))
            .find(|p| p.is_file())
        });
    let Some(helper) = helper else {
        println!(
            "local provider rows SKIPPED: no tether-confine built (cargo build -p tether-provider-local)"
        );
        return None;
    };
    let mut cfg = LocalConfig::with_root(state.join("local"));
    cfg.confine_helper = Some(helper);
    cfg.templates_dir = Some(
        std::env::var_os("TETHER_TEMPLATE_DIR")
            .map_or_else(|| ws.join("target/tether-templates"), PathBuf::from),
    );
    Some(Arc::new(LocalProvider::new(cfg).unwrap()))
}

fn base_spec() -> SandboxSpec {
    SandboxSpec {
        template: Some("base".into()),
        ..SandboxSpec::default()
    }
}

async fn write_read_64(sb: &Arc<dyn Sandbox>, what: &str) {
    let data = bytes::Bytes::from(vec![0x5au8; MIB_64]);
    let t = Instant::now();
    sb.fs()
        .write(
            &ctx(),
            "/home/user/big.bin",
            tether_provider::util::once_bytes(data),
            WriteGuard::None,
        )
        .await
        .unwrap();
    summary(&format!("write 64 MiB ({what})"), vec![ms(t)]);
    let t = Instant::now();
    let mut s = sb
        .fs()
        .read(&ctx(), "/home/user/big.bin", ByteRange::default())
        .await
        .unwrap();
    let mut n = 0;
    while let Some(c) = s.next().await {
        n += c.unwrap().len();
    }
    assert_eq!(n, MIB_64);
    summary(&format!("read 64 MiB ({what})"), vec![ms(t)]);
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn ctx() -> CallCtx {
    CallCtx::new("bench")
}

async fn exec(sb: &Arc<dyn Sandbox>, cmd: &str) -> f64 {
    let t = Instant::now();
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .unwrap();
    assert!(h.wait(&ctx()).await.unwrap().success());
    ms(t)
}

fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The tests' configuration with its image cache, at the provider's default VM size.
fn config() -> Option<MicrovmConfig> {
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cfg = tether_provider_microvm::testkit::test_config(&ws)
        .map_err(|why| println!("SKIPPED: {why}"))
        .ok()?;
    cfg.image_dir = Some(cfg.root.join("image"));
    cfg.memory_mib = MicrovmConfig::default().memory_mib;
    Some(cfg)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(mut cfg) = config() else { return };
    let state = tempfile::Builder::new()
        .prefix("tether-microvm-bench-")
        .tempdir()
        .unwrap();
    cfg.root = state.path().to_owned();
    let kvm = tether_provider_microvm::client::use_kvm(&cfg);
    println!(
        "microVM figures ({}, {} MiB, {} vCPU), load {}",
        if kvm { "KVM" } else { "TCG" },
        cfg.memory_mib,
        cfg.vcpus,
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let p: Arc<dyn Provider> = Arc::new(MicrovmProvider::new(cfg.clone()).unwrap());
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let local = local_provider(&ws, state.path());

    // Cold: boot the template, save it, restore the first sandbox, run a command.
    let t = Instant::now();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let create = ms(t);
    let first = exec(&sb, "true").await;
    summary(
        "cold boot + save + restore + first command",
        vec![create + first],
    );
    p.destroy(&ctx(), &sb.info().id).await.unwrap();

    // Restore to first command.
    let (mut restore, mut to_first) = (Vec::new(), Vec::new());
    let mut sandboxes = Vec::new();
    for _ in 0..RESTORES {
        let t = Instant::now();
        let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
        restore.push(ms(t));
        exec(&sb, "true").await;
        to_first.push(ms(t));
        sandboxes.push(sb);
    }
    summary("restore (create) to agent ready", restore);
    summary("restore (create) to first command done", to_first);
    let mut locals = Vec::new();
    if let Some(lp) = &local {
        let mut to_first = Vec::new();
        for _ in 0..RESTORES {
            let t = Instant::now();
            let sb = lp.create(&ctx(), base_spec()).await.unwrap();
            exec(&sb, "true").await;
            to_first.push(ms(t));
            locals.push(sb);
        }
        summary("local: create to first command done", to_first);
    }

    // exec true, hot, interleaved with the host's fork/exec.
    let sb = sandboxes[0].clone();
    let (mut vm, mut host, mut loc) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..EXECS {
        vm.push(exec(&sb, "true").await);
        if let Some(l) = locals.first() {
            loc.push(exec(l, "true").await);
        }
        let t = Instant::now();
        assert!(
            std::process::Command::new("true")
                .status()
                .unwrap()
                .success()
        );
        host.push(ms(t));
    }
    summary_vs("exec true (microVM)", vm, &host);
    if !loc.is_empty() {
        summary_vs("exec true (local, base template)", loc, &host);
    }
    summary("exec true (host fork/exec floor)", host);

    // 64 MiB write and read through envd, and through the local provider.
    write_read_64(&sb, "microVM").await;
    if let Some(l) = locals.first() {
        write_read_64(l, "local").await;
    }

    // Memory of idle VMs (the ones restored above, idle for 5 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut rss = Vec::new();
    let mut pss = Vec::new();
    for sb in &sandboxes {
        let id = sb.info().id;
        let m = p.metrics(&ctx(), &id).await.unwrap();
        rss.push(m.memory_bytes as f64 / (1 << 20) as f64);
    }
    for sb in &sandboxes {
        let pid = state_pid(state.path(), &sb.info().id);
        pss.push(pss_kib(pid) as f64 / 1024.0);
    }
    rss.sort_by(|a, b| a.partial_cmp(b).unwrap());
    pss.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{:<44} RSS median {:>6.0} MiB   PSS median {:>6.0} MiB   (n={})",
        "memory per idle restored VM",
        rss[rss.len() / 2],
        pss[pss.len() / 2],
        rss.len()
    );
    if let Some(lp) = &local {
        let mut lm = Vec::new();
        for sb in &locals {
            let m = lp.metrics(&ctx(), &sb.info().id).await.unwrap();
            lm.push(m.memory_bytes as f64 / (1 << 20) as f64);
        }
        println!(
            "{:<44} memory median {:>6.1} MiB   (n={}, the sandbox's cgroup)",
            "memory per idle local sandbox",
            median(&lm),
            lm.len()
        );
        for sb in locals {
            lp.destroy(&ctx(), &sb.info().id).await.unwrap();
        }
    }
    for sb in sandboxes {
        p.destroy(&ctx(), &sb.info().id).await.unwrap();
    }
}

fn state_pid(root: &std::path::Path, id: &str) -> u32 {
    std::fs::read_to_string(root.join("vms").join(id).join("qemu.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}
