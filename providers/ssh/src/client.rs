//! The raw transport: a pool of russh connections per host, host-key checking, one
//! exec round trip, and a lazily opened SFTP session per connection.
//!
//! Each host has a small pool of SSH connections; a connection carries up to
//! `channels_per_connection` session channels before another is opened, and the host as a
//! whole at most `max_sessions_per_host` (a semaphore). A closed connection is dropped from
//! the pool and a new one is made on the next call, with `backon` backoff on errors that
//! may pass (refused, reset); a connect timeout or a refused host key is not retried.
//!
//! Clocks: the connect phase (TCP + handshake + auth) has its own limit and reports
//! `CONNECT_TIMEOUT`; silence on a connection is bounded by russh's inactivity timeout
//! with keepalives every `keepalive_interval`, and a connection closed that way reports
//! `TRANSPORT_IDLE_TIMEOUT`; each request/response call is bounded by the call's deadline
//! and `request_timeout`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tether_provider::Clock;

use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use russh::ChannelMsg;
use russh::client::{self, Handle, Msg};
use russh::keys::{HashAlg, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use russh_sftp::client::RawSftpSession;
use tether_provider::clock::TimeoutReason;
use tether_provider::{CallCtx, ProviderError, Result};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::{AuthConfig, HostConfig, HostKeyPolicy, SshConfig};
use crate::error::{russh_error, transport_idle};

/// First delay of the reconnect backoff.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);
/// Largest delay of the reconnect backoff.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(2);
/// Reconnect attempts after the first within one call.
const RECONNECT_TIMES: usize = 3;
/// Window of a session channel (flow control), bytes.
const WINDOW_SIZE: u32 = 8 * 1024 * 1024;
/// Largest SSH packet we accept.
const MAX_PACKET: u32 = 64 * 1024;
/// The SFTP extension in which a server states its request limits.
const SFTP_LIMITS: &str = "limits@openssh.com";
/// Bytes per SFTP read or write request to a server that does not state its limits: what
/// every server takes.
const SFTP_DEFAULT_CHUNK: usize = 64 * 1024;
/// Largest SFTP read or write request: OpenSSH's (256 KiB messages, less room for headers).
const SFTP_MAX_CHUNK: usize = 255 * 1024;

/// An SFTP session and the request sizes its server takes.
#[derive(Clone)]
pub(crate) struct Sftp {
    pub session: Arc<RawSftpSession>,
    /// Bytes per read request.
    pub read_chunk: usize,
    /// Bytes per write request.
    pub write_chunk: usize,
}

/// Ciphers offered, best first: russh's own list with AES-GCM ahead of ChaCha20-Poly1305.
/// Both are AEADs of the same strength; on x86-64 and arm64 hosts (AES instructions) both
/// ends run AES-GCM several times faster, and file transfers are bound by the cipher.
const CIPHERS: &[russh::cipher::Name] = &[
    russh::cipher::AES_256_GCM,
    russh::cipher::AES_128_GCM,
    russh::cipher::CHACHA20_POLY1305,
    russh::cipher::AES_256_CTR,
    russh::cipher::AES_192_CTR,
    russh::cipher::AES_128_CTR,
];

/// Quote `s` for a POSIX shell.
pub fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A command line that runs `script` under bash with `args` as `$1...`.
pub fn bash_line(script: &str, args: &[&str]) -> String {
    let mut line = String::with_capacity(script.len() + 64);
    line.push_str("exec /bin/bash -c ");
    line.push_str(&sh_quote(script));
    line.push_str(" tether");
    for a in args {
        line.push(' ');
        line.push_str(&sh_quote(a));
    }
    line
}

/// The same command when the login shell is bash itself: the script runs in the login
/// shell with `args` as `$1...`, one bash start fewer per call.
pub fn bash_direct_line(script: &str, args: &[&str]) -> String {
    let mut line = String::with_capacity(script.len() + 64);
    line.push_str("set -- ");
    for a in args {
        line.push_str(&sh_quote(a));
        line.push(' ');
    }
    line.push('\n');
    line.push_str(script);
    line
}

/// Why a connection closed, recorded by the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseCause {
    /// No traffic for the transport-idle limit (or keepalives unanswered).
    Idle,
    /// Any other end (reset, EOF, protocol error, server disconnect).
    Lost,
}

/// The russh handler of one connection: host-key verdicts and why it closed.
#[derive(Debug)]
pub(crate) struct ClientHandler {
    address: String,
    port: u16,
    known_hosts: PathBuf,
    policy: HostKeyPolicy,
    rejected: Arc<OnceLock<ProviderError>>,
    cause: Arc<OnceLock<CloseCause>>,
    gone: CancellationToken,
}

impl client::Handler for ClientHandler {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &PublicKeyOrCertificate,
    ) -> std::result::Result<bool, Self::Error> {
        let host = format!("{}:{}", self.address, self.port);
        let PublicKeyOrCertificate::PublicKey { key, .. } = key else {
            let _ = self.rejected.set(ProviderError::HostKeyRejected {
                host,
                fingerprint: "certificate".into(),
                changed: false,
            });
            return Ok(false);
        };
        let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
        let checked = russh::keys::known_hosts::check_known_hosts_path(
            &self.address,
            self.port,
            key,
            &self.known_hosts,
        );
        match checked {
            Ok(true) => Ok(true),
            Ok(false) if self.policy == HostKeyPolicy::TrustOnFirstUse => {
                match russh::keys::known_hosts::learn_known_hosts_path(
                    &self.address,
                    self.port,
                    key,
                    &self.known_hosts,
                ) {
                    Ok(()) => {
                        tracing::info!(%host, %fingerprint, "Trusted a new host key on first use");
                        Ok(true)
                    }
                    Err(e) => {
                        tracing::warn!(%host, error = %e, "Could not record a host key");
                        let _ = self.rejected.set(ProviderError::HostKeyRejected {
                            host,
                            fingerprint,
                            changed: false,
                        });
                        Ok(false)
                    }
                }
            }
            Ok(false) => {
                let _ = self.rejected.set(ProviderError::HostKeyRejected {
                    host,
                    fingerprint,
                    changed: false,
                });
                Ok(false)
            }
            Err(e) => {
                let changed = matches!(e, russh::keys::Error::KeyChanged { .. });
                tracing::warn!(%host, %fingerprint, changed, error = %e, "Refused a host key");
                let _ = self.rejected.set(ProviderError::HostKeyRejected {
                    host,
                    fingerprint,
                    changed,
                });
                Ok(false)
            }
        }
    }

    async fn disconnected(
        &mut self,
        reason: client::DisconnectReason<Self::Error>,
    ) -> std::result::Result<(), Self::Error> {
        let cause = match &reason {
            client::DisconnectReason::Error(
                russh::Error::InactivityTimeout | russh::Error::KeepaliveTimeout,
            ) => CloseCause::Idle,
            _ => CloseCause::Lost,
        };
        let _ = self.cause.set(cause);
        self.gone.cancel();
        tracing::debug!(?reason, "SSH connection closed");
        Ok(())
    }
}

/// One SSH connection of a pool.
pub(crate) struct Conn {
    handle: Handle<ClientHandler>,
    cause: Arc<OnceLock<CloseCause>>,
    /// Cancelled when the connection closes: wakes a call whose channel would wait on
    /// it for ever (a channel write waiting for window space is not woken by the close).
    gone: CancellationToken,
    channels: AtomicUsize,
    sftp: tokio::sync::OnceCell<Sftp>,
    transport_idle: Duration,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("channels", &self.channels.load(Ordering::Relaxed))
            .field("closed", &self.handle.is_closed())
            .finish()
    }
}

impl Conn {
    /// Whether the connection has ended.
    pub(crate) fn closed_now(&self) -> bool {
        self.closed()
    }

    fn closed(&self) -> bool {
        self.handle.is_closed() || self.cause.get().is_some()
    }

    /// The error a call that lost this connection returns.
    pub(crate) fn lost(&self, what: &str) -> ProviderError {
        match self.cause.get() {
            Some(CloseCause::Idle) => transport_idle(self.transport_idle),
            _ => ProviderError::Unavailable {
                message: format!("the SSH connection was lost during {what}"),
                retry_after: None,
                source: None,
            },
        }
    }

    /// Whether the connection ended by the transport-idle clock.
    pub(crate) fn idle_closed(&self) -> bool {
        self.cause.get() == Some(&CloseCause::Idle)
    }
}

/// A session channel's hold on its connection and on the host's session budget.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) conn: Arc<Conn>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.conn.channels.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A forwarded channel's byte stream ([`HostPool::forward`]), holding its lease while it
/// lives.
pub(crate) struct Forwarded {
    stream: std::pin::Pin<Box<russh::ChannelStream<Msg>>>,
    _lease: Lease,
}

impl Forwarded {
    pub(crate) fn new(ch: russh::Channel<Msg>, lease: Lease) -> Self {
        Self {
            stream: Box::pin(ch.into_stream()),
            _lease: lease,
        }
    }
}

impl tokio::io::AsyncRead for Forwarded {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Forwarded {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.stream.as_mut().poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.stream.as_mut().poll_shutdown(cx)
    }
}

/// What one exec round trip produced.
#[derive(Debug, Default)]
pub(crate) struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub code: Option<u32>,
}

impl ExecOutput {
    pub(crate) fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub(crate) fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).trim().to_owned()
    }
}

/// The connections of one host.
pub(crate) struct HostPool {
    pub(crate) name: String,
    pub(crate) host: HostConfig,
    settings: Arc<SshConfig>,
    conns: Mutex<Vec<Arc<Conn>>>,
    sessions: Arc<Semaphore>,
    key: tokio::sync::OnceCell<Arc<russh::keys::PrivateKey>>,
    /// The user's login shell is bash (probed on the first connection).
    login_bash: OnceLock<bool>,
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool")
            .field("name", &self.name)
            .field("address", &self.host.address)
            .field("port", &self.host.port)
            .finish_non_exhaustive()
    }
}

impl HostPool {
    pub(crate) fn new(name: String, host: HostConfig, settings: Arc<SshConfig>) -> Self {
        Self {
            name,
            sessions: Arc::new(Semaphore::new(settings.max_sessions_per_host)),
            host,
            settings,
            conns: Mutex::new(Vec::new()),
            key: tokio::sync::OnceCell::new(),
            login_bash: OnceLock::new(),
        }
    }

    /// The command line that runs `script` with `args` on this host.
    pub(crate) fn line(&self, script: &str, args: &[&str]) -> String {
        if self.login_bash.get() == Some(&true) {
            bash_direct_line(script, args)
        } else {
            bash_line(script, args)
        }
    }

    /// Whether the login shell is bash (`$BASH_VERSION` set in the exec'd command).
    async fn probe_shell(handle: &Handle<ClientHandler>) -> bool {
        let Ok(mut ch) = handle.channel_open_session().await else {
            return false;
        };
        if ch
            .exec(true, &b"echo \"b${BASH_VERSION:+ash}\""[..])
            .await
            .is_err()
        {
            return false;
        }
        let mut out = Vec::new();
        while let Some(m) = ch.wait().await {
            match m {
                ChannelMsg::Data { data } => out.extend_from_slice(&data),
                ChannelMsg::Close => break,
                _ => {}
            }
        }
        out.starts_with(b"bash\n")
    }

    pub(crate) fn settings(&self) -> &SshConfig {
        &self.settings
    }

    fn known_hosts(&self) -> PathBuf {
        match &self.settings.known_hosts {
            Some(p) => p.clone(),
            None => std::env::home_dir()
                .unwrap_or_default()
                .join(".ssh")
                .join("known_hosts"),
        }
    }

    /// One connection attempt: TCP, handshake, host key, authentication.
    async fn connect_once(&self) -> Result<Conn> {
        let s = &self.settings;
        let config = Arc::new(client::Config {
            inactivity_timeout: Some(s.transport_idle()),
            keepalive_interval: s.keepalive(),
            keepalive_max: keepalive_max(s),
            window_size: WINDOW_SIZE,
            maximum_packet_size: MAX_PACKET,
            nodelay: true,
            preferred: russh::Preferred {
                cipher: std::borrow::Cow::Borrowed(CIPHERS),
                ..russh::Preferred::DEFAULT
            },
            ..Default::default()
        });
        let rejected = Arc::new(OnceLock::new());
        let cause = Arc::new(OnceLock::new());
        let gone = CancellationToken::new();
        let handler = ClientHandler {
            address: self.host.address.clone(),
            port: self.host.port,
            known_hosts: self.known_hosts(),
            policy: s.host_key_policy,
            rejected: rejected.clone(),
            cause: cause.clone(),
            gone: gone.clone(),
        };
        let addr = (self.host.address.as_str(), self.host.port);
        let mut handle = match client::connect(config, addr, handler).await {
            Ok(h) => h,
            Err(e) => {
                if let Some(r) = Arc::into_inner(rejected).and_then(OnceLock::into_inner) {
                    return Err(r);
                }
                return Err(russh_error(&format!("connect to {}", self.label()), e));
            }
        };
        self.authenticate(&mut handle).await?;
        if self.login_bash.get().is_none() {
            let bash = Self::probe_shell(&handle).await;
            let _ = self.login_bash.set(bash);
        }
        Ok(Conn {
            handle,
            cause,
            gone,
            channels: AtomicUsize::new(0),
            sftp: tokio::sync::OnceCell::new(),
            transport_idle: s.transport_idle(),
        })
    }

    fn label(&self) -> String {
        format!(
            "{}@{}:{}",
            self.host.user, self.host.address, self.host.port
        )
    }

    async fn authenticate(&self, handle: &mut Handle<ClientHandler>) -> Result<()> {
        let user = self.host.user.clone();
        let ok = match &self.host.auth {
            AuthConfig::KeyFile { path, passphrase } => {
                let key = self
                    .key
                    .get_or_try_init(|| async {
                        russh::keys::load_secret_key(path, passphrase.as_deref())
                            .map(Arc::new)
                            .map_err(|e| ProviderError::InvalidRequest {
                                message: format!("ssh: cannot load key {}: {e}", path.display()),
                            })
                    })
                    .await?
                    .clone();
                let hash = handle
                    .best_supported_rsa_hash()
                    .await
                    .map_err(|e| russh_error("authentication", e))?
                    .flatten();
                handle
                    .authenticate_publickey(user, PrivateKeyWithHashAlg::new(key, hash))
                    .await
                    .map_err(|e| russh_error("authentication", e))?
                    .success()
            }
            AuthConfig::Agent => {
                let mut agent = russh::keys::agent::client::AgentClient::connect_env()
                    .await
                    .map_err(|e| ProviderError::Unavailable {
                        message: format!("ssh: no SSH agent: {e}"),
                        retry_after: None,
                        source: None,
                    })?;
                let ids =
                    agent
                        .request_identities()
                        .await
                        .map_err(|e| ProviderError::Unavailable {
                            message: format!("ssh: the SSH agent did not list keys: {e}"),
                            retry_after: None,
                            source: None,
                        })?;
                let mut ok = false;
                for id in ids {
                    let key = id.public_key().into_owned();
                    let r = handle
                        .authenticate_publickey_with(user.clone(), key, None, &mut agent)
                        .await;
                    if r.is_ok_and(|r| r.success()) {
                        ok = true;
                        break;
                    }
                }
                ok
            }
        };
        if ok {
            Ok(())
        } else {
            Err(ProviderError::Backend {
                message: format!("ssh: {} refused our key", self.label()),
                source: None,
            })
        }
    }

    /// Connect within the connect limit, retrying passing errors with backoff.
    async fn connect(&self, ctx: &CallCtx) -> Result<Conn> {
        let limit = self.settings.connect_timeout();
        let attempt = || async {
            let cctx = ctx.with_timeout(limit, Clock::Connect);
            cctx.run(self.connect_once()).await
        };
        let backoff = ExponentialBuilder::default()
            .with_min_delay(RECONNECT_MIN_DELAY)
            .with_max_delay(RECONNECT_MAX_DELAY)
            .with_max_times(RECONNECT_TIMES)
            .with_jitter();
        attempt
            .retry(backoff)
            .sleep(tokio::time::sleep)
            .when(|e: &ProviderError| {
                matches!(e, ProviderError::Unavailable { .. }) && ctx.check().is_ok()
            })
            .notify(|e, dur| {
                tracing::warn!(host = %self.name, error = %e, ?dur, "Reconnecting to the SSH host");
            })
            .await
    }

    /// A connection with room for one more channel, and a lease on it.
    pub(crate) async fn lease(&self, ctx: &CallCtx) -> Result<Lease> {
        let permit = ctx
            .run(async {
                self.sessions
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| ProviderError::Internal {
                        message: "ssh: the session semaphore is closed".into(),
                        source: None,
                    })
            })
            .await?;
        let per_conn = self.settings.channels_per_connection;
        let mut conns = ctx.run(async { Ok(self.conns.lock().await) }).await?;
        conns.retain(|c| !c.closed());
        let found = conns
            .iter()
            .find(|c| c.channels.load(Ordering::Acquire) < per_conn)
            .cloned();
        let conn = match found {
            Some(c) => c,
            None => {
                let c = Arc::new(self.connect(ctx).await?);
                conns.push(c.clone());
                c
            }
        };
        conn.channels.fetch_add(1, Ordering::AcqRel);
        drop(conns);
        Ok(Lease {
            conn,
            _permit: permit,
        })
    }

    /// A new session channel and its lease.
    pub(crate) async fn channel(&self, ctx: &CallCtx) -> Result<(russh::Channel<Msg>, Lease)> {
        self.open_channel(ctx, "opening a channel", |conn| async move {
            conn.handle
                .channel_open_session()
                .await
                .map_err(|e| russh_error("opening a channel", e))
        })
        .await
    }

    /// A `direct-tcpip` channel (what `ssh -L` opens) to `port` on the host's loopback, and
    /// its lease: the channel counts against the connection's and the host's limits like
    /// a command's, until the stream is dropped. A port nothing listens on is refused by
    /// the server at once.
    pub(crate) async fn forward(
        &self,
        ctx: &CallCtx,
        port: u16,
    ) -> Result<(russh::Channel<Msg>, Lease)> {
        let what = "opening a forwarded channel";
        self.open_channel(ctx, what, |conn| async move {
            conn.handle
                .channel_open_direct_tcpip("127.0.0.1", u32::from(port), "127.0.0.1", 0)
                .await
                .map_err(|e| match e {
                    russh::Error::ChannelOpenFailure(why) => ProviderError::Unavailable {
                        message: format!(
                            "ssh: nothing answers on port {port} of host {} ({why:?})",
                            self.name
                        ),
                        retry_after: None,
                        source: None,
                    },
                    e => russh_error(what, e),
                })
        })
        .await
    }

    /// A channel `open` asks of a leased connection, within the call, and its lease; a
    /// failure because the connection went is that connection's loss (`what` it was doing).
    async fn open_channel<F, Fut>(
        &self,
        ctx: &CallCtx,
        what: &str,
        open: F,
    ) -> Result<(russh::Channel<Msg>, Lease)>
    where
        F: FnOnce(Arc<Conn>) -> Fut,
        Fut: std::future::Future<Output = Result<russh::Channel<Msg>>>,
    {
        let lease = self.lease(ctx).await?;
        let ch = ctx.run(open(lease.conn.clone())).await;
        match ch {
            Ok(ch) => Ok((ch, lease)),
            Err(_) if lease.conn.closed() => Err(lease.conn.lost(what)),
            Err(e) => Err(e),
        }
    }

    /// Run `line` and collect its output, within the call's deadline and the request limit.
    pub(crate) async fn exec(
        &self,
        ctx: &CallCtx,
        line: &str,
        stdin: Option<Bytes>,
    ) -> Result<ExecOutput> {
        let rctx = ctx.with_timeout(self.settings.request_timeout(), Clock::Total);
        let (mut ch, lease) = self.channel(&rctx).await?;
        let gone = lease.conn.gone.clone();
        let conn = lease.conn.clone();
        let body = async move {
            ch.exec(true, line.as_bytes())
                .await
                .map_err(|e| russh_error("exec", e))?;
            if let Some(data) = stdin {
                ch.data_bytes(data)
                    .await
                    .map_err(|e| russh_error("stdin", e))?;
                ch.eof().await.map_err(|e| russh_error("stdin", e))?;
            }
            let mut out = ExecOutput::default();
            let mut closed = false;
            while let Some(msg) = ch.wait().await {
                match msg {
                    ChannelMsg::Data { data } => out.stdout.extend_from_slice(&data),
                    ChannelMsg::ExtendedData { data, .. } => out.stderr.extend_from_slice(&data),
                    ChannelMsg::ExitStatus { exit_status } => out.code = Some(exit_status),
                    ChannelMsg::ExitSignal { .. } => out.code = Some(255),
                    ChannelMsg::Close => {
                        closed = true;
                        break;
                    }
                    _ => {}
                }
            }
            if out.code.is_none() && (!closed || lease.conn.closed()) {
                return Err(lease.conn.lost("a remote command"));
            }
            drop(lease);
            Ok(out)
        };
        rctx.run(async move {
            tokio::select! {
                biased;
                r = body => r,
                () = gone.cancelled() => Err(conn.lost("a remote command")),
            }
        })
        .await
    }

    /// [`Self::exec`] of a step that may be run again whole (its script makes a repeat
    /// harmless): on a retryable error (a lost or stalled connection, whose connection
    /// leaves the pool) it is sent again on a fresh one with backoff, within the call.
    pub(crate) async fn exec_repeatable(
        &self,
        ctx: &CallCtx,
        line: &str,
        stdin: Option<Bytes>,
    ) -> Result<ExecOutput> {
        let backoff = ExponentialBuilder::default()
            .with_min_delay(RECONNECT_MIN_DELAY)
            .with_max_delay(RECONNECT_MAX_DELAY)
            .with_max_times(RECONNECT_TIMES)
            .with_jitter();
        (|| self.exec(ctx, line, stdin.clone()))
            .retry(backoff)
            .sleep(tokio::time::sleep)
            .when(|e: &ProviderError| e.retryable() && ctx.check().is_ok())
            .notify(|e, dur| {
                tracing::debug!(host = %self.name, error = %e, ?dur, "Repeating a remote step");
            })
            .await
    }

    /// [`Self::exec`] of an idempotent step: once more on a fresh connection when the
    /// connection was lost under it (a connection that died unnoticed in the pool).
    pub(crate) async fn exec_idempotent(&self, ctx: &CallCtx, line: &str) -> Result<ExecOutput> {
        match self.exec(ctx, line, None).await {
            Err(ProviderError::Unavailable { message, .. }) if ctx.check().is_ok() => {
                tracing::debug!(host = %self.name, %message, "Retrying an idempotent step");
                self.exec(ctx, line, None).await
            }
            r => r,
        }
    }

    /// Exec an idempotent `line` and require exit status 0; other statuses become
    /// `Backend` errors.
    pub(crate) async fn exec_ok(&self, ctx: &CallCtx, line: &str) -> Result<ExecOutput> {
        let out = self.exec_idempotent(ctx, line).await?;
        if out.code == Some(0) {
            Ok(out)
        } else {
            Err(ProviderError::Backend {
                message: format!(
                    "ssh: a remote step failed on {} (status {:?}): {}",
                    self.name,
                    out.code,
                    out.err()
                ),
                source: None,
            })
        }
    }

    /// The SFTP session of some live connection (opened on first use).
    pub(crate) async fn sftp(&self, ctx: &CallCtx) -> Result<(Sftp, Lease)> {
        let lease = self.lease(ctx).await?;
        let conn = lease.conn.clone();
        let timeout_s = self.settings.request_timeout().as_secs().max(1);
        let sftp = ctx
            .run(conn.sftp.get_or_try_init(|| async {
                let ch = conn
                    .handle
                    .channel_open_session()
                    .await
                    .map_err(|e| russh_error("opening the SFTP channel", e))?;
                // The SFTP channel holds a slot of its connection for as long as it lives.
                conn.channels.fetch_add(1, Ordering::AcqRel);
                ch.request_subsystem(true, "sftp")
                    .await
                    .map_err(|e| russh_error("starting SFTP", e))?;
                let raw = RawSftpSession::new(ch.into_stream());
                raw.set_timeout(timeout_s);
                let version = raw.init().await.map_err(|e| ProviderError::Backend {
                    message: format!("ssh: SFTP init failed: {e}"),
                    source: Some(Box::new(e)),
                })?;
                // Servers that state their limits (OpenSSH's `limits@openssh.com`) get
                // requests as large as they take, up to `SFTP_MAX_CHUNK`; the others get
                // the size every server takes.
                let limits = if version
                    .extensions
                    .get(SFTP_LIMITS)
                    .is_some_and(|v| v == "1")
                {
                    raw.limits().await.ok()
                } else {
                    None
                };
                let chunk = |limit: Option<u64>| match limit.filter(|l| *l > 0) {
                    Some(l) => usize::try_from(l)
                        .unwrap_or(SFTP_MAX_CHUNK)
                        .min(SFTP_MAX_CHUNK),
                    None => SFTP_DEFAULT_CHUNK,
                };
                Ok::<_, ProviderError>(Sftp {
                    session: Arc::new(raw),
                    read_chunk: chunk(limits.as_ref().map(|l| l.max_read_len)),
                    write_chunk: chunk(limits.as_ref().map(|l| l.max_write_len)),
                })
            }))
            .await?
            .clone();
        Ok((sftp, lease))
    }

    /// Close every connection (shutdown).
    pub(crate) async fn close(&self) {
        let conns = std::mem::take(&mut *self.conns.lock().await);
        for c in conns {
            let _ = c
                .handle
                .disconnect(russh::Disconnect::ByApplication, "", "en")
                .await;
        }
    }
}

/// Unanswered keepalives before the connection counts as dead: as many as fit in the
/// transport-idle limit.
fn keepalive_max(s: &SshConfig) -> usize {
    match s.keepalive() {
        Some(k) if !k.is_zero() => {
            ((s.transport_idle().as_millis() / k.as_millis()).max(1)) as usize
        }
        _ => 3,
    }
}

/// A timeout error of `clock` with the limit `limit`.
pub(crate) fn timeout_error(clock: Clock, limit: Duration) -> ProviderError {
    ProviderError::Timeout {
        reason: TimeoutReason {
            clock,
            timeout_ms: limit.as_millis() as u64,
        },
    }
}
