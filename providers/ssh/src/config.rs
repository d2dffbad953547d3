//! The SSH provider's configuration section (`kind = "ssh"`).
//!
//! One or more hosts, each reached as one user with a key file or the SSH agent, with a
//! directory (`workspace_root`) under which every sandbox gets a private workspace. The
//! server's host key is checked against a known_hosts file; an unknown or changed key is
//! refused unless trust-on-first-use is configured. Every phase of a remote call has its
//! own limit (connect, transport idle, total); durations are integer milliseconds, as
//! everywhere in tether's configuration.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_provider::ProviderError;

/// Default SSH port.
pub const DEFAULT_PORT: u16 = 22;
/// Default directory of the workspaces on a host (relative paths are under the user's home).
pub const DEFAULT_WORKSPACE_ROOT: &str = ".tether/sandboxes";
/// Default limit of TCP connect + SSH handshake + authentication.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default limit of silence on a connection (no bytes at all, keepalive replies included).
pub const DEFAULT_TRANSPORT_IDLE_MS: u64 = 30_000;
/// Default interval of SSH keepalives on an idle connection.
pub const DEFAULT_KEEPALIVE_INTERVAL_MS: u64 = 5_000;
/// Default total limit of one request/response call (a stat, a file-system step, a spawn).
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Default largest number of session channels open at once on one host.
pub const DEFAULT_MAX_SESSIONS_PER_HOST: usize = 64;
/// Session channels multiplexed over one SSH connection before another is opened
/// (OpenSSH's `MaxSessions` defaults to 10; one channel of each connection is SFTP).
pub const DEFAULT_CHANNELS_PER_CONNECTION: usize = 8;
/// Default number of attempts to re-attach a command's output after the connection broke.
pub const DEFAULT_REATTACH_ATTEMPTS: usize = 5;
/// Default time to live recorded for a new sandbox (the daemon's leases enforce it).
pub const DEFAULT_TTL_MS: u64 = 3_600_000;
/// Default bytes of output kept in memory per stream and command (older output is read
/// back from the journal on the host).
pub const DEFAULT_OUTPUT_BUFFER_BYTES: u64 = 8 * 1024 * 1024;

/// What to do with a host key that the known_hosts file does not list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostKeyPolicy {
    /// Refuse unknown and changed keys (the default).
    #[default]
    Strict,
    /// Accept and record a key the first time a host is seen; refuse a changed one.
    TrustOnFirstUse,
}

/// How to authenticate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "snake_case", deny_unknown_fields)]
pub enum AuthConfig {
    /// A private key file (OpenSSH format; ed25519 or ECDSA).
    KeyFile {
        /// Path of the private key.
        path: PathBuf,
        /// Its passphrase, if it has one.
        #[serde(default)]
        passphrase: Option<String>,
    },
    /// The keys of the SSH agent at `SSH_AUTH_SOCK`.
    Agent,
}

/// One host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// Name of the host in sandbox ids (letters, digits, `_`; default `h<index>`).
    #[serde(default)]
    pub name: Option<String>,
    /// Address (name or IP).
    pub address: String,
    /// Port. Default 22.
    #[serde(default = "d_port")]
    pub port: u16,
    /// User to log in as.
    pub user: String,
    /// How to authenticate.
    pub auth: AuthConfig,
    /// Directory of the sandboxes' workspaces; relative paths are under the user's home.
    #[serde(default = "d_root")]
    pub workspace_root: String,
}

/// The `[providers.NAME] kind = "ssh"` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshConfig {
    /// The hosts; new sandboxes go to the one with the fewest.
    #[serde(default)]
    pub hosts: Vec<HostConfig>,
    /// The known_hosts file. Default `~/.ssh/known_hosts`.
    #[serde(default)]
    pub known_hosts: Option<PathBuf>,
    /// Unknown host keys: `strict` (default) or `trust_on_first_use`.
    #[serde(default)]
    pub host_key_policy: HostKeyPolicy,
    /// Limit of TCP connect + handshake + authentication, ms.
    #[serde(default = "d_connect")]
    pub connect_timeout_ms: u64,
    /// Limit of silence on a connection, ms (keepalive replies count as traffic).
    #[serde(default = "d_transport_idle")]
    pub transport_idle_timeout_ms: u64,
    /// Interval of keepalives on a quiet connection, ms (0: none).
    #[serde(default = "d_keepalive")]
    pub keepalive_interval_ms: u64,
    /// Total limit of one request/response call, ms.
    #[serde(default = "d_request")]
    pub request_timeout_ms: u64,
    /// Largest number of session channels open at once per host. A running command holds
    /// one for as long as its output streams; a call waits for a free one (within its
    /// deadline).
    #[serde(default = "d_max_sessions")]
    pub max_sessions_per_host: usize,
    /// Session channels per SSH connection before another connection is opened.
    #[serde(default = "d_per_conn")]
    pub channels_per_connection: usize,
    /// Attempts to re-attach a command's output after its connection broke.
    #[serde(default = "d_reattach")]
    pub reattach_attempts: usize,
    /// Time to live recorded for a new sandbox without its own, ms.
    #[serde(default = "d_ttl")]
    pub default_ttl_ms: u64,
    /// Output kept in memory per stream and command.
    #[serde(default = "d_buffer")]
    pub output_buffer_bytes: u64,
}

fn d_port() -> u16 {
    DEFAULT_PORT
}
fn d_root() -> String {
    DEFAULT_WORKSPACE_ROOT.to_owned()
}
fn d_connect() -> u64 {
    DEFAULT_CONNECT_TIMEOUT_MS
}
fn d_transport_idle() -> u64 {
    DEFAULT_TRANSPORT_IDLE_MS
}
fn d_keepalive() -> u64 {
    DEFAULT_KEEPALIVE_INTERVAL_MS
}
fn d_request() -> u64 {
    DEFAULT_REQUEST_TIMEOUT_MS
}
fn d_max_sessions() -> usize {
    DEFAULT_MAX_SESSIONS_PER_HOST
}
fn d_per_conn() -> usize {
    DEFAULT_CHANNELS_PER_CONNECTION
}
fn d_reattach() -> usize {
    DEFAULT_REATTACH_ATTEMPTS
}
fn d_ttl() -> u64 {
    DEFAULT_TTL_MS
}
fn d_buffer() -> u64 {
    DEFAULT_OUTPUT_BUFFER_BYTES
}

impl Default for SshConfig {
    fn default() -> Self {
        Self {
            hosts: Vec::new(),
            known_hosts: None,
            host_key_policy: HostKeyPolicy::Strict,
            connect_timeout_ms: d_connect(),
            transport_idle_timeout_ms: d_transport_idle(),
            keepalive_interval_ms: d_keepalive(),
            request_timeout_ms: d_request(),
            max_sessions_per_host: d_max_sessions(),
            channels_per_connection: d_per_conn(),
            reattach_attempts: d_reattach(),
            default_ttl_ms: d_ttl(),
            output_buffer_bytes: d_buffer(),
        }
    }
}

impl SshConfig {
    /// The connect limit.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// The transport-idle limit.
    pub fn transport_idle(&self) -> Duration {
        Duration::from_millis(self.transport_idle_timeout_ms)
    }
    /// The keepalive interval (`None`: no keepalives).
    pub fn keepalive(&self) -> Option<Duration> {
        (self.keepalive_interval_ms > 0).then(|| Duration::from_millis(self.keepalive_interval_ms))
    }
    /// The total limit of a request/response call.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// The name of host `i` in sandbox ids.
    pub fn host_name(&self, i: usize) -> String {
        self.hosts
            .get(i)
            .and_then(|h| h.name.clone())
            .unwrap_or_else(|| format!("h{i}"))
    }

    /// Check the section; a bad value is an `INVALID_REQUEST` naming the field.
    pub fn validate(&self) -> Result<(), ProviderError> {
        let bad = |m: String| Err(ProviderError::InvalidRequest { message: m });
        if self.hosts.is_empty() {
            return bad("ssh: at least one [[hosts]] entry is needed".into());
        }
        for (i, h) in self.hosts.iter().enumerate() {
            let name = self.host_name(i);
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return bad(format!(
                    "ssh: host name {name:?}: letters, digits and _ only"
                ));
            }
            if self.hosts[..i]
                .iter()
                .enumerate()
                .any(|(j, _)| self.host_name(j) == name)
            {
                return bad(format!("ssh: two hosts are named {name:?}"));
            }
            if h.address.trim().is_empty() || h.user.trim().is_empty() {
                return bad(format!("ssh: host {name}: address and user are required"));
            }
            if h.workspace_root.trim().is_empty()
                || h.workspace_root.split('/').any(|c| c == "..")
                || h.workspace_root.trim_end_matches('/').is_empty()
            {
                return bad(format!(
                    "ssh: host {name}: workspace_root {:?} must be a directory below /",
                    h.workspace_root
                ));
            }
        }
        if self.connect_timeout_ms == 0 || self.transport_idle_timeout_ms == 0 {
            return bad("ssh: connect_timeout_ms and transport_idle_timeout_ms must be > 0".into());
        }
        if self.keepalive_interval_ms >= self.transport_idle_timeout_ms {
            return bad(
                "ssh: keepalive_interval_ms must be below transport_idle_timeout_ms".into(),
            );
        }
        if self.max_sessions_per_host == 0 || self.channels_per_connection == 0 {
            return bad(
                "ssh: max_sessions_per_host and channels_per_connection must be > 0".into(),
            );
        }
        Ok(())
    }
}
