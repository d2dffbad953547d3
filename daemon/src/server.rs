//! The HTTP server's assembly: one listener for HTTP/1.1 and h2c, the router over the
//! native API and the E2B front with the shared layers of [`crate::http`], start-up
//! (providers, recovery, housekeeping) and graceful shutdown.
//!
//! The edge, before any layer ([`edge`]): connection caps (in all and per client address;
//! an extra connection is closed as soon as it is accepted), a header-read timeout, an idle
//! timeout, header size limits, and a cap on requests in flight (503 `OVERLOADED`).
//! Layers, outermost first: request id + span (continuing an inbound `traceparent`) ->
//! auth (the caller's [`Principal`] on `/v1/*`, see [`crate::auth`]) -> route -> handler.
//! Every error leaves through [`DaemonError`]'s one mapping to status and code.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tether_provider::CallCtx;
use tether_provider::clock::{CancelReason, CancelToken};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ShutdownPolicy};
use crate::error::{DaemonError, Result};
use crate::invariants::Invariants;
use crate::pipeline::Pipeline;
use crate::providers::ProviderRegistry;
use crate::session_manager::{RecoveryReport, SessionManager};
use crate::state::AppState;
use crate::telemetry::Metrics;
use tether_provider::Clock;

/// The whole router: native API, E2B front, layers.
pub fn router(state: Arc<AppState>) -> Router {
    let mut app: Router<Arc<AppState>> = if state.config.e2b_front.guest.is_some() {
        // A guest agent: envd for its one sandbox, and the tunnel to its ports.
        crate::e2b_front::envd_router().route(
            &format!("{}{{port}}", tether_protocol::e2b::GUEST_PORT_TUNNEL_PATH),
            axum::routing::get(crate::e2b_front::ports::guest_tunnel),
        )
    } else {
        crate::api::router()
    };
    if state.config.e2b_front.enabled && state.config.e2b_front.guest.is_none() {
        app = app.merge(crate::e2b_front::router());
    }
    app = app
        .fallback(crate::http::not_found)
        .method_not_allowed_fallback(crate::http::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            crate::http::auth_layer,
        ));
    if state.config.e2b_front.enabled && state.config.e2b_front.guest.is_none() {
        // Outside the native API's authentication: a sandbox's ports are public, as on
        // E2B (see `e2b_front::ports`).
        app = app.layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            crate::e2b_front::ports::layer,
        ));
    }
    app.layer(axum::middleware::from_fn_with_state(
        Arc::clone(&state),
        crate::http::request_layer,
    ))
    .layer(axum::extract::DefaultBodyLimit::max(
        usize::try_from(state.config.server.max_body_bytes).unwrap_or(usize::MAX),
    ))
    .with_state(state)
}

/// A daemon being started.
#[derive(Debug)]
pub struct Daemon;

/// A running daemon.
#[derive(Debug)]
pub struct RunningDaemon {
    /// The bound address.
    pub addr: SocketAddr,
    /// Shared state.
    pub state: Arc<AppState>,
    /// What start-up recovery did.
    pub recovery: RecoveryReport,
    /// The Prometheus scrape listener's address, when `[telemetry.prometheus]` is on.
    pub metrics_addr: Option<SocketAddr>,
    server: JoinHandle<()>,
}

impl Daemon {
    /// Build everything from `config`, bind, recover sessions, and serve in the background.
    pub async fn start(config: Config) -> Result<RunningDaemon> {
        config
            .validate()
            .map_err(|e| DaemonError::invalid(e.to_string()))?;
        let listener = TcpListener::bind(config.server.listen).await.map_err(|e| {
            DaemonError::internal(format!("cannot listen on {}: {e}", config.server.listen))
        })?;
        Self::start_on(config, listener).await
    }

    /// As [`Daemon::start`], on an already bound listener.
    pub async fn start_on(mut config: Config, listener: TcpListener) -> Result<RunningDaemon> {
        let addr = listener
            .local_addr()
            .map_err(|e| DaemonError::internal(e.to_string()))?;
        config.server.listen = addr;
        // The scrape listener `telemetry::init` set up, bound first: a taken port fails
        // the start-up before anything runs.
        let scrape = crate::telemetry::scrape::bind_installed()
            .await
            .map_err(|e| DaemonError::internal(format!("{e}: {}", chain_of(&e))))?;
        let config = Arc::new(config);
        let shutdown = CancelToken::new();
        let tasks = TaskTracker::new();
        let metrics = Metrics::new();
        let invariants =
            Invariants::new(&config.invariants).map_err(|e| DaemonError::invalid(e.to_string()))?;
        let providers = Arc::new(ProviderRegistry::from_config(&config)?);
        for (name, p) in providers.iter() {
            let ctx = CallCtx::new("healthcheck")
                .with_timeout(config.limits.deadlines().sandbox_op, Clock::Total);
            if let Err(e) = p.healthcheck(&ctx).await {
                tracing::warn!(provider = %name, code = %e.code(), error = %e, "Provider healthcheck failed");
            }
        }
        let sessions = Arc::new(
            SessionManager::new(
                config.server.state_dir.clone(),
                providers,
                shutdown.clone(),
                tasks.clone(),
                metrics.clone(),
                invariants.clone(),
                config.limits.deadlines(),
            )
            .await?
            .with_log_memory(config.server.session_log_memory_bytes),
        );
        let recovery = sessions.recover(config.server.closed_retention()).await?;
        let pipeline = Arc::new(
            Pipeline::new(&config.pipeline, &config.limits, metrics.clone())
                .map_err(|e| DaemonError::invalid(e.to_string()))?,
        );
        let secret = crate::e2b_front::token_secret(&config.server.state_dir)
            .map_err(|e| DaemonError::internal(format!("the E2B front's token secret: {e}")))?;
        let e2b = crate::e2b_front::FrontState::new(
            &config.e2b_front,
            config.limits.deadlines().fs_op,
            secret,
        );
        let state = Arc::new(AppState {
            config: Arc::clone(&config),
            sessions: Arc::clone(&sessions),
            pipeline,
            metrics,
            shutdown: shutdown.clone(),
            tasks: tasks.clone(),
            invariants,
            e2b,
        });
        if crate::auth::is_development(&config) {
            tracing::warn!(
                listen = %addr,
                "Development mode: no auth token or API key is configured, so every caller on this loopback listener is trusted"
            );
        }
        if config.e2b_front.guest.is_some() {
            crate::e2b_front::adopt_guest_sandbox(&state).await?;
        }
        spawn_housekeeping(&state);
        let stop = shutdown.clone();
        let metrics_addr = scrape.map(|s| s.spawn(&tasks, async move { stop.cancelled().await }));
        let app = router(Arc::clone(&state));
        let server = tokio::spawn(edge::serve(
            listener,
            app,
            edge::EdgeLimits::of(&config.server),
            shutdown.clone(),
        ));
        Ok(RunningDaemon {
            addr,
            state,
            recovery,
            metrics_addr,
            server,
        })
    }
}

/// How often closed sessions past their retention are removed, seconds.
const RETENTION_SWEEP_EVERY_S: u64 = 3_600;

fn chain_of(e: &dyn std::error::Error) -> String {
    std::iter::successors(e.source(), |s| s.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// The reaper (TTL expiry, every second), the renewer, the reconciler (orphaned
/// sandboxes) and the retention sweep.
fn spawn_housekeeping(state: &Arc<AppState>) {
    let s = Arc::clone(state);
    state.tasks.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let reconcile_every = s.config.leases.reconcile_interval_s.max(1);
        let renew_every = s.config.leases.renew_interval_s.max(1);
        let renew_ttl = Duration::from_secs(s.config.leases.renew_ttl_s);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = s.shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            for id in s.sessions.expire().await {
                tracing::info!(session.id = %id, "Session expired; its sandbox was destroyed");
            }
            n += 1;
            if n.is_multiple_of(renew_every) {
                s.sessions.renew_all(renew_ttl).await;
            }
            if n.is_multiple_of(reconcile_every) {
                s.sessions.reconcile().await;
            }
            if let Some(retention) = s.config.server.closed_retention()
                && n.is_multiple_of(RETENTION_SWEEP_EVERY_S)
            {
                s.sessions.sweep_retention(retention).await;
            }
        }
    });
}

impl RunningDaemon {
    /// `http://addr`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful shutdown: stop accepting, cancel, drain within the grace period, then
    /// keep or release sandboxes per config.
    pub async fn shutdown(self) {
        let grace = Duration::from_millis(self.state.config.server.shutdown_grace_ms);
        self.state.shutdown.cancel(CancelReason::Shutdown);
        let release = self.state.config.server.on_shutdown == ShutdownPolicy::Release;
        let _ = tokio::time::timeout(grace, self.state.sessions.shutdown(release)).await;
        self.state.tasks.close();
        if tokio::time::timeout(grace, self.state.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("Some tasks did not finish within the shutdown grace period");
        }
        let _ = tokio::time::timeout(grace, self.server).await;
    }

    /// Wait until the server stops (it stops after shutdown is requested).
    pub async fn wait_for_shutdown_signal(&self) {
        self.state.shutdown.cancelled().await
    }
}

/// The listener's accept loop and its limits: hand-rolled over hyper-util's auto builder
/// (HTTP/1.1 and h2c on one port) because `axum::serve` has no header-read timeout, no
/// connection caps and no per-connection idle timeout.
mod edge {
    use std::collections::HashMap;
    use std::convert::Infallible;
    use std::net::IpAddr;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::task::{Context, Poll};
    use std::time::Duration;

    use axum::Router;
    use axum::body::Body;
    use axum::response::IntoResponse;
    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use tether_provider::clock::CancelToken;
    use tokio::net::TcpListener;
    use tokio::sync::{Semaphore, mpsc};
    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;
    use tower::Service as _;

    use crate::config::ServerConfig;
    use crate::error::DaemonError;

    /// Pause after a failed accept (e.g. out of descriptors) before trying again, ms.
    const ACCEPT_ERROR_BACKOFF_MS: u64 = 50;
    /// How often a connection checks its idle time, as a fraction of the idle timeout.
    const IDLE_CHECKS_PER_TIMEOUT: u32 = 4;

    /// The limits of the edge, from `[server]`.
    #[derive(Debug, Clone)]
    pub(super) struct EdgeLimits {
        header_read_timeout: Duration,
        idle_timeout: Duration,
        max_connections: usize,
        max_connections_per_client: usize,
        max_concurrent_requests: usize,
        max_header_bytes: usize,
        grace: Duration,
    }

    impl EdgeLimits {
        pub(super) fn of(s: &ServerConfig) -> Self {
            Self {
                header_read_timeout: Duration::from_millis(s.header_read_timeout_ms),
                idle_timeout: Duration::from_millis(s.idle_timeout_ms),
                max_connections: s.max_connections,
                max_connections_per_client: s.max_connections_per_client,
                max_concurrent_requests: s.max_concurrent_requests,
                max_header_bytes: s.max_header_bytes,
                grace: Duration::from_millis(s.shutdown_grace_ms),
            }
        }
    }

    /// Open connections, in all and per client address. Owned by the accept loop; a
    /// connection's [`Slot`] gives its place back through `freed` when it ends.
    struct Open {
        total: usize,
        by_client: HashMap<IpAddr, usize>,
        freed_tx: mpsc::UnboundedSender<IpAddr>,
        freed: mpsc::UnboundedReceiver<IpAddr>,
    }

    /// A connection's place in [`Open`], given back when dropped.
    struct Slot {
        freed: mpsc::UnboundedSender<IpAddr>,
        ip: IpAddr,
    }

    impl Drop for Slot {
        fn drop(&mut self) {
            // The accept loop may be gone (shutdown): nothing to give back to then.
            let _ = self.freed.send(self.ip);
        }
    }

    impl Open {
        fn new() -> Self {
            let (freed_tx, freed) = mpsc::unbounded_channel();
            Self {
                total: 0,
                by_client: HashMap::new(),
                freed_tx,
                freed,
            }
        }

        fn admit(&mut self, ip: IpAddr, limits: &EdgeLimits) -> Option<Slot> {
            while let Ok(gone) = self.freed.try_recv() {
                self.total = self.total.saturating_sub(1);
                if let Some(n) = self.by_client.get_mut(&gone) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.by_client.remove(&gone);
                    }
                }
            }
            let mine = self.by_client.get(&ip).copied().unwrap_or(0);
            if self.total >= limits.max_connections || mine >= limits.max_connections_per_client {
                return None;
            }
            self.total += 1;
            *self.by_client.entry(ip).or_insert(0) += 1;
            Some(Slot {
                freed: self.freed_tx.clone(),
                ip,
            })
        }
    }

    /// Whether a connection has requests in flight, and since when it has had none.
    struct Activity {
        start: Instant,
        in_flight: AtomicUsize,
        idle_since_ms: AtomicU64,
    }

    impl Activity {
        fn new() -> Self {
            Self {
                start: Instant::now(),
                in_flight: AtomicUsize::new(0),
                idle_since_ms: AtomicU64::new(0),
            }
        }

        fn now_ms(&self) -> u64 {
            u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
        }

        fn idle_for(&self) -> Option<Duration> {
            (self.in_flight.load(Ordering::Acquire) == 0).then(|| {
                Duration::from_millis(
                    self.now_ms()
                        .saturating_sub(self.idle_since_ms.load(Ordering::Acquire)),
                )
            })
        }
    }

    /// A request in flight on its connection: from its head until its response body ends.
    struct InFlight(Arc<Activity>);

    impl InFlight {
        fn new(a: &Arc<Activity>) -> Self {
            a.in_flight.fetch_add(1, Ordering::AcqRel);
            Self(Arc::clone(a))
        }
    }

    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0
                .idle_since_ms
                .store(self.0.now_ms(), Ordering::Release);
            self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A response body that keeps its request counted in flight until it ends.
    struct Tracked {
        inner: Body,
        _in_flight: InFlight,
    }

    impl http_body::Body for Tracked {
        type Data = bytes::Bytes;
        type Error = axum::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            Pin::new(&mut self.inner).poll_frame(cx)
        }

        fn is_end_stream(&self) -> bool {
            self.inner.is_end_stream()
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.inner.size_hint()
        }
    }

    fn builder(limits: &EdgeLimits) -> hyper_util::server::conn::auto::Builder<TokioExecutor> {
        let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        b.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(limits.max_header_bytes);
        b.http2()
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
        b
    }

    /// Accept and serve until `stop`, then drain open connections within the grace period
    /// and close what is left.
    pub(super) async fn serve(
        listener: TcpListener,
        app: Router,
        limits: EdgeLimits,
        stop: CancelToken,
    ) {
        let mut open = Open::new();
        let requests = Arc::new(Semaphore::new(limits.max_concurrent_requests));
        let builder = Arc::new(builder(&limits));
        let conns = TaskTracker::new();
        let hard_stop = CancellationToken::new();
        loop {
            let (tcp, peer) = tokio::select! {
                () = stop.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "Cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(ACCEPT_ERROR_BACKOFF_MS)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = open.admit(peer.ip(), &limits) else {
                // Over a cap: closed at once, before a byte is read.
                tracing::debug!(client = %peer, "Connection refused: connection cap reached");
                drop(tcp);
                continue;
            };
            // Streams (NDJSON, Connect server-streaming) write small frames: without
            // TCP_NODELAY, Nagle's algorithm and the peer's delayed ACK hold each one ~40 ms.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "Cannot set TCP_NODELAY");
            }
            conns.spawn(connection(
                tcp,
                slot,
                app.clone(),
                Arc::clone(&builder),
                Arc::clone(&requests),
                limits.idle_timeout,
                stop.clone(),
                hard_stop.clone(),
            ));
        }
        drop(listener);
        conns.close();
        if tokio::time::timeout(limits.grace, conns.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                open = conns.len(),
                "Connections still open after the shutdown grace period are closed"
            );
            hard_stop.cancel();
            conns.wait().await;
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn connection(
        tcp: tokio::net::TcpStream,
        _slot: Slot,
        app: Router,
        builder: Arc<hyper_util::server::conn::auto::Builder<TokioExecutor>>,
        requests: Arc<Semaphore>,
        idle_timeout: Duration,
        stop: CancelToken,
        hard_stop: CancellationToken,
    ) {
        let activity = Arc::new(Activity::new());
        let act = Arc::clone(&activity);
        let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
            let in_flight = InFlight::new(&act);
            let permit = Arc::clone(&requests).try_acquire_owned();
            let mut app = app.clone();
            async move {
                let Ok(_permit) = permit else {
                    let resp = DaemonError::Overloaded.into_response();
                    return Ok::<_, Infallible>(resp.map(|inner| Tracked {
                        inner,
                        _in_flight: in_flight,
                    }));
                };
                let resp = match app.call(req.map(Body::new)).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok(resp.map(|inner| Tracked {
                    inner,
                    _in_flight: in_flight,
                }))
            }
        });
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), svc);
        tokio::pin!(conn);
        let mut tick = tokio::time::interval(idle_timeout / IDLE_CHECKS_PER_TIMEOUT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut draining = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "Connection ended with an error");
                    }
                    break;
                }
                () = hard_stop.cancelled() => break,
                () = stop.cancelled(), if !draining => {
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
                _ = tick.tick(), if !draining => {
                    if activity.idle_for().is_some_and(|d| d >= idle_timeout) {
                        conn.as_mut().graceful_shutdown();
                        draining = true;
                    }
                }
            }
        }
    }
}
