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

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tether_provider::{CallCtx, PauseKind, Provider, SandboxSpec};
use tether_provider_microvm::{MicrovmConfig, MicrovmProvider};

mod common;
use common::config;

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
    tether_provider_microvm::client::probe(
        &http,
        ([127, 0, 0, 1], port).into(),
        Duration::from_secs(2),
    )
    .await
}

/// The ids the provider lists.
async fn listed(p: &MicrovmProvider) -> Vec<String> {
    p.list(&ctx())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.id)
        .collect()
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

    let ids = listed(&p).await;
    assert!(ids.contains(&id) && ids.contains(&id2));
    let m = p.metrics(&ctx(), &id).await.unwrap();
    assert!(m.memory_bytes > 0 && m.memory_limit_bytes == Some(256 << 20));

    p.destroy(&ctx(), &id).await.unwrap();
    p.destroy(&ctx(), &id2).await.unwrap();
    assert!(qemus_of(&vmdir).is_empty(), "a qemu survived destroy");
    assert!(qemus_of(&core2.dir).is_empty(), "a qemu survived destroy");
    assert!(!vmdir.exists());
    let ids = listed(&p).await;
    assert!(!ids.contains(&id) && !ids.contains(&id2));
    // Destroying again succeeds.
    p.destroy(&ctx(), &id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_caller_goes_away_leaves_no_vm_behind() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    // The template first (its boot is not what is dropped here).
    let warm = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    p.destroy(&ctx(), &warm.info().id).await.unwrap();
    let vms = cfg.root.join("vms");
    let dirs = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&vms)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let before = dirs();
    // The create is dropped once its qemu runs (restoring, before the guest answers).
    let started = async {
        loop {
            if let Some(d) = dirs().into_iter().find(|d| !before.contains(d))
                && !qemus_of(&d).is_empty()
            {
                return d;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let c = ctx();
    let dir = tokio::select! {
        r = p.create(&c, SandboxSpec::default()) => {
            panic!("the create ended before it could be dropped: {:?}", r.map(|s| s.info().id.clone()));
        }
        d = started => d,
    };
    let id = dir.file_name().unwrap().to_string_lossy().into_owned();
    // Its qemu, cgroup and directory go; the provider lists nothing of it.
    let gone = async {
        while !qemus_of(&dir).is_empty()
            || dir.exists()
            || tether_provider_microvm::client::Cgroup::find(Path::new("/sys/fs/cgroup"), &id)
                .is_some()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .expect("a dropped create left its VM behind");
    let ids = listed(&p).await;
    assert!(!ids.contains(&id), "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_the_guest_and_resume_continues_it() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    let port = p.vm(&id).unwrap().port();
    p.pause(&ctx(), &id, PauseKind::Memory).await.unwrap();
    // A stopped guest does not answer (slirp accepts, the guest never replies).
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    assert!(
        !tether_provider_microvm::client::probe(
            &http,
            ([127, 0, 0, 1], port).into(),
            Duration::from_millis(500)
        )
        .await
    );
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

// === through the guest agent (envd) ===

async fn run(sb: &dyn tether_provider::Sandbox, cmd: &str) -> (Option<i32>, String) {
    use futures_util::StreamExt;
    use tether_protocol::process::{ProcessEvent, ProcessSpec};
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut code = None;
    let mut events = h.events(Default::default());
    while let Some(ev) = events.next().await {
        match ev.unwrap() {
            ProcessEvent::Output { data, .. } => out.extend_from_slice(&data),
            ProcessEvent::Exited { status, .. } => code = status.code,
            ProcessEvent::Started { .. } => {}
        }
    }
    (code, String::from_utf8_lossy(&out).into_owned())
}

/// The guest's clock is the host's, within 10 s.
async fn assert_clock_is_the_hosts(sb: &dyn tether_provider::Sandbox) {
    let (_, t) = run(sb, "date +%s").await;
    let guest: i64 = t.trim().parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest - host).abs() < 10,
        "guest clock {guest}, host {host}"
    );
}

async fn write_file(sb: &dyn tether_provider::Sandbox, path: &str, data: &[u8]) {
    sb.fs()
        .write(
            &ctx(),
            path,
            tether_provider::util::once_bytes(bytes::Bytes::copy_from_slice(data)),
            tether_protocol::fs::WriteGuard::None,
        )
        .await
        .unwrap();
}

async fn read_file(sb: &dyn tether_provider::Sandbox, path: &str) -> Vec<u8> {
    use futures_util::StreamExt;
    let mut s = sb
        .fs()
        .read(&ctx(), path, tether_protocol::fs::ByteRange::default())
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(c) = s.next().await {
        out.extend_from_slice(&c.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_and_files_run_in_the_guest() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let mut spec = SandboxSpec::default();
    spec.env
        .insert("TETHER_TEST_VAR".into(), "from-create".into());
    let sb = p.create(&ctx(), spec).await.unwrap();
    let started = tokio::time::Instant::now();
    let (code, out) = run(sb.as_ref(), "echo $TETHER_TEST_VAR; uname -r; id -un; pwd").await;
    eprintln!("first command after restore: {:?}", started.elapsed());
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "from-create");
    assert!(
        lines[1].contains("cloud-amd64"),
        "not the guest kernel: {out}"
    );
    assert_eq!(lines[3], "/home/user");
    write_file(sb.as_ref(), "/home/user/hello.txt", b"hello from the host").await;
    assert_eq!(
        read_file(sb.as_ref(), "/home/user/hello.txt").await,
        b"hello from the host"
    );
    let (code, out) = run(sb.as_ref(), "cat /home/user/hello.txt").await;
    assert_eq!((code, out.as_str()), (Some(0), "hello from the host"));
    // Clones restored from one saved state differ: /init re-seeded each.
    let sb2 = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let (_, r1) = run(sb.as_ref(), "head -c 16 /dev/urandom | od -An -tx1").await;
    let (_, r2) = run(sb2.as_ref(), "head -c 16 /dev/urandom | od -An -tx1").await;
    assert_ne!(r1, r2);
    let (_, b1) = run(sb.as_ref(), "cat /proc/sys/kernel/random/boot_id").await;
    let (_, t) = run(sb2.as_ref(), "date +%s").await;
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let guest_now: i64 = t.trim().parse().unwrap();
    assert!(
        (guest_now - host_now).abs() < 30,
        "the guest clock was not set: {guest_now} vs {host_now}"
    );
    assert!(!b1.trim().is_empty());
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
    p.destroy(&ctx(), &sb2.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_keep_a_running_process_and_its_files() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    write_file(sb.as_ref(), "/home/user/kept.txt", b"kept").await;
    let h = sb
        .process()
        .spawn(
            &ctx(),
            tether_protocol::process::ProcessSpec::shell(
                "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.5; done",
            ),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    p.pause(&ctx(), &id, PauseKind::Memory).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(h.try_status().is_none(), "the command ended while paused");
    let sb = p.resume(&ctx(), &id).await.unwrap();
    let status = h.wait(&ctx()).await.unwrap();
    assert!(status.success());
    use futures_util::StreamExt;
    let mut out = Vec::new();
    let mut ev = h.events(Default::default());
    while let Some(e) = ev.next().await {
        if let tether_protocol::process::ProcessEvent::Output { data, .. } = e.unwrap() {
            out.extend_from_slice(&data);
        }
    }
    let out = String::from_utf8_lossy(&out).into_owned();
    assert_eq!(out.lines().count(), 6, "{out}");
    assert_eq!(read_file(sb.as_ref(), "/home/user/kept.txt").await, b"kept");
    p.destroy(&ctx(), &id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_pause_saves_the_vm_to_disk_and_resume_restores_its_processes_and_files() {
    let Some(mut cfg) = config() else { return };
    cfg.pause_to_disk_after_ms = 300;
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    let dir = cfg.root.join("vms").join(&id);
    let first_qemu = qemus_of(&dir);
    assert_eq!(first_qemu.len(), 1);

    // A short pause stays in memory: the resume cancels the save it armed.
    p.pause(&ctx(), &id, PauseKind::Memory).await.unwrap();
    p.resume(&ctx(), &id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(qemus_of(&dir), first_qemu);
    assert!(!dir.join("suspend.state").exists());

    write_file(sb.as_ref(), "/home/user/kept.txt", b"kept").await;
    let (code, out) = run(
        sb.as_ref(),
        "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.2; done' \
         >/dev/null 2>&1 & echo $!",
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let pid = out.trim().to_owned();

    // A long pause: saved to disk, qemu gone, its memory given back.
    p.pause(&ctx(), &id, PauseKind::Memory).await.unwrap();
    let end = tokio::time::Instant::now() + Duration::from_secs(90);
    while !(qemus_of(&dir).is_empty() && dir.join("suspend.state").exists()) {
        assert!(
            tokio::time::Instant::now() < end,
            "the paused VM was not saved to disk"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(p.metrics(&ctx(), &id).await.unwrap().memory_bytes, 0);
    // A fresh provider over the same table (a restarted daemon) keeps it and lists it.
    {
        let again = MicrovmProvider::new(cfg.clone()).unwrap();
        let listed = again.list(&ctx()).await.unwrap();
        assert!(listed.iter().any(|i| i.id == id), "{listed:?}");
    }
    assert!(dir.join("suspend.state").exists());
    tokio::time::sleep(Duration::from_secs(2)).await;

    let sb = p.resume(&ctx(), &id).await.unwrap();
    assert_eq!(qemus_of(&dir).len(), 1);
    assert!(!dir.join("suspend.state").exists());
    assert_eq!(read_file(sb.as_ref(), "/home/user/kept.txt").await, b"kept");
    let (_, a) = run(sb.as_ref(), "cat /home/user/count").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, b) = run(sb.as_ref(), "cat /home/user/count").await;
    let (a, b): (u64, u64) = (a.trim().parse().unwrap(), b.trim().parse().unwrap());
    assert!(
        b > a,
        "the background process does not run on: {a} then {b}"
    );
    let (code, _) = run(sb.as_ref(), &format!("kill -0 {pid}")).await;
    assert_eq!(code, Some(0), "the background process {pid} is gone");
    // `/init` after the restore set the guest's clock to the host's.
    assert_clock_is_the_hosts(sb.as_ref()).await;
    p.destroy(&ctx(), &id).await.unwrap();
    assert!(qemus_of(&dir).is_empty() && !dir.exists());
}

/// E2B's pause without memory: the guest syncs, its qemu stops (no state saved, nothing
/// in memory), a restarted provider finds it stopped, and resume boots the VM's own
/// disk: its files kept, its processes gone, a new boot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_without_memory_stops_the_vm_and_resume_boots_its_disk() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    assert!(p.capabilities().pause_filesystem);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    let dir = cfg.root.join("vms").join(&id);
    // Written just before the pause: still only in the guest's page cache.
    write_file(sb.as_ref(), "/home/user/kept.txt", b"kept").await;
    let (code, out) = run(
        sb.as_ref(),
        "echo tmp > /tmp/kept2.txt; cat /proc/sys/kernel/random/boot_id; \
         nohup sleep 1000 >/dev/null 2>&1 & echo $!",
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let mut lines = out.lines();
    let boot = lines.next().unwrap().to_owned();
    let pid = lines.next().unwrap().to_owned();

    p.pause(&ctx(), &id, PauseKind::Filesystem).await.unwrap();
    assert!(qemus_of(&dir).is_empty(), "qemu still runs");
    assert!(!dir.join("suspend.state").exists(), "no memory is kept");
    let code = |r: Result<_, tether_provider::ProviderError>| r.err().map(|e| e.code());
    assert_eq!(
        code(p.connect(&ctx(), &id).await.map(|_| ())),
        Some(tether_protocol::ErrorCode::Conflict)
    );
    assert_eq!(
        code(p.metrics(&ctx(), &id).await.map(|_| ())),
        Some(tether_protocol::ErrorCode::Conflict)
    );
    // A second pause of either kind changes nothing.
    p.pause(&ctx(), &id, PauseKind::Filesystem).await.unwrap();
    // A fresh provider over the same table (a restarted daemon) keeps it, stopped.
    {
        let again = MicrovmProvider::new(cfg.clone()).unwrap();
        assert!(listed(&again).await.contains(&id));
        assert_eq!(
            code(again.connect(&ctx(), &id).await.map(|_| ())),
            Some(tether_protocol::ErrorCode::Conflict)
        );
    }
    assert!(dir.exists());

    let sb = p.resume(&ctx(), &id).await.unwrap();
    assert_eq!(qemus_of(&dir).len(), 1);
    assert_eq!(read_file(sb.as_ref(), "/home/user/kept.txt").await, b"kept");
    assert_eq!(read_file(sb.as_ref(), "/tmp/kept2.txt").await, b"tmp\n");
    let (_, again) = run(sb.as_ref(), "cat /proc/sys/kernel/random/boot_id").await;
    assert_ne!(again.trim(), boot, "a new boot");
    // A new boot reuses pids: the old process is looked for by what it ran.
    let (_, procs) = run(sb.as_ref(), "pgrep -x sleep || echo none").await;
    assert_eq!(procs, "none\n", "the old process ({pid} before) is gone");
    // `/init` after the boot set the guest's clock to the host's.
    assert_clock_is_the_hosts(sb.as_ref()).await;
    assert!(p.connect(&ctx(), &id).await.is_ok());
    p.destroy(&ctx(), &id).await.unwrap();
    assert!(qemus_of(&dir).is_empty() && !dir.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_keeps_the_files_of_its_source_and_diverges() {
    let Some(cfg) = config() else { return };
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    write_file(sb.as_ref(), "/home/user/forked.txt", b"before the fork").await;
    let snap = p.snapshot(&ctx(), &id).await.unwrap();
    write_file(sb.as_ref(), "/home/user/forked.txt", b"after the fork").await;
    let fork = p
        .create_from_snapshot(&ctx(), &snap, SandboxSpec::default())
        .await
        .unwrap();
    assert_eq!(
        read_file(fork.as_ref(), "/home/user/forked.txt").await,
        b"before the fork"
    );
    assert_eq!(
        read_file(sb.as_ref(), "/home/user/forked.txt").await,
        b"after the fork"
    );
    // Each has its own token: the source's client does not open the fork.
    let a = p.vm(&id).unwrap().stamp().token;
    let b = p.vm(&fork.info().id).unwrap().stamp().token;
    assert_ne!(a, b);
    p.destroy(&ctx(), &id).await.unwrap();
    p.destroy(&ctx(), &fork.info().id).await.unwrap();
    p.delete_snapshot(&ctx(), &snap).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_stops_answering_ends_calls_within_their_limit() {
    let Some(mut cfg) = config() else { return };
    cfg.envd.request_timeout_ms = 2_000;
    cfg.envd.connect_timeout_ms = 1_000;
    cfg.envd.retry.max_times = 0;
    let p = provider(&cfg);
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id.clone();
    p.pause(&ctx(), &id, PauseKind::Memory).await.unwrap();
    let started = tokio::time::Instant::now();
    let err = sb.fs().stat(&ctx(), "/home/user").await.unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(6), "took {took:?}");
    assert!(
        matches!(
            err.code(),
            tether_protocol::ErrorCode::DeadlineExceeded
                | tether_protocol::ErrorCode::ConnectTimeout
                | tether_protocol::ErrorCode::TransportIdleTimeout
        ),
        "{err:?}"
    );
    // A start that got no answer may have started: OUTCOME_UNKNOWN, never a retry.
    let started = tokio::time::Instant::now();
    let err = sb
        .process()
        .spawn(&ctx(), tether_protocol::process::ProcessSpec::shell("true"))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(
        err.code() == tether_protocol::ErrorCode::OutcomeUnknown || err.clock().is_some(),
        "{err:?}"
    );
    p.destroy(&ctx(), &id).await.unwrap();
}

/// The host's own address on its default route (no packet is sent to find it).
fn host_address() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// The live (not zombie) `passt` children of this test process (nextest runs each test
/// in a process of its own).
fn live_passts() -> Vec<u32> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if head.ends_with("(passt") && f.get(1) == Some(&me.as_str()) && f.first() != Some(&"Z") {
            found.extend(e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()));
        }
    }
    found
}

/// A host listener that counts what connects to it.
async fn listener(addr: &str) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    let l = tokio::net::TcpListener::bind(addr).await.unwrap();
    let port = l.local_addr().unwrap().port();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((_s, _)) = l.accept().await {
            h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    (port, hits)
}

/// Whether the guest can open a TCP connection to `host:port` (bash's `/dev/tcp`).
async fn guest_connects(sb: &dyn tether_provider::Sandbox, host: &str, port: u16) -> bool {
    let (code, _) = run(
        sb,
        &format!("timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>/dev/null"),
    )
    .await;
    code == Some(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_goes_through_passt_and_never_reaches_the_host_loopback() {
    let Some(mut cfg) = config() else { return };
    if tether_provider_microvm::client::passt_binary(&cfg).is_none() {
        eprintln!("SKIPPED: passt is not installed");
        return;
    }
    let spec = SandboxSpec {
        network: true,
        ..SandboxSpec::default()
    };
    // tetherd's API and every other loopback service of the host: out of reach.
    let (lo_port, lo_hits) = listener("127.0.0.1:0").await;
    let (any_port, any_hits) = listener("0.0.0.0:0").await;
    let p = provider(&cfg);
    let sb = p.create(&ctx(), spec.clone()).await.unwrap();
    let info = sb.info();
    assert!(info.network);
    let pid = p.vm(&info.id).unwrap().pid().await;
    if std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .contains("tether-microvm")
    {
        assert_eq!(info.enforcement, tether_provider::Enforcement::Full);
    }
    let (code, out) = run(sb.as_ref(), "cat /etc/resolv.conf; ip route | head -1").await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("nameserver 10.0.2.3") && out.contains("via 10.0.2.2"),
        "{out}"
    );
    assert!(!guest_connects(sb.as_ref(), "10.0.2.2", lo_port).await);
    assert!(!guest_connects(sb.as_ref(), "10.0.2.2", any_port).await);
    assert_eq!(lo_hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    if let Some(ip) = host_address() {
        // Egress: the host's own address (as any other host's) is reachable.
        assert!(guest_connects(sb.as_ref(), &ip.to_string(), any_port).await);
        assert!(any_hits.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    }
    // A no-network sandbox restored from the same template has no egress at all.
    let plain = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    assert!(!plain.info().network);
    if let Some(ip) = host_address() {
        let before = any_hits.load(std::sync::atomic::Ordering::SeqCst);
        assert!(!guest_connects(plain.as_ref(), &ip.to_string(), any_port).await);
        assert_eq!(any_hits.load(std::sync::atomic::Ordering::SeqCst), before);
    }
    p.destroy(&ctx(), &plain.info().id).await.unwrap();
    p.destroy(&ctx(), &info.id).await.unwrap();
    // No passt outlives its VM.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(live_passts(), Vec::<u32>::new());

    // Without passt, egress is slirp's, which gives the guest the host's loopback as
    // 10.0.2.2: refused unless weaker isolation is allowed, and then `partial` (and the
    // loopback listener is indeed reached, which is what passt prevents).
    cfg.passt = Some("/nonexistent/passt".into());
    let p = provider(&cfg);
    let err = p.create(&ctx(), spec.clone()).await.unwrap_err();
    assert_eq!(err.code(), tether_protocol::ErrorCode::IsolationUnavailable);
    cfg.allow_weaker_isolation = true;
    let p = provider(&cfg);
    let sb = p.create(&ctx(), spec).await.unwrap();
    let info = sb.info();
    assert!(info.network);
    assert_eq!(info.enforcement, tether_provider::Enforcement::Partial);
    assert!(guest_connects(sb.as_ref(), "10.0.2.2", lo_port).await);
    assert!(lo_hits.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    p.destroy(&ctx(), &info.id).await.unwrap();
}
