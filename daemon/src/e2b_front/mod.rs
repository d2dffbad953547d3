//! The E2B front: tetherd serves the E2B control-plane API and the in-sandbox `envd`
//! protocol, so programs written against the official E2B SDKs run unchanged on any
//! tether provider.
//!
//! Each E2B sandbox is a tether session (owned by the API key's tenant), so everything an
//! SDK does is logged in the session log, bounded by tether's clocks and traced. The
//! control plane ([`control`]) maps sandbox create / list / get / kill / timeout /
//! connect onto the [`SessionManager`](crate::session_manager::SessionManager). envd is
//! served by `tether_envd_server` with tetherd as its host ([`host`]): a request finds
//! its session by the `E2b-Sandbox-Id` header (the `E2B_SANDBOX_URL` recipe) or the
//! `49983-<id>.<domain>` host, is authenticated by the access token issued at create
//! ([`auth`]), and reaches the session's sandbox through the operation layer and `exec`.
//!
//! What the front keeps itself ([`FrontState`]) is small and disposable: the secret the
//! access tokens derive from, per-sandbox extras (the template, the metrics sample, and
//! envd's own state: `/init` defaults, command tags, file metadata, watchers) and create
//! idempotency keys. Sessions, commands and files are the daemon's.

mod auth;
mod control;
mod host;
pub(crate) mod ports;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::Router;
use http::StatusCode;
use tether_envd_server::util::{form_pairs, now_ms, parse_rfc3339, percent_decode, rfc3339};
use tether_envd_server::{EnvdState, RestError};
use tether_protocol::ErrorCode;
use tokio::sync::watch;

use crate::config::E2bFrontConfig;
use crate::error::DaemonError;
use crate::state::AppState;

pub use auth::Tenant;

/// The `clientID` the SDKs require in every sandbox (deprecated upstream, a constant).
const CLIENT_ID: &str = "tether";

/// The per-front state, in [`AppState::e2b`].
pub struct FrontState {
    cfg: E2bFrontConfig,
    keys: auth::KeyRing,
    /// The secret envd access tokens are derived from (per daemon run: after a restart,
    /// `Sandbox.connect` hands out a fresh token).
    token_secret: [u8; 32],
    sandboxes: RwLock<HashMap<String, Arc<SandboxExtra>>>,
    /// Creates by (tenant, idempotency key): a retry of a create still in flight waits
    /// for it instead of making a second sandbox.
    idempotency: RwLock<HashMap<(String, String), watch::Receiver<Keyed>>>,
    /// Deadline of the front's own file operations (stat of a cwd, entries of events).
    fs_op: std::time::Duration,
    /// The one sandbox of a guest agent (`[e2b_front.guest]`).
    guest: Option<GuestSlot>,
}

/// A guest agent's sandbox: the machine itself.
#[derive(Debug)]
struct GuestSlot {
    cfg: crate::config::GuestConfig,
    /// Its session, set once at start-up.
    id: std::sync::OnceLock<String>,
    /// The access token the first `/init` set; until then envd requires none (as envd).
    token: RwLock<Option<String>>,
}

/// The tenant that owns a guest agent's sandbox.
const GUEST_TENANT: &str = "guest";

impl std::fmt::Debug for FrontState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys and the token secret stay out of logs.
        f.debug_struct("FrontState")
            .field("domain", &self.cfg.domain)
            .field("api_keys", &self.keys.len())
            .field("development_mode", &self.keys.is_dev())
            .field(
                "sandboxes",
                &self.sandboxes.read().map(|m| m.len()).unwrap_or(0),
            )
            .finish_non_exhaustive()
    }
}

/// The file of the state dir that keeps [`token_secret`].
pub const TOKEN_SECRET_FILE: &str = "e2b-token-secret";

/// The secret the sandboxes' access tokens derive from: made once per state dir and kept
/// there (mode 0600), so that a token handed out before a restart still admits after it.
/// A file that is not a secret stops the start (a new one would lock every client out
/// of the sandboxes it holds, silently).
pub fn token_secret(state_dir: &std::path::Path) -> std::io::Result<[u8; 32]> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = state_dir.join(TOKEN_SECRET_FILE);
    match std::fs::read(&path) {
        Ok(b) => {
            return <[u8; 32]>::try_from(b.as_slice()).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not a 32-byte secret", path.display()),
                )
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut secret = [0u8; 32];
    secret[..16].copy_from_slice(&uuid::Uuid::new_v4().into_bytes());
    secret[16..].copy_from_slice(&uuid::Uuid::new_v4().into_bytes());
    // Whole or absent: written aside, synced, renamed into place, the directory synced.
    let tmp = state_dir.join(format!("{TOKEN_SECRET_FILE}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&secret)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(state_dir)?.sync_all()?;
    Ok(secret)
}

impl FrontState {
    /// The front's state for `cfg`; its own file operations are bounded by `fs_op`; its
    /// access tokens derive from `token_secret` ([`token_secret`]).
    pub fn new(cfg: &E2bFrontConfig, fs_op: std::time::Duration, token_secret: [u8; 32]) -> Self {
        Self {
            cfg: cfg.clone(),
            keys: auth::KeyRing::new(&cfg.api_keys),
            token_secret,
            sandboxes: RwLock::new(HashMap::new()),
            idempotency: RwLock::new(HashMap::new()),
            fs_op,
            guest: cfg.guest.clone().map(|cfg| GuestSlot {
                cfg,
                id: std::sync::OnceLock::new(),
                token: RwLock::new(None),
            }),
        }
    }

    /// The token envd requests for `sandbox_id` must carry; `None`: none is (a guest
    /// agent before its first `/init`, as envd).
    fn expected_token(&self, sandbox_id: &str) -> Option<String> {
        match &self.guest {
            Some(g) => g.token.read().ok().and_then(|t| t.clone()),
            None => Some(self.access_token(sandbox_id)),
        }
    }

    /// A guest agent's sandbox id (every envd request is for it).
    fn guest_id(&self) -> Option<&str> {
        self.guest
            .as_ref()
            .and_then(|g| g.id.get())
            .map(String::as_str)
    }

    /// The envd access token of a sandbox.
    pub fn access_token(&self, sandbox_id: &str) -> String {
        auth::derive_token(&self.token_secret, sandbox_id)
    }

    /// The traffic access token of a sandbox whose ports are not public (derived like
    /// the envd token, under another label: it survives a restart with nothing stored).
    pub fn traffic_token(&self, sandbox_id: &str) -> String {
        auth::derive_traffic_token(&self.token_secret, sandbox_id)
    }

    /// The front's extras of a sandbox, created on first use (also after a restart).
    fn extra(&self, id: &str, template: Option<&str>) -> Arc<SandboxExtra> {
        if let Some(e) = self.sandboxes.read().ok().and_then(|m| m.get(id).cloned()) {
            return e;
        }
        let mut m = match self.sandboxes.write() {
            Ok(m) => m,
            Err(_) => {
                return Arc::new(SandboxExtra::new(template.unwrap_or("base"), self.fs_op));
            }
        };
        Arc::clone(
            m.entry(id.to_owned()).or_insert_with(|| {
                Arc::new(SandboxExtra::new(template.unwrap_or("base"), self.fs_op))
            }),
        )
    }

    fn insert_extra(&self, id: &str, extra: SandboxExtra) -> Arc<SandboxExtra> {
        let extra = Arc::new(extra);
        if let Ok(mut m) = self.sandboxes.write() {
            m.insert(id.to_owned(), Arc::clone(&extra));
        }
        extra
    }

    /// Forget a sandbox (killed or expired): stops its watchers.
    fn forget(&self, id: &str) {
        let gone = self.sandboxes.write().ok().and_then(|mut m| m.remove(id));
        if let Some(extra) = gone {
            extra.envd.stop_watchers();
        }
        if let Ok(mut m) = self.idempotency.write() {
            m.retain(|_, v| !matches!(&*v.borrow(), Keyed::Made(made) if made == id));
        }
    }

    /// The create under `key`: one already made or in flight to join, or (none, or the
    /// last one failed) this caller's to make, announced through the sender.
    fn claim(&self, key: &(String, String)) -> Claim {
        let Ok(mut m) = self.idempotency.write() else {
            return Claim::Unkeyed;
        };
        // Failed entries, and those whose maker is gone without a word, are dropped as
        // they are met, so the map holds only keys of creates in flight or of sandboxes
        // that live (`forget` drops those).
        m.retain(|_, v| {
            let made = matches!(&*v.borrow(), Keyed::Made(_));
            let in_flight = *v.borrow() == Keyed::InFlight && v.has_changed().is_ok();
            made || in_flight
        });
        if let Some(rx) = m.get(key) {
            return Claim::Join(rx.clone());
        }
        let (tx, rx) = watch::channel(Keyed::InFlight);
        m.insert(key.clone(), rx);
        Claim::Make(tx)
    }

    /// Drop `key`'s entry if it still names `id` (a sandbox made under it that is gone).
    fn unclaim(&self, key: &(String, String), id: &str) {
        if let Ok(mut m) = self.idempotency.write()
            && m.get(key)
                .is_some_and(|v| matches!(&*v.borrow(), Keyed::Made(made) if made == id))
        {
            m.remove(key);
        }
    }
}

/// Where a create under an idempotency key is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Keyed {
    /// Being made.
    InFlight,
    /// Made: the sandbox's id.
    Made(String),
    /// It failed: the next request under the key makes its own.
    Failed,
}

/// What [`FrontState::claim`] hands a create.
enum Claim {
    /// Another request's create: wait for it.
    Join(watch::Receiver<Keyed>),
    /// This request makes the sandbox and sends its outcome.
    Make(watch::Sender<Keyed>),
    /// The table is unusable (a panic poisoned it): create without the key.
    Unkeyed,
}

/// What the front knows about a sandbox beyond its session: its control-plane facts, and
/// envd's state of it.
#[derive(Debug)]
struct SandboxExtra {
    /// Template id as the SDK gave it.
    template: String,
    /// The last metrics sample: its time (ms) and the CPU time used by then (µs), so the
    /// next one reports the CPU share in between.
    cpu_sample: RwLock<Option<(i64, u64)>>,
    envd: Arc<EnvdState>,
}

impl SandboxExtra {
    fn new(template: &str, fs_op: std::time::Duration) -> Self {
        Self {
            template: template.to_owned(),
            cpu_sample: RwLock::new(None),
            envd: Arc::new(EnvdState::new(fs_op)),
        }
    }
}

/// All E2B routes (control plane + envd), merged into the main router.
pub fn router() -> Router<Arc<AppState>> {
    control::routes().merge(envd_router())
}

/// envd's routes alone (what a guest agent serves), with tetherd as their host.
pub fn envd_router() -> Router<Arc<AppState>> {
    tether_envd_server::router::<AppState>()
}

/// A guest agent's start: its one sandbox, the machine, as an E2B sandbox session. A
/// restarted agent takes the session it recovered from its log; a new one creates it.
pub async fn adopt_guest_sandbox(state: &Arc<AppState>) -> crate::error::Result<String> {
    use crate::session_manager::{NewSession, Scope, SessionState};
    let Some(slot) = &state.e2b.guest else {
        return Err(DaemonError::invalid("not a guest agent"));
    };
    let existing = state
        .sessions
        .list(Scope::Owner(Some(GUEST_TENANT)))
        .into_iter()
        .find(|s| s.state() == SessionState::Active);
    let session = match existing {
        Some(s) => s,
        None => {
            let ctx = tether_provider::CallCtx::new("guest").with_timeout(
                state.config.limits.deadlines().sandbox_op,
                tether_provider::Clock::Total,
            );
            let new = NewSession {
                provider: state.e2b.cfg.provider.clone(),
                template: Some("base".to_owned()),
                env: BTreeMap::new(),
                metadata: BTreeMap::new(),
                network: true,
                owner: Some(GUEST_TENANT.to_owned()),
                expiry: tether_protocol::events::Expiry::Never,
                limits: Default::default(),
                ports: Default::default(),
                snapshot: None,
                lifecycle: Default::default(),
                egress: Default::default(),
            };
            state.sessions.create_owned(&ctx, new).await?
        }
    };
    state
        .e2b
        .insert_extra(&session.id, SandboxExtra::new("base", state.e2b.fs_op));
    let _ = slot.id.set(session.id.clone());
    tracing::info!(session.id = %session.id, "Guest agent: serving envd for this machine");
    Ok(session.id.clone())
}

/// The lines `tetherd serve` prints at start-up: the environment that points the official
/// E2B SDKs at this daemon.
pub fn recipe(listen: SocketAddr, cfg: &E2bFrontConfig, tokens_configured: bool) -> String {
    let host = match listen.ip() {
        ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        std::net::IpAddr::V4(v4) => v4.to_string(),
    };
    let url = format!("http://{host}:{}", listen.port());
    let mut out = String::from("E2B SDKs (E2B front):\n");
    if cfg.api_keys.is_empty() && tokens_configured {
        out.push_str(
            "  no API key is accepted: bearer tokens are configured and [e2b_front] api_keys is empty\n",
        );
    } else if cfg.api_keys.is_empty() {
        out.push_str("  development mode: any API key is accepted, each key is its own tenant\n");
    }
    out.push_str(&format!("  export E2B_API_URL={url}\n"));
    out.push_str(&format!("  export E2B_SANDBOX_URL={url}\n"));
    let key = if cfg.api_keys.is_empty() {
        "e2b_dev"
    } else {
        "<one of e2b_front.api_keys>"
    };
    out.push_str(&format!("  export E2B_API_KEY={key}\n"));
    // The SDKs must not take their debug shortcut (no control plane, envd on :49983).
    // Unset rather than `false`: E2B's own test suites take their debug branches when the
    // variable is set at all.
    out.push_str("  unset E2B_DEBUG");
    out
}

// === errors ===

/// The control plane's answer for a sandbox that is not the caller's to see.
fn sandbox_not_found(id: &str) -> RestError {
    RestError::new(
        StatusCode::NOT_FOUND,
        format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
    )
}

/// A control-plane error from a daemon error (the daemon's one status mapping).
fn rest_error(e: &DaemonError) -> RestError {
    let code = e.code();
    if crate::error::status_of(code).is_server_error() {
        tracing::warn!(code = %code, error = %e, "E2B request failed");
    } else {
        tracing::debug!(code = %code, error = %e, "E2B request refused");
    }
    let status = match code {
        ErrorCode::SessionNotFound | ErrorCode::SandboxNotFound => StatusCode::NOT_FOUND,
        c => crate::error::status_of(c),
    };
    let r = RestError::new(status, e.public_message());
    if matches!(
        code,
        ErrorCode::Internal | ErrorCode::ProviderError | ErrorCode::SpawnFailed
    ) {
        r.with_error_code("sandbox_create_failed")
    } else {
        r
    }
}

impl From<DaemonError> for RestError {
    fn from(e: DaemonError) -> Self {
        rest_error(&e)
    }
}
