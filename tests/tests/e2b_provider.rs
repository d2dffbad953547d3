//! The E2B provider end to end, against tetherd's own E2B front serving the local
//! provider (in-process, on an ephemeral port):
//!
//! - the provider conformance suite;
//! - faults, through the fault proxy: a backend that never answers, a stalled stream (of
//!   a file and of a command, with and without a way back), a stream cut mid-output and
//!   resumed byte for byte, keepalives that keep a quiet command's transport alive but
//!   not its output, and a backend without pause. Each ends within its limit plus a small
//!   margin, with the code of the clock that fired.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tether_provider::Clock;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::testkit::{ConformanceOptions, Fixture};
use tether_provider::{
    CallCtx, EventStream, PauseKind, ProcessSelector, Provider, ProviderError, Sandbox,
    SandboxSpec, StreamOffsets,
};
use tether_provider_e2b::{E2bConfig, E2bProvider, RetryConfig};
use tether_tests::TestDaemon;
use tether_tests::fault_proxy::FaultProxy;
use tokio::time::Instant;

/// A client configuration pointing both planes at `base`.
fn client_config(base: &str) -> E2bConfig {
    E2bConfig {
        api_url: Some(base.to_owned()),
        sandbox_url: Some(base.to_owned()),
        api_key: Some("e2b_tether_test".into()),
        inherit_env: false,
        // Small, so that readers from early offsets read back from the in-sandbox copy.
        output_buffer_bytes: 64 * 1024,
        ..E2bConfig::default()
    }
}

fn addr_of(base: &str) -> SocketAddr {
    base.trim_start_matches("http://")
        .parse()
        .expect("daemon address")
}

fn ctx() -> CallCtx {
    CallCtx::new(format!("e2b-test-{}", uuid::Uuid::new_v4().simple()))
}

mod conformance {
    use super::*;

    async fn fixture() -> Fixture {
        let d = TestDaemon::start().await;
        let provider: Arc<dyn Provider> =
            Arc::new(E2bProvider::new(client_config(&d.base)).expect("provider"));
        let options = ConformanceOptions {
            fs_confined_to_workspace: false,
            ..ConformanceOptions::default()
        };
        Fixture::new(provider).with_options(options).keep(d)
    }

    tether_provider::conformance_tests!(fixture);
}

/// Everything a reader saw, with offsets checked for continuity on the way.
#[derive(Debug, Default)]
struct Seen {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exited: Option<(Option<i32>, u64)>,
    error: Option<ProviderError>,
}

async fn drain(mut events: EventStream, from: StreamOffsets) -> Seen {
    let mut seen = Seen::default();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ProcessEvent::Output {
                stream,
                offset,
                data,
            }) => {
                let (buf, base) = match stream {
                    StreamKind::Stderr => (&mut seen.stderr, from.stderr),
                    _ => (&mut seen.stdout, from.stdout),
                };
                assert_eq!(
                    offset,
                    base + buf.len() as u64,
                    "{stream:?} chunk at a wrong offset"
                );
                buf.extend_from_slice(&data);
            }
            Ok(ProcessEvent::Exited {
                status,
                stdout_bytes,
                ..
            }) => seen.exited = Some((status.code, stdout_bytes)),
            Ok(ProcessEvent::Started { .. }) => {}
            Err(e) => {
                seen.error = Some(e);
                break;
            }
        }
    }
    seen
}

fn seq(from: u64, to: u64) -> String {
    (from..=to).map(|i| format!("{i}\n")).collect()
}

/// A provider whose control plane is reached directly and whose envd traffic goes
/// through `proxy` (so the proxy sees only what a command's streams and reads do).
fn via_proxy(
    d: &TestDaemon,
    proxy: &FaultProxy,
    tweak: impl FnOnce(&mut E2bConfig),
) -> E2bProvider {
    let mut cfg = client_config(&d.base);
    cfg.sandbox_url = Some(proxy.url());
    tweak(&mut cfg);
    E2bProvider::new(cfg).expect("provider")
}

async fn new_sandbox(p: &E2bProvider) -> Arc<dyn Sandbox> {
    p.create(&ctx(), SandboxSpec::default())
        .await
        .expect("create")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_never_answers_fails_with_connect_timeout() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    proxy.blackhole();
    let mut cfg = client_config(&proxy.url());
    cfg.connect_timeout_ms = 300;
    cfg.request_timeout_ms = 1_500;
    cfg.retry = RetryConfig {
        max_times: 2,
        min_delay_ms: 50,
        max_delay_ms: 100,
    };
    let p = E2bProvider::new(cfg).expect("provider");
    // Three attempts of 300 ms and two backoffs of at most 100 ms.
    let limit = Duration::from_millis(3 * 300 + 2 * 100);
    // A create is sent again under its idempotency key until its own limit (the request
    // limit) is too near for another attempt.
    let create_limit = Duration::from_millis(1_500);
    let margin = Duration::from_millis(800);
    for op in ["healthcheck", "list", "create", "connect", "destroy"] {
        let t = Instant::now();
        let e = match op {
            "healthcheck" => p.healthcheck(&ctx()).await.expect_err("healthcheck"),
            "list" => p.list(&ctx()).await.expect_err("list"),
            "create" => p
                .create(&ctx(), SandboxSpec::default())
                .await
                .map(|_| ())
                .expect_err("create"),
            "connect" => p
                .connect(&ctx(), "isomesandbox")
                .await
                .map(|_| ())
                .expect_err("connect"),
            _ => p
                .destroy(&ctx(), "isomesandbox")
                .await
                .expect_err("destroy"),
        };
        let took = t.elapsed();
        if op == "create" {
            // Whichever attempt the create's limit cut, the caller hears that the
            // backend never answered.
            assert_eq!(e.code(), ErrorCode::ConnectTimeout, "{op}: {e}");
            assert_eq!(e.clock(), Some(Clock::Connect), "{op}");
            assert!(e.retryable(), "{op}");
            assert!(
                took >= create_limit - Duration::from_millis(400),
                "the create gave up before its limit: {took:?}"
            );
            assert!(took < create_limit + margin, "{op} took {took:?}");
            continue;
        }
        assert_eq!(e.code(), ErrorCode::ConnectTimeout, "{op}: {e}");
        assert_eq!(e.clock(), Some(Clock::Connect), "{op}");
        assert!(e.retryable(), "{op}");
        assert!(
            took >= Duration::from_millis(300),
            "{op} gave up before its connect limit: {took:?}"
        );
        assert!(took < limit + margin, "{op} took {took:?}");
    }
    // A total deadline shorter than the retries ends the call at the deadline.
    let t = Instant::now();
    let short = ctx().with_timeout(Duration::from_millis(450), Clock::Total);
    let e = p.list(&short).await.expect_err("list under a deadline");
    assert_eq!(e.code(), ErrorCode::DeadlineExceeded, "{e}");
    assert_eq!(e.clock(), Some(Clock::Total));
    assert!(
        t.elapsed() < Duration::from_millis(450) + margin,
        "took {:?}",
        t.elapsed()
    );
    assert!(proxy.accepted() >= 3 * 5, "every attempt reached the proxy");
    assert_eq!(proxy.forwarded(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_file_stream_ends_with_transport_idle_timeout() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
        // Without retries a stall ends the read (with them it is resumed: see below).
        c.retry.max_times = 0;
    });
    let sb = new_sandbox(&p).await;
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let body = futures_util::stream::iter(
        data.chunks(1 << 20)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect::<Vec<_>>(),
    )
    .boxed();
    sb.fs()
        .write(&ctx(), "big.bin", body, WriteGuard::None)
        .await
        .expect("write");

    proxy.stall_after(1 << 20);
    let t = Instant::now();
    let stream = sb
        .fs()
        .read(&ctx(), "big.bin", ByteRange::default())
        .await
        .expect("the read starts");
    let (got, err) = tether_tests::read_until_error(stream).await;
    let took = t.elapsed();
    assert_eq!(err.code(), ErrorCode::TransportIdleTimeout, "{err}");
    assert_eq!(err.clock(), Some(Clock::TransportIdle));
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_millis(1500 + 1000),
        "took {took:?}"
    );
    assert!(
        !got.is_empty() && got.len() < data.len(),
        "partial data: {} bytes",
        got.len()
    );
    assert!(
        got[..] == data[..got.len()],
        "the partial data is a prefix of the file"
    );
    assert_eq!(proxy.stalls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_read_stalled_once_is_resumed_byte_for_byte() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
    });
    let sb = new_sandbox(&p).await;
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let body = futures_util::stream::iter(
        data.chunks(1 << 20)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect::<Vec<_>>(),
    )
    .boxed();
    sb.fs()
        .write(&ctx(), "big.bin", body, WriteGuard::None)
        .await
        .expect("write");
    proxy.stall_after(1 << 20);
    let t = Instant::now();
    let mut stream = sb
        .fs()
        .read(&ctx(), "big.bin", ByteRange::default())
        .await
        .expect("read");
    let mut got = Vec::new();
    while let Some(chunk) = stream.next().await {
        got.extend_from_slice(&chunk.expect("the stalled body is resumed"));
    }
    assert_eq!(proxy.stalls(), 1);
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "the stall was noticed by the transport-idle clock"
    );
    assert_eq!(got.len(), data.len());
    assert!(got == data, "every byte once, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_mid_output_resumes_byte_for_byte() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |_| {});
    let sb = new_sandbox(&p).await;
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("seq 1 200000; sleep 0.5; seq 200001 300000"),
        )
        .await
        .expect("spawn");
    // A reader from the start, attached before the cut.
    let early = tokio::spawn(drain(
        h.events(StreamOffsets::default()),
        StreamOffsets::default(),
    ));
    proxy.cut_after(300_000);
    let seen = tokio::time::timeout(Duration::from_secs(30), early)
        .await
        .expect("the command's output ended")
        .expect("reader");
    assert!(seen.error.is_none(), "{:?}", seen.error);
    let expected = seq(1, 300_000);
    assert_eq!(proxy.cuts(), 1, "the stream was cut");
    assert_eq!(seen.stdout.len(), expected.len());
    assert!(
        seen.stdout == expected.as_bytes(),
        "the resumed output differs from the command's real output"
    );
    assert_eq!(seen.exited, Some((Some(0), expected.len() as u64)));
    // Readers after the fact, from the start and from offsets inside the cut region.
    for k in [0u64, 1, 299_999, 300_000, 1_000_003, expected.len() as u64] {
        let from = StreamOffsets {
            stdout: k,
            stderr: 0,
        };
        let s = drain(h.events(from), from).await;
        assert!(
            s.stdout == expected.as_bytes()[k as usize..],
            "a reader from {k} got something else"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_reader_survives_a_cut_while_reading_the_output_copy() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    // A small in-memory window: a reader from offset 0 after the fact must read the
    // in-sandbox copy through /files, and that read is what the proxy cuts.
    let p = via_proxy(&d, &proxy, |c| c.output_buffer_bytes = 64 * 1024);
    let sb = new_sandbox(&p).await;
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("seq 1 200000"))
        .await
        .expect("spawn");
    let first = drain(h.events(StreamOffsets::default()), StreamOffsets::default()).await;
    let expected = seq(1, 200_000);
    assert!(first.stdout == expected.as_bytes());
    proxy.cut_after(100_000);
    let late = drain(h.events(StreamOffsets::default()), StreamOffsets::default()).await;
    assert_eq!(proxy.cuts(), 1, "the copy's download was cut");
    assert!(
        late.error.is_none(),
        "a cut range read must be retried: {:?}",
        late.error
    );
    assert!(
        late.stdout == expected.as_bytes(),
        "the late reader got something else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_command_stream_reattaches_and_loses_nothing() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
    });
    let sb = new_sandbox(&p).await;
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("seq 1 50000; sleep 2; seq 50001 60000"),
        )
        .await
        .expect("spawn");
    proxy.stall_after(100_000);
    let t = Instant::now();
    let seen = tokio::time::timeout(
        Duration::from_secs(30),
        drain(h.events(StreamOffsets::default()), StreamOffsets::default()),
    )
    .await
    .expect("the command's output ended");
    assert!(seen.error.is_none(), "{:?}", seen.error);
    assert_eq!(proxy.stalls(), 1, "the stream stalled");
    assert!(
        seen.stdout == seq(1, 60_000).as_bytes(),
        "output lost or duplicated across the stall"
    );
    assert_eq!(seen.exited.map(|e| e.0), Some(Some(0)));
    assert!(
        t.elapsed() < Duration::from_secs(2) + Duration::from_millis(1500) + Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_command_stream_with_no_way_back_fails_with_transport_idle_timeout() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
        c.connect_timeout_ms = 300;
        c.reattach_attempts = 2;
    });
    let sb = new_sandbox(&p).await;
    let id = format!("ticks-{}", uuid::Uuid::new_v4().simple());
    let mut spec = ProcessSpec::shell("while :; do echo tick; sleep 0.05; done");
    spec.command_id = Some(id.clone());
    let h = sb.process().spawn(&ctx(), spec).await.expect("spawn");
    let mut events = h.events(StreamOffsets::default());
    // Some output first, then the link dies: its open connection hangs, new ones too.
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("tick\ntick\n") {
        if let Some(Ok(ProcessEvent::Output { data, .. })) = events.next().await {
            got.extend_from_slice(&data);
        }
    }
    proxy.freeze();
    let t = Instant::now();
    let rest = drain(
        events,
        StreamOffsets {
            stdout: got.len() as u64,
            stderr: 0,
        },
    )
    .await;
    let took = t.elapsed();
    let err = rest.error.expect("the stream must fail");
    assert_eq!(err.code(), ErrorCode::TransportIdleTimeout, "{err}");
    assert_eq!(err.clock(), Some(Clock::TransportIdle));
    // Transport idle, then two re-attach attempts of at most 300 ms and one backoff.
    assert!(
        took < Duration::from_millis(1500 + 2 * 300 + 100 + 1000),
        "took {took:?}"
    );
    assert!(rest.exited.is_none());
    // Once the backend is reachable again, the command is found by its id and its
    // output read again from the start.
    proxy.pass();
    let again = sb
        .process()
        .attach(&ctx(), ProcessSelector::CommandId(id.clone()))
        .await
        .expect("attach by id");
    assert_eq!(again.pid(), h.pid());
    let report = again.terminate(&ctx()).await.expect("terminate");
    assert_eq!(report.survivors, 0);
    let seen = drain(
        again.events(StreamOffsets::default()),
        StreamOffsets::default(),
    )
    .await;
    assert!(seen.error.is_none(), "{:?}", seen.error);
    let out = String::from_utf8(seen.stdout).expect("utf-8");
    assert!(
        out.len() > got.len() && out.starts_with(&String::from_utf8_lossy(&got).to_string()),
        "re-read output: {out:?}"
    );
    assert!(out.split_terminator('\n').all(|l| l == "tick"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_keep_a_quiet_command_transport_alive_but_not_its_output() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
        c.output_idle_ms = 600;
        c.connect_timeout_ms = 300;
    });
    let sb = new_sandbox(&p).await;
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("echo start; sleep 3; echo done"))
        .await
        .expect("spawn");
    // From here on no new connection gets through: a broken stream could not be re-attached.
    // (The provider may have opened another connection before, to make the directory of
    // the sandbox's next command ahead.)
    proxy.blackhole();
    let forwarded = proxy.forwarded();
    let t = Instant::now();
    let seen = drain(h.events(StreamOffsets::default()), StreamOffsets::default()).await;
    let took = t.elapsed();
    let err = seen.error.expect("the output watchdog fires");
    assert_eq!(err.code(), ErrorCode::IdleTimeout, "{err}");
    assert_eq!(err.clock(), Some(Clock::OutputIdle));
    assert_eq!(seen.stdout, b"start\n", "partial output is delivered first");
    assert!(took < Duration::from_millis(600 + 700), "took {took:?}");
    // The command itself runs on: twice the transport idle limit without output, kept
    // alive by keepalives alone, on the one connection it started with.
    let st = tokio::time::timeout(Duration::from_secs(10), h.wait(&ctx()))
        .await
        .expect("wait")
        .expect("status");
    assert_eq!(st.code, Some(0));
    assert_eq!(
        proxy.forwarded(),
        forwarded,
        "the stream was never re-opened"
    );
    proxy.pass();
    let from = StreamOffsets {
        stdout: 6,
        stderr: 0,
    };
    let tail = drain(h.events(from), from).await;
    assert_eq!(tail.stdout, b"done\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_through_the_e2b_provider_keep_the_sandbox() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    // The control plane through the proxy this time.
    let p = E2bProvider::new(client_config(&proxy.url())).expect("provider");
    let sb = new_sandbox(&p).await;
    let id = sb.info().id;
    assert!(
        p.capabilities().pause,
        "pause is assumed until the backend says otherwise"
    );
    sb.fs()
        .write(
            &ctx(),
            "kept.txt",
            futures_util::stream::iter(vec![Ok(Bytes::from_static(b"kept"))]).boxed(),
            WriteGuard::None,
        )
        .await
        .expect("write");
    // tetherd's local provider pauses by freezer: pause and resume go through, and the
    // sandbox's files and commands are there after. (A backend that refuses pause is
    // remembered after one probe, without a second request: providers/e2b's fake backend.)
    p.pause(&ctx(), &id, PauseKind::Memory)
        .await
        .expect("pause");
    let again = p.resume(&ctx(), &id).await.expect("resume");
    let h = again
        .process()
        .spawn(&ctx(), ProcessSpec::shell("cat kept.txt"))
        .await
        .expect("spawn after resume");
    let seen = drain(h.events(StreamOffsets::default()), StreamOffsets::default()).await;
    assert_eq!(String::from_utf8_lossy(&seen.stdout), "kept");
    assert!(p.capabilities().pause);
    // A sandbox that does not exist is still told apart from a missing route.
    let p2 = E2bProvider::new(client_config(&d.base)).expect("provider");
    assert_eq!(
        p2.pause(&ctx(), "inosuchsandbox", PauseKind::Memory)
            .await
            .expect_err("pause")
            .code(),
        ErrorCode::SandboxNotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_ends_with_transport_idle_timeout() {
    let d = TestDaemon::start().await;
    let proxy = Arc::new(FaultProxy::start(addr_of(&d.base)).await);
    let p = via_proxy(&d, &proxy, |c| {
        c.keepalive_interval_s = 1;
        c.transport_idle_ms = 1500;
    });
    let sb = new_sandbox(&p).await;
    // 64 MiB, produced lazily; after 4 MiB the link goes silent both ways.
    let frozen_at = Arc::new(std::sync::OnceLock::new());
    let (px, at) = (proxy.clone(), frozen_at.clone());
    let body = futures_util::stream::iter(0..64u32)
        .map(move |i| {
            if i == 4 {
                px.freeze();
                let _ = at.set(Instant::now());
            }
            Ok(Bytes::from(vec![i as u8; 1 << 20]))
        })
        .boxed();
    let e = sb
        .fs()
        .write(&ctx(), "upload.bin", body, WriteGuard::None)
        .await
        .expect_err("the upload must fail");
    let since = frozen_at.get().expect("the freeze happened").elapsed();
    assert_eq!(e.code(), ErrorCode::TransportIdleTimeout, "{e}");
    assert_eq!(e.clock(), Some(Clock::TransportIdle));
    assert!(
        since >= Duration::from_millis(1500) && since < Duration::from_millis(1500 + 1500),
        "took {since:?} after the freeze"
    );
    // Nothing was published: the target does not exist.
    proxy.pass();
    let p2 = E2bProvider::new(client_config(&d.base)).expect("provider");
    let again = p2.connect(&ctx(), &sb.info().id).await.expect("connect");
    assert_eq!(
        again
            .fs()
            .stat(&ctx(), "upload.bin")
            .await
            .expect_err("stat")
            .code(),
        ErrorCode::FsNotFound
    );
}

/// E2B's port proxy in front of the E2B provider: a request for `<port>-<id>.<domain>`
/// at tetherd goes to the backend's edge addressed as E2B's edge routes it (its host, the
/// `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers), here a second tetherd's E2B front over
/// the local provider, and reaches the server in the backend's sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_front_reaches_a_server_in_a_sandbox_of_an_e2b_backend() {
    let backend = TestDaemon::start().await;
    let cfg = client_config(&backend.base);
    let d = TestDaemon::start_with(move |c| {
        c.providers.insert(
            "cloud".into(),
            tether_daemon::config::ProviderConfig::E2b(cfg),
        );
        c.e2b_front.provider = Some("cloud".into());
    })
    .await;
    let key = "e2b_port_via_backend_key";
    let sid = d.e2b_create(key).await;
    let (st, body) = d
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            serde_json::json!({"cmd": format!(
                "mkdir -p /tmp/www && cd /tmp/www && echo served-from-{sid} > page.txt && exec python3 -m http.server 8080 --bind 127.0.0.1"
            )}),
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let get = |port: u16| {
        d.http
            .get(d.url("/page.txt"))
            .header("host", format!("{port}-{sid}.localhost"))
            .send()
    };
    assert_eq!(
        d.get_port_until_served(&sid, 8080, "/page.txt", 150).await,
        Ok(format!("served-from-{sid}\n")),
        "the server in the backend's sandbox was not reached"
    );
    let r = get(8080).await.unwrap();
    assert_eq!(
        r.headers()["server"].to_str().unwrap().split('/').next(),
        Some("SimpleHTTP")
    );
    // Nothing listens on another port: the backend's own answer comes back.
    let r = get(8081).await.unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let closed: serde_json::Value = r.json().await.unwrap();
    assert_eq!(closed["port"], 8081, "{closed}");
    let r = d
        .http
        .delete(d.url(&format!("/sandboxes/{sid}")))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    assert_ne!(get(8080).await.unwrap().status().as_u16(), 200);
    d.stop().await;
    backend.stop().await;
}

/// After a sandbox's first command the provider makes command directories ahead, so the
/// wrapper starts no `mkdir`: a later command's copies are in such a directory, named by
/// the file the wrapper put there, and a provider that never saw the command (as after a
/// restart) finds them by the command's id and reads its whole output and status back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_in_a_directory_made_ahead_is_found_again_by_its_id() {
    let d = TestDaemon::start().await;
    let p = E2bProvider::new(client_config(&d.base)).expect("provider");
    let sb = new_sandbox(&p).await;
    let first = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("true"))
        .await
        .expect("spawn");
    first.wait(&ctx()).await.expect("first command");
    let state = "/home/user/.cache/tether";
    let spares = || async {
        sb.fs()
            .list(&ctx(), state, 1)
            .await
            .expect("list the state directory")
            .into_iter()
            .filter(|e| {
                e.stat
                    .path
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .starts_with(".spare.")
            })
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while spares().await == 0 {
        assert!(Instant::now() < deadline, "no directory was made ahead");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let id = format!("ahead-{}", uuid::Uuid::new_v4().simple());
    let mut spec = ProcessSpec::shell("seq 1 100000; echo oops >&2; exit 3");
    spec.command_id = Some(id.clone());
    let h = sb.process().spawn(&ctx(), spec).await.expect("spawn");
    let seen = drain(h.events(StreamOffsets::default()), StreamOffsets::default()).await;
    let expected = seq(1, 100_000);
    assert!(seen.stdout == expected.as_bytes());
    assert_eq!(seen.exited, Some((Some(3), expected.len() as u64)));
    // Its copies are in a directory made ahead, next to the file naming it.
    let listing = sb.fs().list(&ctx(), state, 2).await.expect("list");
    let mark = listing
        .iter()
        .find(|e| e.stat.path.ends_with(&format!("/id.{id}")))
        .expect("the file naming the command");
    let dir = mark.stat.path.rsplit_once('/').unwrap().0.to_owned();
    assert!(
        dir.rsplit('/').next().unwrap().starts_with(".spare."),
        "{dir} was not made ahead"
    );
    let mut body = sb
        .fs()
        .read(&ctx(), &format!("{dir}/out"), ByteRange::default())
        .await
        .expect("the stdout copy");
    let mut copy = Vec::new();
    while let Some(c) = body.next().await {
        copy.extend_from_slice(&c.expect("chunk"));
    }
    assert!(copy == expected.as_bytes(), "the copy holds stdout");
    // Another provider, as after a restart, finds the finished command by its id alone.
    let other = E2bProvider::new(client_config(&d.base)).expect("provider");
    let sb2 = other.connect(&ctx(), &sb.info().id).await.expect("connect");
    let again = sb2
        .process()
        .attach(&ctx(), ProcessSelector::CommandId(id.clone()))
        .await
        .expect("attach by id");
    let seen = drain(
        again.events(StreamOffsets::default()),
        StreamOffsets::default(),
    )
    .await;
    assert!(seen.error.is_none(), "{:?}", seen.error);
    assert!(seen.stdout == expected.as_bytes(), "the output read back");
    assert_eq!(seen.stderr, b"oops\n");
    assert_eq!(seen.exited.map(|e| e.0), Some(Some(3)));
    p.destroy(&ctx(), &sb.info().id).await.expect("destroy");
}
