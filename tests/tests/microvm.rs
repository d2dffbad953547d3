//! tetherd with the microVM provider, as a user runs it (a `tetherd serve` child with a
//! config file): sessions on microVMs, a `kill -9` of the daemon, and the restart that
//! finds its VMs again: a live session goes on in its VM, an expired one's VM is stopped,
//! and a VM stamped with the daemon's id that no session owns (a crash between create and
//! the log's `sandbox/leased`) is stopped by the reconciler. No qemu survives.
//!
//! Skipped, with the reason printed, where qemu, the guest agent
//! (`TETHER_GUEST_BIN`, default `target/x86_64-unknown-linux-gnu/release/tether-guest`) or
//! the base template (`TETHER_TEMPLATE_DIR`, default `target/tether-templates`) is missing.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tether_provider::{CallCtx, Provider, SandboxSpec};
use tether_provider_microvm::MicrovmProvider;
use tether_tests::{
    free_port, microvm_config, wait_healthy, wait_until, workspace_bin, workspace_root,
};

/// The pids of the qemu processes of the VM directory `dir`.
fn qemu_pids_of(dir: &Path) -> Vec<u32> {
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

/// qemu processes of the VM directory `dir`.
fn qemus_of(dir: &Path) -> usize {
    qemu_pids_of(dir).len()
}

/// The VM directories under `root` whose VM table entry names the daemon `daemon_id`.
fn vm_dirs_of_daemon(root: &Path, daemon_id: &str) -> Vec<PathBuf> {
    std::fs::read_dir(root.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("vm.json")).is_ok_and(|s| s.contains(daemon_id))
        })
        .map(|e| e.path())
        .collect()
}

/// Kills, when dropped, every qemu still running for the VM directories it holds, and for
/// those of the daemon it names. A test that fails after killing tetherd with -9 (or whose
/// in-process daemon ends with the test's process) would otherwise leave its VMs running:
/// they outlive their daemon by design, and no daemon is left to stop them.
#[derive(Default)]
struct VmReaper {
    dirs: Vec<PathBuf>,
    daemon: Option<(PathBuf, String)>,
}

impl Drop for VmReaper {
    fn drop(&mut self) {
        let of_daemon = self
            .daemon
            .as_ref()
            .map(|(root, id)| vm_dirs_of_daemon(root, id))
            .unwrap_or_default();
        for dir in self.dirs.iter().chain(&of_daemon) {
            for pid in qemu_pids_of(dir) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// `tetherd serve --config FILE` on `port` over `state`; killed and reaped on drop.
struct Tetherd(std::process::Child);

impl Tetherd {
    fn spawn(config: &Path, state: &Path, port: u16) -> Self {
        let child = std::process::Command::new(workspace_bin("tetherd"))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--state-dir"])
            .arg(state)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn tetherd");
        Self(child)
    }
}

impl Drop for Tetherd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn session(http: &reqwest::Client, base: &str, id: &str) -> Value {
    http.get(format!("{base}/v1/sessions/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn bash(http: &reqwest::Client, base: &str, sid: &str, cmd: &str) -> Value {
    let (st, out) = post(
        http,
        format!("{base}/v1/sessions/{sid}/tool-calls"),
        json!({"calls": [{"id": uuid::Uuid::new_v4().to_string(), "name": "bash", "arguments": {"command": cmd}}]}),
    )
    .await;
    assert_eq!(st, 200, "{out}");
    out["results"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_tetherd_then_a_restart_finds_its_vms_and_stops_the_orphans() {
    let Some(vm) = microvm_config() else { return };
    // The template is booted here, once, so that the daemon only restores.
    let direct = MicrovmProvider::new(vm.clone()).unwrap();
    direct.prepare(&CallCtx::new("t")).await.unwrap();

    // Declared before the daemons, so dropped after them.
    let mut reaper = VmReaper::default();
    let state = tempfile::tempdir().unwrap();
    let config = state.path().join("tetherd.toml");
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    std::fs::write(
        &config,
        format!(
            "default_provider = \"vm\"\n\n[leases]\nreconcile_interval_s = 1\n\n\
             [providers.vm]\nkind = \"microvm\"\nroot = {}\nagent_binary = {}\n\
             base_template = {}\nmemory_mib = {}\n",
            q(&vm.root),
            q(vm.agent_binary.as_deref().unwrap()),
            q(vm.base_template.as_deref().unwrap()),
            vm.memory_mib
        ),
    )
    .unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut child = Tetherd::spawn(&config, state.path(), port);
    wait_healthy(&http, &base).await;

    let (st, kept) = post(&http, format!("{base}/v1/sessions"), json!({})).await;
    assert_eq!(st, 201, "{kept}");
    let kept_id = kept["id"].as_str().unwrap().to_owned();
    let kept_vm = vm
        .root
        .join("vms")
        .join(kept["sandbox_id"].as_str().unwrap());
    reaper.dirs.push(kept_vm.clone());
    let out = bash(
        &http,
        &base,
        &kept_id,
        "echo before > /home/user/mark; uname -r",
    )
    .await;
    assert_eq!(out["is_error"], false, "{out}");
    assert!(
        out["content"].as_str().unwrap().contains("cloud-amd64"),
        "{out}"
    );

    // Made last before the kill: its 3 s must not run out while the daemon is still up
    // (a command under TCG on a loaded machine can take that long), only after.
    let (st, exp) = post(&http, format!("{base}/v1/sessions"), json!({"ttl_s": 3})).await;
    assert_eq!(st, 201, "{exp}");
    let exp_id = exp["id"].as_str().unwrap().to_owned();
    let exp_vm = vm
        .root
        .join("vms")
        .join(exp["sandbox_id"].as_str().unwrap());
    reaper.dirs.push(exp_vm.clone());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.0.wait().unwrap();
    // A VM the daemon made but never recorded in a session log (made while the daemon
    // is down: a running daemon's reconciler, every second here, would stop it at once).
    let daemon_id = std::fs::read_to_string(state.path().join("daemon-id")).unwrap();
    let mut spec = SandboxSpec::default();
    spec.metadata
        .insert("tether.daemon".into(), daemon_id.trim().to_owned());
    spec.metadata
        .insert("tether.session".into(), "no-such-session".into());
    let orphan = direct.create(&CallCtx::new("t"), spec).await.unwrap();
    let orphan_vm = vm.root.join("vms").join(orphan.info().id);
    reaper.dirs.push(orphan_vm.clone());
    drop(orphan);

    for (what, d) in [
        ("kept", &kept_vm),
        ("expiring", &exp_vm),
        ("orphan", &orphan_vm),
    ] {
        assert_eq!(
            qemus_of(d),
            1,
            "the {what} VM died with its daemon: {}",
            d.display()
        );
    }

    let _child = Tetherd::spawn(&config, state.path(), port);
    wait_healthy(&http, &base).await;
    wait_until("the orphan stopped", Duration::from_secs(30), || async {
        qemus_of(&orphan_vm) == 0
    })
    .await;
    wait_until(
        "the expired session closed",
        Duration::from_secs(30),
        || async { session(&http, &base, &exp_id).await["state"] == "closed" },
    )
    .await;
    wait_until(
        "the expired session's VM stopped",
        Duration::from_secs(30),
        || async { qemus_of(&exp_vm) == 0 },
    )
    .await;
    // The live session goes on in the same VM, found again in the VM table.
    assert_eq!(session(&http, &base, &kept_id).await["state"], "active");
    let out = bash(&http, &base, &kept_id, "cat /home/user/mark").await;
    assert_eq!(out["is_error"], false, "{out}");
    assert!(out["content"].as_str().unwrap().contains("before"), "{out}");
    assert_eq!(qemus_of(&kept_vm), 1);

    let r = http
        .delete(format!("{base}/v1/sessions/{kept_id}"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    wait_until(
        "the closed session's VM stopped",
        Duration::from_secs(30),
        || async { qemus_of(&kept_vm) == 0 },
    )
    .await;
    assert!(!orphan_vm.exists() && !exp_vm.exists());
}

/// The official E2B Python SDK suite of the project (`tests/e2b_sdk/python`) against
/// tetherd's E2B front with every sandbox a microVM (all but the one case that needs
/// extended attributes on the guest's files). Needs `tests/e2b_sdk/setup.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_suite_runs_on_microvm_sandboxes() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let Some(vm) = microvm_config() else { return };
    let py = workspace_root().join(".venv-e2b/bin/python");
    if !py.exists() {
        eprintln!("SKIPPED: no {} (run tests/e2b_sdk/setup.sh)", py.display());
        return;
    }
    MicrovmProvider::new(vm.clone())
        .unwrap()
        .prepare(&CallCtx::new("t"))
        .await
        .unwrap();
    let key = |p: &str| format!("e2b_{p}_{}", uuid::Uuid::new_v4().simple());
    let (main_key, other_key) = (key("main"), key("other"));
    let keys = vec![
        tether_daemon::config::ApiKey {
            key: main_key.clone(),
            tenant: Some("main".into()),
        },
        tether_daemon::config::ApiKey {
            key: other_key.clone(),
            tenant: Some("other".into()),
        },
    ];
    let d = tether_tests::TestDaemon::start_with(|cfg| {
        cfg.providers.insert(
            "vm".into(),
            tether_daemon::config::ProviderConfig::Microvm(vm.clone()),
        );
        cfg.default_provider = "vm".into();
        cfg.e2b_front.api_keys = keys;
        // A 64 MiB upload into an emulated (TCG) guest on a 2-core host busy with the
        // rest of the suite has taken over the default minute per file operation.
        cfg.limits.fs_op_timeout_ms = 300_000;
    })
    .await;
    let daemon_id = d
        .daemon
        .as_ref()
        .unwrap()
        .state
        .sessions
        .daemon_id()
        .to_owned();
    let _reaper = VmReaper {
        dirs: Vec::new(),
        daemon: Some((vm.root.clone(), daemon_id.clone())),
    };
    let mut child = tokio::process::Command::new("bash")
        .arg(workspace_root().join("tests/e2b_sdk/run.sh"))
        .arg("python")
        .env("E2B_API_URL", &d.base)
        .env("E2B_SANDBOX_URL", &d.base)
        .env("E2B_API_KEY", &main_key)
        .env("TETHER_E2B_OTHER_KEY", &other_key)
        .env("TETHER_E2B_BAD_KEY", key("bad"))
        // The provider reaches the guests' ports (through the agents' tunnel) and takes
        // snapshots (saved machine state plus a copy of the overlay).
        .env("TETHER_SUITE_PORTS", "1")
        .env("TETHER_SUITE_SNAPSHOTS", "1")
        // ... and pauses without memory (the guest syncs, qemu stops, resume boots).
        .env("TETHER_SUITE_PAUSE_FILESYSTEM", "1")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        // File metadata as `user.e2b.*` extended attributes needs `Fs::xattrs`, which
        // the envd client (envd's protocol) does not have: the front keeps the metadata
        // itself, so the SDK sees it but the guest's files do not carry it.
        .env(
            "PYTEST_ADDOPTS",
            "--deselect test_sdk.py::test_files_metadata_is_xattrs",
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut summary = None;
    while let Ok(Some(l)) = lines.next_line().await {
        println!("[python] {l}");
        if l.contains("passed") && (l.contains("failed") || l.contains(" in ")) {
            summary = Some(l);
        }
    }
    let status = child.wait().await.unwrap();
    assert!(status.success(), "the SDK suite failed: {summary:?}");
    assert!(
        summary
            .as_deref()
            .is_some_and(|s| !s.contains("failed") || s.contains(" 0 failed")),
        "{summary:?}"
    );
    // The suite kills what it creates; a kill is synchronous, an expiry takes a second.
    let ours = || -> Vec<PathBuf> {
        vm_dirs_of_daemon(&vm.root, &daemon_id)
            .into_iter()
            .filter(|d| qemus_of(d) > 0)
            .collect()
    };
    wait_until(
        "the suite's VMs stopped",
        Duration::from_secs(30),
        || async { ours().is_empty() },
    )
    .await;
    d.stop().await;
    let leftover = ours();
    assert!(leftover.is_empty(), "VMs left running: {leftover:?}");
}
