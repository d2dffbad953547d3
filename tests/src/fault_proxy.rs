//! A TCP fault proxy on 127.0.0.1, for the faults no real peer produces on demand.
//!
//! It forwards byte for byte to an upstream address until told otherwise:
//!
//! - [`FaultProxy::blackhole`]: new connections are accepted and never answered (what
//!   they send is read and dropped);
//! - [`FaultProxy::cut_after`]: after `n` more bytes towards the client, the connection
//!   that carries the `n`-th byte is cut (both directions closed);
//! - [`FaultProxy::stall_after`]: the same, but that connection stalls instead: it stays
//!   open and carries nothing more, either way;
//! - [`FaultProxy::drip_after`]: the same, but from then on that connection carries one
//!   byte towards the client every interval (a link that is slow, not dead: idle clocks
//!   must not fire, total deadlines must);
//! - [`FaultProxy::half_close_after`]: the same, but that connection's direction towards
//!   the client is closed (FIN) while the other stays open: the client reads a clean end of
//!   stream in the middle of a body;
//! - [`FaultProxy::freeze`]: every open connection stops carrying anything and new ones
//!   are black-holed (the backend is unreachable, its connections hang);
//! - [`FaultProxy::pass`]: back to forwarding for new connections.
//!
//! Connection counts and forwarded bytes are counted, so a test can also show that an
//! operation made no network call at all.

// Test support: a proxy that cannot bind means a broken test machine, and says so.
#![allow(clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const PASS: u8 = 0;
const BLACKHOLE: u8 = 1;

const FAULT_NONE: u8 = 0;
const FAULT_CUT: u8 = 1;
const FAULT_STALL: u8 = 2;
const FAULT_DRIP: u8 = 3;
const FAULT_HALF_CLOSE: u8 = 4;

#[derive(Debug, Default)]
struct State {
    mode: AtomicU8,
    fault: AtomicU8,
    budget: AtomicI64,
    frozen: AtomicBool,
    accepted: AtomicU64,
    forwarded: AtomicU64,
    cuts: AtomicU64,
    stalls: AtomicU64,
    drips: AtomicU64,
    half_closes: AtomicU64,
    drip_every_ms: AtomicU64,
    down_bytes: AtomicU64,
    up_bytes: AtomicU64,
    closed: AtomicBool,
}

/// A running fault proxy. Dropping it stops it and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::Release);
        self.stop.cancel();
    }
}

impl FaultProxy {
    /// Start a proxy to `upstream` on an ephemeral port of 127.0.0.1.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fault proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(State::default());
        let stop = CancellationToken::new();
        serve(listener, upstream, state.clone(), stop.clone());
        Self { addr, state, stop }
    }

    /// A route for clients with one upstream per port (a microVM provider dials each VM's
    /// agent at its own forwarded port on 127.0.0.1): the address to dial for upstream
    /// port `p` is a listener of its own, made at the first ask, that forwards to
    /// `127.0.0.1:p` under this proxy's faults and counters (arming this proxy arms them
    /// all, and a fault still fires once) and stops with it. Call it inside a runtime.
    pub fn per_port_route(&self) -> Arc<dyn Fn(u16) -> SocketAddr + Send + Sync> {
        let (state, stop) = (self.state.clone(), self.stop.clone());
        // Held for a bind only, never across an await.
        let routes = std::sync::RwLock::new(std::collections::HashMap::new());
        Arc::new(move |port| {
            let mut routes = routes.write().unwrap_or_else(|e| e.into_inner());
            *routes.entry(port).or_insert_with(|| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a route");
                l.set_nonblocking(true).expect("a non-blocking route");
                let addr = l.local_addr().expect("route address");
                let l = TcpListener::from_std(l).expect("a route in the runtime");
                let upstream = SocketAddr::from(([127, 0, 0, 1], port));
                serve(l, upstream, state.clone(), stop.clone());
                addr
            })
        })
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// New connections are forwarded (open ones keep whatever they were doing), and a
    /// freeze ends for new connections.
    pub fn pass(&self) {
        self.state.mode.store(PASS, Ordering::Release);
        self.state.frozen.store(false, Ordering::Release);
    }

    /// Every open connection goes silent (what it receives from now on is held back),
    /// and new ones are black-holed.
    pub fn freeze(&self) {
        self.state.frozen.store(true, Ordering::Release);
    }

    /// New connections are accepted and never answered.
    pub fn blackhole(&self) {
        self.state.mode.store(BLACKHOLE, Ordering::Release);
    }

    /// Cut the connection carrying the `n`-th next byte towards the client.
    pub fn cut_after(&self, n: u64) {
        self.arm(FAULT_CUT, n);
    }

    /// Stall the connection carrying the `n`-th next byte towards the client.
    pub fn stall_after(&self, n: u64) {
        self.arm(FAULT_STALL, n);
    }

    /// From the `n`-th next byte towards the client, the connection carrying it sends one
    /// byte every `every`.
    pub fn drip_after(&self, n: u64, every: std::time::Duration) {
        self.state.drip_every_ms.store(
            u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1),
            Ordering::Release,
        );
        self.arm(FAULT_DRIP, n);
    }

    /// Close the client-bound direction of the connection carrying the `n`-th next byte
    /// (the client reads end of stream; what it sends is still forwarded).
    pub fn half_close_after(&self, n: u64) {
        self.arm(FAULT_HALF_CLOSE, n);
    }

    fn arm(&self, fault: u8, n: u64) {
        self.state
            .budget
            .store(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Release);
        self.state.fault.store(fault, Ordering::Release);
    }

    /// Whether an armed fault has not fired yet.
    pub fn armed(&self) -> bool {
        self.state.fault.load(Ordering::Acquire) != FAULT_NONE
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::Relaxed)
    }

    /// Connections forwarded to the upstream so far (not black-holed).
    pub fn forwarded(&self) -> u64 {
        self.state.forwarded.load(Ordering::Relaxed)
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> u64 {
        self.state.cuts.load(Ordering::Relaxed)
    }

    /// Connections stalled so far.
    pub fn stalls(&self) -> u64 {
        self.state.stalls.load(Ordering::Relaxed)
    }

    /// Connections that started dripping so far.
    pub fn drips(&self) -> u64 {
        self.state.drips.load(Ordering::Relaxed)
    }

    /// Connections half-closed so far.
    pub fn half_closes(&self) -> u64 {
        self.state.half_closes.load(Ordering::Relaxed)
    }

    /// Bytes forwarded so far (towards the client, towards the upstream).
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.state.down_bytes.load(Ordering::Relaxed),
            self.state.up_bytes.load(Ordering::Relaxed),
        )
    }
}

async fn blackhole(mut client: TcpStream, token: CancellationToken) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            r = client.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
}

/// Accept on `listener` and forward to `upstream` under `st`, until `stop`.
fn serve(listener: TcpListener, upstream: SocketAddr, st: Arc<State>, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                a = listener.accept() => a,
            };
            let Ok((client, _)) = accepted else { continue };
            st.accepted.fetch_add(1, Ordering::Relaxed);
            let (st, token) = (st.clone(), stop.clone());
            tokio::spawn(async move {
                if st.mode.load(Ordering::Acquire) == BLACKHOLE || st.frozen.load(Ordering::Acquire)
                {
                    blackhole(client, token).await;
                } else {
                    st.forwarded.fetch_add(1, Ordering::Relaxed);
                    forward(client, upstream, st, token).await;
                }
            });
        }
    });
}

async fn forward(
    client: TcpStream,
    upstream: SocketAddr,
    st: Arc<State>,
    token: CancellationToken,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Set when this connection's fault fires (or the proxy stops): both directions stop.
    let halted = token.child_token();
    let up = {
        let (st, halted) = (st.clone(), halted.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = tokio::select! {
                    _ = halted.cancelled() => return,
                    r = cr.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
                };
                if st.frozen.load(Ordering::Acquire) {
                    halted.cancelled().await;
                    return;
                }
                if halted.is_cancelled() || sw.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                st.up_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    };
    let down = {
        let (st, halted) = (st.clone(), halted.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = tokio::select! {
                    _ = halted.cancelled() => return None,
                    r = sr.read(&mut buf) => match r { Ok(0) | Err(_) => return None, Ok(n) => n },
                };
                if st.frozen.load(Ordering::Acquire) {
                    halted.cancelled().await;
                    return None;
                }
                let mut send = n;
                let mut fire = FAULT_NONE;
                let fault = st.fault.load(Ordering::Acquire);
                if fault != FAULT_NONE {
                    let left = st.budget.fetch_sub(n as i64, Ordering::AcqRel);
                    if left < n as i64 {
                        // This connection carries the byte the fault was armed for.
                        send = usize::try_from(left.max(0)).unwrap_or(0);
                        if st
                            .fault
                            .compare_exchange(
                                fault,
                                FAULT_NONE,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            )
                            .is_ok()
                        {
                            fire = fault;
                        }
                    }
                }
                if send > 0 {
                    if cw.write_all(&buf[..send]).await.is_err() {
                        return None;
                    }
                    st.down_bytes.fetch_add(send as u64, Ordering::Relaxed);
                }
                match fire {
                    FAULT_NONE => {}
                    FAULT_DRIP => {
                        st.drips.fetch_add(1, Ordering::Relaxed);
                        drip(&buf[send..n], &mut sr, &mut cw, &st, &halted).await;
                        return None;
                    }
                    FAULT_HALF_CLOSE => {
                        st.half_closes.fetch_add(1, Ordering::Relaxed);
                        let _ = cw.shutdown().await;
                        // The upstream's further answer is read and dropped; the client's
                        // direction keeps flowing until either side ends.
                        loop {
                            tokio::select! {
                                _ = halted.cancelled() => return None,
                                r = sr.read(&mut buf) => match r {
                                    Ok(0) | Err(_) => return None,
                                    Ok(_) => {}
                                },
                            }
                        }
                    }
                    _ => {
                        halted.cancel();
                        return Some((fire, cw));
                    }
                }
            }
        }
    };
    let (_, fired) = tokio::join!(up, down);
    match fired {
        Some((FAULT_CUT, cw)) => {
            st.cuts.fetch_add(1, Ordering::Relaxed);
            drop(cw);
        }
        Some((_, cw)) => {
            st.stalls.fetch_add(1, Ordering::Relaxed);
            // Keep the connection open and silent until the proxy goes away.
            token.cancelled().await;
            drop(cw);
        }
        None => {}
    }
}

/// The rest of a dripping connection: `pending`, then everything the upstream sends, one
/// byte every interval.
async fn drip(
    pending: &[u8],
    sr: &mut tokio::net::tcp::OwnedReadHalf,
    cw: &mut tokio::net::tcp::OwnedWriteHalf,
    st: &State,
    halted: &CancellationToken,
) {
    let every = std::time::Duration::from_millis(st.drip_every_ms.load(Ordering::Acquire));
    let mut queue: std::collections::VecDeque<u8> = pending.iter().copied().collect();
    let mut buf = vec![0u8; 64 * 1024];
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut upstream_open = true;
    loop {
        tokio::select! {
            _ = halted.cancelled() => return,
            // Read ahead only a little: the upstream feels the slow link as back-pressure.
            r = sr.read(&mut buf), if upstream_open && queue.len() < 64 * 1024 => match r {
                Ok(0) | Err(_) => upstream_open = false,
                Ok(n) => queue.extend(&buf[..n]),
            },
            _ = tick.tick() => {
                let Some(b) = queue.pop_front() else {
                    if !upstream_open {
                        return;
                    }
                    continue;
                };
                if cw.write_all(&[b]).await.is_err() {
                    return;
                }
                st.down_bytes.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
