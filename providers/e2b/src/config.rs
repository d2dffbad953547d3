//! The E2B provider's configuration section (`kind = "e2b"`), and where its endpoints are.
//!
//! The connection settings are the ones the official E2B SDKs read, with the same
//! environment variables and the same precedence (an explicit value beats the variable,
//! the variable beats the default): `E2B_API_URL`, `E2B_API_KEY`, `E2B_ACCESS_TOKEN`,
//! `E2B_DOMAIN`, `E2B_SANDBOX_URL`, `E2B_DEBUG`. The environment is read through a lookup
//! function ([`E2bConfig::with_env`]), never from ambient state, so tests pass their own.
//!
//! Everything else is tether's: the template and lifetime of new sandboxes, `auto_pause`
//! (always sent explicitly), one limit per phase of a remote call (connect / first byte,
//! transport idle, output idle, total), the retry policy of idempotent calls, and the
//! in-sandbox directory where command output is kept for resumption. Durations are
//! integer milliseconds, as everywhere in tether's configuration.

use std::time::Duration;

use reqwest::Url;
use serde::{Deserialize, Serialize};
use tether_envd_client::config::{
    DEFAULT_HEALTH_TIMEOUT_MS, DEFAULT_POOL_IDLE_MS, EnvdClientConfig,
};
use tether_envd_client::join;
use tether_provider::ProviderError;

/// `E2B_API_URL`: the control-plane base URL.
pub const ENV_API_URL: &str = "E2B_API_URL";
/// `E2B_API_KEY`: sent as `X-API-KEY` on every control-plane call.
pub const ENV_API_KEY: &str = "E2B_API_KEY";
/// `E2B_ACCESS_TOKEN`: sent as `Authorization: Bearer` (the older credential).
pub const ENV_ACCESS_TOKEN: &str = "E2B_ACCESS_TOKEN";
/// `E2B_DOMAIN`: the base domain (`api.<domain>`, `49983-<id>.<domain>`).
pub const ENV_DOMAIN: &str = "E2B_DOMAIN";
/// `E2B_SANDBOX_URL`: one envd base URL for every sandbox (requests are told apart by
/// the `E2b-Sandbox-Id` header).
pub const ENV_SANDBOX_URL: &str = "E2B_SANDBOX_URL";
/// `E2B_DEBUG`: `true` skips the control plane and talks to envd on localhost.
pub const ENV_DEBUG: &str = "E2B_DEBUG";

/// The E2B domain when none is configured.
pub const DEFAULT_DOMAIN: &str = "e2b.app";
/// The template of new sandboxes when neither the spec nor the config names one.
pub const DEFAULT_TEMPLATE: &str = "base";
pub use tether_envd_client::config::DEFAULT_WORKSPACE;
/// Control-plane URL in debug mode.
pub const DEBUG_API_URL: &str = "http://localhost:3000";
/// envd URL in debug mode.
pub const DEBUG_ENVD_URL: &str = "http://localhost:49983";
/// The sandbox id the SDKs use in debug mode (no control plane).
pub const DEBUG_SANDBOX_ID: &str = "debug_sandbox_id";

/// Domains served by E2B itself, whose envd traffic goes through one shared host
/// (`https://sandbox.<domain>`) routed by headers (the SDKs' `SUPPORTED_SANDBOX_DOMAINS`).
pub const SHARED_HOST_DOMAINS: &[&str] = &[
    "e2b.app",
    "e2b.dev",
    "e2b.pro",
    "e2b-staging.dev",
    "e2b-tango.dev",
    "e2b-juliett.dev",
    "foxtrot-2.e2b.dev",
];

pub use tether_envd_client::RetryConfig;
pub use tether_envd_client::config::{
    DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_DRAIN_AFTER_EXIT_MS, DEFAULT_FINISHED_COMMANDS_KEPT,
    DEFAULT_KEEPALIVE_INTERVAL_S, DEFAULT_MAX_GRACE_MS, DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_OUTPUT_BUFFER_BYTES, DEFAULT_REATTACH_ATTEMPTS, DEFAULT_REQUEST_TIMEOUT_MS,
    DEFAULT_TRANSPORT_IDLE_MS,
};
/// Default time to live of a new sandbox.
pub const DEFAULT_TTL_MS: u64 = 300_000;

/// Configuration of one E2B backend (E2B cloud, or a self-hosted E2B-compatible one).
///
/// `Debug` hides the credentials.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bConfig {
    /// Control-plane base URL. Default (after the environment): `https://api.<domain>`,
    /// or `http://localhost:3000` in debug mode.
    #[serde(default)]
    pub api_url: Option<String>,
    /// API key, sent as `X-API-KEY`.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Access token, sent as `Authorization: Bearer` (older self-hosted control planes).
    #[serde(default)]
    pub access_token: Option<String>,
    /// Base domain. Default `e2b.app`.
    #[serde(default)]
    pub domain: Option<String>,
    /// One envd base URL for every sandbox. Default: per sandbox,
    /// `https://49983-<id>.<domain>` (or the shared `https://sandbox.<domain>` host of
    /// E2B's own domains).
    #[serde(default)]
    pub sandbox_url: Option<String>,
    /// Debug mode: no control plane; one sandbox, envd on `localhost:49983`.
    #[serde(default)]
    pub debug: Option<bool>,
    /// Fill unset connection settings from the `E2B_*` environment variables. Default
    /// true; set false on a section that must not pick up another backend's credentials.
    #[serde(default = "yes")]
    pub inherit_env: bool,
    /// Template of new sandboxes when their spec names none. Default `base`.
    #[serde(default = "d_template")]
    pub template: String,
    /// Time to live of new sandboxes when their spec sets none, ms (sent in seconds,
    /// rounded up). Default 300 000.
    #[serde(default = "d_ttl")]
    pub ttl_ms: u64,
    /// Pause (instead of kill) a sandbox at its timeout. Always sent. Default false.
    #[serde(default)]
    pub auto_pause: bool,
    /// Give sandboxes internet access even when their spec does not ask for it. Default
    /// true, as in E2B.
    #[serde(default = "yes")]
    pub default_network: bool,
    /// The workspace as sandbox paths see it: where relative paths and the default
    /// working directory point. Default `/home/user`.
    #[serde(default = "d_workspace")]
    pub workspace: String,
    /// User of file operations and commands when a command names none (`user`, `root`).
    /// Default: envd's default user.
    #[serde(default)]
    pub user: Option<String>,
    /// Directory inside the sandbox where each command's output is copied so that a
    /// broken stream can be resumed from any offset. Default `<workspace>/.cache/tether`.
    #[serde(default)]
    pub state_dir: Option<String>,
    /// Limit of the connect / first-byte phase of every call, ms (CONNECT_TIMEOUT).
    /// Default 10 000.
    #[serde(default = "d_connect")]
    pub connect_timeout_ms: u64,
    /// Limit of silence on a stream, keepalives included, ms (TRANSPORT_IDLE_TIMEOUT).
    /// Default 60 000.
    #[serde(default = "d_transport_idle")]
    pub transport_idle_ms: u64,
    /// Limit of silence on a command's output as each reader sees it, keepalives not
    /// counted, ms (IDLE_TIMEOUT). Default 0: off (the daemon applies its own).
    #[serde(default)]
    pub output_idle_ms: u64,
    /// Total limit of one request/response call, ms (DEADLINE_EXCEEDED). Default 60 000.
    #[serde(default = "d_request")]
    pub request_timeout_ms: u64,
    /// Interval of envd's keepalive events on streams, seconds. Must be shorter than the
    /// transport idle limit. Default 15.
    #[serde(default = "d_keepalive")]
    pub keepalive_interval_s: u32,
    /// Retry policy of idempotent calls.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Capture cap per output stream when a command's spec sets none, bytes.
    #[serde(default = "d_max_output")]
    pub max_output_bytes: u64,
    /// Recent output kept in memory per stream and command, bytes; older output is read
    /// back from the sandbox. Default 4 MiB.
    #[serde(default = "d_output_buffer")]
    pub output_buffer_bytes: u64,
    /// How long to wait for a command's output copies after it exited, ms (a background
    /// process may keep them open). Default 500.
    #[serde(default = "d_drain")]
    pub drain_after_exit_ms: u64,
    /// Upper bound of a command's grace period (SIGTERM to SIGKILL), ms. Default 60 000.
    #[serde(default = "d_max_grace")]
    pub max_grace_ms: u64,
    /// Attempts to re-attach to a command after its stream broke. Default 5.
    #[serde(default = "d_reattach")]
    pub reattach_attempts: u32,
    /// Check the SHA-256 of every written file inside the sandbox before publishing it.
    /// Default false.
    #[serde(default)]
    pub verify_writes: bool,
    /// Finished commands remembered per sandbox (for `attach` and `list`). Default 256.
    #[serde(default = "d_finished")]
    pub finished_commands_kept: usize,
    /// Start a signal relay beside every command, for backends that confine each
    /// command in a user namespace of its own (see the envd client's `signal_relay`).
    /// Default false.
    #[serde(default)]
    pub signal_relay: bool,
}

impl std::fmt::Debug for E2bConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("E2bConfig")
            .field("api_url", &self.api_url)
            .field("api_key", &redact(&self.api_key))
            .field("access_token", &redact(&self.access_token))
            .field("domain", &self.domain)
            .field("sandbox_url", &self.sandbox_url)
            .field("debug", &self.debug)
            .field("template", &self.template)
            .field("ttl_ms", &self.ttl_ms)
            .field("workspace", &self.workspace)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("transport_idle_ms", &self.transport_idle_ms)
            .field("output_idle_ms", &self.output_idle_ms)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .finish_non_exhaustive()
    }
}

impl Default for E2bConfig {
    fn default() -> Self {
        Self {
            api_url: None,
            api_key: None,
            access_token: None,
            domain: None,
            sandbox_url: None,
            debug: None,
            inherit_env: true,
            template: d_template(),
            ttl_ms: DEFAULT_TTL_MS,
            auto_pause: false,
            default_network: true,
            workspace: d_workspace(),
            user: None,
            state_dir: None,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            transport_idle_ms: DEFAULT_TRANSPORT_IDLE_MS,
            output_idle_ms: 0,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            keepalive_interval_s: DEFAULT_KEEPALIVE_INTERVAL_S,
            retry: RetryConfig::default(),
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            output_buffer_bytes: DEFAULT_OUTPUT_BUFFER_BYTES,
            drain_after_exit_ms: DEFAULT_DRAIN_AFTER_EXIT_MS,
            max_grace_ms: DEFAULT_MAX_GRACE_MS,
            reattach_attempts: DEFAULT_REATTACH_ATTEMPTS,
            verify_writes: false,
            finished_commands_kept: DEFAULT_FINISHED_COMMANDS_KEPT,
            signal_relay: false,
        }
    }
}

fn yes() -> bool {
    true
}
fn d_template() -> String {
    DEFAULT_TEMPLATE.to_owned()
}
fn d_workspace() -> String {
    DEFAULT_WORKSPACE.to_owned()
}
fn d_ttl() -> u64 {
    DEFAULT_TTL_MS
}
fn d_connect() -> u64 {
    DEFAULT_CONNECT_TIMEOUT_MS
}
fn d_transport_idle() -> u64 {
    DEFAULT_TRANSPORT_IDLE_MS
}
fn d_request() -> u64 {
    DEFAULT_REQUEST_TIMEOUT_MS
}
fn d_keepalive() -> u32 {
    DEFAULT_KEEPALIVE_INTERVAL_S
}
fn d_max_output() -> u64 {
    DEFAULT_MAX_OUTPUT_BYTES
}
fn d_output_buffer() -> u64 {
    DEFAULT_OUTPUT_BUFFER_BYTES
}
fn d_drain() -> u64 {
    DEFAULT_DRAIN_AFTER_EXIT_MS
}
fn d_max_grace() -> u64 {
    DEFAULT_MAX_GRACE_MS
}
fn d_reattach() -> u32 {
    DEFAULT_REATTACH_ATTEMPTS
}
fn d_finished() -> usize {
    DEFAULT_FINISHED_COMMANDS_KEPT
}

/// `true`, case-insensitively, as the SDKs read `E2B_DEBUG`.
fn truthy(v: &str) -> bool {
    v.trim().eq_ignore_ascii_case("true")
}

fn non_empty(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

impl E2bConfig {
    /// A configuration from the `E2B_*` environment alone, if it names a backend (an API
    /// key, an access token, an API URL, or debug mode); `None` otherwise.
    pub fn from_env(lookup: &dyn Fn(&str) -> Option<String>) -> Option<Self> {
        let names_a_backend = [ENV_API_KEY, ENV_ACCESS_TOKEN, ENV_API_URL]
            .iter()
            .any(|n| non_empty(lookup(n)).is_some())
            || lookup(ENV_DEBUG).is_some_and(|v| truthy(&v));
        names_a_backend.then(|| Self::default().with_env(lookup))
    }

    /// Fill the connection settings this configuration leaves unset from the `E2B_*`
    /// variables (unless `inherit_env` is off).
    pub fn with_env(mut self, lookup: &dyn Fn(&str) -> Option<String>) -> Self {
        if !self.inherit_env {
            return self;
        }
        let fill = |slot: &mut Option<String>, name: &str| {
            if slot.is_none() {
                *slot = non_empty(lookup(name));
            }
        };
        fill(&mut self.api_url, ENV_API_URL);
        fill(&mut self.api_key, ENV_API_KEY);
        fill(&mut self.access_token, ENV_ACCESS_TOKEN);
        fill(&mut self.domain, ENV_DOMAIN);
        fill(&mut self.sandbox_url, ENV_SANDBOX_URL);
        if self.debug.is_none() {
            self.debug = lookup(ENV_DEBUG).map(|v| truthy(&v));
        }
        self
    }

    /// Whether debug mode is on.
    pub fn is_debug(&self) -> bool {
        self.debug.unwrap_or(false)
    }

    /// The base domain.
    pub fn domain(&self) -> &str {
        self.domain
            .as_deref()
            .filter(|d| !d.is_empty())
            .unwrap_or(DEFAULT_DOMAIN)
    }

    /// The in-sandbox directory of command output copies.
    pub fn state_dir(&self) -> String {
        match &self.state_dir {
            Some(d) => d.trim_end_matches('/').to_owned(),
            None => format!("{}/.cache/tether", self.workspace.trim_end_matches('/')),
        }
    }

    /// Check the configuration and resolve its endpoints.
    pub fn validate(&self) -> Result<Endpoints, ProviderError> {
        let invalid = |message: String| ProviderError::InvalidRequest { message };
        if self.template.trim().is_empty() {
            return Err(invalid("e2b template must not be empty".into()));
        }
        if self.ttl_ms < 1000 {
            return Err(invalid("e2b ttl_ms must be at least 1000".into()));
        }
        self.envd_config().validate("e2b")?;
        Endpoints::resolve(self)
    }

    /// The total limit of a request/response call.
    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// The envd client's settings: the clocks, the retry policy, the workspace and the
    /// command settings of this section (the readiness probe's limit is the client's
    /// default: this provider's health check goes through the control plane).
    pub fn envd_config(&self) -> EnvdClientConfig {
        EnvdClientConfig {
            workspace: self.workspace.clone(),
            user: self.user.clone(),
            state_dir: self.state_dir.clone(),
            connect_timeout_ms: self.connect_timeout_ms,
            transport_idle_ms: self.transport_idle_ms,
            output_idle_ms: self.output_idle_ms,
            request_timeout_ms: self.request_timeout_ms,
            health_timeout_ms: DEFAULT_HEALTH_TIMEOUT_MS,
            keepalive_interval_s: self.keepalive_interval_s,
            pool_idle_ms: DEFAULT_POOL_IDLE_MS,
            retry: self.retry,
            max_output_bytes: self.max_output_bytes,
            output_buffer_bytes: self.output_buffer_bytes,
            drain_after_exit_ms: self.drain_after_exit_ms,
            max_grace_ms: self.max_grace_ms,
            reattach_attempts: self.reattach_attempts,
            verify_writes: self.verify_writes,
            finished_commands_kept: self.finished_commands_kept,
            signal_relay: self.signal_relay,
        }
    }
}

/// Where a backend's control plane and envd are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// Control-plane base URL (no trailing slash).
    pub api: Url,
    /// The fixed envd base URL, when one is configured (or debug mode).
    pub sandbox_url: Option<Url>,
    /// Base domain.
    pub domain: String,
    /// Debug mode.
    pub debug: bool,
}

fn parse_url(what: &str, s: &str) -> Result<Url, ProviderError> {
    let u = Url::parse(s.trim()).map_err(|e| ProviderError::InvalidRequest {
        message: format!("e2b {what} {s:?} is not a URL: {e}"),
    })?;
    if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
        return Err(ProviderError::InvalidRequest {
            message: format!("e2b {what} {s:?} must be an http(s) URL"),
        });
    }
    Ok(u)
}

impl Endpoints {
    /// Resolve the URLs of `cfg` as the SDKs do (`ConnectionConfig`).
    pub fn resolve(cfg: &E2bConfig) -> Result<Self, ProviderError> {
        let debug = cfg.is_debug();
        let domain = cfg.domain().to_owned();
        let api = match &cfg.api_url {
            Some(u) => parse_url("api_url", u)?,
            None if debug => parse_url("api_url", DEBUG_API_URL)?,
            None => parse_url("api_url", &format!("https://api.{domain}"))?,
        };
        let sandbox_url = match &cfg.sandbox_url {
            Some(u) => Some(parse_url("sandbox_url", u)?),
            None if debug => Some(parse_url("sandbox_url", DEBUG_ENVD_URL)?),
            None => None,
        };
        Ok(Self {
            api,
            sandbox_url,
            domain,
            debug,
        })
    }

    /// The envd base URL of a sandbox whose create/connect answer named `domain` (if any).
    pub fn envd_url(&self, sandbox_id: &str, domain: Option<&str>) -> Result<Url, ProviderError> {
        self.port_url(sandbox_id, tether_protocol::e2b::ENVD_PORT, domain)
    }

    /// The base URL at which E2B's edge serves `port` of a sandbox whose create/connect
    /// answer named `domain`: the fixed sandbox URL, the shared `sandbox.<domain>` host,
    /// or `https://<port>-<id>.<domain>`. Every request there also carries the
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers.
    pub fn port_url(
        &self,
        sandbox_id: &str,
        port: u16,
        domain: Option<&str>,
    ) -> Result<Url, ProviderError> {
        if let Some(u) = &self.sandbox_url {
            return Ok(u.clone());
        }
        let domain = domain.filter(|d| !d.is_empty()).unwrap_or(&self.domain);
        let url = if SHARED_HOST_DOMAINS.contains(&domain) {
            format!("https://sandbox.{domain}")
        } else {
            format!("https://{port}-{sandbox_id}.{domain}")
        };
        parse_url("sandbox URL", &url)
    }

    /// `api` joined with `path` (which starts with `/`).
    pub fn api_path(&self, path: &str) -> Url {
        join(&self.api, path)
    }
}
