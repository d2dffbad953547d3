//! The microVM provider against real qemu VMs (TCG on hosts without hardware
//! virtualisation): boot + save + restore, destroy, a kill -9 of the owner, pause/resume,
//! snapshot and fork.
//!
//! Needs qemu (`qemu-system-x86`, `qemu-utils`), `busybox-static`, `cpio`, `e2fsprogs`,
//! the local provider's `base` template (`TETHER_TEMPLATE_DIR`, default
//! `target/tether-templates`) and the static guest agent (`TETHER_GUEST_BIN`, default
//! `target/x86_64-unknown-linux-gnu/release/tether-guest`). Each test prints why and
//! passes when one is missing. The guest image and the saved template are cached under
//! `target/microvm-test` between runs: one template boot, every sandbox restored.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tether_provider::{CallCtx, Provider, SandboxSpec};
use tether_provider_microvm::{MicrovmConfig, MicrovmProvider};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The test configuration, or `None` (with the reason printed) where the host lacks
/// something.
pub fn config() -> Option<MicrovmConfig> {
    let ws = workspace();
    let agent = std::env::var_os("TETHER_GUEST_BIN").map_or_else(
        || ws.join("target/x86_64-unknown-linux-gnu/release/tether-guest"),
        PathBuf::from,
    );
    let templates = std::env::var_os("TETHER_TEMPLATE_DIR")
        .map_or_else(|| ws.join("target/tether-templates"), PathBuf::from);
    let base = templates.join("base");
    let missing = |what: String| {
        eprintln!("SKIPPED: {what}");
        None
    };
    for prog in ["qemu-system-x86_64", "qemu-img", "mkfs.ext4", "cpio"] {
        if !std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join(prog).is_file())
        {
            return missing(format!("{prog} is not installed"));
        }
    }
    if !Path::new("/bin/busybox").exists() {
        return missing("busybox-static is not installed".into());
    }
    if !agent.is_file() {
        return missing(format!("no guest agent at {}", agent.display()));
    }
    if !base.join(".tether-template-complete").exists() {
        return missing(format!("no base template at {}", base.display()));
    }
    let root = ws.join("target/microvm-test");
    let mut cfg = MicrovmConfig::with_root(root.canonicalize().unwrap_or(root));
    std::fs::create_dir_all(&cfg.root).unwrap();
    cfg.root = cfg.root.canonicalize().unwrap();
    cfg.agent_binary = Some(agent);
    cfg.base_template = Some(base);
    // Small VMs: the tests run several at once on a small host.
    cfg.memory_mib = 256;
    Some(cfg)
}

fn ctx() -> CallCtx {
    CallCtx::new("test")
}

/// qemu processes whose command line names `dir`.
fn qemus_of(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c).into_owned();
                c.contains("qemu-system") && c.contains(&needle)
            })
        })
        .filter(|pid| tether_provider_microvm::client::pid_alive(*pid))
        .collect()
}

async fn healthy(port: u16) -> bool {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    tether_provider_microvm::client::probe(&http, port, Duration::from_secs(2)).await
}

fn provider(cfg: &MicrovmConfig) -> Arc<MicrovmProvider> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    Arc::new(MicrovmProvider::new(cfg.clone()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_save_restore_answers_health_and_destroy_leaves_no_qemu() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let started = tokio::time::Instant::now();
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    eprintln!(
        "create (template boot if not cached, then restore): {:?}",
        started.elapsed()
    );
    let id = sb.info().id.clone();
    assert_eq!(sb.info().provider, "microvm");
    assert_eq!(sb.info().workspace, "/home/user");
    let core = p.vm(&id).unwrap();
    assert!(healthy(core.port()).await);
    let vmdir = core.dir.clone();
    assert_eq!(qemus_of(&vmdir).len(), 1);

    // A second sandbox restores from the saved template.
    let started = tokio::time::Instant::now();
    let sb2 = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let restore = started.elapsed();
    eprintln!("restore to /health: {restore:?}");
    let id2 = sb2.info().id.clone();
    let core2 = p.vm(&id2).unwrap();
    assert_ne!(core.port(), core2.port());
    assert!(healthy(core2.port()).await);

    let ids: Vec<String> = p
        .list(&ctx())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert!(ids.contains(&id) && ids.contains(&id2));
    let m = p.metrics(&ctx(), &id).await.unwrap();
    assert!(m.memory_bytes > 0 && m.memory_limit_bytes == Some(256 << 20));

    p.destroy(&ctx(), &id).await.unwrap();
    p.destroy(&ctx(), &id2).await.unwrap();
    assert!(qemus_of(&vmdir).is_empty(), "a qemu survived destroy");
    assert!(qemus_of(&core2.dir).is_empty(), "a qemu survived destroy");
    assert!(!vmdir.exists());
    let ids: Vec<String> = p
        .list(&ctx())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert!(!ids.contains(&id) && !ids.contains(&id2));
    // Destroying again succeeds.
    p.destroy(&ctx(), &id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_the_guest_and_resume_continues_it() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    let port = p.vm(&id).unwrap().port();
    p.pause(&ctx(), &id).await.unwrap();
    // A stopped guest does not answer (slirp accepts, the guest never replies).
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    assert!(!tether_provider_microvm::client::probe(&http, port, Duration::from_millis(500)).await);
    p.resume(&ctx(), &id).await.unwrap();
    assert!(healthy(port).await);
    p.destroy(&ctx(), &id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_forks_into_a_running_sandbox() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    let started = tokio::time::Instant::now();
    let snap = p.snapshot(&ctx(), &id).await.unwrap();
    eprintln!("snapshot: {:?}", started.elapsed());
    // The source runs on.
    assert!(healthy(p.vm(&id).unwrap().port()).await);
    let started = tokio::time::Instant::now();
    let fork = p
        .create_from_snapshot(&ctx(), &snap, SandboxSpec::default())
        .await
        .unwrap();
    eprintln!("fork restore to /health: {:?}", started.elapsed());
    let fid = fork.info().id.clone();
    assert_ne!(fid, id);
    assert!(healthy(p.vm(&fid).unwrap().port()).await);
    p.destroy(&ctx(), &id).await.unwrap();
    p.delete_snapshot(&ctx(), &snap).await.unwrap();
    // The fork has its own disk: it outlives the snapshot and its source.
    assert!(healthy(p.vm(&fid).unwrap().port()).await);
    p.destroy(&ctx(), &fid).await.unwrap();
    let err = p
        .create_from_snapshot(&ctx(), &snap, SandboxSpec::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tether_protocol::ErrorCode::InvalidRequest);
}

/// Run by `a_killed_owner_leaves_vms_that_a_fresh_provider_stops` in a child process:
/// creates a VM, writes its id to `TETHER_MICROVM_OWNER_OUT`, then waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run by a_killed_owner_leaves_vms_that_a_fresh_provider_stops"]
async fn helper_owner_creates_a_vm_and_waits() {
    let Some(out) = std::env::var_os("TETHER_MICROVM_OWNER_OUT") else {
        return;
    };
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    std::fs::write(&out, sb.info().id).unwrap();
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_leaves_vms_that_a_fresh_provider_stops() {
    let Some(cfg) = config() else { return };
    // Boot the template here first, so the child only restores.
    provider(&cfg).prepare(&ctx()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("id");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_owner_creates_a_vm_and_waits",
            "--ignored",
            "--nocapture",
        ])
        .env("TETHER_MICROVM_OWNER_OUT", &out)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let end = tokio::time::Instant::now() + Duration::from_secs(120);
    while !out.exists() {
        assert!(tokio::time::Instant::now() < end, "the owner made no VM");
        if let Ok(Some(st)) = child.try_wait() {
            panic!("the owner exited: {st}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let id = std::fs::read_to_string(&out).unwrap();
    let vmdir = cfg.root.join("vms").join(&id);
    assert_eq!(qemus_of(&vmdir).len(), 1);
    // kill -9: no destructor runs, the VM stays.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
    assert_eq!(qemus_of(&vmdir).len(), 1, "the VM died with its owner");

    let fresh = provider(&cfg);
    let listed: Vec<String> = fresh
        .list(&ctx())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert!(listed.contains(&id), "the table lost the orphan");
    let reaped = fresh.reap_orphans(&ctx()).await.unwrap();
    assert!(reaped.contains(&id));
    assert!(qemus_of(&vmdir).is_empty(), "the orphan's qemu survived");
    assert!(!vmdir.exists());
}
