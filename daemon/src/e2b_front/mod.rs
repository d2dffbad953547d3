//! The E2B front: tetherd serves the E2B control-plane API and the in-sandbox `envd`
//! protocol, so programs written against the official E2B SDKs run unchanged on any
//! tether provider.
//!
//! Each E2B sandbox is a tether session (owned by the API key's tenant), so everything an
//! SDK does is logged in the session log, bounded by tether's clocks and traced. The
//! control plane ([`control`]) maps sandbox create / list / get / kill / timeout /
//! connect onto the [`SessionManager`](crate::session_manager::SessionManager); envd's REST
//! endpoints ([`envd`]) and its Connect services ([`process`], [`filesystem`], over the
//! codec in [`connect`]) map onto the session's sandbox through the provider seam. envd
//! requests are routed by the `E2b-Sandbox-Id` header (the `E2B_SANDBOX_URL` recipe) or
//! the `49983-<id>.<domain>` host, and authenticated by the access token issued at create
//! ([`auth`]).
//!
//! What the front keeps itself ([`FrontState`]) is small and disposable: the secret the
//! access tokens derive from, per-sandbox extras (the `/init` defaults, command tags, file
//! metadata, watchers) and create idempotency keys. Sessions, commands and files are the
//! daemon's.

mod auth;
mod connect;
mod control;
mod envd;
mod filesystem;
mod multipart;
pub(crate) mod ports;
mod process;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{ApiError, ConnectCode};
use tokio::sync::watch;

use crate::config::E2bFrontConfig;
use crate::error::DaemonError;
use crate::state::AppState;

pub use auth::Tenant;

/// The `clientID` the SDKs require in every sandbox (deprecated upstream, a constant).
const CLIENT_ID: &str = "tether";

/// The sandbox user's home, the workspace: where `user`'s relative paths and `~` point.
const HOME: &str = "/home/user";

/// `root`'s home.
const ROOT_HOME: &str = "/root";

/// The home of an envd user (`user` or `root`, the users [`auth::check_user`] admits).
fn home_of(user: &str) -> &'static str {
    if user == "root" { ROOT_HOME } else { HOME }
}

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
                return Arc::new(SandboxExtra::new(
                    template.unwrap_or("base"),
                    true,
                    self.fs_op,
                ));
            }
        };
        Arc::clone(m.entry(id.to_owned()).or_insert_with(|| {
            Arc::new(SandboxExtra::new(
                template.unwrap_or("base"),
                true,
                self.fs_op,
            ))
        }))
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
            extra.stop_watchers();
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

/// What the front knows about a sandbox beyond its session.
#[derive(Debug)]
struct SandboxExtra {
    /// Template id as the SDK gave it.
    template: String,
    allow_internet: bool,
    init: RwLock<InitState>,
    /// Command ids that the client chose (E2B tags), as opposed to generated ones.
    tags: RwLock<HashSet<String>>,
    /// User metadata of files written through `/files` (`X-Metadata-*`), by path.
    file_meta: RwLock<HashMap<String, BTreeMap<String, String>>>,
    watchers: RwLock<HashMap<String, Arc<filesystem::Watcher>>>,
    /// Uploads in flight (`None`) or just answered (until when), by path: the watches
    /// drop the provider's own events of these paths and report envd's instead.
    uploads: RwLock<HashMap<String, Option<tokio::time::Instant>>>,
    /// envd's events of answered uploads, for the `WatchDir` streams.
    announced: tokio::sync::broadcast::Sender<filesystem::Announced>,
    /// Deadline of the front's own file operations on this sandbox (from config).
    fs_op: std::time::Duration,
    /// The last metrics sample: its time (ms) and the CPU time used by then (µs), so the
    /// next one reports the CPU share in between.
    cpu_sample: RwLock<Option<(i64, u64)>>,
}

/// How long after an upload was answered the provider's events of its path are dropped.
const UPLOAD_QUIET: std::time::Duration = std::time::Duration::from_secs(2);

/// Announcements a slow `WatchDir` stream may lag behind before it loses some.
const ANNOUNCE_BUFFER: usize = 256;

/// Defaults set by envd's `POST /init`.
#[derive(Debug, Clone, Default)]
struct InitState {
    env: BTreeMap<String, String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
}

impl SandboxExtra {
    fn new(template: &str, allow_internet: bool, fs_op: std::time::Duration) -> Self {
        Self {
            fs_op,
            template: template.to_owned(),
            allow_internet,
            init: RwLock::new(InitState::default()),
            tags: RwLock::new(HashSet::new()),
            file_meta: RwLock::new(HashMap::new()),
            watchers: RwLock::new(HashMap::new()),
            uploads: RwLock::new(HashMap::new()),
            announced: tokio::sync::broadcast::channel(ANNOUNCE_BUFFER).0,
            cpu_sample: RwLock::new(None),
        }
    }

    /// An upload of `path` starts: the watches stop reporting the provider's events of it.
    fn upload_started(&self, path: &str) {
        if let Ok(mut u) = self.uploads.write() {
            let now = tokio::time::Instant::now();
            u.retain(|_, until| until.is_none_or(|t| t > now));
            u.insert(path.to_owned(), None);
        }
    }

    /// An upload of `path` was answered: the provider's late events of it stay dropped for
    /// a moment.
    fn upload_ended(&self, path: &str) {
        if let Ok(mut u) = self.uploads.write() {
            u.insert(
                path.to_owned(),
                Some(tokio::time::Instant::now() + UPLOAD_QUIET),
            );
        }
    }

    /// Whether the provider's events of `path` are dropped now.
    fn upload_quiet(&self, path: &str) -> bool {
        self.uploads
            .read()
            .ok()
            .and_then(|u| u.get(path).copied())
            .is_some_and(|until| until.is_none_or(|t| t > tokio::time::Instant::now()))
    }

    fn init(&self) -> InitState {
        self.init.read().map(|g| g.clone()).unwrap_or_default()
    }

    fn is_tag(&self, command_id: &str) -> bool {
        self.tags
            .read()
            .map(|t| t.contains(command_id))
            .unwrap_or(false)
    }

    fn meta_of(&self, path: &str) -> BTreeMap<String, String> {
        self.file_meta
            .read()
            .ok()
            .and_then(|m| m.get(path).cloned())
            .unwrap_or_default()
    }

    fn set_meta(&self, path: &str, meta: Option<BTreeMap<String, String>>) {
        if let Ok(mut m) = self.file_meta.write() {
            match meta {
                Some(meta) if !meta.is_empty() => {
                    m.insert(path.to_owned(), meta);
                }
                _ => {
                    m.remove(path);
                }
            }
        }
    }

    /// A path was removed or moved away: its metadata (and that of anything below it) goes
    /// with it, to `to` when it was moved.
    fn move_meta(&self, from: &str, to: Option<&str>) {
        if let Ok(mut m) = self.file_meta.write() {
            let prefix = format!("{}/", from.trim_end_matches('/'));
            let moved: Vec<String> = m
                .keys()
                .filter(|k| *k == from || k.starts_with(&prefix))
                .cloned()
                .collect();
            for k in moved {
                if let Some(v) = m.remove(&k)
                    && let Some(to) = to
                {
                    m.insert(format!("{to}{}", &k[from.len()..]), v);
                }
            }
        }
    }

    fn stop_watchers(&self) {
        let all: Vec<_> = self
            .watchers
            .write()
            .map(|mut w| w.drain().map(|(_, v)| v).collect())
            .unwrap_or_default();
        for w in all {
            w.stop();
        }
    }
}

/// All E2B routes (control plane + envd), merged into the main router.
pub fn router() -> Router<Arc<AppState>> {
    control::routes().merge(envd_router())
}

/// envd's routes alone (what a guest agent serves).
pub fn envd_router() -> Router<Arc<AppState>> {
    envd::routes()
        .merge(process::routes())
        .merge(filesystem::routes())
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
    state.e2b.insert_extra(
        &session.id,
        SandboxExtra::new("base", true, state.e2b.fs_op),
    );
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

/// An error of the control plane or of envd's REST endpoints: `{"code": status,
/// "message"}`, the body every SDK parser expects.
#[derive(Debug)]
pub(crate) struct RestError {
    status: StatusCode,
    message: String,
    error_code: Option<&'static str>,
}

impl RestError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            error_code: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    fn sandbox_not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
        )
    }

    /// A control-plane error from a daemon error (the daemon's one status mapping).
    fn from_daemon(e: &DaemonError) -> Self {
        log_error(e);
        let code = e.code();
        let status = match code {
            ErrorCode::SessionNotFound | ErrorCode::SandboxNotFound => StatusCode::NOT_FOUND,
            c => crate::error::status_of(c),
        };
        let error_code = matches!(
            code,
            ErrorCode::Internal | ErrorCode::ProviderError | ErrorCode::SpawnFailed
        )
        .then_some("sandbox_create_failed");
        Self {
            status,
            message: e.public_message(),
            error_code,
        }
    }

    /// An envd REST error: envd's statuses (400 for a bad path or a directory, 404, 401,
    /// 403, 507 when out of space).
    fn from_envd(e: &DaemonError) -> Self {
        log_error(e);
        Self::new(envd_status(e.code()), e.public_message())
    }

    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let body = ApiError {
            code: self.status.as_u16(),
            message: self.message,
            error_code: self.error_code.map(str::to_owned),
        };
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<DaemonError> for RestError {
    fn from(e: DaemonError) -> Self {
        Self::from_daemon(&e)
    }
}

fn log_error(e: &DaemonError) {
    if crate::error::status_of(e.code()).is_server_error() {
        tracing::warn!(code = %e.code(), error = %e, "E2B request failed");
    } else {
        tracing::debug!(code = %e.code(), error = %e, "E2B request refused");
    }
}

/// envd's REST status of a code.
fn envd_status(code: ErrorCode) -> StatusCode {
    use ErrorCode as C;
    match code {
        C::InvalidRequest
        | C::FsIsDirectory
        | C::FsNotDirectory
        | C::FsNotRegularFile
        | C::FsNotText => StatusCode::BAD_REQUEST,
        C::FsTooLarge | C::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        c => crate::error::status_of(c),
    }
}

/// The Connect code of a tether error code: the one mapping the envd services use.
/// Exhaustive, so a new code forces a decision.
pub(crate) fn connect_code(code: ErrorCode) -> ConnectCode {
    use ConnectCode as K;
    use ErrorCode as C;
    match code {
        C::InvalidRequest
        | C::UnknownTool
        | C::FsNotDirectory
        | C::FsIsDirectory
        | C::FsNotRegularFile
        | C::FsNotText
        | C::SpawnFailed => K::InvalidArgument,
        C::Unauthorized => K::Unauthenticated,
        C::Forbidden | C::FsPermissionDenied | C::ToolDenied => K::PermissionDenied,
        C::NotFound
        | C::SessionNotFound
        | C::SandboxNotFound
        | C::CommandNotFound
        | C::SnapshotNotFound
        | C::FsNotFound
        | C::FsEditNotFound => K::NotFound,
        C::MethodNotAllowed | C::Unsupported => K::Unimplemented,
        C::PayloadTooLarge
        | C::FsTooLarge
        | C::RateLimited
        | C::FsNoSpace
        | C::StorageFull
        | C::LimitExceeded => K::ResourceExhausted,
        C::Conflict | C::FsAlreadyExists => K::AlreadyExists,
        C::FsVersionMismatch | C::FsNotEmpty | C::FsAmbiguousEdit | C::IsolationUnavailable => {
            K::FailedPrecondition
        }
        C::FsAborted => K::Aborted,
        C::ToolTimeout
        | C::IdleTimeout
        | C::ConnectTimeout
        | C::TransportIdleTimeout
        | C::DeadlineExceeded => K::DeadlineExceeded,
        C::Cancelled => K::Canceled,
        C::ProviderUnavailable | C::ShuttingDown | C::Overloaded => K::Unavailable,
        C::ToolNotStarted | C::ToolOutcomeUnknown | C::OutcomeUnknown | C::ProviderError => {
            K::Unknown
        }
        C::FsIoError | C::Invariant | C::Internal => K::Internal,
    }
}

// === shared helpers ===

/// Milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    crate::leases::now_ms()
}

/// RFC 3339 (UTC, second precision with milliseconds) of ms since the epoch.
fn rfc3339(ms: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned())
}

/// Parse RFC 3339 into ms since the epoch.
fn parse_rfc3339(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// Resolve an envd path the way envd does (`ExpandAndResolve`): `~` is the home of the
/// user the operation runs as, and a relative path is relative to it (`root`'s is
/// `/root`). The provider's seam confines the result to the sandbox.
fn resolve_path(path: &str, user: &str) -> String {
    let home = home_of(user);
    let p = path.trim();
    if p == "~" {
        return home.to_owned();
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return format!("{home}/{rest}");
    }
    if p.starts_with('/') {
        p.to_owned()
    } else if p.is_empty() {
        home.to_owned()
    } else {
        format!("{home}/{p}")
    }
}

/// Percent-decode (`+` left alone).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex_val(b[i + 1]), hex_val(b[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// `application/x-www-form-urlencoded` pairs of a query string.
fn form_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

/// The value of a query parameter.
fn query_param(q: Option<&str>, name: &str) -> Option<String> {
    form_pairs(q.unwrap_or(""))
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}
