//! Wire types of the E2B API, as the official E2B SDKs speak it.
//!
//! Two planes: the control-plane REST API (`/sandboxes`, `/v2/sandboxes`, JSON with the
//! field spellings of E2B's OpenAPI spec: `templateID`, `sandboxID`, `envVars`, and the
//! odd snake_case `allow_internet_access`), and the in-sandbox `envd` API: a few REST
//! endpoints plus the `process.Process` and `filesystem.Filesystem` services over Connect
//! with the JSON codec.
//!
//! The Connect messages follow the proto3 JSON mapping: lowerCamelCase names on output
//! (the original snake_case is accepted on input), `int64` as a JSON string (numbers
//! accepted), `bytes` as standard base64, enums by their proto names (numbers accepted), a
//! `oneof` as the one field that is set. Unknown fields are ignored, as the SDKs' own
//! decoders do, so a newer SDK can talk to this server.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// The envd version tether's E2B front implements. The SDKs gate features on it
/// (`e2b/envd/versions.py`): 0.4.0 default user, 0.5.2 `CloseStdin`, 0.5.7 octet-stream
/// uploads, 0.6.2 file metadata, 0.6.3 watch events with entries, 0.6.4 network-mount
/// watches. Everything up to 0.6.4 is implemented.
pub const ENVD_VERSION: &str = "0.6.4";

/// The port envd listens on in a sandbox (`49983-<id>.<domain>` routing).
pub const ENVD_PORT: u16 = 49983;

/// Where a guest agent (tetherd inside a microVM) tunnels to a port of its machine: `GET`
/// this path followed by the port, with its envd access token, `Connection: upgrade` and
/// `Upgrade:` [`GUEST_PORT_TUNNEL_PROTOCOL`]; a `101` answer's connection is then spliced
/// to that port on the guest's loopback, a `502` says nothing listens there.
pub const GUEST_PORT_TUNNEL_PATH: &str = "/tether/port/";

/// The `Upgrade` protocol of [`GUEST_PORT_TUNNEL_PATH`].
pub const GUEST_PORT_TUNNEL_PROTOCOL: &str = "tether-port";

// === control plane ===

/// Body of `POST /sandboxes` (v1) and `POST /v2/sandboxes` (v2): the fields tether uses.
/// Other fields (`mcp`, `iam`, `volumeMounts`, ...) are accepted and ignored; `network`'s
/// are each served or refused ([`SandboxNetwork`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewSandboxRequest {
    /// Template id or alias.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Time to live in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
    /// Metadata stored with the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Environment of every process.
    #[serde(rename = "envVars", default, skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Pause instead of kill at timeout.
    #[serde(rename = "autoPause", default, skip_serializing_if = "Option::is_none")]
    pub auto_pause: Option<bool>,
    /// Whether the pause at timeout keeps memory (default) or the file system only.
    #[serde(
        rename = "autoPauseMemory",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub auto_pause_memory: Option<bool>,
    /// Resume a paused sandbox when traffic reaches it.
    #[serde(
        rename = "autoResume",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub auto_resume: Option<AutoResume>,
    /// v1 only: secure envd with an access token (always on in tether).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure: Option<bool>,
    /// Network access from inside the sandbox (snake_case on the wire, as E2B spells it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    /// Network options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetwork>,
}

/// `network` of a create (E2B's `SandboxNetworkConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetwork {
    /// Whether the sandbox's ports are reached without its traffic access token
    /// (default true).
    #[serde(
        rename = "allowPublicTraffic",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub allow_public_traffic: Option<bool>,
    /// The `Host` header the sandbox's servers see; `${PORT}` is the port.
    #[serde(
        rename = "maskRequestHost",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mask_request_host: Option<String>,
    /// Ports whose servers speak HTTPS: the port proxy reaches them over TLS (their
    /// certificates are not verified, so self-signed ones work).
    #[serde(
        rename = "httpsPorts",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub https_ports: Option<Vec<u16>>,
    /// Egress allowed despite `denyOut`.
    #[serde(rename = "allowOut", default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    /// Egress denied.
    #[serde(rename = "denyOut", default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    /// Any other option, by name (refused unless empty: a rule is never silently dropped).
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `network` of a sandbox's detail: how its ports are reached, as created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetworkDetail {
    /// Whether the sandbox's ports are reached without its traffic access token.
    #[serde(rename = "allowPublicTraffic")]
    pub allow_public_traffic: bool,
    /// The `Host` header the sandbox's servers see.
    #[serde(
        rename = "maskRequestHost",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mask_request_host: Option<String>,
    /// Ports reached over TLS.
    #[serde(rename = "httpsPorts", default, skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u16>,
}

/// Body of `PUT /sandboxes/{id}/network`: a running sandbox's egress rules, replaced
/// whole (an absent list is an empty one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetworkUpdate {
    /// Egress allowed despite `denyOut` (and despite `allow_internet_access: false`).
    #[serde(rename = "allowOut", default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    /// Egress denied.
    #[serde(rename = "denyOut", default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    /// `false`: every destination not in `allowOut` is denied (snake_case on the wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    /// Any other option, by name (refused unless empty: a rule is never silently dropped).
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `autoResume` of a create (`SandboxAutoResumeConfig`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoResume {
    /// Resume on traffic.
    pub enabled: bool,
}

/// Response of create, connect and resume (`Sandbox` in E2B's spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxResponse {
    /// Template id.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Sandbox id.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Deprecated constant, still required by the SDKs' parsers.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// The envd version served ([`ENVD_VERSION`]).
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    /// Template alias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// The token envd requests must carry in `X-Access-Token`.
    #[serde(
        rename = "envdAccessToken",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_access_token: Option<String>,
    /// Token for user-port traffic (not used: always null).
    #[serde(rename = "trafficAccessToken", default)]
    pub traffic_access_token: Option<String>,
    /// Base domain of the sandbox's traffic (`49983-<id>.<domain>`).
    #[serde(default)]
    pub domain: Option<String>,
}

/// State of a sandbox in listings and details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Running.
    Running,
    /// Paused.
    Paused,
}

impl SandboxState {
    /// Parse the wire spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "running" => Some(Self::Running),
            "paused" => Some(Self::Paused),
            _ => None,
        }
    }
}

/// What happens to a sandbox at its timeout, and whether it resumes by itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLifecycle {
    /// Resume on traffic.
    #[serde(rename = "autoResume")]
    pub auto_resume: bool,
    /// `kill` or `pause`.
    #[serde(rename = "onTimeout")]
    pub on_timeout: String,
}

/// `GET /sandboxes/{id}` (`SandboxDetail`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxDetail {
    /// Template id.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Sandbox id.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Deprecated constant.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// Start time, RFC 3339.
    #[serde(rename = "startedAt")]
    pub started_at: String,
    /// End time (timeout), RFC 3339.
    #[serde(rename = "endAt")]
    pub end_at: String,
    /// envd version.
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    /// CPUs.
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    /// Memory, MiB.
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    /// Disk, MiB.
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    /// State.
    pub state: SandboxState,
    /// Template alias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// envd access token.
    #[serde(
        rename = "envdAccessToken",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_access_token: Option<String>,
    /// Network access.
    #[serde(
        rename = "allowInternetAccess",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub allow_internet_access: Option<bool>,
    /// Base domain.
    #[serde(default)]
    pub domain: Option<String>,
    /// Metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Lifecycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<SandboxLifecycle>,
    /// How its ports are reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetworkDetail>,
}

/// One sample of `GET /sandboxes/{id}/metrics` (`SandboxMetric`): every field required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    /// When it was taken, RFC 3339 (deprecated by E2B in favour of `timestampUnix`).
    pub timestamp: String,
    /// When it was taken, Unix seconds.
    pub timestamp_unix: i64,
    /// CPUs of the sandbox.
    pub cpu_count: u32,
    /// CPU used since the previous sample (or since the start), percent of `cpu_count`.
    pub cpu_used_pct: f32,
    /// Memory used, bytes.
    pub mem_used: u64,
    /// Memory the sandbox may use, bytes.
    pub mem_total: u64,
    /// Page cache, bytes (0 where the provider does not tell it apart).
    pub mem_cache: u64,
    /// Disk used, bytes.
    pub disk_used: u64,
    /// Disk the sandbox may use, bytes.
    pub disk_total: u64,
}

/// `GET /sandboxes/metrics?sandbox_ids=...`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxesMetrics {
    /// The latest sample of each sandbox asked for that exists.
    pub sandboxes: std::collections::BTreeMap<String, SandboxMetric>,
}

/// One item of `GET /sandboxes` and `GET /v2/sandboxes` (`ListedSandbox`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedSandbox {
    /// Template id.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Sandbox id.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Deprecated constant.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// Start time, RFC 3339.
    #[serde(rename = "startedAt")]
    pub started_at: String,
    /// End time, RFC 3339.
    #[serde(rename = "endAt")]
    pub end_at: String,
    /// CPUs.
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    /// Memory, MiB.
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    /// Disk, MiB.
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    /// State.
    pub state: SandboxState,
    /// envd version.
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    /// Template alias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// Metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// Body of `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeoutRequest {
    /// New time to live from now, seconds.
    pub timeout: i64,
}

/// Body of `POST /sandboxes/{id}/refreshes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefreshRequest {
    /// Extension from now, seconds (extends only).
    #[serde(default)]
    pub duration: Option<i64>,
}

/// Body of `POST /sandboxes/{id}/connect` (v1, `timeout` required there) and
/// `POST /v2/sandboxes/{id}/connect` (everything optional).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectSandboxRequest {
    /// Time to live from now, seconds; extends only.
    #[serde(default)]
    pub timeout: Option<i64>,
    /// `false`: a paused sandbox is resumed by a boot, without the memory its pause kept
    /// (the SDKs' `onResume: "reboot"`); absent or `true`: as it was paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
}

/// Body of `POST /sandboxes/{id}/pause` (optional; the SDKs send `{}` or
/// `{"memory": false}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseSandboxRequest {
    /// Keep the sandbox's memory (default): `false` keeps its file system only, and its
    /// resume boots it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<bool>,
}

/// Body of `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// A name; a later snapshot under the same name takes it over.
    #[serde(default)]
    pub name: Option<String>,
    /// Whether the sandbox's memory is kept too (where the provider can: the microVM
    /// provider keeps it always, the local provider never).
    #[serde(default)]
    pub memory: Option<bool>,
}

/// A snapshot (`SnapshotInfo` in E2B's spec): answer of `POST /sandboxes/{id}/snapshots`,
/// items of `GET /snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// `<name or id>:<tag>`: what `templateID` takes to create a sandbox from it.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// Its full names (`<name>:<tag>`).
    pub names: Vec<String>,
}

/// Body of `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// Time to live of each fork, seconds (15 when absent, as E2B).
    #[serde(default)]
    pub timeout: Option<i64>,
    /// How many forks (1 when absent).
    #[serde(default)]
    pub count: Option<i64>,
}

/// One fork's outcome in the answer of `POST /sandboxes/{id}/fork`: exactly one of the
/// two is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkResult {
    /// The fork, when it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxResponse>,
    /// Why it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

/// The error body of the control plane and of envd's REST endpoints:
/// `{"code": <HTTP status>, "message": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// The HTTP status, repeated.
    pub code: u16,
    /// A human sentence.
    pub message: String,
    /// A machine code for a few create failures (`sandbox_create_failed`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

/// The answer of the edge proxy in front of envd when a sandbox is gone: the SDKs key
/// on `"was not found"` in `message` (`SandboxNotRunningException`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyError {
    /// The sandbox id asked for.
    #[serde(rename = "sandboxId")]
    pub sandbox_id: String,
    /// `The sandbox was not found`.
    pub message: String,
    /// 502.
    pub code: u16,
    /// The port asked for, when that port is what is closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

// === envd REST ===

/// Body of envd's `POST /init`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitRequest {
    /// Sandbox-wide environment added to every process.
    #[serde(rename = "envVars", default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// The access token; must repeat the one issued at create.
    #[serde(rename = "accessToken", default)]
    pub access_token: Option<String>,
    /// Default user of processes and file operations.
    #[serde(rename = "defaultUser", default)]
    pub default_user: Option<String>,
    /// Default working directory of processes.
    #[serde(rename = "defaultWorkdir", default)]
    pub default_workdir: Option<String>,
    /// The caller's clock, RFC 3339: a guest agent sets the machine's clock to it (a
    /// restored VM's clock is its snapshot's); the E2B front ignores it.
    #[serde(default)]
    pub timestamp: Option<String>,
    /// tether's guest agent only: random bytes (base64, at least 32) mixed into the
    /// guest's random pool, so that VMs restored from one saved state diverge.
    #[serde(
        rename = "tetherEntropy",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub tether_entropy: Option<String>,
}

/// One entry of the answer of `POST /files`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenEntry {
    /// Sandbox path.
    pub path: String,
    /// Base name.
    pub name: String,
    /// Always `file`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The metadata stored with the file, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

// === Connect errors ===

pub use crate::connect::{ConnectCode, ConnectErrorBody, EndOfStream};

/// An empty message (`{}`): the responses that carry nothing, `KeepAlive`, `StartEvent`
/// of `WatchDir`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

// === process.Process ===

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessConfig {
    /// The program.
    #[serde(default)]
    pub cmd: String,
    /// Its arguments.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_default"
    )]
    pub args: Vec<String>,
    /// Environment added for this process.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "null_default"
    )]
    pub envs: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `process.PTY.Size`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySizeMsg {
    /// Columns.
    #[serde(default, deserialize_with = "uint_lenient")]
    pub cols: u32,
    /// Rows.
    #[serde(default, deserialize_with = "uint_lenient")]
    pub rows: u32,
}

/// `process.PTY`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtyMsg {
    /// The terminal size.
    #[serde(default)]
    pub size: Option<PtySizeMsg>,
}

/// `process.ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessSelector {
    /// By pid.
    Pid(#[serde(deserialize_with = "uint_lenient")] u32),
    /// By tag.
    Tag(String),
}

/// `process.StartRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartRequest {
    /// What to run.
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    /// Run under a pty of this size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtyMsg>,
    /// A client-chosen tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Keep stdin open (absent means true, for old clients).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
}

/// `process.ConnectRequest`, `process.CloseStdinRequest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectRequest {
    /// The process.
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

/// `process.UpdateRequest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateRequest {
    /// The process.
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    /// The new pty size.
    #[serde(default)]
    pub pty: Option<PtyMsg>,
}

/// `process.ProcessInput`: a oneof of `stdin` and `pty` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessInput {
    /// Bytes for stdin.
    Stdin(#[serde(with = "b64_lenient")] Vec<u8>),
    /// Bytes for the pty.
    Pty(#[serde(with = "b64_lenient")] Vec<u8>),
}

/// `process.SendInputRequest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInputRequest {
    /// The process.
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    /// The input.
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// `process.Signal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalMsg {
    /// `SIGNAL_UNSPECIFIED` (0).
    Unspecified,
    /// `SIGNAL_SIGTERM` (15).
    Sigterm,
    /// `SIGNAL_SIGKILL` (9).
    Sigkill,
    /// A number the proto does not name.
    Other(i64),
}

impl Serialize for SignalMsg {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Unspecified => s.serialize_str("SIGNAL_UNSPECIFIED"),
            Self::Sigterm => s.serialize_str("SIGNAL_SIGTERM"),
            Self::Sigkill => s.serialize_str("SIGNAL_SIGKILL"),
            Self::Other(n) => s.serialize_i64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for SignalMsg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match EnumRepr::deserialize(d)? {
            EnumRepr::Name(n) => match n.as_str() {
                "SIGNAL_UNSPECIFIED" => Self::Unspecified,
                "SIGNAL_SIGTERM" => Self::Sigterm,
                "SIGNAL_SIGKILL" => Self::Sigkill,
                other => return Err(de::Error::custom(format!("unknown signal {other:?}"))),
            },
            EnumRepr::Number(0) | EnumRepr::Null => Self::Unspecified,
            EnumRepr::Number(15) => Self::Sigterm,
            EnumRepr::Number(9) => Self::Sigkill,
            EnumRepr::Number(n) => Self::Other(n),
        })
    }
}

/// `process.SendSignalRequest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSignalRequest {
    /// The process.
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    /// The signal.
    #[serde(default = "unspecified_signal")]
    pub signal: SignalMsg,
}

fn unspecified_signal() -> SignalMsg {
    SignalMsg::Unspecified
}

/// `process.StreamInputRequest`: a oneof of `start`, `data` and `keepalive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    /// The first message: which process.
    Start(SelectRequest),
    /// Input bytes.
    Data(StreamInputData),
    /// Keeps the stream alive.
    Keepalive(Empty),
}

/// `process.StreamInputRequest.DataEvent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputData {
    /// The input.
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// `process.ProcessEvent.DataEvent`: a oneof of `stdout`, `stderr` and `pty` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    /// Standard output.
    Stdout(#[serde(with = "b64_lenient")] Vec<u8>),
    /// Standard error.
    Stderr(#[serde(with = "b64_lenient")] Vec<u8>),
    /// Pty output.
    Pty(#[serde(with = "b64_lenient")] Vec<u8>),
}

/// `process.ProcessEvent.StartEvent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartEvent {
    /// The process id.
    #[serde(deserialize_with = "uint_lenient")]
    pub pid: u32,
}

/// `process.ProcessEvent.EndEvent`, shaped like Go's `ProcessState`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndEvent {
    /// Exit code; -1 when ended by a signal. Omitted when 0 (proto3 default).
    #[serde(
        rename = "exitCode",
        alias = "exit_code",
        default,
        skip_serializing_if = "is_zero_i32"
    )]
    pub exit_code: i32,
    /// Whether the process exited by itself (not by a signal).
    #[serde(default, skip_serializing_if = "is_false")]
    pub exited: bool,
    /// `exit status N` or `signal: killed`.
    #[serde(default)]
    pub status: String,
    /// The wait error text, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Go's names of the Linux signals 1 to 31 (`syscall.Signal.String`), as envd's `status`
/// spells them (`signal: killed`).
const GO_SIGNAL_NAMES: [&str; 31] = [
    "hangup",
    "interrupt",
    "quit",
    "illegal instruction",
    "trace/breakpoint trap",
    "aborted",
    "bus error",
    "floating point exception",
    "killed",
    "user defined signal 1",
    "segmentation fault",
    "user defined signal 2",
    "broken pipe",
    "alarm clock",
    "terminated",
    "stack fault",
    "child exited",
    "continued",
    "stopped (signal)",
    "stopped",
    "stopped (tty input)",
    "stopped (tty output)",
    "urgent I/O condition",
    "CPU time limit exceeded",
    "file size limit exceeded",
    "virtual timer expired",
    "profiling timer expired",
    "window changed",
    "I/O possible",
    "power failure",
    "bad system call",
];

/// Go's name of a signal number (`signal 40` for one it does not name).
pub fn go_signal_name(sig: i32) -> std::borrow::Cow<'static, str> {
    usize::try_from(sig)
        .ok()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| GO_SIGNAL_NAMES.get(i))
        .map_or_else(
            || std::borrow::Cow::Owned(format!("signal {sig}")),
            |n| std::borrow::Cow::Borrowed(*n),
        )
}

/// The number of a signal from Go's name of it (`killed`, `signal 40`); a trailing
/// ` (core dumped)` is ignored.
pub fn go_signal_number(name: &str) -> Option<i32> {
    let name = name.trim().trim_end_matches(" (core dumped)");
    if let Some(i) = GO_SIGNAL_NAMES.iter().position(|n| *n == name) {
        return i32::try_from(i + 1).ok();
    }
    name.strip_prefix("signal ")
        .and_then(|n| n.trim().parse().ok())
}

/// How a process ended, as an [`EndEvent`] says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessOutcome {
    /// It exited with this code.
    Exited(i32),
    /// A signal ended it.
    Signaled(i32),
    /// The event does not say (a status envd did not spell as Go does).
    Unknown,
}

impl EndEvent {
    /// The end of a process that exited with `code`: Go's `exit status N`, the same text
    /// as the error when the code is not 0 (`exec.ExitError`).
    pub fn exited_with(code: i32) -> Self {
        let status = format!("exit status {code}");
        Self {
            exit_code: code,
            exited: true,
            error: (code != 0).then(|| status.clone()),
            status,
        }
    }

    /// The end of a process a signal ended: Go's `signal: killed`, exit code -1.
    pub fn signaled(sig: i32) -> Self {
        let status = format!("signal: {}", go_signal_name(sig));
        Self {
            exit_code: -1,
            exited: false,
            error: Some(status.clone()),
            status,
        }
    }

    /// The end of a process whose status was lost.
    pub fn unknown() -> Self {
        Self {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("the process ended without a status".into()),
        }
    }

    /// How the process ended: from `exited` and `exitCode`, else from the `status` text.
    pub fn outcome(&self) -> ProcessOutcome {
        if self.exited {
            return ProcessOutcome::Exited(self.exit_code);
        }
        let status = self.status.trim();
        if let Some(n) = status.strip_prefix("signal: ").and_then(go_signal_number) {
            return ProcessOutcome::Signaled(n);
        }
        if let Some(code) = status
            .strip_prefix("exit status ")
            .and_then(|c| c.trim().parse().ok())
        {
            return ProcessOutcome::Exited(code);
        }
        if self.exit_code >= 0 {
            ProcessOutcome::Exited(self.exit_code)
        } else {
            ProcessOutcome::Unknown
        }
    }
}

/// `process.ProcessEvent`: a oneof of `start`, `data`, `end` and `keepalive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEventMsg {
    /// Always first.
    Start(StartEvent),
    /// Output.
    Data(DataEvent),
    /// Always last.
    End(EndEvent),
    /// Sent when nothing else was for the keepalive interval.
    Keepalive(Empty),
}

/// `process.StartResponse` and `process.ConnectResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEventResponse {
    /// The event.
    pub event: ProcessEventMsg,
}

/// `process.ProcessInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfoMsg {
    /// What runs.
    pub config: ProcessConfig,
    /// Its pid.
    pub pid: u32,
    /// Its tag, if it was started with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `process.ListResponse`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListResponse {
    /// Running processes.
    #[serde(default)]
    pub processes: Vec<ProcessInfoMsg>,
}

// === filesystem.Filesystem ===

/// `filesystem.FileType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileType {
    /// Unknown (the SDKs drop such entries).
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    /// Regular file.
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    /// Directory.
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    /// Symbolic link.
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryInfo {
    /// Base name.
    pub name: String,
    /// Kind.
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Absolute sandbox path.
    pub path: String,
    /// Size in bytes (int64: a JSON string).
    #[serde(with = "int64_string")]
    pub size: i64,
    /// Mode bits including the type bits (Go's `os.FileMode`).
    pub mode: u32,
    /// `-rw-r--r--`.
    pub permissions: String,
    /// Owner name.
    pub owner: String,
    /// Group name.
    pub group: String,
    /// Modification time, RFC 3339.
    #[serde(
        rename = "modifiedTime",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub modified_time: Option<String>,
    /// Where a symlink points.
    #[serde(
        rename = "symlinkTarget",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub symlink_target: Option<String>,
    /// User metadata of the file.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Whether the path is a symlink.
    #[serde(rename = "isSymlink", default, skip_serializing_if = "is_false")]
    pub is_symlink: bool,
}

/// A request naming one path (`StatRequest`, `MakeDirRequest`, `RemoveRequest`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRequest {
    /// The path.
    #[serde(default)]
    pub path: String,
}

/// A response carrying one entry (`StatResponse`, `MakeDirResponse`, `MoveResponse`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryResponse {
    /// The entry.
    pub entry: EntryInfo,
}

/// `filesystem.MoveRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveRequest {
    /// From.
    #[serde(default)]
    pub source: String,
    /// To.
    #[serde(default)]
    pub destination: String,
}

/// `filesystem.ListDirRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListDirRequest {
    /// The directory.
    #[serde(default)]
    pub path: String,
    /// Levels (0 reads as 1).
    #[serde(default, deserialize_with = "uint_lenient")]
    pub depth: u32,
}

/// `filesystem.ListDirResponse`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListDirResponse {
    /// The entries.
    #[serde(default)]
    pub entries: Vec<EntryInfo>,
}

/// `filesystem.WatchDirRequest` and `filesystem.CreateWatcherRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    /// The directory.
    #[serde(default)]
    pub path: String,
    /// Watch subdirectories too.
    #[serde(default)]
    pub recursive: bool,
    /// Attach the entry to each event.
    #[serde(rename = "includeEntry", alias = "include_entry", default)]
    pub include_entry: bool,
    /// Allow network mounts (accepted; the front watches through the provider).
    #[serde(rename = "allowNetworkMounts", alias = "allow_network_mounts", default)]
    pub allow_network_mounts: bool,
}

/// `filesystem.EventType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    /// Unknown.
    #[serde(rename = "EVENT_TYPE_UNSPECIFIED")]
    Unspecified,
    /// Created.
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    /// Written.
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    /// Removed.
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    /// Renamed.
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    /// Permissions changed.
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

/// `filesystem.FilesystemEvent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilesystemEvent {
    /// Path relative to the watched directory.
    pub name: String,
    /// What happened.
    #[serde(rename = "type")]
    pub kind: EventType,
    /// The entry, when asked for and available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `filesystem.WatchDirResponse`: a oneof of `start`, `filesystem` and `keepalive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchDirResponse {
    /// Always first: the watch is armed.
    Start(Empty),
    /// One event (boxed: it dwarfs the other variants).
    Filesystem(Box<FilesystemEvent>),
    /// Sent when nothing else was for the keepalive interval.
    Keepalive(Empty),
}

/// `filesystem.CreateWatcherResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateWatcherResponse {
    /// The watcher's id.
    #[serde(rename = "watcherId", alias = "watcher_id")]
    pub watcher_id: String,
}

/// `filesystem.GetWatcherEventsRequest` and `filesystem.RemoveWatcherRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatcherRequest {
    /// The watcher's id.
    #[serde(rename = "watcherId", alias = "watcher_id", default)]
    pub watcher_id: String,
}

/// `filesystem.GetWatcherEventsResponse`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatcherEventsResponse {
    /// Events since the previous call.
    #[serde(default)]
    pub events: Vec<FilesystemEvent>,
}

// === proto3 JSON helpers ===

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

/// `null` reads as the default value (proto3 JSON).
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// An enum value as proto3 JSON allows it: a name, a number or null.
enum EnumRepr {
    Name(String),
    Number(i64),
    Null,
}

impl<'de> Deserialize<'de> for EnumRepr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = EnumRepr;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an enum name or number")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<EnumRepr, E> {
                Ok(EnumRepr::Name(v.to_owned()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<EnumRepr, E> {
                Ok(EnumRepr::Number(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<EnumRepr, E> {
                i64::try_from(v)
                    .map(EnumRepr::Number)
                    .map_err(|_| E::custom("enum number out of range"))
            }
            fn visit_unit<E: de::Error>(self) -> Result<EnumRepr, E> {
                Ok(EnumRepr::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<EnumRepr, E> {
                Ok(EnumRepr::Null)
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer given as a JSON number or a decimal string (proto3 JSON accepts both).
fn int_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = i64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an integer or a decimal string")
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
            Ok(v)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
            i64::try_from(v).map_err(|_| E::custom("integer out of range"))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<i64, E> {
            if v.fract() == 0.0 && v.abs() < 9.0e15 {
                Ok(v as i64)
            } else {
                Err(E::custom("not an integer"))
            }
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<i64, E> {
            v.trim()
                .parse()
                .map_err(|_| E::custom("not an integer string"))
        }
        fn visit_unit<E: de::Error>(self) -> Result<i64, E> {
            Ok(0)
        }
    }
    d.deserialize_any(V)
}

fn uint_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = int_lenient(d)?;
    u32::try_from(n).map_err(|_| de::Error::custom("value out of range for uint32"))
}

/// `int64` fields: a string on output, a string or a number on input.
mod int64_string {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        super::int_lenient(d)
    }
}

/// `bytes` fields: standard padded base64 on output; standard or URL-safe, padded or
/// not, on input (proto3 JSON parsers accept all four).
mod b64_lenient {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
            .iter()
            .find_map(|e| e.decode(s.as_bytes()).ok())
            .ok_or_else(|| serde::de::Error::custom("invalid base64"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn start_request_as_the_python_sdk_sends_it() {
        let body = r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hello"],"envs":{"X":"y"},"cwd":"/tmp"},"stdin":false}"#;
        let r: StartRequest = serde_json::from_str(body).unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hello"]);
        assert_eq!(p.envs.get("X").map(String::as_str), Some("y"));
        assert_eq!(p.cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.stdin, Some(false));
        let pty: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-i","-l"]},"pty":{"size":{"cols":80,"rows":24}},"tag":"x"}"#,
        )
        .unwrap();
        assert_eq!(
            pty.pty.unwrap().size,
            Some(PtySizeMsg { cols: 80, rows: 24 })
        );
        assert_eq!(pty.stdin, None);
    }

    #[test]
    fn oneofs_enums_and_bytes_follow_proto3_json() {
        let s: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(s.process, Some(ProcessSelector::Pid(7)));
        assert_eq!(s.signal, SignalMsg::Sigkill);
        let n: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":"7"},"signal":15}"#).unwrap();
        assert_eq!(
            (n.process, n.signal),
            (Some(ProcessSelector::Pid(7)), SignalMsg::Sigterm)
        );
        assert!(
            serde_json::from_str::<SendSignalRequest>(r#"{"signal":"SIGNAL_SIGHUP"}"#).is_err()
        );
        let i: SendInputRequest =
            serde_json::from_str(r#"{"process":{"tag":"t1"},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(i.input, Some(ProcessInput::Stdin(b"hi\n".to_vec())));
        let unpadded: ProcessInput = serde_json::from_str(r#"{"pty":"aGk"}"#).unwrap();
        assert_eq!(unpadded, ProcessInput::Pty(b"hi".to_vec()));
        let first: StreamInputRequest =
            serde_json::from_str(r#"{"start":{"process":{"pid":3}}}"#).unwrap();
        assert_eq!(
            first,
            StreamInputRequest::Start(SelectRequest {
                process: Some(ProcessSelector::Pid(3))
            })
        );
    }

    #[test]
    fn process_status_and_signal_names_are_go_s() {
        for sig in 1..=40 {
            assert_eq!(
                go_signal_number(&go_signal_name(sig)),
                Some(sig),
                "signal {sig}"
            );
        }
        assert_eq!(go_signal_name(9), "killed");
        assert_eq!(go_signal_name(15), "terminated");
        assert_eq!(go_signal_name(40), "signal 40");
        assert_eq!(
            go_signal_number("segmentation fault (core dumped)"),
            Some(11)
        );
        assert_eq!(go_signal_number("nonsense"), None);
        let killed = EndEvent::signaled(9);
        assert_eq!(
            (killed.exit_code, killed.exited, killed.status.as_str()),
            (-1, false, "signal: killed")
        );
        assert_eq!(killed.outcome(), ProcessOutcome::Signaled(9));
        let ok = EndEvent::exited_with(0);
        assert_eq!(
            (ok.status.as_str(), ok.error.as_deref()),
            ("exit status 0", None)
        );
        assert_eq!(ok.outcome(), ProcessOutcome::Exited(0));
        let three = EndEvent::exited_with(3);
        assert_eq!(three.error.as_deref(), Some("exit status 3"));
        assert_eq!(three.outcome(), ProcessOutcome::Exited(3));
        // Decoded from envd's JSON, where `exited` may be missing but the text says it.
        let parsed: EndEvent =
            serde_json::from_str(r#"{"exitCode":2,"status":"exit status 2"}"#).unwrap();
        assert_eq!(parsed.outcome(), ProcessOutcome::Exited(2));
        assert_eq!(EndEvent::unknown().outcome(), ProcessOutcome::Unknown);
    }

    #[test]
    fn events_serialise_as_envd_sends_them() {
        let start = ProcessEventResponse {
            event: ProcessEventMsg::Start(StartEvent { pid: 42 }),
        };
        assert_eq!(
            serde_json::to_value(&start).unwrap(),
            json!({"event":{"start":{"pid":42}}})
        );
        let data = ProcessEventResponse {
            event: ProcessEventMsg::Data(DataEvent::Stdout(b"hi\n".to_vec())),
        };
        assert_eq!(
            serde_json::to_value(&data).unwrap(),
            json!({"event":{"data":{"stdout":"aGkK"}}})
        );
        let ok = EndEvent {
            exit_code: 0,
            exited: true,
            status: "exit status 0".into(),
            error: None,
        };
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"exited":true,"status":"exit status 0"})
        );
        let killed = EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: None,
        };
        assert_eq!(
            serde_json::to_value(&killed).unwrap(),
            json!({"exitCode":-1,"status":"signal: killed"})
        );
        let ka = ProcessEventResponse {
            event: ProcessEventMsg::Keepalive(Empty {}),
        };
        assert_eq!(
            serde_json::to_string(&ka).unwrap(),
            r#"{"event":{"keepalive":{}}}"#
        );
        let w = WatchDirResponse::Filesystem(Box::new(FilesystemEvent {
            name: "a".into(),
            kind: EventType::Create,
            entry: None,
        }));
        assert_eq!(
            serde_json::to_value(&w).unwrap(),
            json!({"filesystem":{"name":"a","type":"EVENT_TYPE_CREATE"}})
        );
    }

    #[test]
    fn entry_info_carries_int64_as_string() {
        let e = EntryInfo {
            name: "a.txt".into(),
            kind: FileType::File,
            path: "/home/user/a.txt".into(),
            size: 5,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: Some("2026-01-01T00:00:00Z".into()),
            symlink_target: None,
            metadata: BTreeMap::new(),
            is_symlink: false,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["size"], json!("5"));
        assert_eq!(v["type"], json!("FILE_TYPE_FILE"));
        assert_eq!(v["modifiedTime"], json!("2026-01-01T00:00:00Z"));
        assert_eq!(serde_json::from_value::<EntryInfo>(v).unwrap(), e);
        let l: ListDirRequest = serde_json::from_str(r#"{"path":"/home/user","depth":1}"#).unwrap();
        assert_eq!(l.depth, 1);
    }

    #[test]
    fn control_plane_bodies() {
        let v2: NewSandboxRequest =
            serde_json::from_str(r#"{"templateID":"base","metadata":{},"envVars":{}}"#).unwrap();
        assert_eq!(v2.template_id, "base");
        assert_eq!(v2.timeout, None);
        let v1: NewSandboxRequest = serde_json::from_str(
            r#"{"templateID":"base","timeout":120,"secure":true,"allow_internet_access":true,"metadata":{"k":"v"},"envVars":{"A":"1"},"mcp":null}"#,
        )
        .unwrap();
        assert_eq!(v1.timeout, Some(120));
        assert_eq!(v1.allow_internet_access, Some(true));
        let r = SandboxResponse {
            template_id: "base".into(),
            sandbox_id: "i1".into(),
            client_id: "tether".into(),
            envd_version: ENVD_VERSION.into(),
            alias: None,
            envd_access_token: Some("t".into()),
            traffic_access_token: None,
            domain: None,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["clientID"], json!("tether"));
        assert!(v.get("trafficAccessToken").unwrap().is_null());
        assert_eq!(
            serde_json::to_value(ConnectCode::InvalidArgument).unwrap(),
            json!("invalid_argument")
        );
        assert_eq!(
            serde_json::to_string(&EndOfStream::error(ConnectCode::NotFound, "x")).unwrap(),
            r#"{"error":{"code":"not_found","message":"x"}}"#
        );
    }
}
