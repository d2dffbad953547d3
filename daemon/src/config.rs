//! The daemon's configuration: one typed tree, TOML on disk, validated at load.
//!
//! Every field has a documented default; unknown fields are refused. `tetherd
//! validate-config` loads and validates a file and exits 64 (`EX_USAGE`) when it is
//! invalid. Command-line flags (`--listen`, `--state-dir`) override the file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Default listen address of the native API and the E2B front.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7420";
/// Default state directory (session logs, lease ledger, local sandboxes).
pub const DEFAULT_STATE_DIR: &str = "/var/lib/tether";
/// Default limit of a JSON request body.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 8 * 1024 * 1024;
/// Default limit of an uploaded file.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 4 * 1024 * 1024 * 1024;
/// Default grace period of a graceful shutdown.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 10_000;
/// Default time a client has to send a request's headers, ms.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default time a connection with no request in flight stays open, ms.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 120_000;
/// Default cap on open connections (kept under the usual 1 024 descriptor limit).
pub const DEFAULT_MAX_CONNECTIONS: usize = 768;
/// Default cap on open connections from one client address.
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = 256;
/// Default cap on requests being handled at once.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 512;
/// Default limit of a request's headers, bytes (HTTP/1.1 read buffer, HTTP/2 header list).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// The smallest `max_header_bytes` accepted (hyper's smallest HTTP/1.1 read buffer).
pub const MIN_MAX_HEADER_BYTES: usize = 8 * 1024;
/// The smallest `session_log_memory_bytes` accepted.
pub const MIN_SESSION_LOG_MEMORY_BYTES: u64 = 4 * 1024;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listener, state and shutdown.
    #[serde(default)]
    pub server: ServerConfig,
    /// Limits of tool calls and commands.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// The provider sessions use when a request names none (default `local`).
    #[serde(default = "default_provider")]
    pub default_provider: String,
    /// Named providers. `local` exists even when not listed.
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Tool pipeline and guards.
    #[serde(default)]
    pub pipeline: crate::pipeline::PipelineConfig,
    /// Runtime invariants.
    #[serde(default)]
    pub invariants: crate::invariants::InvariantsConfig,
    /// Telemetry (traces, metrics, logs).
    #[serde(default)]
    pub telemetry: crate::telemetry::TelemetryConfig,
    /// The E2B-compatible API.
    #[serde(default)]
    pub e2b_front: E2bFrontConfig,
    /// Sandbox leases.
    #[serde(default)]
    pub leases: LeaseConfig,
}

fn default_provider() -> String {
    "local".to_owned()
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerConfig::default(),
            limits: LimitsConfig::default(),
            default_provider: default_provider(),
            providers: BTreeMap::new(),
            pipeline: Default::default(),
            invariants: Default::default(),
            telemetry: Default::default(),
            e2b_front: E2bFrontConfig::default(),
            leases: LeaseConfig::default(),
        }
    }
}

/// What to do with live sandboxes when the daemon shuts down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShutdownPolicy {
    /// Keep sandboxes (and their leases) so sessions resume after a restart.
    #[default]
    Keep,
    /// Destroy every sandbox.
    Release,
}

/// Listener, state and shutdown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Listen address (HTTP/1.1 and h2c). Default `127.0.0.1:7420`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// State directory. Default `/var/lib/tether`.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Admin bearer tokens of the native API (see `crate::auth`), at least 16 characters.
    /// Required when `listen` is not loopback.
    #[serde(default)]
    pub auth_tokens: Vec<String>,
    /// Largest JSON request body, bytes. Default 8 MiB.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: u64,
    /// Largest uploaded file, bytes. Default 4 GiB.
    #[serde(default = "default_max_file")]
    pub max_file_bytes: u64,
    /// Grace period to drain requests at shutdown, ms. Default 10 000.
    #[serde(default = "default_grace")]
    pub shutdown_grace_ms: u64,
    /// What happens to sandboxes at shutdown. Default `keep`.
    #[serde(default)]
    pub on_shutdown: ShutdownPolicy,
    /// Largest deadline a caller may set with the `Tether-Timeout-Ms` header, ms.
    /// Default 3 600 000.
    #[serde(default = "default_max_request_timeout")]
    pub max_request_timeout_ms: u64,
    /// How long a closed session's log is kept, seconds; older ones are removed at start
    /// and hourly. 0 keeps them forever. Default 0.
    #[serde(default)]
    pub closed_retention_s: u64,
    /// The most bytes of a live session's newest events kept in memory; older events are
    /// read back from its log file when asked for (event replays, history, fork). At
    /// least 4 096. Default 1 048 576.
    #[serde(default = "default_session_log_memory_bytes")]
    pub session_log_memory_bytes: u64,
    /// Time a client has to send a request's complete headers, ms; a slower one is
    /// disconnected. An HTTP/1.1 connection waiting for its next request is bound by it
    /// too. Default 10 000.
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout_ms: u64,
    /// Time a connection with no request in flight stays open, ms. Default 120 000.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_ms: u64,
    /// Open connections in all; one more is closed as soon as it is accepted.
    /// Default 768.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Open connections from one client IP address; one more is closed as soon as it is
    /// accepted. Default 256.
    #[serde(default = "default_max_connections_per_client")]
    pub max_connections_per_client: usize,
    /// Requests being handled at once; one more is answered 503 `OVERLOADED`.
    /// Default 512.
    #[serde(default = "default_max_concurrent_requests")]
    pub max_concurrent_requests: usize,
    /// Largest request head (request line and headers), bytes; at least 8 192.
    /// Default 65 536.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
}

impl ServerConfig {
    /// The retention of closed sessions, `None` = forever.
    pub fn closed_retention(&self) -> Option<Duration> {
        (self.closed_retention_s > 0).then(|| Duration::from_secs(self.closed_retention_s))
    }
}

fn default_session_log_memory_bytes() -> u64 {
    crate::session_log::DEFAULT_HELD_BYTES
}

fn default_listen() -> SocketAddr {
    DEFAULT_LISTEN
        .parse()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 7420)))
}
fn default_state_dir() -> PathBuf {
    PathBuf::from(DEFAULT_STATE_DIR)
}
fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY_BYTES
}
fn default_max_file() -> u64 {
    DEFAULT_MAX_FILE_BYTES
}
fn default_max_request_timeout() -> u64 {
    3_600_000
}
fn default_grace() -> u64 {
    DEFAULT_SHUTDOWN_GRACE_MS
}
fn default_header_read_timeout() -> u64 {
    DEFAULT_HEADER_READ_TIMEOUT_MS
}
fn default_idle_timeout() -> u64 {
    DEFAULT_IDLE_TIMEOUT_MS
}
fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_max_connections_per_client() -> usize {
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT
}
fn default_max_concurrent_requests() -> usize {
    DEFAULT_MAX_CONCURRENT_REQUESTS
}
fn default_max_header_bytes() -> usize {
    DEFAULT_MAX_HEADER_BYTES
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            state_dir: default_state_dir(),
            auth_tokens: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
            on_shutdown: ShutdownPolicy::Keep,
            closed_retention_s: 0,
            session_log_memory_bytes: default_session_log_memory_bytes(),
            max_request_timeout_ms: default_max_request_timeout(),
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_client: DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
        }
    }
}

/// Limits of commands and tool calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Default total deadline of a command, ms (`bash` tool and processes API). Default 120 000.
    #[serde(default = "d_cmd_timeout")]
    pub command_timeout_ms: u64,
    /// Largest total deadline a caller may ask for, ms. Default 3 600 000.
    #[serde(default = "d_cmd_max")]
    pub command_timeout_max_ms: u64,
    /// Default output-idle limit of a command, ms (no stdout/stderr for this long ends it
    /// with IDLE_TIMEOUT). Default 300 000. 0 disables.
    #[serde(default = "d_idle")]
    pub output_idle_ms: u64,
    /// Bytes of a command's output kept in a tool result (the tail). Default 64 000.
    #[serde(default = "d_tool_output")]
    pub tool_output_bytes: u64,
    /// Largest file `read_file` returns, bytes. Default 4 MiB.
    #[serde(default = "d_read_max")]
    pub read_file_max_bytes: u64,
    /// Total deadline of one file operation, ms. Default 60 000.
    #[serde(default = "d_fs_op")]
    pub fs_op_timeout_ms: u64,
    /// Deadline of sandbox creation, ms. Default 120 000.
    #[serde(default = "d_create")]
    pub sandbox_create_timeout_ms: u64,
    /// Deadline of the daemon's other calls on a sandbox (destroy, connect, list, renew),
    /// ms. Default 30 000.
    #[serde(default = "d_sandbox_op")]
    pub sandbox_op_timeout_ms: u64,
    /// Deadline of starting a command (the spawn at the provider), ms. Default 60 000.
    #[serde(default = "d_process_start")]
    pub process_start_timeout_ms: u64,
    /// Deadline of terminating a command's process group (TERM, grace, KILL, verify), ms.
    /// Default 30 000.
    #[serde(default = "d_terminate")]
    pub terminate_timeout_ms: u64,
    /// How long output is still journaled after a command's group was terminated, beyond
    /// its grace period, ms. Default 5 000.
    #[serde(default = "d_drain_after_terminate")]
    pub drain_after_terminate_ms: u64,
    /// How long closing a session waits for each command to record its end, ms.
    /// Default 15 000.
    #[serde(default = "d_command_drain")]
    pub command_drain_ms: u64,
    /// Total deadline of one streamed file transfer (a native API download or upload),
    /// ms. Default 600 000.
    #[serde(default = "d_transfer")]
    pub transfer_timeout_ms: u64,
    /// Command output one session may journal in all, bytes: a command that would pass it
    /// is ended with `LIMIT_EXCEEDED`, and so is every later one. 0 = no cap. Default
    /// 4 GiB.
    #[serde(default = "d_session_output")]
    pub session_output_max_bytes: u64,
    /// Every this many bytes of a running command's output journaled, the journal is
    /// synced and the provider told it may free its own copy of them (the local
    /// provider's spool), so long output is on disk once. 0 = never. Default 8 MiB.
    #[serde(default = "d_output_release")]
    pub output_release_bytes: u64,
}

/// The deadlines of the daemon's own calls, as durations, from [`LimitsConfig`]: the one
/// place request paths take them from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// Sandbox creation.
    pub sandbox_create: Duration,
    /// Destroy, connect, list, renew.
    pub sandbox_op: Duration,
    /// A command's spawn.
    pub process_start: Duration,
    /// A command group's terminate.
    pub terminate: Duration,
    /// Journaling after terminate, beyond the grace period.
    pub drain_after_terminate: Duration,
    /// Waiting for a command's end at session close.
    pub command_drain: Duration,
    /// One file operation.
    pub fs_op: Duration,
    /// One streamed file transfer.
    pub transfer: Duration,
    /// Command output one session may journal, bytes (0 = no cap).
    pub session_output_max_bytes: u64,
    /// Output journaled between two releases of the provider's copy (0 = never).
    pub output_release_bytes: u64,
}

impl LimitsConfig {
    /// The deadlines as durations.
    pub fn deadlines(&self) -> Deadlines {
        Deadlines {
            sandbox_create: Duration::from_millis(self.sandbox_create_timeout_ms),
            sandbox_op: Duration::from_millis(self.sandbox_op_timeout_ms),
            process_start: Duration::from_millis(self.process_start_timeout_ms),
            terminate: Duration::from_millis(self.terminate_timeout_ms),
            drain_after_terminate: Duration::from_millis(self.drain_after_terminate_ms),
            command_drain: Duration::from_millis(self.command_drain_ms),
            fs_op: Duration::from_millis(self.fs_op_timeout_ms),
            transfer: Duration::from_millis(self.transfer_timeout_ms),
            session_output_max_bytes: self.session_output_max_bytes,
            output_release_bytes: self.output_release_bytes,
        }
    }
}

impl Default for Deadlines {
    fn default() -> Self {
        LimitsConfig::default().deadlines()
    }
}

fn d_sandbox_op() -> u64 {
    30_000
}
fn d_process_start() -> u64 {
    60_000
}
fn d_terminate() -> u64 {
    30_000
}
fn d_drain_after_terminate() -> u64 {
    5_000
}
fn d_command_drain() -> u64 {
    15_000
}
fn d_transfer() -> u64 {
    600_000
}
fn d_session_output() -> u64 {
    4 << 30
}
fn d_output_release() -> u64 {
    8 << 20
}

fn d_cmd_timeout() -> u64 {
    120_000
}
fn d_cmd_max() -> u64 {
    3_600_000
}
fn d_idle() -> u64 {
    300_000
}
fn d_tool_output() -> u64 {
    64_000
}
fn d_read_max() -> u64 {
    4 * 1024 * 1024
}
fn d_fs_op() -> u64 {
    60_000
}
fn d_create() -> u64 {
    120_000
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            command_timeout_ms: d_cmd_timeout(),
            command_timeout_max_ms: d_cmd_max(),
            output_idle_ms: d_idle(),
            tool_output_bytes: d_tool_output(),
            read_file_max_bytes: d_read_max(),
            fs_op_timeout_ms: d_fs_op(),
            sandbox_create_timeout_ms: d_create(),
            sandbox_op_timeout_ms: d_sandbox_op(),
            process_start_timeout_ms: d_process_start(),
            terminate_timeout_ms: d_terminate(),
            drain_after_terminate_ms: d_drain_after_terminate(),
            command_drain_ms: d_command_drain(),
            transfer_timeout_ms: d_transfer(),
            session_output_max_bytes: d_session_output(),
            output_release_bytes: d_output_release(),
        }
    }
}

/// One named provider. Each provider crate owns its section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ProviderConfig {
    /// Confined local processes.
    Local(tether_provider_local::LocalConfig),
    /// An E2B backend (E2B cloud or a self-hosted E2B-compatible one).
    E2b(tether_provider_e2b::E2bConfig),
    /// Plain hosts reached over SSH.
    Ssh(tether_provider_ssh::SshConfig),
    /// qemu microVMs on this host (KVM where real, TCG otherwise).
    Microvm(tether_provider_microvm::MicrovmConfig),
}

/// An API key of the E2B front and the tenant it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The key (`X-API-Key` or bearer).
    pub key: String,
    /// The tenant's name; sandboxes are visible only to keys of the same tenant.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// The E2B-compatible API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bFrontConfig {
    /// Serve it. Default true.
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// Accepted API keys (at least 16 characters), each naming a tenant on the E2B front
    /// and on the native API. Empty, with no `server.auth_tokens` either, on a loopback
    /// listener: any key is accepted (development mode, said at start-up). Empty with
    /// tokens: no key is accepted. Empty on another listener: refused to start.
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// The provider E2B sandboxes run on. Default: `default_provider`.
    #[serde(default)]
    pub provider: Option<String>,
    /// The domain reported to SDKs (`49983-<id>.<domain>` routing). Default `localhost`.
    #[serde(default = "d_domain")]
    pub domain: String,
    /// Sandbox timeout when the SDK sends none, seconds. Default 300.
    #[serde(default = "d_e2b_timeout")]
    pub default_timeout_s: u64,
    /// Largest timeout an SDK may set, seconds. Default 86 400.
    #[serde(default = "d_e2b_max_timeout")]
    pub max_timeout_s: u64,
    /// Template names (or ids) create accepts; any other is refused as E2B refuses it
    /// (404 `template '<name>' not found`). Default `["base"]`, the SDKs' default.
    #[serde(default = "d_e2b_templates")]
    pub templates: Vec<String>,
    /// Serve as a VM's guest agent: envd only, for exactly one sandbox, the machine
    /// itself (the local provider with `isolation = "none"`), reached through the VM's
    /// host port forward. The native API and the control plane are not served; envd is
    /// authenticated by the access token the first `/init` sets.
    #[serde(default)]
    pub guest: Option<GuestConfig>,
}

/// The guest-agent mode of the E2B front (`[e2b_front.guest]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestConfig {
    /// Set the machine's clock from `/init`'s `timestamp` (a restored VM's clock is its
    /// snapshot's). Default true.
    #[serde(default = "d_true")]
    pub set_clock: bool,
}

impl Default for GuestConfig {
    fn default() -> Self {
        Self { set_clock: true }
    }
}

fn d_true() -> bool {
    true
}
fn d_domain() -> String {
    "localhost".to_owned()
}
fn d_e2b_timeout() -> u64 {
    300
}
fn d_e2b_max_timeout() -> u64 {
    86_400
}
fn d_e2b_templates() -> Vec<String> {
    vec!["base".to_owned()]
}

impl Default for E2bFrontConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            api_keys: Vec::new(),
            provider: None,
            domain: d_domain(),
            default_timeout_s: d_e2b_timeout(),
            max_timeout_s: d_e2b_max_timeout(),
            templates: d_e2b_templates(),
            guest: None,
        }
    }
}

/// Sandbox leases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseConfig {
    /// Time to live of a session's sandbox without activity, seconds. Default 3600.
    #[serde(default = "d_ttl")]
    pub ttl_s: u64,
    /// How often the reconciler compares the ledger with the providers, seconds. Default 60.
    #[serde(default = "d_reconcile")]
    pub reconcile_interval_s: u64,
    /// How often the sandbox of every live session is renewed at its provider (where the
    /// provider has a TTL of its own, e.g. E2B), seconds. Default 60.
    #[serde(default = "d_renew_every")]
    pub renew_interval_s: u64,
    /// The TTL each renewal asks the provider for, seconds: how long a sandbox outlives a
    /// daemon that stopped renewing it. Must exceed `renew_interval_s`. Default 300.
    #[serde(default = "d_renew_ttl")]
    pub renew_ttl_s: u64,
}

fn d_renew_every() -> u64 {
    60
}
fn d_renew_ttl() -> u64 {
    300
}

fn d_ttl() -> u64 {
    3_600
}
fn d_reconcile() -> u64 {
    60
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl_s: d_ttl(),
            reconcile_interval_s: d_reconcile(),
            renew_interval_s: d_renew_every(),
            renew_ttl_s: d_renew_ttl(),
        }
    }
}

/// An invalid configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TOML does not parse or does not match the schema.
    #[error("invalid configuration: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Parse and validate TOML.
    pub fn from_toml_str(s: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(s)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read, parse and validate a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let s = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&s)
    }

    /// Check cross-field rules. Called by the loaders; call again after overrides.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        // A guest agent serves envd only, authenticated by its access token.
        let guest = self.e2b_front.guest.is_some();
        if guest && !self.e2b_front.enabled {
            return Err(ConfigError::Invalid(
                "e2b_front.guest needs e2b_front.enabled".into(),
            ));
        }
        if !guest && !s.listen.ip().is_loopback() && s.auth_tokens.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "listen address {} is not loopback: server.auth_tokens must not be empty",
                s.listen
            )));
        }
        let min = crate::auth::MIN_CREDENTIAL_LEN;
        if s.auth_tokens.iter().any(|t| t.chars().count() < min) {
            return Err(ConfigError::Invalid(format!(
                "server.auth_tokens: every token must be at least {min} characters"
            )));
        }
        if self
            .e2b_front
            .api_keys
            .iter()
            .any(|k| k.key.chars().count() < min)
        {
            return Err(ConfigError::Invalid(format!(
                "e2b_front.api_keys: every key must be at least {min} characters"
            )));
        }
        if self.e2b_front.enabled
            && !guest
            && !s.listen.ip().is_loopback()
            && self.e2b_front.api_keys.is_empty()
        {
            return Err(ConfigError::Invalid(
                "e2b_front is enabled on a non-loopback listener: e2b_front.api_keys must not be empty".into(),
            ));
        }
        if s.header_read_timeout_ms == 0
            || s.idle_timeout_ms == 0
            || s.max_connections == 0
            || s.max_connections_per_client == 0
            || s.max_concurrent_requests == 0
        {
            return Err(ConfigError::Invalid(
                "server: header_read_timeout_ms, idle_timeout_ms, max_connections, max_connections_per_client and max_concurrent_requests must be positive".into(),
            ));
        }
        if s.max_header_bytes < MIN_MAX_HEADER_BYTES {
            return Err(ConfigError::Invalid(format!(
                "server.max_header_bytes must be at least {MIN_MAX_HEADER_BYTES}"
            )));
        }
        if s.session_log_memory_bytes < MIN_SESSION_LOG_MEMORY_BYTES {
            return Err(ConfigError::Invalid(format!(
                "server.session_log_memory_bytes must be at least {MIN_SESSION_LOG_MEMORY_BYTES}"
            )));
        }
        if s.max_body_bytes == 0 || s.max_file_bytes == 0 {
            return Err(ConfigError::Invalid(
                "server.max_body_bytes and max_file_bytes must be positive".into(),
            ));
        }
        let l = &self.limits;
        if l.command_timeout_ms == 0 || l.command_timeout_max_ms < l.command_timeout_ms {
            return Err(ConfigError::Invalid(
                "limits.command_timeout_ms must be positive and at most limits.command_timeout_max_ms".into(),
            ));
        }
        if l.tool_output_bytes == 0 || l.read_file_max_bytes == 0 || l.fs_op_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "limits: byte limits and fs_op_timeout_ms must be positive".into(),
            ));
        }
        // `local` always exists; `e2b` may come from the E2B_* environment (checked when the
        // providers are built).
        let implicit = |name: &str| name == "local" || name == "e2b";
        if !self.providers.contains_key(&self.default_provider) && !implicit(&self.default_provider)
        {
            return Err(ConfigError::Invalid(format!(
                "default_provider {:?} is not a configured provider",
                self.default_provider
            )));
        }
        if let Some(p) = &self.e2b_front.provider
            && !self.providers.contains_key(p)
            && !implicit(p)
        {
            return Err(ConfigError::Invalid(format!(
                "e2b_front.provider {p:?} is not a configured provider"
            )));
        }
        if self.e2b_front.default_timeout_s == 0
            || self.e2b_front.max_timeout_s < self.e2b_front.default_timeout_s
        {
            return Err(ConfigError::Invalid(
                "e2b_front: default_timeout_s must be positive and <= max_timeout_s".into(),
            ));
        }
        let le = &self.leases;
        if le.renew_interval_s == 0
            || le.renew_ttl_s <= le.renew_interval_s
            || le.reconcile_interval_s == 0
            || le.ttl_s == 0
        {
            return Err(ConfigError::Invalid(
                "leases: intervals and TTLs must be positive, and renew_ttl_s must exceed renew_interval_s".into(),
            ));
        }
        self.pipeline
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        crate::invariants::Invariants::new(&self.invariants)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.telemetry
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_the_documented_defaults() {
        let c = Config::from_toml_str("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.server.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.default_provider, "local");
        assert_eq!(c.limits.command_timeout_ms, 120_000);
        assert!(c.e2b_front.enabled);
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(matches!(
            Config::from_toml_str("[server]\nlisten_addr = \"x\""),
            Err(ConfigError::Parse(_))
        ));
        assert!(matches!(
            Config::from_toml_str("bogus = 1"),
            Err(ConfigError::Parse(_))
        ));
    }

    #[test]
    fn non_loopback_needs_a_token() {
        let e = Config::from_toml_str("[server]\nlisten = \"0.0.0.0:7420\"").unwrap_err();
        assert!(matches!(e, ConfigError::Invalid(_)));
        let ok = Config::from_toml_str(
            "[server]\nlisten = \"0.0.0.0:7420\"\nauth_tokens = [\"0123456789abcdef\"]\n[e2b_front]\napi_keys = [{key = \"0123456789abcdef-key\"}]",
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn unknown_default_provider_is_refused() {
        assert!(matches!(
            Config::from_toml_str("default_provider = \"nope\""),
            Err(ConfigError::Invalid(_))
        ));
    }
}
