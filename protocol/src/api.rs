//! Requests and responses of the native HTTP API (`/v1/...`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::events::{Message, Source, ToolResult};
use crate::process::{ExitStatus, PtySize, StdinMode};

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthResponse {
    /// `"ok"`.
    pub status: String,
    /// The API version ([`crate::API_VERSION`]).
    pub api_version: String,
    /// The daemon's version.
    pub daemon_version: String,
    /// Configured provider names.
    pub providers: Vec<String>,
}

/// `POST /v1/sessions`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// A configured provider name; the configured default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Provider template (E2B template id, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Time to live of the sandbox without activity, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// Environment variables of every command in the sandbox.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Free-form metadata, stored in the log header and the provider's metadata.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Allow network access from the sandbox (local provider: off by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<bool>,
    /// Resource limits of the sandbox (memory, pids, CPU, disk); the provider's defaults
    /// fill what is not given.
    #[serde(default)]
    pub limits: crate::limits::ResourceLimits,
    /// A snapshot (id or name) the sandbox's file system starts from, instead of the
    /// template; the session's provider is the snapshot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Egress rules, with `network` (`{allow?: [CIDR], deny?: [CIDR]}`): enforced where
    /// the sandbox cannot change them, or the create is refused.
    #[serde(default, skip_serializing_if = "crate::network::Egress::is_empty")]
    pub egress: crate::network::Egress,
}

/// A session as the API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Session id.
    pub id: String,
    /// Provider name.
    pub provider: String,
    /// Sandbox id at the provider, when one is leased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// `active`, `detached` (sandbox lost), or `closed`.
    pub state: String,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: i64,
    /// Number of events in the log.
    pub events: u64,
    /// The parent session, if forked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session: Option<String>,
    /// The isolation the sandbox enforces (`full`, `partial`, `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<String>,
    /// Metadata.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// The sandbox is paused (`POST /v1/sessions/{id}/pause`): calls are refused with
    /// `CONFLICT` until it is resumed.
    #[serde(default)]
    pub paused: bool,
    /// The egress rules in force (with network; `PUT /v1/sessions/{id}/network`
    /// replaces them).
    #[serde(default, skip_serializing_if = "crate::network::Egress::is_empty")]
    pub egress: crate::network::Egress,
}

/// `GET /v1/sessions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListSessionsResponse {
    /// The sessions.
    pub sessions: Vec<SessionInfo>,
}

/// One tool call of a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallRequest {
    /// Call id, unique in the session.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments (a JSON object).
    #[serde(default)]
    pub arguments: Value,
}

/// `POST /v1/sessions/{id}/tool-calls`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallsRequest {
    /// The calls of one model reply, in model order.
    pub calls: Vec<ToolCallRequest>,
}

/// Response of `POST /v1/sessions/{id}/tool-calls`: results in model order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallsResponse {
    /// One result per call, in the order of the request.
    pub results: Vec<ToolResult>,
}

/// `POST /v1/sessions/{id}/messages`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostMessageRequest {
    /// `user` or `assistant`.
    pub role: String,
    /// Text.
    pub content: String,
}

/// `GET /v1/sessions/{id}/messages`: the history derived from the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesResponse {
    /// Messages in log order.
    pub messages: Vec<Message>,
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Inclusive boundary seq; the last event outside an open turn when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_seq: Option<u64>,
}

/// `POST /v1/sessions/{id}/pause` (the body is optional).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// What the pause keeps: `memory` (default) or `filesystem`.
    #[serde(default)]
    pub kind: crate::events::PauseKind,
}

/// `POST /v1/sessions/{id}/resume` (the body is optional).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Boot the sandbox again instead of going on from where its pause kept it (its
    /// processes end; its file system stays).
    #[serde(default)]
    pub reboot: bool,
}

/// `POST /v1/sessions/{id}/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// A name, unique per owner: a later snapshot under the same name takes it over
    /// (the earlier one is deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A snapshot as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// The snapshot id.
    pub id: String,
    /// Its name, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The session it was taken of.
    pub session_id: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// The provider that keeps it.
    pub provider: String,
    /// When it was taken, ms since the Unix epoch.
    pub created_ms: i64,
}

/// The query of `GET /v1/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListSnapshotsQuery {
    /// Only the snapshots of this session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Only the snapshot of this name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `GET /v1/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListSnapshotsResponse {
    /// Oldest first.
    pub snapshots: Vec<SnapshotInfo>,
}

/// The query of `GET /v1/sessions/{id}/events`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only the events after this seq; all of them when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// Keep the stream open and send new events as they are logged.
    #[serde(default)]
    pub follow: bool,
}

/// `POST /v1/sessions/{id}/processes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartProcessRequest {
    /// A shell command line (exclusive with `argv`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    /// An argv vector (exclusive with `cmd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Environment changes (`null` removes).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, Option<String>>,
    /// Standard input.
    #[serde(default)]
    pub stdin: StdinMode,
    /// Total deadline, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Output-idle limit, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_ms: Option<u64>,
    /// Run under a pty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Client-chosen command id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
}

/// Response of `POST /v1/sessions/{id}/processes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartProcessResponse {
    /// The command id, to read output from and send input to.
    pub command_id: String,
    /// The pid inside the sandbox.
    pub pid: u32,
}

/// The query of `GET .../processes/{cid}/output`: where to resume each stream.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// Offset in stdout (or the pty output), bytes.
    #[serde(default)]
    pub offset: u64,
    /// Offset in stderr, bytes.
    #[serde(default)]
    pub stderr_offset: u64,
    /// Keep the stream open until the command ends.
    #[serde(default)]
    pub follow: bool,
}

/// `POST .../processes/{cid}/stdin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// Bytes to write, base64.
    #[serde(default, with = "crate::b64")]
    pub data: Vec<u8>,
    /// Close stdin after writing.
    #[serde(default)]
    pub eof: bool,
}

/// `POST .../processes/{cid}/signal`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// Signal name (`TERM`, `KILL`, `INT`, `HUP`, ...) or `terminate` for TERM, grace, KILL.
    pub signal: String,
}

/// `POST .../processes/{cid}/wait` response, and the summary of a finished command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WaitResponse {
    /// The command id.
    pub command_id: String,
    /// How it ended.
    pub status: ExitStatus,
    /// Bytes of stdout (or pty output).
    pub stdout_bytes: u64,
    /// Bytes of stderr.
    pub stderr_bytes: u64,
    /// The clock that ended it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<crate::Clock>,
    /// The sandbox limit it ran into, if it did (`memory`, `pids`, `disk`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<crate::limits::LimitKind>,
}

/// The query of the file routes (`/v1/sessions/{id}/files`, `/v1/sessions/{id}/dirs`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// The file or directory, in the sandbox.
    pub path: String,
    /// `GET .../files`: the first byte to read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// `GET .../files`: how many bytes to read at most; to the end when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    /// `GET .../dirs`: how deep to list (1 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
    /// `DELETE .../files`: remove a directory with its contents.
    #[serde(default)]
    pub recursive: bool,
}

/// An injected context to post as a user message with a non-user source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextMessage {
    /// Source.
    pub source: Source,
    /// Text.
    pub content: String,
}
