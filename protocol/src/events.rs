//! Session-log events: the header line and the events of `events.jsonl`.
//!
//! Each line after the header is an [`Event`]: `{"seq","time","type","data"}` with a
//! contiguous `seq` from 0 and `time` in milliseconds since the Unix epoch.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use serde_json::Value;

use crate::ErrorCode;
use crate::process::{ExitStatus, ProcessSpec};

/// The first line of `events.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionHeader {
    /// Always `"session"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Format version ([`crate::SESSION_LOG_VERSION`]).
    pub version: u32,
    /// Session id.
    pub id: String,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: i64,
    /// The session this one was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session: Option<String>,
    /// Number of events copied from the parent (the seed), when forked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_length: Option<u64>,
    /// The session's parameters: what create, fork and recovery all read.
    pub params: SessionParams,
}

/// What a session was created with. Written once, in the log header; a fork copies it and
/// recovery reads it back, so no setting is lost across a restart or a fork.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionParams {
    /// The configured provider name.
    pub provider: String,
    /// The template, where the provider has templates.
    pub template: Option<String>,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// Whether the sandbox has network access.
    pub network: bool,
    /// Metadata stored with the sandbox.
    pub metadata: BTreeMap<String, String>,
    /// The tenant owning the session (an E2B front API key's tenant); `None` for the
    /// native API without tenants.
    pub owner: Option<String>,
    /// When the session expires. A later `session/expiry` event supersedes it.
    pub expiry: Expiry,
    /// Resource limits asked for at create (the provider's defaults fill the rest).
    pub limits: crate::limits::ResourceLimits,
    /// Who reaches the sandbox's ports through the E2B front's port proxy. A log
    /// written before it existed: public, as every sandbox then was.
    #[serde(default)]
    pub ports: PortAccess,
    /// The snapshot (a daemon snapshot id) the sandbox's file system started from, for a
    /// session created from one; `None`: from its template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// What happens at expiry and on traffic while paused (E2B's `autoPause` and
    /// `autoResume`). A log written before it existed: closed at expiry.
    #[serde(default)]
    pub lifecycle: Lifecycle,
    /// Egress rules of a sandbox with network (E2B's `allowOut` / `denyOut`).
    #[serde(default, skip_serializing_if = "crate::network::Egress::is_empty")]
    pub egress: crate::network::Egress,
}

/// What happens to a session at its expiry, and to its paused sandbox when a request
/// reaches it (E2B's `autoPause`, `autoResume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lifecycle {
    /// Pause the sandbox at expiry instead of closing the session (a paused sandbox does
    /// not expire).
    #[serde(default)]
    pub pause_on_expiry: bool,
    /// Resume the paused sandbox when a request for it (envd, a port) arrives.
    #[serde(default)]
    pub auto_resume: bool,
    /// Its time to live after such a resume, ms (the create's timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_ttl_ms: Option<u64>,
    /// What the pause at expiry keeps (E2B's `autoPauseMemory`).
    #[serde(default, skip_serializing_if = "PauseKind::is_memory")]
    pub pause_kind: PauseKind,
}

/// What a pause keeps of a sandbox (E2B's `keepMemory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseKind {
    /// Memory and file system: its processes stop where they are and go on at resume.
    /// What every pause was before the kind existed.
    #[default]
    Memory,
    /// The file system only: its processes end, and resume boots it again from its
    /// file system (a new boot, as a machine's cold start).
    Filesystem,
}

impl PauseKind {
    /// Whether the pause keeps memory.
    pub fn is_memory(&self) -> bool {
        *self == Self::Memory
    }

    /// The kind E2B's `keepMemory` / `memory` names (`None`: memory, its default).
    pub fn keeping_memory(keep: Option<bool>) -> Self {
        if keep == Some(false) {
            Self::Filesystem
        } else {
            Self::Memory
        }
    }

    /// `memory` or `filesystem`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Filesystem => "filesystem",
        }
    }
}

/// How the E2B front's port proxy admits requests for a sandbox's ports (E2B's
/// `network.allowPublicTraffic`, `network.maskRequestHost` and `network.httpsPorts`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortAccess {
    /// Reached without a token; otherwise a request carries the sandbox's traffic
    /// access token in `e2b-traffic-access-token`.
    pub public: bool,
    /// The `Host` the sandbox's servers see (`${PORT}` is the port asked for); `None`:
    /// the host the client asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_host: Option<String>,
    /// Ports whose servers speak HTTPS, reached over TLS (E2B's `httpsPorts`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub https_ports: std::collections::BTreeSet<u16>,
}

impl Default for PortAccess {
    fn default() -> Self {
        Self {
            public: true,
            mask_host: None,
            https_ports: std::collections::BTreeSet::new(),
        }
    }
}

/// When a session expires by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Expiry {
    /// Never.
    #[default]
    Never,
    /// This long after the last activity (every call renews it).
    Idle {
        /// The idle time to live, ms.
        ttl_ms: u64,
    },
    /// At a fixed time (moved only explicitly, e.g. E2B `set_timeout`).
    At {
        /// Ms since the Unix epoch.
        at_ms: i64,
    },
}

/// One logged event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the log, contiguous from 0.
    pub seq: u64,
    /// Append time, ms since the Unix epoch.
    pub time: i64,
    /// The typed body (`type` and `data` on the wire).
    #[serde(flatten)]
    pub body: EventBody,
}

/// Where an injected context or message came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// Typed by the user.
    User,
    /// Added by a pipeline plugin (guard).
    Plugin {
        /// The plugin's name, e.g. `repeat-tool-reminder`.
        plugin: String,
        /// A one-line summary, e.g. `bash × 3`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
    },
    /// Added by the daemon itself.
    System,
}

/// An advisory context attached to a tool result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdditionalContext {
    /// Who added it.
    pub source: Source,
    /// The text.
    pub content: String,
}

/// A structured tool error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolError {
    /// The stable code.
    pub code: ErrorCode,
    /// A human sentence.
    pub message: String,
    /// Which clock fired, for timeouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<crate::Clock>,
    /// The limit that expired, in milliseconds, for timeouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The result of one tool call, as returned to the caller and logged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The call this answers.
    pub call_id: String,
    /// Whether the call failed.
    pub is_error: bool,
    /// Model-visible text.
    pub content: String,
    /// The structured error, when `is_error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolError>,
    /// Advisory contexts added by guards (model-visible, logged with the result).
    #[serde(default)]
    pub additional_contexts: Vec<AdditionalContext>,
}

/// How a turn ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnEndKind {
    /// All calls of the turn have results.
    Completed,
    /// The daemon stopped (crash or shutdown) inside the turn; repaired on open.
    Interrupted,
    /// The caller cancelled the turn.
    Cancelled,
}

/// Typed event bodies. `type` is the tag, `data` the content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data")]
pub enum EventBody {
    /// A batch of tool calls (a model reply) begins.
    #[serde(rename = "turn/start")]
    TurnStart {
        /// The turn number, from 0.
        turn: u64,
        /// The ids of the batch's calls, in model order, announced before any is dispatched.
        /// Crash repair answers a listed id that has no `tool/call` with `TOOL_NOT_STARTED`
        /// (never dispatched) rather than `TOOL_OUTCOME_UNKNOWN`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        call_ids: Vec<String>,
    },
    /// A user message (model-visible).
    #[serde(rename = "user/message")]
    UserMessage {
        /// Text.
        content: String,
        /// Where it came from.
        #[serde(default = "user_source")]
        source: Source,
    },
    /// An assistant message (model-visible).
    #[serde(rename = "assistant/message")]
    AssistantMessage {
        /// Text.
        content: String,
    },
    /// A tool call was accepted for dispatch.
    #[serde(rename = "tool/call")]
    ToolCall {
        /// The call id.
        call_id: String,
        /// The tool name.
        name: String,
        /// The arguments as given.
        arguments: Value,
    },
    /// A tool call's result (model-visible).
    #[serde(rename = "tool/result")]
    ToolResult {
        /// The result.
        #[serde(flatten)]
        result: ToolResult,
        /// `seq` of the `tool/call` it answers, when there is one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call_seq: Option<u64>,
    },
    /// The turn ended.
    #[serde(rename = "turn/end")]
    TurnEnd {
        /// The turn number.
        turn: u64,
        /// How it ended.
        kind: TurnEndKind,
    },
    /// A sandbox was leased for the session.
    #[serde(rename = "sandbox/leased")]
    SandboxLeased {
        /// Provider name.
        provider: String,
        /// Sandbox id at the provider.
        sandbox_id: String,
    },
    /// The session's sandbox was released.
    #[serde(rename = "sandbox/released")]
    SandboxReleased {
        /// Sandbox id.
        sandbox_id: String,
        /// Why (`session_closed`, `expired`, `shutdown`, ...).
        reason: String,
    },
    /// A command started; its output is journaled in `output/<command_id>`.
    #[serde(rename = "process/started")]
    ProcessStarted {
        /// Command id.
        command_id: String,
        /// Pid in the sandbox.
        pid: u32,
        /// The spec it was started with.
        spec: ProcessSpec,
        /// When its total deadline passes, ms since the Unix epoch (none: unbounded).
        /// A restarted daemon that finds the command again supervises it to this.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<i64>,
        /// Its output-idle limit, ms (none: off).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output_idle_ms: Option<u64>,
    },
    /// A command ended.
    #[serde(rename = "process/exited")]
    ProcessExited {
        /// Command id.
        command_id: String,
        /// How it ended.
        status: ExitStatus,
        /// Bytes of stdout (or pty output) journaled.
        stdout_bytes: u64,
        /// Bytes of stderr journaled.
        stderr_bytes: u64,
        /// The clock that ended it, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clock: Option<crate::Clock>,
        /// The sandbox limit it ran into (an out-of-memory kill, a refused fork, a full
        /// disk), when the provider can tell.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<crate::limits::LimitKind>,
    },
    /// A file operation done through an API other than a tool (E2B front, native files API).
    #[serde(rename = "fs/op")]
    FsOp {
        /// Operation (`write`, `remove`, `rename`, `mkdir`).
        op: String,
        /// The sandbox path.
        path: String,
        /// Outcome: `ok` or an error code.
        outcome: String,
        /// Bytes moved, where it applies.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bytes: Option<u64>,
    },
    /// Marks the end of a forked session's seed (copied prefix).
    #[serde(rename = "session/end-seed")]
    EndSeed {
        /// The parent session.
        parent_session: String,
        /// Last seq copied from the parent.
        boundary_seq: u64,
    },
    /// The session's expiry was changed (E2B `set_timeout`); supersedes the header's.
    #[serde(rename = "session/expiry")]
    ExpirySet {
        /// The new expiry.
        expiry: Expiry,
    },
    /// The session's sandbox was paused (frozen, or its VM stopped): commands do not run
    /// until a `sandbox/resumed`.
    #[serde(rename = "sandbox/paused")]
    SandboxPaused {
        /// Sandbox id.
        sandbox_id: String,
        /// What the pause kept: with `filesystem` the sandbox's processes ended and its
        /// resume boots it again. A log written before the field: `memory`.
        #[serde(default, skip_serializing_if = "PauseKind::is_memory")]
        kind: PauseKind,
    },
    /// The session's sandbox runs again after a `sandbox/paused`.
    #[serde(rename = "sandbox/resumed")]
    SandboxResumed {
        /// Sandbox id.
        sandbox_id: String,
    },
    /// A snapshot of the session's sandbox was taken (its file system, and its memory
    /// where the provider keeps it): sandboxes can be created from it.
    #[serde(rename = "sandbox/snapshot")]
    SandboxSnapshot {
        /// Sandbox id.
        sandbox_id: String,
        /// The daemon's snapshot id.
        snapshot_id: String,
    },
    /// The egress rules of the session's sandbox were replaced; supersede the header's
    /// (a fork and a restarted daemon keep the latest).
    #[serde(rename = "sandbox/network")]
    SandboxNetwork {
        /// Sandbox id.
        sandbox_id: String,
        /// The rules now in force (empty: none).
        egress: crate::network::Egress,
    },
    /// The session was closed.
    #[serde(rename = "session/closed")]
    SessionClosed {
        /// Why.
        reason: String,
    },
}

fn user_source() -> Source {
    Source::User
}

/// A message of the derived model history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    /// A user message (prompts and injected contexts).
    User {
        /// Text.
        content: String,
        /// Where it came from.
        source: Source,
    },
    /// An assistant message.
    Assistant {
        /// Text.
        content: String,
    },
    /// A tool result.
    Tool {
        /// The result.
        #[serde(flatten)]
        result: ToolResult,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_wire_shape() {
        let e = Event {
            seq: 3,
            time: 1_700_000_000_000,
            body: EventBody::ToolCall {
                call_id: "c1".into(),
                name: "bash".into(),
                arguments: serde_json::json!({"command": "ls"}),
            },
        };
        let j = serde_json::to_string(&e).unwrap();
        assert_eq!(
            j,
            r#"{"seq":3,"time":1700000000000,"type":"tool/call","data":{"call_id":"c1","name":"bash","arguments":{"command":"ls"}}}"#
        );
        assert_eq!(serde_json::from_str::<Event>(&j).unwrap(), e);
    }

    #[test]
    fn tool_result_event_round_trips() {
        let e = Event {
            seq: 4,
            time: 1,
            body: EventBody::ToolResult {
                result: ToolResult {
                    call_id: "c1".into(),
                    is_error: true,
                    content: "Error: tool call timed out after 100ms".into(),
                    error: Some(ToolError {
                        code: ErrorCode::ToolTimeout,
                        message: "tool call timed out after 100ms".into(),
                        clock: Some(crate::Clock::Tool),
                        timeout_ms: Some(100),
                    }),
                    additional_contexts: vec![AdditionalContext {
                        source: Source::Plugin {
                            plugin: "repeat-tool-reminder".into(),
                            summary: None,
                        },
                        content: "x".into(),
                    }],
                },
                call_seq: Some(3),
            },
        };
        let j = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<Event>(&j).unwrap(), e);
    }
}
