//! Slow and half-broken links, through the fault proxy, between the E2B provider and
//! tetherd's E2B front (local provider, in-process, on an ephemeral port):
//!
//! - a link that drips one byte at a time: no idle clock fires (bytes keep arriving), the
//!   call's total deadline does, within its limit plus a small margin;
//! - a connection whose client-bound direction is closed in the middle of a body (a clean
//!   FIN, not a reset): the read notices the short body and resumes it byte for byte.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_provider::{CallCtx, Clock, Provider, Sandbox, SandboxSpec};
use tether_provider_e2b::{E2bConfig, E2bProvider};
use tether_tests::TestDaemon;
use tether_tests::fault_proxy::FaultProxy;
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
    let mut stream = sb
        .fs()
        .read(&call, "big.bin", ByteRange::default())
        .await
        .expect("the read starts");
    let mut got = Vec::new();
    let err = loop {
        match stream.next().await {
            Some(Ok(chunk)) => got.extend_from_slice(&chunk),
            Some(Err(e)) => break e,
            None => panic!("a dripping 256 KiB read ended after {} bytes", got.len()),
        }
    };
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
