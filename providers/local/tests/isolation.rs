//! Acceptance tests of the local provider's isolation, on this machine's kernel: what a
//! confined command cannot read, write, reach or outlive.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ExitStatus, ProcessEvent, ProcessSpec};
use tether_provider::{
    CallCtx, Enforcement, ProcessHandle, Provider, Sandbox, SandboxSpec, StreamOffsets,
};
use tether_provider_local::{
    CONFINE_FAILED_EXIT, CONFINE_FAILED_PREFIX, ConfineSpec, LocalConfig, LocalProvider,
    ProbeReport,
};

const HELPER: &str = env!("CARGO_BIN_EXE_tether-confine");

struct Env {
    dir: tempfile::TempDir,
    provider: Arc<LocalProvider>,
}

fn config(root: &Path) -> LocalConfig {
    let mut cfg = LocalConfig::with_root(root.join("sandboxes"));
    cfg.confine_helper = Some(HELPER.into());
    cfg
}

fn env_with(f: impl FnOnce(&mut LocalConfig)) -> Env {
    let dir = tempfile::Builder::new()
        .prefix("tether-isolation-")
        .tempdir()
        .unwrap();
    let mut cfg = config(dir.path());
    f(&mut cfg);
    Env {
        provider: Arc::new(LocalProvider::new(cfg).unwrap()),
        dir,
    }
}

fn ctx() -> CallCtx {
    CallCtx::new("isolation")
}

async fn sandbox(e: &Env, network: bool) -> Arc<dyn Sandbox> {
    e.provider
        .create(
            &ctx(),
            SandboxSpec {
                network,
                ..SandboxSpec::default()
            },
        )
        .await
        .expect("create")
}

struct Out {
    stdout: String,
    stderr: String,
    status: ExitStatus,
}

async fn collect(h: &dyn ProcessHandle) -> Out {
    let mut out = Out {
        stdout: String::new(),
        stderr: String::new(),
        status: ExitStatus {
            code: None,
            signal: None,
        },
    };
    let mut events = h.events(StreamOffsets::default());
    while let Some(ev) = events.next().await {
        match ev.unwrap() {
            ProcessEvent::Output {
                stream: tether_protocol::process::StreamKind::Stderr,
                data,
                ..
            } => out.stderr.push_str(&String::from_utf8_lossy(&data)),
            ProcessEvent::Output { data, .. } => {
                out.stdout.push_str(&String::from_utf8_lossy(&data))
            }
            ProcessEvent::Exited { status, .. } => out.status = status,
            ProcessEvent::Started { .. } => {}
        }
    }
    out
}

async fn sh(sb: &dyn Sandbox, cmd: &str) -> Out {
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .expect("spawn");
    collect(h.as_ref()).await
}

/// Whether a host pid is a live (non-zombie) process, seen from the host.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next()),
            Some("Z" | "X")
        ),
        Err(_) => false,
    }
}

fn pgid_of(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

async fn until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

async fn read_pid(sb: &dyn Sandbox, path: &str) -> i32 {
    for _ in 0..1000 {
        if let Ok(mut s) = sb.fs().read(&ctx(), path, ByteRange::default()).await {
            let mut buf = Vec::new();
            while let Some(c) = s.next().await {
                buf.extend_from_slice(&c.unwrap());
            }
            if buf.ends_with(b"\n") {
                return String::from_utf8(buf).unwrap().trim().parse().unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{path} never appeared");
}

// === what a confined command cannot reach ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_readable_secret_outside_the_workspace_stays_out_of_reach() {
    let e = env_with(|_| {});
    // /var/tmp stays visible inside (it is not hidden by a tmpfs): only Landlock keeps
    // the secret out. Another one under /tmp is also hidden by the private /tmp.
    let outside = tempfile::Builder::new()
        .prefix("tether-secret-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let secret = outside.path().join("secret.txt");
    std::fs::write(&secret, "TOP-SECRET-VALUE").unwrap();
    let tmp_secret = e.dir.path().join("tmp-secret.txt");
    std::fs::write(&tmp_secret, "TOP-SECRET-VALUE").unwrap();
    let sb = sandbox(&e, false).await;

    // Sanity check of the test itself: the daemon's user can read it.
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "TOP-SECRET-VALUE"
    );
    for path in [&secret, &tmp_secret] {
        let out = sh(sb.as_ref(), &format!("cat {}", path.display())).await;
        assert_ne!(out.status.code, Some(0), "cat {} succeeded", path.display());
        assert!(
            !out.stdout.contains("TOP-SECRET"),
            "the secret leaked: {}",
            out.stdout
        );
    }
    let out = sh(sb.as_ref(), &format!("ls {}", outside.path().display())).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "listing the secret's directory succeeded: {}",
        out.stdout
    );

    // Through the Fs API, directly or via a symlink made inside: refused, never content.
    let refused =
        |c: ErrorCode| matches!(c, ErrorCode::FsPermissionDenied | ErrorCode::InvalidRequest);
    let err = sb
        .fs()
        .read(&ctx(), secret.to_str().unwrap(), ByteRange::default())
        .await
        .err()
        .expect("refused");
    assert!(refused(err.code()), "{}", err.code());
    let made = sh(
        sb.as_ref(),
        &format!("ln -s {} link && echo ok", secret.display()),
    )
    .await;
    assert_eq!(made.stdout.trim(), "ok");
    let err = sb
        .fs()
        .read(&ctx(), "link", ByteRange::default())
        .await
        .err()
        .expect("refused");
    assert!(refused(err.code()), "{}", err.code());

    // Writes outside the workspace fail, and nothing appears on the host.
    let targets = [
        outside.path().join("pwned"),
        PathBuf::from("/etc/tether-pwned"),
        PathBuf::from("/root/tether-pwned"),
    ];
    for t in &targets {
        let out = sh(sb.as_ref(), &format!("echo pwned > {}", t.display())).await;
        assert_ne!(
            out.status.code,
            Some(0),
            "writing {} succeeded",
            t.display()
        );
        assert!(!t.exists(), "{} was created on the host", t.display());
    }
    let had_hostname = Path::new("/etc/hostname").exists();
    let out = sh(
        sb.as_ref(),
        "rm -f /etc/hostname; touch /usr/tether-pwned; mkdir /var/tether-pwned",
    )
    .await;
    assert_ne!(out.status.code, Some(0));
    assert_eq!(
        Path::new("/etc/hostname").exists(),
        had_hostname,
        "/etc/hostname was removed"
    );
    assert!(!Path::new("/usr/tether-pwned").exists() && !Path::new("/var/tether-pwned").exists());
    // The workspace itself is writable, and it is the sandbox's host directory.
    let out = sh(
        sb.as_ref(),
        "echo fine > /home/user/ok.txt && cat /home/user/ok.txt",
    )
    .await;
    assert_eq!(out.stdout, "fine\n");
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_is_out_of_reach_and_its_environment_does_not_leak() {
    let e = env_with(|_| {});
    let sb = sandbox(&e, false).await;
    let me = std::process::id();
    // Signals and /proc/<pid>/environ of processes outside the sandbox's domain.
    let out = sh(sb.as_ref(), &format!("kill -0 {me}")).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "a confined command could signal the daemon"
    );
    let out = sh(sb.as_ref(), &format!("cat /proc/{me}/environ")).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "a confined command could read the daemon's environment"
    );
    assert!(out.stdout.is_empty());

    // The command's environment is the base one plus what was asked for; nothing of
    // the daemon's (this test process has CARGO_* and more).
    let mut spec = ProcessSpec::argv(["/usr/bin/env"]);
    spec.env
        .insert("EXPLICIT_TOKEN".into(), Some("given-on-purpose".into()));
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let out = collect(h.as_ref()).await;
    let keys: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    assert!(keys.contains(&"EXPLICIT_TOKEN"));
    let mut expected = vec!["EXPLICIT_TOKEN", "HOME", "LANG", "PATH"];
    expected.sort_unstable();
    let mut got = keys.clone();
    got.sort_unstable();
    assert_eq!(got, expected, "unexpected environment: {}", out.stdout);
    assert!(
        std::env::vars().any(|(k, _)| k.starts_with("CARGO")),
        "the test runs under cargo"
    );

    // The host's /home is hidden; the workspace is where the sandbox's home is.
    let out = sh(sb.as_ref(), "ls -A /home 2>&1; echo; cd && pwd").await;
    assert!(
        out.stdout.trim_end().ends_with("/home/user"),
        "{}",
        out.stdout
    );
    if let Ok(entries) = std::fs::read_dir("/home") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let out = sh(
                sb.as_ref(),
                &format!("test -e '/home/{name}' && echo visible"),
            )
            .await;
            assert_ne!(
                out.stdout.trim(),
                "visible",
                "host /home/{name} shows through"
            );
        }
    }
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_network_a_tcp_connect_to_a_loopback_listener_fails() {
    let e = env_with(|_| {});
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let attempt = format!("exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected >&3 && echo ok");

    let denied = sandbox(&e, false).await;
    assert!(!denied.info().network);
    let out = sh(denied.as_ref(), &attempt).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "connected without network: {}",
        out.stdout
    );
    let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(
        accepted.is_err(),
        "the listener accepted a connection from a sandbox without network"
    );

    // Control: the same command from a sandbox with network reaches the listener, so
    // the refusal above is the sandbox's doing.
    let allowed = sandbox(&e, true).await;
    let h = allowed
        .process()
        .spawn(&ctx(), ProcessSpec::shell(&attempt))
        .await
        .unwrap();
    let (mut sock, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("no connection")
        .unwrap();
    let mut buf = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut sock, &mut buf)
        .await
        .unwrap();
    assert_eq!(buf, "connected\n");
    assert_eq!(collect(h.as_ref()).await.status.code, Some(0));
    for sb in [denied, allowed] {
        e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
    }
}

// === what a confined command cannot outlive ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_kills_a_grandchild_that_ignores_sigterm_and_killing_the_leader_would_not() {
    let e = env_with(|_| {});
    let sb = sandbox(&e, false).await;
    // The grandchild writes its pid only once it ignores SIGTERM.
    let cmd = "sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & wait";

    // First show what a naive kill of the direct child leaves behind.
    let naive = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .unwrap();
    let gc = read_pid(sb.as_ref(), "gc.pid").await;
    assert!(alive(gc));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(naive.pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    naive.wait(&ctx()).await.unwrap();
    assert!(
        alive(gc),
        "the grandchild must survive a kill of the leader alone, or this test proves nothing"
    );
    let report = naive.terminate(&ctx()).await.unwrap();
    assert_eq!(report.survivors, 0);
    assert!(
        until(Duration::from_secs(2), || !alive(gc)).await,
        "terminate left the orphaned grandchild {gc}"
    );

    // Then the real thing, with SIGTERM ignored.
    sb.fs().remove(&ctx(), "gc.pid", false).await.unwrap();
    let mut spec = ProcessSpec::shell(cmd);
    spec.grace_ms = 200;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let gc = read_pid(sb.as_ref(), "gc.pid").await;
    assert_eq!(
        pgid_of(gc),
        Some(h.pid() as i32),
        "the grandchild is in the command's group"
    );
    let report = h.terminate(&ctx()).await.unwrap();
    assert!(report.term_sent && report.killed, "{report:?}");
    assert_eq!(report.survivors, 0);
    assert!(!alive(gc), "the grandchild {gc} survived terminate");
    assert!(!alive(h.pid() as i32));
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_reaches_a_process_that_left_the_group_with_setsid() {
    let e = env_with(|_| {});
    assert!(
        e.provider.tracks_by_cgroup(),
        "this machine has a writable cgroup v2 hierarchy"
    );
    let sb = sandbox(&e, false).await;
    let mut spec = ProcessSpec::shell(
        "setsid sh -c 'trap \"\" TERM; echo $$ > esc.pid; exec sleep 1000' & wait; sleep 1000",
    );
    spec.grace_ms = 200;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let esc = read_pid(sb.as_ref(), "esc.pid").await;
    assert_eq!(
        pgid_of(esc),
        Some(esc),
        "the escapee leads its own group (it left the command's)"
    );
    assert_ne!(pgid_of(esc), Some(h.pid() as i32));
    let report = h.terminate(&ctx()).await.unwrap();
    assert_eq!(report.survivors, 0, "{report:?}");
    assert!(!alive(esc), "the setsid escapee {esc} survived terminate");
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cgroups_terminate_still_reaches_the_group() {
    let e = env_with(|c| c.cgroups = false);
    assert!(!e.provider.tracks_by_cgroup());
    let sb = sandbox(&e, false).await;
    let mut spec =
        ProcessSpec::shell("sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & wait");
    spec.grace_ms = 200;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let gc = read_pid(sb.as_ref(), "gc.pid").await;
    let report = h.terminate(&ctx()).await.unwrap();
    assert!(report.killed && report.survivors == 0, "{report:?}");
    assert!(!alive(gc));
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_provider_reconnects_and_destroy_kills_what_the_old_one_left() {
    let dir = tempfile::Builder::new()
        .prefix("tether-restart-")
        .tempdir()
        .unwrap();
    let first = LocalProvider::new(config(dir.path())).unwrap();
    let sb = first.create(&ctx(), SandboxSpec::default()).await.unwrap();
    let id = sb.info().id;
    let cgroup = first.sandbox_cgroup(&id);
    assert!(
        cgroup.as_ref().is_some_and(|p| p.is_dir()),
        "the sandbox has a cgroup: {cgroup:?}"
    );
    sb.fs()
        .write(
            &ctx(),
            "kept.txt",
            tether_provider::util::once_bytes("kept"),
            WriteGuard::None,
        )
        .await
        .unwrap();
    // A background server outlives the command that started it.
    let out = sh(
        sb.as_ref(),
        "sleep 1000 > /dev/null 2>&1 & echo $! > bg.pid",
    )
    .await;
    assert_eq!(out.status.code, Some(0));
    let bg = read_pid(sb.as_ref(), "bg.pid").await;
    assert!(alive(bg), "a background process outlives its command");
    drop(sb);
    drop(first); // the daemon "restarts" without destroying anything

    let second = LocalProvider::new(config(dir.path())).unwrap();
    assert!(
        second
            .list(&ctx())
            .await
            .unwrap()
            .iter()
            .any(|s| s.id == id)
    );
    let again = second.connect(&ctx(), &id).await.unwrap();
    assert_eq!(again.info().enforcement, Enforcement::Full);
    let out = sh(again.as_ref(), "cat kept.txt").await;
    assert_eq!(out.stdout, "kept");
    drop(again);
    second.destroy(&ctx(), &id).await.unwrap();
    assert!(
        until(Duration::from_secs(2), || !alive(bg)).await,
        "destroy left {bg} running"
    );
    assert!(
        !dir.path().join("sandboxes").join(&id).exists(),
        "the sandbox directory is gone"
    );
    assert!(!cgroup.unwrap().exists(), "the sandbox cgroup is gone");
    assert_eq!(
        second.connect(&ctx(), &id).await.err().map(|e| e.code()),
        Some(ErrorCode::SandboxNotFound)
    );
}

// === enforcement, probed and reported ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforcement_is_full_on_this_machine() {
    let e = env_with(|_| {});
    e.provider.healthcheck(&ctx()).await.expect("healthcheck");
    let sb = sandbox(&e, false).await;
    assert_eq!(sb.info().enforcement, Enforcement::Full);
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weaker_isolation_is_refused_unless_allowed() {
    // Landlock switched off: the probe reports partial enforcement.
    let strict = env_with(|c| c.landlock = false);
    let err = strict
        .provider
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect_err("refused");
    assert_eq!(err.code(), ErrorCode::IsolationUnavailable);
    assert_eq!(
        strict
            .provider
            .healthcheck(&ctx())
            .await
            .err()
            .map(|e| e.code()),
        Some(ErrorCode::IsolationUnavailable)
    );
    assert!(
        strict.provider.list(&ctx()).await.unwrap().is_empty(),
        "a refused sandbox leaves nothing behind"
    );

    let lenient = env_with(|c| {
        c.landlock = false;
        c.allow_weaker_isolation = true;
    });
    let sb = lenient
        .provider
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("allowed");
    assert_eq!(
        sb.info().enforcement,
        Enforcement::Partial,
        "reported honestly"
    );
    let out = sh(
        sb.as_ref(),
        "echo runs; cat /etc/hostname > /dev/null && echo landlock-off",
    )
    .await;
    assert_eq!(out.stdout, "runs\nlandlock-off\n", "{}", out.stderr);
    lenient
        .provider
        .destroy(&ctx(), &sb.info().id)
        .await
        .unwrap();
}

fn run_helper(verb: &str, spec: &ConfineSpec, dir: &Path) -> std::process::Output {
    let path = dir.join(format!("{verb}.json"));
    std::fs::write(&path, serde_json::to_vec(spec).unwrap()).unwrap();
    std::process::Command::new(HELPER)
        .args(["__confine", verb])
        .arg(&path)
        .env_clear()
        .output()
        .unwrap()
}

fn spec_for(dir: &Path, argv: &[&str]) -> ConfineSpec {
    let workspace = dir.join("ws");
    std::fs::create_dir_all(&workspace).unwrap();
    let cfg = LocalConfig::default();
    ConfineSpec {
        workspace_host: workspace,
        workspace_path: "/home/user".into(),
        hidden: vec!["/home".into(), "/run".into()],
        private_tmpfs: vec!["/tmp".into()],
        read_only: cfg.read_only_paths,
        devices: cfg.device_paths,
        network: false,
        landlock: true,
        cgroup: None,
        require: Enforcement::Full,
        pty: false,
        cwd: "/home/user".into(),
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        argv: argv.iter().map(|s| (*s).to_owned()).collect(),
    }
}

#[test]
fn the_trampoline_probes_and_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let probe = run_helper("probe", &spec_for(dir.path(), &[]), dir.path());
    let report: ProbeReport = serde_json::from_slice(&probe.stdout).expect("a probe report");
    assert_eq!(report.enforcement, Enforcement::Full, "{report:?}");
    assert!(
        report.user_ns && report.mount_ns && report.net_ns,
        "{report:?}"
    );

    // It runs the command when everything holds...
    let ok = run_helper(
        "run",
        &spec_for(dir.path(), &["/bin/sh", "-c", "echo inside > marker"]),
        dir.path(),
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(dir.path().join("ws/marker").exists());

    // ...and never when it cannot reach what the sandbox promised.
    let mut weaker = spec_for(dir.path(), &["/bin/sh", "-c", "echo ran > unconfined"]);
    weaker.landlock = false;
    let out = run_helper("run", &weaker, dir.path());
    assert_eq!(out.status.code(), Some(CONFINE_FAILED_EXIT));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with(CONFINE_FAILED_PREFIX));
    assert!(
        !dir.path().join("ws/unconfined").exists(),
        "the command ran unconfined"
    );

    let mut broken = spec_for(
        dir.path(),
        &["/bin/sh", "-c", "echo ran > /tmp/tether-never"],
    );
    broken.workspace_host = dir.path().join("does-not-exist");
    let out = run_helper("run", &broken, dir.path());
    assert_eq!(out.status.code(), Some(CONFINE_FAILED_EXIT));
    assert!(!Path::new("/tmp/tether-never").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_cannot_open_terminals_other_than_its_own() {
    let e = env_with(|_| {});
    let sb = sandbox(&e, false).await;
    // A terminal of someone else: the daemon holds its master, nobody uses the slave.
    let mut spec = ProcessSpec::shell("tty; sleep 1000");
    spec.pty = Some(tether_protocol::process::PtySize { rows: 24, cols: 80 });
    let other = sb.process().spawn(&ctx(), spec).await.unwrap();
    let mut events = other.events(StreamOffsets::default());
    let mut name = String::new();
    while !name.contains('\n') {
        if let Some(Ok(ProcessEvent::Output { data, .. })) = events.next().await {
            name.push_str(&String::from_utf8_lossy(&data));
        }
    }
    let name = name.trim().to_owned();
    assert!(name.starts_with("/dev/pts/"), "{name}");
    let out = sh(sb.as_ref(), &format!("echo injected > {name}")).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "a command wrote to another command's terminal {name}"
    );
    let out = sh(sb.as_ref(), &format!("cat {name}")).await;
    assert_ne!(
        out.status.code,
        Some(0),
        "a command read another command's terminal {name}"
    );
    // Its own terminal stays usable, by name and as /dev/tty.
    let mut own =
        ProcessSpec::shell("echo by-name > $(tty) && echo via-dev-tty > /dev/tty && stty size");
    own.pty = Some(tether_protocol::process::PtySize {
        rows: 30,
        cols: 100,
    });
    let h = sb.process().spawn(&ctx(), own).await.unwrap();
    let out = collect(h.as_ref()).await;
    assert_eq!(out.status.code, Some(0), "{}", out.stdout);
    assert!(
        out.stdout.contains("by-name")
            && out.stdout.contains("via-dev-tty")
            && out.stdout.contains("30 100"),
        "{}",
        out.stdout
    );
    other.terminate(&ctx()).await.unwrap();
    e.provider.destroy(&ctx(), &sb.info().id).await.unwrap();
}
