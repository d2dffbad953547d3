//! Slow and half-broken links, through the fault proxy, between the E2B provider and
//! tetherd's E2B front (local provider, in-process, on an ephemeral port):
//!
//! - a link that drips one byte at a time: no idle clock fires (bytes keep arriving), the
//!   call's total deadline does, within its limit plus a small margin;
//! - a connection whose client-bound direction is closed in the middle of a body (a clean
//!   FIN, not a reset): the read notices the short body and resumes it byte for byte;
//! - at the HTTP level ([`HttpFaultProxy`]): 429s with `Retry-After` are waited out, one
//!   that outlasts the retries is `RATE_LIMITED` carrying it; a storm of 503s on an
//!   idempotent call is retried through; a command stream that loses its end frame still
//!   reports the command's real exit and output, and the command is never started twice.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::StreamOffsets;
use tether_provider::{CallCtx, Clock, Provider, Sandbox, SandboxSpec};
use tether_provider_e2b::{E2bConfig, E2bProvider, RetryConfig};
use tether_tests::TestDaemon;
use tether_tests::fault_proxy::FaultProxy;
use tether_tests::http_fault::HttpFaultProxy;
use tokio::time::Instant;

fn addr_of(base: &str) -> SocketAddr {
    base.trim_start_matches("http://")
        .parse()
        .expect("daemon address")
}

fn ctx() -> CallCtx {
    CallCtx::new(format!("faults-{}", uuid::Uuid::new_v4().simple()))
}

/// A provider whose envd traffic goes through `proxy`.
fn via_proxy(d: &TestDaemon, proxy: &FaultProxy, transport_idle_ms: u64) -> E2bProvider {
    let cfg = E2bConfig {
        api_url: Some(d.base.clone()),
        sandbox_url: Some(proxy.url()),
        api_key: Some("e2b_tether_test".into()),
        inherit_env: false,
        transport_idle_ms,
        keepalive_interval_s: 1,
        ..E2bConfig::default()
    };
    E2bProvider::new(cfg).expect("provider")
}

/// A sandbox with `big.bin` of `len` pseudo-random bytes; the bytes.
async fn sandbox_with_file(p: &E2bProvider, len: usize) -> (Arc<dyn Sandbox>, Vec<u8>) {
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create");
    let data: Vec<u8> = (0..len as u32)
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
    (sb, data)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dripping_read_is_ended_by_the_total_deadline_not_by_an_idle_clock() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    // One byte every 150 ms keeps a 1.5 s transport-idle clock from firing.
    let p = via_proxy(&d, &proxy, 1_500);
    let (sb, data) = sandbox_with_file(&p, 256 * 1024).await;
    proxy.drip_after(4 * 1024, Duration::from_millis(150));
    let limit = Duration::from_millis(3_000);
    let call = ctx().with_timeout(limit, Clock::Total);
    let t = Instant::now();
    let stream = sb
        .fs()
        .read(&call, "big.bin", ByteRange::default())
        .await
        .expect("the read starts");
    let (got, err) = tether_tests::read_until_error(stream).await;
    let took = t.elapsed();
    assert_eq!(err.code(), ErrorCode::DeadlineExceeded, "{err}");
    assert_eq!(err.clock(), Some(Clock::Total));
    assert!(
        took >= limit && took < limit + Duration::from_millis(1_500),
        "took {took:?}"
    );
    assert_eq!(proxy.drips(), 1);
    // The bytes that did arrive are the file's, in order: all the proxy passed before it
    // began to drip (less the response's head) and some dripped ones.
    assert!(
        got.len() > 3 * 1024 && got.len() < data.len(),
        "{}",
        got.len()
    );
    assert!(got[..] == data[..got.len()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_half_closed_mid_body_is_resumed_byte_for_byte() {
    let d = TestDaemon::start().await;
    let proxy = FaultProxy::start(addr_of(&d.base)).await;
    let p = via_proxy(&d, &proxy, 5_000);
    let (sb, data) = sandbox_with_file(&p, 8 << 20).await;
    proxy.half_close_after(1 << 20);
    let mut stream = sb
        .fs()
        .read(&ctx(), "big.bin", ByteRange::default())
        .await
        .expect("read");
    let mut got = Vec::new();
    while let Some(chunk) = stream.next().await {
        got.extend_from_slice(&chunk.expect("the short body is resumed"));
    }
    assert_eq!(proxy.half_closes(), 1);
    assert_eq!(got.len(), data.len());
    assert!(got == data, "every byte once, in order");
}

/// A provider with both planes behind one HTTP fault proxy and a short retry policy.
fn via_http_proxy(proxy: &HttpFaultProxy) -> E2bProvider {
    let cfg = E2bConfig {
        api_url: Some(proxy.url()),
        sandbox_url: Some(proxy.url()),
        api_key: Some("e2b_tether_test".into()),
        inherit_env: false,
        retry: RetryConfig {
            max_times: 3,
            min_delay_ms: 50,
            max_delay_ms: 2_000,
        },
        ..E2bConfig::default()
    };
    E2bProvider::new(cfg).expect("provider")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_waited_out_as_retry_after_says() {
    let d = TestDaemon::start().await;
    let proxy = HttpFaultProxy::start(&d.base).await;
    let p = via_http_proxy(&proxy);
    proxy.refuse("/v2/sandboxes", 2, 429, Some(1));
    let t = Instant::now();
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create");
    let took = t.elapsed();
    // Creates only: a create that took more than one attempt lists the sandboxes after it
    // (`GET /v2/sandboxes`) to remove any duplicate.
    let post = http::Method::POST;
    assert_eq!(
        proxy.count_method(post.clone(), "/v2/sandboxes", "refused"),
        2
    );
    assert_eq!(proxy.count_method(post, "/v2/sandboxes", "forwarded"), 1);
    assert!(
        took >= Duration::from_secs(2),
        "two Retry-After: 1 were honoured: {took:?}"
    );
    p.destroy(&ctx(), &sb.info().id).await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_that_outlasts_the_retries_is_rate_limited_with_its_retry_after() {
    let d = TestDaemon::start().await;
    let proxy = HttpFaultProxy::start(&d.base).await;
    let p = via_http_proxy(&proxy);
    proxy.refuse("/v2/sandboxes", 100, 429, Some(1));
    let t = Instant::now();
    let err = match p.create(&ctx(), SandboxSpec::default()).await {
        Ok(_) => panic!(
            "every attempt is refused, yet after {:?}: {:?}",
            t.elapsed(),
            proxy.seen()
        ),
        Err(e) => e,
    };
    assert_eq!(err.code(), ErrorCode::RateLimited, "{err}");
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
    // The first attempt and three retries, no more.
    let post = http::Method::POST;
    assert_eq!(
        proxy.count_method(post.clone(), "/v2/sandboxes", "refused"),
        4
    );
    assert_eq!(proxy.count_method(post, "/v2/sandboxes", "forwarded"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_503s_on_an_idempotent_call_is_retried_through() {
    let d = TestDaemon::start().await;
    let proxy = HttpFaultProxy::start(&d.base).await;
    let p = via_http_proxy(&proxy);
    let (sb, data) = sandbox_with_file(&p, 4096).await;
    let before = proxy.count("/filesystem.Filesystem/Stat", "forwarded");
    proxy.refuse("/filesystem.Filesystem/Stat", 3, 503, None);
    let st = sb.fs().stat(&ctx(), "big.bin").await.expect("stat");
    assert_eq!(st.size, data.len() as u64);
    assert_eq!(proxy.count("/filesystem.Filesystem/Stat", "refused"), 3);
    assert_eq!(
        proxy.count("/filesystem.Filesystem/Stat", "forwarded"),
        before + 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stream_without_its_end_frame_reports_the_real_exit_without_a_rerun() {
    let d = TestDaemon::start().await;
    let proxy = HttpFaultProxy::start(&d.base).await;
    let p = via_http_proxy(&proxy);
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create");
    proxy.drop_end_frame("/process.Process/Start", 1);
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("echo out; sleep 0.3; exit 3"))
        .await
        .expect("spawn");
    let mut events = h.events(StreamOffsets::default());
    let (mut out, mut exit) = (Vec::new(), None);
    while let Some(ev) = events.next().await {
        match ev.expect("no error: the stream is re-attached") {
            ProcessEvent::Output { data, .. } => out.extend_from_slice(&data),
            ProcessEvent::Exited { status, .. } => exit = Some(status.code),
            ProcessEvent::Started { .. } => {}
        }
    }
    assert_eq!(proxy.count("/process.Process/Start", "truncated"), 1);
    assert_eq!(String::from_utf8_lossy(&out), "out\n", "{:?}", proxy.seen());
    assert_eq!(exit, Some(Some(3)), "exit {exit:?}: {:?}", proxy.seen());
    // Found again, never started again.
    assert_eq!(proxy.count("/process.Process/Start", "forwarded"), 0);
}

/// A create whose answer is slower than the connect limit, again and again, is sent again
/// under its idempotency key until the create's own limit, not only as often as the retry
/// policy allows: the backend answers the later attempts with the sandbox the first one
/// made, and exactly one sandbox is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_slower_than_the_connect_limit_is_sent_again_until_answered() {
    let d = TestDaemon::start().await;
    let proxy = HttpFaultProxy::start(&d.base).await;
    let cfg = E2bConfig {
        api_url: Some(proxy.url()),
        sandbox_url: Some(proxy.url()),
        api_key: Some("e2b_tether_test".into()),
        inherit_env: false,
        connect_timeout_ms: 300,
        request_timeout_ms: 10_000,
        // One retry: the slow answers outnumber it.
        retry: RetryConfig {
            max_times: 1,
            min_delay_ms: 50,
            max_delay_ms: 100,
        },
        ..E2bConfig::default()
    };
    let p = E2bProvider::new(cfg).expect("provider");
    // The first four answers come 900 ms late: each attempt gives up on its answer.
    proxy.delay("/v2/sandboxes", 4, Duration::from_millis(900));
    let t = Instant::now();
    let sb = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("a slow create succeeds");
    assert!(
        t.elapsed() >= Duration::from_millis(4 * 300),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        proxy.count("/v2/sandboxes", "delayed"),
        4,
        "{:?}",
        proxy.seen()
    );
    // The answered attempt, and the looks for sandboxes the others made (lists).
    assert!(
        proxy.count("/v2/sandboxes", "forwarded") >= 1,
        "{:?}",
        proxy.seen()
    );
    let listed = p.list(&ctx()).await.expect("list");
    assert_eq!(
        listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [sb.info().id.as_str()],
        "one create, one sandbox"
    );
    p.destroy(&ctx(), &sb.info().id).await.expect("destroy");
}
