//! The one error type of the seam.

use std::time::Duration;

use tether_protocol::ErrorCode;

use crate::clock::{CancelReason, Clock, TimeoutReason};

/// Result alias of the seam.
pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// Who is at the origin of an error (pingora's question): the caller's request, the
/// daemon itself, or the provider (backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Bad input from the caller.
    Client,
    /// The daemon (a bug, a limit, shutdown).
    Daemon,
    /// The sandbox backend or the sandbox itself.
    Provider,
}

/// An error of a provider operation. Every variant answers three questions: its stable
/// [`ErrorCode`], its [`Origin`], and whether it is retryable.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The request is malformed or a value is out of range.
    #[error("invalid request: {message}")]
    InvalidRequest {
        /// What is wrong.
        message: String,
    },
    /// No such sandbox (or it is gone).
    #[error("sandbox {id} not found")]
    SandboxNotFound {
        /// The sandbox id.
        id: String,
    },
    /// No such command in the sandbox.
    #[error("command {id} not found")]
    CommandNotFound {
        /// The command id or pid.
        id: String,
    },
    /// A file-system error with one of the `FS_*` codes.
    #[error("{path}: {message}")]
    Fs {
        /// One of the `FS_*` codes.
        code: ErrorCode,
        /// The sandbox path.
        path: String,
        /// What happened.
        message: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// A clock expired (total deadline, output idle, transport idle, connect).
    #[error("{reason}")]
    Timeout {
        /// Which clock and its limit.
        reason: TimeoutReason,
    },
    /// The call was cancelled by its caller, by shutdown or by session close.
    #[error("{reason}")]
    Cancelled {
        /// Why.
        reason: CancelReason,
    },
    /// The sandbox is stopped (paused without its memory): only resume and destroy
    /// reach it (`CONFLICT`).
    #[error("sandbox {id} is stopped (paused without its memory): resume it first")]
    Stopped {
        /// The sandbox id.
        id: String,
    },
    /// The provider does not support this operation.
    #[error("{op} is not supported by this provider")]
    Unsupported {
        /// The operation.
        op: &'static str,
    },
    /// The isolation the sandbox asks for cannot be enforced here.
    #[error("isolation {requested} cannot be enforced: {why}")]
    IsolationUnavailable {
        /// What was asked for.
        requested: String,
        /// Why it cannot be had.
        why: String,
    },
    /// The command could not be started.
    #[error("could not start the command: {message}")]
    SpawnFailed {
        /// What happened.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<std::io::Error>,
    },
    /// An SSH host presented a key that the known_hosts file does not list, or one that
    /// differs from the listed key: the connection is refused (`FORBIDDEN`, not retried).
    #[error("host key of {host} refused ({}): {fingerprint}", if *changed { "changed" } else { "unknown" })]
    HostKeyRejected {
        /// `address:port` of the host.
        host: String,
        /// The presented key's SHA-256 fingerprint (`SHA256:...`).
        fingerprint: String,
        /// The known_hosts file lists another key for the host (not just none).
        changed: bool,
    },
    /// The backend cannot be reached or refused the call; may be retried.
    #[error("provider unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
        /// Advice from the backend (`Retry-After`).
        retry_after: Option<Duration>,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The backend refused the call for its rate: retry after the advised delay.
    #[error("rate limited: {message}")]
    RateLimited {
        /// What happened.
        message: String,
        /// Advice from the backend (`Retry-After`).
        retry_after: Option<Duration>,
    },
    /// The request reached the backend but its answer did not arrive in time: it may have
    /// taken effect. Never re-sent; a command is re-attached by its id instead.
    #[error("the outcome of {op} is unknown: {message}")]
    OutcomeUnknown {
        /// The operation.
        op: &'static str,
        /// What happened.
        message: String,
    },
    /// The backend answered with an error that maps to no more specific code.
    #[error("provider error: {message}")]
    Backend {
        /// What the backend said.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A bug or an unexpected state in the provider.
    #[error("internal provider error: {message}")]
    Internal {
        /// What happened.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl ProviderError {
    /// The stable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidRequest { .. } => ErrorCode::InvalidRequest,
            Self::SandboxNotFound { .. } => ErrorCode::SandboxNotFound,
            Self::CommandNotFound { .. } => ErrorCode::CommandNotFound,
            Self::Fs { code, .. } => *code,
            Self::Timeout { reason } => reason.clock.code(),
            Self::Cancelled {
                reason: CancelReason::Timeout(t),
            } => t.clock.code(),
            Self::Cancelled {
                reason: CancelReason::Shutdown,
            } => ErrorCode::ShuttingDown,
            Self::Cancelled { .. } => ErrorCode::Cancelled,
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::Stopped { .. } => ErrorCode::Conflict,
            Self::IsolationUnavailable { .. } => ErrorCode::IsolationUnavailable,
            Self::SpawnFailed { .. } => ErrorCode::SpawnFailed,
            Self::Unavailable { .. } => ErrorCode::ProviderUnavailable,
            Self::RateLimited { .. } => ErrorCode::RateLimited,
            Self::OutcomeUnknown { .. } => ErrorCode::OutcomeUnknown,
            Self::HostKeyRejected { .. } => ErrorCode::Forbidden,
            Self::Backend { .. } => ErrorCode::ProviderError,
            Self::Internal { .. } => ErrorCode::Internal,
        }
    }

    /// Who caused it.
    pub fn origin(&self) -> Origin {
        match self {
            Self::InvalidRequest { .. } | Self::Cancelled { .. } => Origin::Client,
            Self::SandboxNotFound { .. } | Self::CommandNotFound { .. } => Origin::Client,
            Self::Stopped { .. } => Origin::Client,
            Self::Fs { code, .. } if *code == ErrorCode::FsIoError => Origin::Provider,
            Self::Fs { .. } => Origin::Client,
            Self::Internal { .. } => Origin::Daemon,
            Self::Timeout { .. }
            | Self::Unsupported { .. }
            | Self::IsolationUnavailable { .. }
            | Self::SpawnFailed { .. }
            | Self::Unavailable { .. }
            | Self::RateLimited { .. }
            | Self::OutcomeUnknown { .. }
            | Self::HostKeyRejected { .. }
            | Self::Backend { .. } => Origin::Provider,
        }
    }

    /// Whether the same call may succeed if retried (only idempotent calls are retried).
    pub fn retryable(&self) -> bool {
        match self {
            Self::Unavailable { .. } | Self::RateLimited { .. } => true,
            Self::Timeout { reason } => reason.clock.code().retryable(),
            _ => false,
        }
    }

    /// Which clock fired, for timeouts.
    pub fn clock(&self) -> Option<Clock> {
        match self {
            Self::Timeout { reason }
            | Self::Cancelled {
                reason: CancelReason::Timeout(reason),
            } => Some(reason.clock),
            _ => None,
        }
    }

    /// The backend's advice on when to retry (`Retry-After`), where it gave one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Unavailable { retry_after, .. } | Self::RateLimited { retry_after, .. } => {
                *retry_after
            }
            _ => None,
        }
    }

    /// Turn a cancellation reason into the error an operation returns for it.
    pub fn from_reason(reason: CancelReason) -> Self {
        match reason {
            CancelReason::Timeout(reason) => Self::Timeout { reason },
            reason => Self::Cancelled { reason },
        }
    }

    /// An `FS_*` error without an I/O source.
    pub fn fs(code: ErrorCode, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Fs {
            code,
            path: path.into(),
            message: message.into(),
            source: None,
        }
    }

    /// Map an I/O error on `path` to the matching `FS_*` error.
    pub fn from_io(path: impl Into<String>, e: std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        let code = match e.kind() {
            K::NotFound => ErrorCode::FsNotFound,
            K::PermissionDenied => ErrorCode::FsPermissionDenied,
            K::AlreadyExists => ErrorCode::FsAlreadyExists,
            K::NotADirectory => ErrorCode::FsNotDirectory,
            K::IsADirectory => ErrorCode::FsIsDirectory,
            K::DirectoryNotEmpty => ErrorCode::FsNotEmpty,
            K::InvalidFilename | K::InvalidInput => ErrorCode::InvalidRequest,
            K::StorageFull | K::QuotaExceeded => ErrorCode::FsNoSpace,
            _ => match e.raw_os_error() {
                Some(40) => ErrorCode::FsPermissionDenied, // ELOOP: a symlink we refused to follow
                _ => ErrorCode::FsIoError,
            },
        };
        let message = e.to_string();
        Self::Fs {
            code,
            path: path.into(),
            message,
            source: Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_origins_and_retryability() {
        let t = |clock| ProviderError::Timeout {
            reason: TimeoutReason {
                clock,
                timeout_ms: 5,
            },
        };
        assert_eq!(t(Clock::OutputIdle).code(), ErrorCode::IdleTimeout);
        assert_eq!(t(Clock::OutputIdle).clock(), Some(Clock::OutputIdle));
        assert_eq!(t(Clock::Connect).code(), ErrorCode::ConnectTimeout);
        assert!(t(Clock::Connect).retryable());
        assert!(!t(Clock::Total).retryable());
        for c in Clock::ALL {
            assert_eq!(t(*c).code(), c.code());
            assert_eq!(Clock::of_code(c.code()), Some(*c));
            assert_eq!(Clock::parse(c.name()), Some(*c));
        }
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = ProviderError::from_io("/home/user/x", io);
        assert_eq!(e.code(), ErrorCode::FsNotFound);
        assert_eq!(e.origin(), Origin::Client);
        assert_eq!(
            ProviderError::from_reason(CancelReason::Shutdown).code(),
            ErrorCode::ShuttingDown
        );
        assert_eq!(
            ProviderError::from_reason(CancelReason::Caller("x")).code(),
            ErrorCode::Cancelled
        );
        let u = ProviderError::Unavailable {
            message: "down".into(),
            retry_after: None,
            source: None,
        };
        assert!(u.retryable());
        assert_eq!(u.code(), ErrorCode::ProviderUnavailable);
        assert_eq!(
            ProviderError::Unsupported { op: "pause" }.code(),
            ErrorCode::Unsupported
        );
    }
}
