//! The envd client's configuration: one limit per phase of a remote call (connect /
//! first byte, transport idle, output idle, total, the readiness probe), the retry policy
//! of idempotent calls, the capture and resumption settings of commands, and where file
//! operations and commands run inside the sandbox. Durations are integer milliseconds, as
//! everywhere in tether's configuration; every default is a named constant.
//!
//! A provider builds one [`EnvdClientConfig`] from its own configuration section (the E2B
//! provider keeps its flat `[providers.e2b]` keys and maps them here).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_provider::ProviderError;

/// The sandbox user's home, the workspace of file operations and processes.
pub const DEFAULT_WORKSPACE: &str = "/home/user";
/// Default limit of the connect / first-byte phase of a remote call.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default limit of silence on a transport (no bytes at all, keepalives included).
pub const DEFAULT_TRANSPORT_IDLE_MS: u64 = 60_000;
/// Default total limit of one request/response call.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Default limit of one readiness probe (`GET /health`), connect to answer.
pub const DEFAULT_HEALTH_TIMEOUT_MS: u64 = 2_000;
/// Default time an idle connection to envd is kept for reuse. Shorter than the server's own
/// keep-alive: tether's guest agent closes a kept-alive connection that sends no request
/// for its header-read limit (10 s by default), and a request sent on a connection as the
/// server closes it fails unsent (`PROVIDER_UNAVAILABLE`, "the request could not be sent").
pub const DEFAULT_POOL_IDLE_MS: u64 = 4_000;
/// Default interval of envd's keepalive events on streams, seconds.
pub const DEFAULT_KEEPALIVE_INTERVAL_S: u32 = 15;
/// Default capture cap per output stream.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 64 * 1024 * 1024;
/// Default bytes of recent output kept in memory per stream (older output is read back
/// from the in-sandbox copy).
pub const DEFAULT_OUTPUT_BUFFER_BYTES: u64 = 4 * 1024 * 1024;
/// Default time to wait for a command's output copies to complete after it exited.
pub const DEFAULT_DRAIN_AFTER_EXIT_MS: u64 = 500;
/// Default upper bound of a command's grace period.
pub const DEFAULT_MAX_GRACE_MS: u64 = 60_000;
/// Default number of attempts to re-attach to a command after its stream broke.
pub const DEFAULT_REATTACH_ATTEMPTS: u32 = 5;
/// Default number of finished commands remembered per sandbox.
pub const DEFAULT_FINISHED_COMMANDS_KEPT: usize = 256;
/// Default retries of an idempotent call after its first attempt (as the E2B SDKs).
pub const DEFAULT_RETRY_MAX_TIMES: usize = 3;
/// Default first backoff delay of a retry.
pub const DEFAULT_RETRY_MIN_DELAY_MS: u64 = 100;
/// Default largest backoff delay (and largest honoured `Retry-After`).
pub const DEFAULT_RETRY_MAX_DELAY_MS: u64 = 10_000;

/// Retry policy of idempotent calls (reads, stat, list, renew, destroy, and create with
/// an idempotency key): exponential backoff with jitter, honouring `Retry-After`, never
/// past the call's deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Retries after the first attempt. Default 3 (as the SDKs). 0 disables retries.
    #[serde(default = "d_retries")]
    pub max_times: usize,
    /// First backoff delay, ms. Default 100.
    #[serde(default = "d_min_delay")]
    pub min_delay_ms: u64,
    /// Largest backoff delay (and largest honoured `Retry-After`), ms. Default 10 000.
    #[serde(default = "d_max_delay")]
    pub max_delay_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_times: d_retries(),
            min_delay_ms: d_min_delay(),
            max_delay_ms: d_max_delay(),
        }
    }
}

fn d_retries() -> usize {
    DEFAULT_RETRY_MAX_TIMES
}
fn d_min_delay() -> u64 {
    DEFAULT_RETRY_MIN_DELAY_MS
}
fn d_max_delay() -> u64 {
    DEFAULT_RETRY_MAX_DELAY_MS
}

/// The clocks and settings of the envd client of one sandbox. As a configuration table
/// (a provider may embed it), every key is optional and defaults to its named constant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvdClientConfig {
    /// The workspace as sandbox paths see it: where relative paths and the default
    /// working directory point. Default `/home/user`.
    pub workspace: String,
    /// User of file operations and commands when a command names none (`user`, `root`).
    /// Default: envd's default user.
    pub user: Option<String>,
    /// Directory inside the sandbox where each command's output is copied so that a
    /// broken stream can be resumed from any offset. Default `<workspace>/.cache/tether`.
    pub state_dir: Option<String>,
    /// Limit of the connect / first-byte phase of every call, ms (CONNECT_TIMEOUT).
    pub connect_timeout_ms: u64,
    /// Limit of silence on a stream, keepalives included, ms (TRANSPORT_IDLE_TIMEOUT).
    /// A transfer (`/files` up or down) is bounded by this limit on its progress, not by
    /// a total: it may last as long as bytes keep moving.
    pub transport_idle_ms: u64,
    /// Limit of silence on a command's output as each reader sees it, keepalives not
    /// counted, ms (IDLE_TIMEOUT). 0: off.
    pub output_idle_ms: u64,
    /// Total limit of one request/response call, ms (DEADLINE_EXCEEDED).
    pub request_timeout_ms: u64,
    /// Limit of one readiness probe ([`crate::EnvdSandboxClient::probe_health`]), ms.
    pub health_timeout_ms: u64,
    /// Interval of envd's keepalive events on streams, seconds. Must be shorter than the
    /// transport idle limit.
    pub keepalive_interval_s: u32,
    /// How long an idle connection to envd is kept for reuse, ms: below the server's own
    /// keep-alive. Default 4 000.
    pub pool_idle_ms: u64,
    /// Retry policy of idempotent calls.
    pub retry: RetryConfig,
    /// Capture cap per output stream when a command's spec sets none, bytes.
    pub max_output_bytes: u64,
    /// Recent output kept in memory per stream and command, bytes.
    pub output_buffer_bytes: u64,
    /// How long to wait for a command's output copies after it exited, ms.
    pub drain_after_exit_ms: u64,
    /// Upper bound of a command's grace period (SIGTERM to SIGKILL), ms.
    pub max_grace_ms: u64,
    /// Attempts to re-attach to a command after its stream broke.
    pub reattach_attempts: u32,
    /// Check the SHA-256 of every written file inside the sandbox before publishing it.
    pub verify_writes: bool,
    /// Finished commands remembered per sandbox (for `attach` and `list`).
    pub finished_commands_kept: usize,
    /// Start a signal relay beside every command ([`crate::RELAY`]): for backends that
    /// confine each command in a user namespace of its own, where a `kill` from another
    /// command is refused. Off, signals other than envd's own are sent to the command's
    /// group by a `kill` from a control command as the same user, which every backend
    /// that runs commands in one machine (E2B's, tether's) allows; it saves three
    /// programs per command. Default false.
    pub signal_relay: bool,
}

impl Default for EnvdClientConfig {
    fn default() -> Self {
        Self {
            workspace: DEFAULT_WORKSPACE.to_owned(),
            user: None,
            state_dir: None,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            transport_idle_ms: DEFAULT_TRANSPORT_IDLE_MS,
            output_idle_ms: 0,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            health_timeout_ms: DEFAULT_HEALTH_TIMEOUT_MS,
            keepalive_interval_s: DEFAULT_KEEPALIVE_INTERVAL_S,
            pool_idle_ms: DEFAULT_POOL_IDLE_MS,
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

impl EnvdClientConfig {
    /// Check the settings; `section` names the configuration section in the messages
    /// (`e2b`, `microvm`). Errors are `INVALID_REQUEST`.
    pub fn validate(&self, section: &str) -> Result<(), ProviderError> {
        let invalid = |message: String| ProviderError::InvalidRequest { message };
        if !self.workspace.starts_with('/') {
            return Err(invalid(format!(
                "{section} workspace {:?} must be an absolute path",
                self.workspace
            )));
        }
        if !self.state_dir().starts_with('/') {
            return Err(invalid(format!(
                "{section} state_dir {:?} must be an absolute path",
                self.state_dir()
            )));
        }
        for (name, v) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("transport_idle_ms", self.transport_idle_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("health_timeout_ms", self.health_timeout_ms),
            ("max_output_bytes", self.max_output_bytes),
            ("output_buffer_bytes", self.output_buffer_bytes),
        ] {
            if v == 0 {
                return Err(invalid(format!("{section} {name} must be positive")));
            }
        }
        if self.keepalive_interval_s == 0
            || u64::from(self.keepalive_interval_s) * 1000 >= self.transport_idle_ms
        {
            return Err(invalid(format!(
                "{section} keepalive_interval_s must be positive and shorter than transport_idle_ms"
            )));
        }
        if self.retry.min_delay_ms > self.retry.max_delay_ms {
            return Err(invalid(format!(
                "{section} retry.min_delay_ms must not exceed retry.max_delay_ms"
            )));
        }
        Ok(())
    }

    /// The in-sandbox directory of command output copies.
    pub fn state_dir(&self) -> String {
        match &self.state_dir {
            Some(d) => d.trim_end_matches('/').to_owned(),
            None => format!("{}/.cache/tether", self.workspace.trim_end_matches('/')),
        }
    }

    /// The connect / first-byte limit.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// The total limit of a request/response call.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// The limit of one readiness probe.
    pub fn health_timeout(&self) -> Duration {
        Duration::from_millis(self.health_timeout_ms)
    }
}
