//! The closed set of error codes and the error body every API returns.

use serde::{Deserialize, Serialize};

/// A stable, machine-readable error code. SCREAMING_SNAKE on the wire.
///
/// The set is closed: clients may match on it exhaustively. A code is never renamed or
/// reused; the full list is pinned by a snapshot test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The request is malformed: bad JSON, an unknown field, a value out of range.
    InvalidRequest,
    /// No credentials, or wrong credentials.
    Unauthorized,
    /// The credentials are valid but do not grant access to this resource.
    Forbidden,
    /// No such route.
    NotFound,
    /// The route exists but not for this HTTP method.
    MethodNotAllowed,
    /// The request body is larger than the configured limit.
    PayloadTooLarge,
    /// No session with that id.
    SessionNotFound,
    /// No sandbox with that id, or it is gone.
    SandboxNotFound,
    /// No command (process) with that id in this sandbox.
    CommandNotFound,
    /// No snapshot with that id or name (for this tenant).
    SnapshotNotFound,
    /// The request conflicts with the current state (e.g. a fork boundary inside an open turn).
    Conflict,
    /// The path does not exist.
    FsNotFound,
    /// A path component that must be a directory is not one.
    FsNotDirectory,
    /// The path is a directory where a file was expected.
    FsIsDirectory,
    /// The path is not a regular file.
    FsNotRegularFile,
    /// The file is not valid UTF-8 text where text was required.
    FsNotText,
    /// The file is larger than the caller's limit.
    FsTooLarge,
    /// Permission denied, including any attempt to leave the workspace.
    FsPermissionDenied,
    /// The path already exists (a `create_if_absent` write, or mkdir of an existing path).
    FsAlreadyExists,
    /// The file's version is not the one the write was guarded by.
    FsVersionMismatch,
    /// The directory is not empty.
    FsNotEmpty,
    /// `edit_file`: the old string occurs more than once.
    FsAmbiguousEdit,
    /// `edit_file`: the old string does not occur.
    FsEditNotFound,
    /// An I/O error in the sandbox's file system.
    FsIoError,
    /// The file operation was aborted before it took effect.
    FsAborted,
    /// A tool call's own deadline expired.
    ToolTimeout,
    /// The tool call was interrupted before it was recorded as started.
    ToolNotStarted,
    /// The tool call was dispatched but its outcome was not recorded (crash repair).
    ToolOutcomeUnknown,
    /// No tool with that name.
    UnknownTool,
    /// A policy (pre-execute waterfall) denied the tool call.
    ToolDenied,
    /// A command produced no output for longer than its output-idle limit.
    IdleTimeout,
    /// The remote peer did not connect or send a first byte in time.
    ConnectTimeout,
    /// The transport carried no bytes at all (keepalives included) for too long.
    TransportIdleTimeout,
    /// The total deadline of the call expired.
    DeadlineExceeded,
    /// The call was cancelled by its caller or by shutdown.
    Cancelled,
    /// The provider (sandbox backend) cannot be reached or refused the call.
    ProviderUnavailable,
    /// The provider answered with an error that has no more specific code.
    ProviderError,
    /// The provider cannot enforce the isolation the sandbox asked for.
    IsolationUnavailable,
    /// The command could not be started.
    SpawnFailed,
    /// The backend or provider does not support this operation.
    Unsupported,
    /// Too many requests; retry later.
    RateLimited,
    /// A runtime invariant was violated; the operation was refused to avoid corruption.
    Invariant,
    /// The daemon is shutting down.
    ShuttingDown,
    /// An internal error. Details are in the daemon's log, not in the response.
    Internal,
    /// The sandbox's file system is full (or its quota is used up). It stays inside the
    /// sandbox: other sandboxes and the daemon are not affected.
    FsNoSpace,
    /// The daemon's own storage (its state directory) is full: nothing was recorded.
    StorageFull,
    /// The request reached the backend but its answer did not arrive: it may have taken
    /// effect. Never re-run it; re-attach (a command by its id) or look before retrying.
    OutcomeUnknown,
    /// A command ran into one of its sandbox's resource limits (memory: killed out of
    /// memory; processes; disk). The sandbox and every other one are unaffected.
    LimitExceeded,
    /// The daemon is at its limit of concurrent requests; retry later.
    Overloaded,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: &'static [ErrorCode] = &[
        Self::InvalidRequest,
        Self::Unauthorized,
        Self::Forbidden,
        Self::NotFound,
        Self::MethodNotAllowed,
        Self::PayloadTooLarge,
        Self::SessionNotFound,
        Self::SandboxNotFound,
        Self::CommandNotFound,
        Self::SnapshotNotFound,
        Self::Conflict,
        Self::FsNotFound,
        Self::FsNotDirectory,
        Self::FsIsDirectory,
        Self::FsNotRegularFile,
        Self::FsNotText,
        Self::FsTooLarge,
        Self::FsPermissionDenied,
        Self::FsAlreadyExists,
        Self::FsVersionMismatch,
        Self::FsNotEmpty,
        Self::FsAmbiguousEdit,
        Self::FsEditNotFound,
        Self::FsIoError,
        Self::FsAborted,
        Self::ToolTimeout,
        Self::ToolNotStarted,
        Self::ToolOutcomeUnknown,
        Self::UnknownTool,
        Self::ToolDenied,
        Self::IdleTimeout,
        Self::ConnectTimeout,
        Self::TransportIdleTimeout,
        Self::DeadlineExceeded,
        Self::Cancelled,
        Self::ProviderUnavailable,
        Self::ProviderError,
        Self::IsolationUnavailable,
        Self::SpawnFailed,
        Self::Unsupported,
        Self::RateLimited,
        Self::Invariant,
        Self::ShuttingDown,
        Self::Internal,
        Self::FsNoSpace,
        Self::StorageFull,
        Self::OutcomeUnknown,
        Self::LimitExceeded,
        Self::Overloaded,
    ];

    /// The HTTP status of the code: the one mapping every HTTP surface uses (the native
    /// API, the E2B control plane, envd). Exhaustive: a new code forces a decision.
    pub fn http_status(self) -> u16 {
        use ErrorCode as C;
        match self {
            C::InvalidRequest | C::UnknownTool => 400,
            C::Unauthorized => 401,
            C::Forbidden | C::FsPermissionDenied | C::ToolDenied => 403,
            C::NotFound
            | C::SessionNotFound
            | C::SandboxNotFound
            | C::CommandNotFound
            | C::SnapshotNotFound
            | C::FsNotFound => 404,
            C::MethodNotAllowed => 405,
            C::PayloadTooLarge | C::FsTooLarge => 413,
            C::Conflict
            | C::FsNotDirectory
            | C::FsIsDirectory
            | C::FsNotRegularFile
            | C::FsAlreadyExists
            | C::FsNotEmpty
            | C::FsAmbiguousEdit
            | C::FsEditNotFound
            | C::FsAborted => 409,
            C::FsVersionMismatch => 412,
            C::FsNotText | C::SpawnFailed | C::LimitExceeded => 422,
            C::ToolTimeout
            | C::IdleTimeout
            | C::ConnectTimeout
            | C::TransportIdleTimeout
            | C::DeadlineExceeded => 504,
            // 499: the de-facto status of a request its client abandoned.
            C::Cancelled => 499,
            C::ProviderUnavailable | C::IsolationUnavailable | C::ShuttingDown | C::Overloaded => {
                503
            }
            C::ProviderError => 502,
            C::Unsupported => 501,
            C::RateLimited => 429,
            C::FsNoSpace | C::StorageFull => 507,
            // The backend may have acted: a gateway error the client must not blindly retry.
            C::OutcomeUnknown => 502,
            C::FsIoError
            | C::ToolNotStarted
            | C::ToolOutcomeUnknown
            | C::Invariant
            | C::Internal => 500,
        }
    }

    /// The wire spelling, e.g. `"FS_NOT_FOUND"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "INVALID_REQUEST",
            Self::Unauthorized => "UNAUTHORIZED",
            Self::Forbidden => "FORBIDDEN",
            Self::NotFound => "NOT_FOUND",
            Self::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::SessionNotFound => "SESSION_NOT_FOUND",
            Self::SandboxNotFound => "SANDBOX_NOT_FOUND",
            Self::CommandNotFound => "COMMAND_NOT_FOUND",
            Self::SnapshotNotFound => "SNAPSHOT_NOT_FOUND",
            Self::Conflict => "CONFLICT",
            Self::FsNotFound => "FS_NOT_FOUND",
            Self::FsNotDirectory => "FS_NOT_DIRECTORY",
            Self::FsIsDirectory => "FS_IS_DIRECTORY",
            Self::FsNotRegularFile => "FS_NOT_REGULAR_FILE",
            Self::FsNotText => "FS_NOT_TEXT",
            Self::FsTooLarge => "FS_TOO_LARGE",
            Self::FsPermissionDenied => "FS_PERMISSION_DENIED",
            Self::FsAlreadyExists => "FS_ALREADY_EXISTS",
            Self::FsVersionMismatch => "FS_VERSION_MISMATCH",
            Self::FsNotEmpty => "FS_NOT_EMPTY",
            Self::FsAmbiguousEdit => "FS_AMBIGUOUS_EDIT",
            Self::FsEditNotFound => "FS_EDIT_NOT_FOUND",
            Self::FsIoError => "FS_IO_ERROR",
            Self::FsAborted => "FS_ABORTED",
            Self::ToolTimeout => "TOOL_TIMEOUT",
            Self::ToolNotStarted => "TOOL_NOT_STARTED",
            Self::ToolOutcomeUnknown => "TOOL_OUTCOME_UNKNOWN",
            Self::UnknownTool => "UNKNOWN_TOOL",
            Self::ToolDenied => "TOOL_DENIED",
            Self::IdleTimeout => "IDLE_TIMEOUT",
            Self::ConnectTimeout => "CONNECT_TIMEOUT",
            Self::TransportIdleTimeout => "TRANSPORT_IDLE_TIMEOUT",
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::Cancelled => "CANCELLED",
            Self::ProviderUnavailable => "PROVIDER_UNAVAILABLE",
            Self::ProviderError => "PROVIDER_ERROR",
            Self::IsolationUnavailable => "ISOLATION_UNAVAILABLE",
            Self::SpawnFailed => "SPAWN_FAILED",
            Self::Unsupported => "UNSUPPORTED",
            Self::RateLimited => "RATE_LIMITED",
            Self::Invariant => "INVARIANT",
            Self::ShuttingDown => "SHUTTING_DOWN",
            Self::Internal => "INTERNAL",
            Self::FsNoSpace => "FS_NO_SPACE",
            Self::StorageFull => "STORAGE_FULL",
            Self::OutcomeUnknown => "OUTCOME_UNKNOWN",
            Self::LimitExceeded => "LIMIT_EXCEEDED",
            Self::Overloaded => "OVERLOADED",
        }
    }

    /// Parse the wire spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.as_str() == s)
    }

    /// Whether a client may retry the same request unchanged and expect a different outcome.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::ProviderUnavailable
                | Self::RateLimited
                | Self::ConnectTimeout
                | Self::TransportIdleTimeout
                | Self::ShuttingDown
                | Self::Overloaded
        )
    }

    /// Whether this code names the expiry of one of tether's clocks.
    pub fn is_timeout(self) -> bool {
        Clock::of_code(self).is_some()
    }
}

/// The clocks of a call: each separately configured, separately reported. On the wire
/// (error bodies, events) by its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    /// Connect / first byte (`CONNECT_TIMEOUT`).
    Connect,
    /// No bytes at all on the transport, keepalives included (`TRANSPORT_IDLE_TIMEOUT`).
    TransportIdle,
    /// No output from a command (`IDLE_TIMEOUT`).
    OutputIdle,
    /// The total deadline of the call (`DEADLINE_EXCEEDED`).
    Total,
    /// A tool call's own deadline (`TOOL_TIMEOUT`).
    Tool,
}

impl Clock {
    /// Every clock.
    pub const ALL: &'static [Clock] = &[
        Self::Connect,
        Self::TransportIdle,
        Self::OutputIdle,
        Self::Total,
        Self::Tool,
    ];

    /// The wire name (`connect`, `transport_idle`, `output_idle`, `total`, `tool`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::TransportIdle => "transport_idle",
            Self::OutputIdle => "output_idle",
            Self::Total => "total",
            Self::Tool => "tool",
        }
    }

    /// The error code its expiry is reported with.
    pub fn code(self) -> ErrorCode {
        match self {
            Self::Connect => ErrorCode::ConnectTimeout,
            Self::TransportIdle => ErrorCode::TransportIdleTimeout,
            Self::OutputIdle => ErrorCode::IdleTimeout,
            Self::Total => ErrorCode::DeadlineExceeded,
            Self::Tool => ErrorCode::ToolTimeout,
        }
    }

    /// The clock whose expiry `code` reports, if any.
    pub fn of_code(code: ErrorCode) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.code() == code)
    }

    /// The clock of a wire name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.name() == name)
    }
}

impl std::fmt::Display for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of every error response of the native API: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// One error: a stable code, a human sentence, whether to retry, and the request id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// The stable code.
    pub code: ErrorCode,
    /// A short human-readable sentence. Not for matching.
    pub message: String,
    /// Whether retrying the same request may succeed.
    pub retryable: bool,
    /// The id of the request, to find it in the daemon's logs and traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Which clock fired, for timeout codes (`total`, `output_idle`, `transport_idle`, `connect`, `tool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<Clock>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the full list of codes: a code may be added at the end, never renamed or removed.
    #[test]
    fn error_code_list_is_pinned() {
        let wire: Vec<String> = ErrorCode::ALL
            .iter()
            .map(|c| {
                serde_json::to_value(c)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        let expected = [
            "INVALID_REQUEST",
            "UNAUTHORIZED",
            "FORBIDDEN",
            "NOT_FOUND",
            "METHOD_NOT_ALLOWED",
            "PAYLOAD_TOO_LARGE",
            "SESSION_NOT_FOUND",
            "SANDBOX_NOT_FOUND",
            "COMMAND_NOT_FOUND",
            "SNAPSHOT_NOT_FOUND",
            "CONFLICT",
            "FS_NOT_FOUND",
            "FS_NOT_DIRECTORY",
            "FS_IS_DIRECTORY",
            "FS_NOT_REGULAR_FILE",
            "FS_NOT_TEXT",
            "FS_TOO_LARGE",
            "FS_PERMISSION_DENIED",
            "FS_ALREADY_EXISTS",
            "FS_VERSION_MISMATCH",
            "FS_NOT_EMPTY",
            "FS_AMBIGUOUS_EDIT",
            "FS_EDIT_NOT_FOUND",
            "FS_IO_ERROR",
            "FS_ABORTED",
            "TOOL_TIMEOUT",
            "TOOL_NOT_STARTED",
            "TOOL_OUTCOME_UNKNOWN",
            "UNKNOWN_TOOL",
            "TOOL_DENIED",
            "IDLE_TIMEOUT",
            "CONNECT_TIMEOUT",
            "TRANSPORT_IDLE_TIMEOUT",
            "DEADLINE_EXCEEDED",
            "CANCELLED",
            "PROVIDER_UNAVAILABLE",
            "PROVIDER_ERROR",
            "ISOLATION_UNAVAILABLE",
            "SPAWN_FAILED",
            "UNSUPPORTED",
            "RATE_LIMITED",
            "INVARIANT",
            "SHUTTING_DOWN",
            "INTERNAL",
            "FS_NO_SPACE",
            "STORAGE_FULL",
            "OUTCOME_UNKNOWN",
            "LIMIT_EXCEEDED",
            "OVERLOADED",
        ];
        assert_eq!(wire, expected);
        for c in ErrorCode::ALL {
            assert_eq!(
                c.as_str(),
                serde_json::to_value(c).unwrap().as_str().unwrap()
            );
            assert_eq!(ErrorCode::parse(c.as_str()), Some(*c));
        }
    }

    #[test]
    fn error_body_round_trips_and_rejects_unknown_fields() {
        let body = ErrorBody {
            error: ErrorDetail {
                code: ErrorCode::FsNotFound,
                message: "no such file".into(),
                retryable: false,
                request_id: Some("r1".into()),
                clock: None,
            },
        };
        let s = serde_json::to_string(&body).unwrap();
        assert_eq!(
            s,
            r#"{"error":{"code":"FS_NOT_FOUND","message":"no such file","retryable":false,"request_id":"r1"}}"#
        );
        assert_eq!(serde_json::from_str::<ErrorBody>(&s).unwrap(), body);
        let bad = r#"{"error":{"code":"FS_NOT_FOUND","message":"x","retryable":false,"extra":1}}"#;
        assert!(serde_json::from_str::<ErrorBody>(bad).is_err());
        assert!(serde_json::from_str::<ErrorCode>(r#""NOT_A_CODE""#).is_err());
    }
}
