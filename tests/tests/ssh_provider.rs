//! The SSH provider against a real OpenSSH server on a test host of our own (a network
//! namespace behind a veth pair; see `tether_tests::ssh_host`): the conformance suite, and
//! the faults of a real network path (a cut connection, a blackholed link, delay, a server
//! that never answers), host-key checking and group kills.
//!
//! Needs root, iproute2 and openssh-server; without them every test fails with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;
use tether_provider::Clock;

use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec, StdinMode};
use tether_provider::testkit::Fixture;
use tether_provider::{CallCtx, ProcessSelector, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_ssh::{HostKeyPolicy, SshConfig, SshProvider};
use tether_tests::ssh_host::{DelayRelay, SilentServer, SshHost};

/// The test host's config with test-sized clocks.
fn config(host: &SshHost) -> SshConfig {
    SshConfig {
        connect_timeout_ms: 5_000,
        transport_idle_timeout_ms: 3_000,
        keepalive_interval_ms: 1_000,
        request_timeout_ms: 30_000,
        ..host.provider_config("t")
    }
}

fn provider(cfg: SshConfig) -> Arc<SshProvider> {
    Arc::new(SshProvider::new(cfg).expect("provider"))
}

fn ctx() -> CallCtx {
    CallCtx::new(format!("ssh-test-{}", uuid::Uuid::new_v4().simple()))
}

tether_provider::conformance_tests!(|| async {
    let host = SshHost::start().await;
    let p: Arc<dyn Provider> = provider(config(&host));
    Fixture::new(p).keep(host)
});

/// Read events until stdout contains `needle`; returns stdout so far.
async fn read_until(events: &mut tether_provider::EventStream, needle: &str) -> String {
    let mut out = Vec::new();
    while let Some(ev) = events.next().await {
        if let Ok(ProcessEvent::Output { data, .. }) = ev {
            out.extend_from_slice(&data);
            if String::from_utf8_lossy(&out).contains(needle) {
                break;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every stdout byte and the exit status, or the error that ended the stream.
async fn collect(
    h: &dyn tether_provider::ProcessHandle,
) -> (
    Vec<u8>,
    Option<tether_protocol::process::ExitStatus>,
    Option<ErrorCode>,
) {
    let mut out = Vec::new();
    let mut events = h.events(StreamOffsets::default());
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ProcessEvent::Output {
                stream: tether_protocol::process::StreamKind::Stdout,
                offset,
                data,
            }) => {
                assert_eq!(offset, out.len() as u64, "offsets are contiguous");
                out.extend_from_slice(&data);
            }
            Ok(ProcessEvent::Exited { status, .. }) => return (out, Some(status), None),
            Ok(_) => {}
            Err(e) => return (out, None, Some(e.code())),
        }
    }
    (out, None, None)
}

/// A handle on command `cid` of sandbox `sid` made by another provider from the ids
/// alone, as after a daemon restart.
async fn attach_anew(
    host: &SshHost,
    sid: &str,
    cid: &str,
) -> Arc<dyn tether_provider::ProcessHandle> {
    let other = provider(config(host));
    let sb = other.connect(&ctx(), sid).await.unwrap();
    sb.process()
        .attach(&ctx(), ProcessSelector::CommandId(cid.to_owned()))
        .await
        .unwrap()
}

/// Kill the provider's SSH connections. A connection dropped by an earlier cut may still
/// be coming back (a follower reconnects on its own clock): up to 2 s for one to be there.
async fn cut(host: &SshHost) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while host.kill_connections() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no SSH connection to cut"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn sandbox(p: &SshProvider) -> Arc<dyn Sandbox> {
    p.create(&ctx(), SandboxSpec::default())
        .await
        .expect("create")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_loses_no_output() {
    let host = SshHost::start().await;
    let p = provider(config(&host));
    let sb = sandbox(&p).await;
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell(
                "for i in $(seq 1 40); do echo line$i; sleep 0.05; done; echo err >&2",
            ),
        )
        .await
        .unwrap();
    let mut events = h.events(StreamOffsets::default());
    read_until(&mut events, "line5\n").await;
    cut(&host).await;
    let (out, status, err) = collect(h.as_ref()).await;
    assert_eq!(err, None, "the stream must recover");
    let expected: String = (1..=40).map(|i| format!("line{i}\n")).collect();
    assert_eq!(
        String::from_utf8_lossy(&out),
        expected,
        "the output in full, once"
    );
    assert_eq!(status.and_then(|s| s.code), Some(0));
    // A handle made from the command id alone (as after a daemon restart) reads the same.
    let again = attach_anew(&host, &sb.info().id, h.command_id()).await;
    let (out2, status2, _) = collect(again.as_ref()).await;
    assert_eq!(out2, out);
    assert_eq!(status2.and_then(|s| s.code), Some(0));
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
}

/// A piped stdin is journaled on the host: a cut connection loses none of it and ends
/// nothing, the command reads its end of file only from `close_stdin`, and a handle made
/// from the command id alone (as after a daemon restart) writes on where the first left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_loses_no_stdin() {
    let host = SshHost::start().await;
    let p = provider(config(&host));
    let sb = sandbox(&p).await;
    let mut spec = ProcessSpec::argv(["cat"]);
    spec.stdin = StdinMode::Pipe;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let big: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8).collect();
    h.write_stdin(&ctx(), "first\n".into()).await.unwrap();
    let mut events = h.events(StreamOffsets::default());
    read_until(&mut events, "first\n").await;
    cut(&host).await;
    h.write_stdin(&ctx(), big.clone().into()).await.unwrap();
    cut(&host).await;
    h.write_stdin(&ctx(), "second\n".into()).await.unwrap();
    // Another provider's handle on the same command, found by its id.
    let again = attach_anew(&host, &sb.info().id, h.command_id()).await;
    again.write_stdin(&ctx(), "third\n".into()).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), h.wait(&ctx()))
            .await
            .is_err(),
        "cat ended before its stdin was closed"
    );
    again.close_stdin(&ctx()).await.unwrap();
    let (out, status, err) = collect(h.as_ref()).await;
    assert_eq!(err, None);
    let mut want = b"first\n".to_vec();
    want.extend_from_slice(&big);
    want.extend_from_slice(b"second\nthird\n");
    assert_eq!(out.len(), want.len(), "every stdin byte, once");
    assert!(out == want, "the stdin bytes in order");
    assert_eq!(status.and_then(|s| s.code), Some(0));
    let e = h.write_stdin(&ctx(), "late".into()).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
    let e = again.write_stdin(&ctx(), "late".into()).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
    // The feeder and its holder ended with the command.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<String> = host
            .user_pids()
            .into_iter()
            .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).ok())
            .filter(|c| c.contains(&format!("/{}.", h.command_id())))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stdin helpers left running: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_kills_a_term_ignoring_command_and_its_grandchild() {
    let host = SshHost::start().await;
    let p = provider(config(&host));
    let sb = sandbox(&p).await;
    let mut spec = ProcessSpec::shell(
        "trap '' TERM; sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & echo started; while :; do sleep 0.1; done",
    );
    spec.grace_ms = 300;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let mut events = h.events(StreamOffsets::default());
    read_until(&mut events, "started").await;
    let gc_path = format!("{}/gc.pid", sb.info().workspace);
    let mut gc = String::new();
    for _ in 0..100 {
        gc = std::fs::read_to_string(&gc_path).unwrap_or_default();
        if gc.ends_with('\n') {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gc: i32 = gc.trim().parse().expect("grandchild pid");
    assert!(host.user_pids().contains(&gc), "the grandchild runs");
    let report = h.terminate(&ctx()).await.unwrap();
    assert!(report.term_sent && report.killed, "{report:?}");
    assert_eq!(report.survivors, 0);
    assert!(!host.user_pids().contains(&gc), "the grandchild survived");
    assert!(
        !host.user_pids().contains(&(h.pid() as i32)),
        "the leader survived"
    );
    let st = tokio::time::timeout(Duration::from_secs(10), h.wait(&ctx()))
        .await
        .unwrap()
        .unwrap();
    assert!(!st.success());
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
    assert!(
        !std::path::Path::new(&sb.info().workspace).exists(),
        "destroy removes the workspace"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_changed_host_keys_are_refused() {
    let host = SshHost::start().await;
    // Changed: known_hosts lists another key for this host.
    let other = host.dir.path().join("other_key");
    let ok = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&other)
        .status()
        .unwrap();
    assert!(ok.success());
    let other_pub = std::fs::read_to_string(other.with_extension("pub")).unwrap();
    let mut it = other_pub.split_whitespace();
    let wrong = host.dir.path().join("known_hosts_wrong");
    std::fs::write(
        &wrong,
        format!(
            "[{}]:{} {} {}\n",
            host.addr.ip(),
            host.addr.port(),
            it.next().unwrap(),
            it.next().unwrap()
        ),
    )
    .unwrap();
    let mut cfg = config(&host);
    cfg.known_hosts = Some(wrong.clone());
    let e = provider(cfg).healthcheck(&ctx()).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Forbidden);
    let msg = e.to_string();
    assert!(
        msg.contains(&host.addr.to_string()) && msg.contains("SHA256:"),
        "{msg}"
    );
    assert!(matches!(
        e,
        tether_provider::ProviderError::HostKeyRejected { changed: true, .. }
    ));
    // Changed keys are refused under trust-on-first-use too.
    let mut cfg = config(&host);
    cfg.known_hosts = Some(wrong);
    cfg.host_key_policy = HostKeyPolicy::TrustOnFirstUse;
    assert_eq!(
        provider(cfg).healthcheck(&ctx()).await.unwrap_err().code(),
        ErrorCode::Forbidden
    );
    // Unknown: strict refuses, trust-on-first-use records it and then connects.
    let empty = host.dir.path().join("known_hosts_empty");
    let mut cfg = config(&host);
    cfg.known_hosts = Some(empty.clone());
    let e = provider(cfg.clone()).healthcheck(&ctx()).await.unwrap_err();
    assert!(matches!(
        e,
        tether_provider::ProviderError::HostKeyRejected { changed: false, .. }
    ));
    cfg.host_key_policy = HostKeyPolicy::TrustOnFirstUse;
    provider(cfg.clone())
        .healthcheck(&ctx())
        .await
        .expect("trust on first use");
    let learned = std::fs::read_to_string(&empty).unwrap();
    assert!(learned.contains(host.host_key.split_whitespace().nth(1).unwrap()));
    cfg.host_key_policy = HostKeyPolicy::Strict;
    provider(cfg)
        .healthcheck(&ctx())
        .await
        .expect("the learned key is trusted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_ends_within_the_connect_limit() {
    let host = SshHost::start().await;
    let silent = SilentServer::start().await;
    let mut cfg = config(&host);
    cfg.hosts[0].address = silent.addr.ip().to_string();
    cfg.hosts[0].port = silent.addr.port();
    cfg.connect_timeout_ms = 1_000;
    let started = tokio::time::Instant::now();
    let e = provider(cfg).healthcheck(&ctx()).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.code(), ErrorCode::ConnectTimeout);
    assert_eq!(e.clock(), Some(Clock::Connect));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2_500),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_succeeds_within_limit_with_200ms_of_delay() {
    let host = SshHost::start().await;
    // 100 ms each way: 200 ms added to every round trip.
    let relay = DelayRelay::start(host.addr, Duration::from_millis(100)).await;
    let mut cfg = config(&host);
    cfg.hosts[0].address = relay.addr.ip().to_string();
    cfg.hosts[0].port = relay.addr.port();
    let known = host.dir.path().join("known_hosts_relay");
    std::fs::write(
        &known,
        format!(
            "[{}]:{} {}\n",
            relay.addr.ip(),
            relay.addr.port(),
            host.host_key
        ),
    )
    .unwrap();
    cfg.known_hosts = Some(known);
    let p = provider(cfg);
    let limit = Duration::from_secs(20);
    let call = || ctx().with_timeout(limit, Clock::Total);
    let started = tokio::time::Instant::now();
    let sb = p.create(&call(), SandboxSpec::default()).await.unwrap();
    let data: Vec<u8> = (0..512 * 1024u32).map(|i| (i % 251) as u8).collect();
    let w = sb
        .fs()
        .write(
            &call(),
            "d/x.bin",
            tether_provider::util::once_bytes(data.clone()),
            WriteGuard::CreateIfAbsent,
        )
        .await
        .unwrap();
    assert_eq!(w.size, data.len() as u64);
    let mut r = sb
        .fs()
        .read(&call(), "d/x.bin", ByteRange::default())
        .await
        .unwrap();
    let mut back = Vec::new();
    while let Some(c) = r.next().await {
        back.extend_from_slice(&c.unwrap());
    }
    assert!(back == data);
    assert_eq!(
        sb.fs().stat(&call(), "d/x.bin").await.unwrap().version,
        w.version
    );
    assert_eq!(sb.fs().list(&call(), "d", 1).await.unwrap().len(), 1);
    let h = sb
        .process()
        .spawn(&call(), ProcessSpec::shell("echo hi; echo there >&2"))
        .await
        .unwrap();
    let (out, status, err) = collect(h.as_ref()).await;
    assert_eq!((out.as_slice(), err), (&b"hi\n"[..], None));
    assert_eq!(status.and_then(|s| s.code), Some(0));
    assert!(!p.list(&call()).await.unwrap().is_empty());
    p.destroy(&call(), &sb.info().id).await.unwrap();
    assert!(started.elapsed() < limit, "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_link_ends_the_stream_with_transport_idle_and_partial_output() {
    let host = SshHost::start().await;
    let mut cfg = config(&host);
    cfg.transport_idle_timeout_ms = 2_000;
    cfg.keepalive_interval_ms = 500;
    cfg.connect_timeout_ms = 2_000;
    cfg.reattach_attempts = 1;
    let p = provider(cfg);
    let sb = sandbox(&p).await;
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("while :; do echo tick; sleep 0.1; done"),
        )
        .await
        .unwrap();
    let mut events = h.events(StreamOffsets::default());
    let mut out = read_until(&mut events, "tick").await;
    host.blackhole();
    let started = tokio::time::Instant::now();
    let mut code = None;
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ProcessEvent::Output { data, .. }) => out.push_str(&String::from_utf8_lossy(&data)),
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(e) => {
                code = Some(e.code());
                assert_eq!(e.clock(), Some(Clock::TransportIdle));
                break;
            }
        }
    }
    let took = started.elapsed();
    host.restore();
    assert_eq!(code, Some(ErrorCode::TransportIdleTimeout));
    assert!(out.contains("tick"), "partial output is kept: {out:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    // The command went on on the host; it is still found and killed.
    let p2 = provider(config(&host));
    let sb2 = p2.connect(&ctx(), &sb.info().id).await.unwrap();
    let again = sb2
        .process()
        .attach(&ctx(), ProcessSelector::Pid(h.pid()))
        .await
        .unwrap();
    assert_eq!(again.terminate(&ctx()).await.unwrap().survivors, 0);
    p2.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_builds_ssh_providers_from_its_config() {
    let host = SshHost::start().await;
    let toml_text = format!(
        "default_provider = \"vm\"\n[providers.vm]\nkind = \"ssh\"\nknown_hosts = {:?}\n\
         [[providers.vm.hosts]]\naddress = \"{}\"\nport = {}\nuser = \"{}\"\n\
         auth = {{ method = \"key_file\", path = {:?} }}\n",
        host.known_hosts.display().to_string(),
        host.addr.ip(),
        host.addr.port(),
        host.user,
        host.key.display().to_string(),
    );
    let cfg: tether_daemon::config::Config = toml::from_str(&toml_text).expect("config");
    let reg = tether_daemon::providers::ProviderRegistry::from_config_with_env(&cfg, &|_| None)
        .expect("registry");
    let p = reg.get("vm").expect("the ssh provider");
    assert_eq!(p.kind(), "ssh");
    p.healthcheck(&ctx()).await.expect("healthcheck");
    let sb = p.create(&ctx(), SandboxSpec::default()).await.unwrap();
    assert!(
        sb.info()
            .workspace
            .starts_with(&host.home().display().to_string())
    );
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_are_found_by_their_stamp_and_destroyed_with_their_processes() {
    let host = SshHost::start().await;
    let mut spec = SandboxSpec::default();
    spec.metadata.insert("tether.session".into(), "s-1".into());
    let (id, ws, pid) = {
        // A daemon that creates a sandbox and a detached grandchild, then dies.
        let p = provider(config(&host));
        let sb = p.create(&ctx(), spec).await.unwrap();
        let h = sb
            .process()
            .spawn(
                &ctx(),
                ProcessSpec::shell("setsid sleep 1000 & echo $! > orphan.pid; sleep 1000"),
            )
            .await
            .unwrap();
        let f = format!("{}/orphan.pid", sb.info().workspace);
        let mut gc = String::new();
        for _ in 0..100 {
            gc = std::fs::read_to_string(&f).unwrap_or_default();
            if gc.ends_with('\n') {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = h;
        p.shutdown().await;
        (
            sb.info().id,
            sb.info().workspace,
            gc.trim().parse::<i32>().unwrap(),
        )
    };
    assert!(host.user_pids().contains(&pid), "the detached process runs");
    let p = provider(config(&host));
    let listed = p.list(&ctx()).await.unwrap();
    let found = listed
        .iter()
        .find(|s| s.id == id)
        .expect("the orphan is listed");
    assert_eq!(
        found.metadata.get("tether.session").map(String::as_str),
        Some("s-1")
    );
    assert!(found.expires_ms.is_some());
    p.destroy(&ctx(), &id).await.unwrap();
    assert!(
        !host.user_pids().contains(&pid),
        "a process of the sandbox survived"
    );
    assert!(!std::path::Path::new(&ws).exists());
    assert!(p.list(&ctx()).await.unwrap().iter().all(|s| s.id != id));
    p.destroy(&ctx(), &id).await.expect("destroy is idempotent");
}

/// A test daemon with the test host as provider `vm` (also the E2B front's, when `e2b`).
async fn daemon_with_ssh(host: &SshHost, e2b: bool) -> tether_tests::TestDaemon {
    let cfg = config(host);
    tether_tests::TestDaemon::start_with(move |c| {
        c.providers
            .insert("vm".into(), tether_daemon::config::ProviderConfig::Ssh(cfg));
        if e2b {
            c.e2b_front.provider = Some("vm".into());
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_run_tools_on_an_ssh_host_through_tetherd() {
    let host = SshHost::start().await;
    let d = daemon_with_ssh(&host, false).await;
    let (st, body) = d
        .post("/v1/sessions", serde_json::json!({"provider": "vm"}))
        .await;
    assert_eq!(st, 201, "{body}");
    let sid = body["id"].as_str().unwrap().to_owned();
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/tool-calls"),
            serde_json::json!({"calls": [
                {"id": "c1", "name": "write_file", "arguments": {"path": "notes/a.txt", "content": "alpha\n"}},
                {"id": "c2", "name": "bash", "arguments": {"command": "cat notes/a.txt; echo on-$(whoami)"}},
            ]}),
        )
        .await;
    assert_eq!(st, 200, "{body}");
    let r = body["results"].as_array().unwrap();
    assert_eq!(r[0]["is_error"], false, "{}", r[0]);
    let out = r[1]["content"].as_str().unwrap();
    assert!(
        out.contains("alpha") && out.contains(&format!("on-{}", host.user)),
        "{out}"
    );
    let (st, _) = d
        .http
        .delete(d.url(&format!("/v1/sessions/{sid}")))
        .send()
        .await
        .map(|r| (r.status().as_u16(), ()))
        .unwrap();
    assert_eq!(st, 204);
    let left: Vec<_> = std::fs::read_dir(host.home().join(".tether/sandboxes"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name() != ".tether")
        .collect();
    assert!(
        left.is_empty(),
        "closing the session destroys its sandbox: {left:?}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_beyond_the_memory_window_is_read_back_from_the_journal() {
    let host = SshHost::start().await;
    let mut cfg = config(&host);
    cfg.output_buffer_bytes = 64 * 1024;
    let p = provider(cfg);
    let sb = sandbox(&p).await;
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("seq 1 200000"))
        .await
        .unwrap();
    assert!(h.wait(&ctx()).await.unwrap().success());
    let expected: String = (1..=200_000).map(|i| format!("{i}\n")).collect();
    let (out, status, err) = collect(h.as_ref()).await;
    assert_eq!(err, None);
    assert_eq!(status.and_then(|s| s.code), Some(0));
    assert!(
        out == expected.as_bytes(),
        "{} vs {} bytes",
        out.len(),
        expected.len()
    );
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_changes_reach_the_command_whatever_their_names() {
    let host = SshHost::start().await;
    let p = provider(config(&host));
    let sb = sandbox(&p).await;
    for (name, value) in [
        ("PLAIN_NAME", "a b"),
        ("my.dotted", "x=y"),
        ("PATH", "/bin:/usr/bin"),
    ] {
        let mut spec = ProcessSpec::argv(["env"]);
        spec.env.insert(name.into(), Some(value.into()));
        let h = sb.process().spawn(&ctx(), spec).await.unwrap();
        let (out, status, _) = collect(h.as_ref()).await;
        assert_eq!(status.and_then(|s| s.code), Some(0));
        let out = String::from_utf8_lossy(&out).into_owned();
        assert!(
            out.lines().any(|l| l == format!("{name}={value}")),
            "{name}: {out}"
        );
        assert!(out.contains("TETHER_SSH_SANDBOX="), "{out}");
    }
    p.destroy(&ctx(), &sb.info().id).await.unwrap();
}

/// E2B's port proxy reaches a port of an SSH sandbox: a port of its host's loopback,
/// through a `direct-tcpip` channel (as `ssh -L` reaches it), for HTTP/1.1 and HTTP/2
/// clients alike. A port nothing listens on is 502, as on every provider, and a
/// destroyed sandbox's ports are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_front_reaches_a_server_in_an_ssh_sandbox() {
    let host = SshHost::start().await;
    let d = daemon_with_ssh(&host, true).await;
    let key = "e2b_ssh_port_test_key";
    let sid = d.e2b_create(key).await;
    // The test host is a network namespace of its own: any port is free on its loopback.
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            serde_json::json!({"cmd": format!(
                "echo served-from-{sid} > page.txt && exec python3 -m http.server {port} --bind 127.0.0.1"
            )}),
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let get = |port: u16, path: &'static str| {
        d.http
            .get(d.url(path))
            .header("host", format!("{port}-{sid}.localhost"))
            .send()
    };
    assert_eq!(
        d.get_port_until_served(&sid, port, "/page.txt", 100).await,
        Ok(format!("served-from-{sid}\n")),
        "the server in the sandbox was not reached"
    );
    // Another connection, another channel: a second request is served as well.
    let r = get(port, "/page.txt").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.headers()["server"].to_str().unwrap().split('/').next(),
        Some("SimpleHTTP")
    );
    // An HTTP/2 client (prior knowledge, as h2c and gRPC clients speak) is served too: the
    // front speaks HTTP/1.1 to the server in the sandbox, which knows no other.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .get(d.url("/page.txt"))
        .header("e2b-sandbox-id", sid.as_str())
        .header("e2b-sandbox-port", port.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), format!("served-from-{sid}\n"));
    // Nothing listens on the next port.
    assert_eq!(get(port + 1, "/").await.unwrap().status().as_u16(), 502);
    let r = d
        .http
        .delete(d.url(&format!("/sandboxes/{sid}")))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    assert_ne!(get(port, "/page.txt").await.unwrap().status().as_u16(), 200);
    d.stop().await;
}
