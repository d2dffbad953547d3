//! The hardened edge, end to end against an in-process tetherd on 127.0.0.1: slowloris
//! connections are closed within the header-read timeout, idle ones within the idle
//! timeout, a client over its connection cap is refused while others are served, requests
//! over the concurrency cap get 503 `OVERLOADED`, and oversized headers are refused.
//! Everything stays on loopback, with bounded counts (well under the descriptor limit).

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;
use tether_tests::{TestDaemon, code};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

fn addr(d: &TestDaemon) -> SocketAddr {
    d.daemon.as_ref().unwrap().addr
}

/// Wait until the server closes `s` (EOF or reset), at most `limit`; how long it took.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    let r = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    r.ok().map(|()| t.elapsed())
}

/// One HTTP/1.1 request on a kept-alive connection; the status line's code.
async fn get_keepalive(s: &mut TcpStream, path: &str) -> Option<u16> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    // Read the head and a Content-Length body.
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        let n = tokio::time::timeout(left, s.read(&mut buf))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return text.split(' ').nth(1)?.parse().ok();
            }
        }
    }
}

/// A connection from another loopback address (127.0.0.2), as a different client.
async fn connect_from(local: &str, to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{local}:0").parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_are_closed_within_the_header_read_timeout() {
    const N: usize = 200;
    const HEADER_READ_TIMEOUT_MS: u64 = 1_000;
    let margin = Duration::from_millis(2_000);
    let d = TestDaemon::start_with(|c| {
        c.server.header_read_timeout_ms = HEADER_READ_TIMEOUT_MS;
        c.server.max_connections_per_client = N + 50;
        c.server.max_connections = N + 100;
    })
    .await;
    let to = addr(&d);
    let started = Instant::now();
    let mut slow = Vec::with_capacity(N);
    for _ in 0..N {
        let mut s = TcpStream::connect(to).await.unwrap();
        s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaa")
            .await
            .unwrap();
        slow.push(s);
    }
    // Meanwhile the daemon answers.
    let t = Instant::now();
    let (st, _) = d.get("/v1/health").await;
    assert_eq!(st, 200);
    let health = t.elapsed();
    assert!(health < Duration::from_secs(2), "health took {health:?}");
    let limit = Duration::from_millis(HEADER_READ_TIMEOUT_MS) + margin;
    let mut worst = Duration::ZERO;
    for (i, s) in slow.iter_mut().enumerate() {
        let left = limit.saturating_sub(started.elapsed());
        assert!(
            closed_within(s, left).await.is_some(),
            "slow connection {i} still open {:?} after it started (limit {limit:?})",
            started.elapsed()
        );
        worst = worst.max(started.elapsed());
    }
    println!(
        "slowloris: {N} connections, header_read_timeout {HEADER_READ_TIMEOUT_MS} ms, all closed {} ms after the first opened; /v1/health meanwhile in {} ms",
        worst.as_millis(),
        health.as_millis()
    );
    // On a new connection: the client's pooled one from above sat idle past the
    // header-read timeout too, which closes idle keep-alive connections as well.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let r = fresh
        .get(format!("{}/v1/health", d.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_its_connection_cap_is_refused_and_others_are_served() {
    const PER_CLIENT: usize = 20;
    let d = TestDaemon::start_with(|c| {
        c.server.max_connections_per_client = PER_CLIENT;
        c.server.max_connections = 3 * PER_CLIENT;
    })
    .await;
    let to = addr(&d);
    // PER_CLIENT kept-alive connections from 127.0.0.1, each served once.
    let mut held = Vec::new();
    for i in 0..PER_CLIENT {
        let mut s = TcpStream::connect(to).await.unwrap();
        assert_eq!(
            get_keepalive(&mut s, "/v1/health").await,
            Some(200),
            "conn {i}"
        );
        held.push(s);
    }
    // More from the same address: closed at once, nothing served.
    let mut refused = 0;
    for _ in 0..5 {
        let mut s = TcpStream::connect(to).await.unwrap();
        let _ = s
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await;
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .expect("an extra connection must be closed at once, not left open");
        assert!(matches!(r, Ok(0) | Err(_)), "served over the cap: {r:?}");
        refused += 1;
    }
    // Another client address is still served (the total cap is not reached).
    let mut other = connect_from("127.0.0.2", to).await;
    assert_eq!(get_keepalive(&mut other, "/v1/health").await, Some(200));
    // Once the held ones close, 127.0.0.1 is served again.
    drop(held);
    let mut again = None;
    for _ in 0..50 {
        let mut s = TcpStream::connect(to).await.unwrap();
        again = get_keepalive(&mut s, "/v1/health").await;
        if again.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(again, Some(200));
    println!("per-client cap {PER_CLIENT}: {refused} extra connections refused");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_within_the_idle_timeout() {
    const IDLE_MS: u64 = 800;
    let d = TestDaemon::start_with(|c| {
        c.server.idle_timeout_ms = IDLE_MS;
        c.server.header_read_timeout_ms = 60_000;
    })
    .await;
    let to = addr(&d);
    let mut s = TcpStream::connect(to).await.unwrap();
    assert_eq!(get_keepalive(&mut s, "/v1/health").await, Some(200));
    let took = closed_within(&mut s, Duration::from_millis(IDLE_MS + 2_000))
        .await
        .expect("idle connection still open");
    println!("idle connection closed after {} ms", took.as_millis());
    // A connection that never sends a byte is idle too.
    let mut silent = TcpStream::connect(to).await.unwrap();
    assert!(
        closed_within(&mut silent, Duration::from_millis(IDLE_MS + 2_000))
            .await
            .is_some()
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_concurrency_cap_get_overloaded() {
    let d = TestDaemon::start_with(|c| c.server.max_concurrent_requests = 2).await;
    let sid = d.new_session().await;
    let base = format!("/v1/sessions/{sid}/processes");
    let (st, b) = d
        .post(&base, json!({"cmd": "sleep 3", "command_id": "slow"}))
        .await;
    assert_eq!(st, 201, "{b}");
    // Two waits hold both slots.
    let wait = format!("{base}/slow/wait");
    let w1 = d.post(&wait, json!({}));
    let w2 = d.post(&wait, json!({}));
    let probe = async {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        d.get("/v1/sessions").await
    };
    let ((s1, _), (s2, _), (st, body)) = tokio::join!(w1, w2, probe);
    assert_eq!((s1, s2), (200, 200));
    assert_eq!((st, code(&body)), (503, "OVERLOADED"), "{body}");
    // Once they end, requests are served again.
    assert_eq!(d.get("/v1/sessions").await.0, 200);
    d.stop().await;
}

#[tokio::test]
async fn oversized_headers_are_refused() {
    let d = TestDaemon::start_with(|c| c.server.max_header_bytes = 8 * 1024).await;
    let big = "a".repeat(16 * 1024);
    let r = d
        .http
        .get(d.url("/v1/health"))
        .header("x-big", &big)
        .send()
        .await;
    match r {
        Ok(r) => assert_eq!(r.status().as_u16(), 431),
        // hyper may close the connection instead of answering.
        Err(e) => assert!(e.is_request() || e.is_connect(), "{e}"),
    }
    assert_eq!(d.get("/v1/health").await.0, 200);
    d.stop().await;
}

/// hyper starts the header-read clock as soon as an HTTP/1.1 connection waits for a head,
/// so a kept-alive connection waiting for its next request is bound by it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_waits_at_most_the_header_read_timeout() {
    const HEADER_READ_TIMEOUT_MS: u64 = 1_000;
    let d = TestDaemon::start_with(|c| {
        c.server.idle_timeout_ms = 60_000;
        c.server.header_read_timeout_ms = HEADER_READ_TIMEOUT_MS;
    })
    .await;
    let mut s = TcpStream::connect(addr(&d)).await.unwrap();
    assert_eq!(get_keepalive(&mut s, "/v1/health").await, Some(200));
    let took = closed_within(
        &mut s,
        Duration::from_millis(HEADER_READ_TIMEOUT_MS + 2_000),
    )
    .await
    .expect("a kept-alive connection outlived the header-read timeout");
    println!("kept-alive connection closed after {} ms", took.as_millis());
    d.stop().await;
}
