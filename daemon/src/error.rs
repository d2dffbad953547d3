//! The daemon's error type and the one function that maps every error to an HTTP status
//! and a stable code.

use http::StatusCode;
use tether_protocol::{ErrorBody, ErrorCode, ErrorDetail};
use tether_provider::ProviderError;

use crate::session_log::LogError;

/// Result alias of the daemon.
pub type Result<T, E = DaemonError> = std::result::Result<T, E>;

/// An error of a daemon operation.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The request is malformed.
    #[error("invalid request: {message}")]
    InvalidRequest {
        /// What is wrong.
        message: String,
    },
    /// Missing or wrong credentials.
    #[error("missing or invalid credentials")]
    Unauthorized,
    /// Valid credentials without access to the resource.
    #[error("access denied")]
    Forbidden,
    /// No such route.
    #[error("no such route")]
    RouteNotFound,
    /// Wrong method for the route.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body is over the limit.
    #[error("request body is larger than {limit} bytes")]
    PayloadTooLarge {
        /// The limit.
        limit: u64,
    },
    /// No such session.
    #[error("session {id} not found")]
    SessionNotFound {
        /// The id.
        id: String,
    },
    /// The session has no sandbox (it was lost and could not be reconnected).
    #[error("session {id} has no sandbox: {why}")]
    Detached {
        /// The session id.
        id: String,
        /// Why.
        why: String,
    },
    /// No such command in the session.
    #[error("command {id} not found")]
    CommandNotFound {
        /// The id.
        id: String,
    },
    /// No such snapshot (for this tenant).
    #[error("snapshot {id} not found")]
    SnapshotNotFound {
        /// The id or name asked for.
        id: String,
    },
    /// The request conflicts with the state.
    #[error("conflict: {message}")]
    Conflict {
        /// What conflicts.
        message: String,
    },
    /// A provider error.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// A session-log error.
    #[error(transparent)]
    Log(#[from] LogError),
    /// A runtime invariant was violated.
    #[error("invariant {module}/{check} violated: {message}")]
    Invariant {
        /// The owning module.
        module: &'static str,
        /// The check.
        check: &'static str,
        /// What was found.
        message: String,
    },
    /// The daemon is shutting down.
    #[error("the daemon is shutting down")]
    ShuttingDown,
    /// The daemon is at `[server] max_concurrent_requests`.
    #[error("too many requests in flight; retry later")]
    Overloaded,
    /// An internal error.
    #[error("internal error: {message}")]
    Internal {
        /// What happened (logged, not returned).
        message: String,
    },
}

impl DaemonError {
    /// Shorthand for an invalid request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
        }
    }

    /// Shorthand for an internal error.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::Internal {
            message: message.into(),
        }
    }

    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidRequest { .. } => ErrorCode::InvalidRequest,
            Self::Unauthorized => ErrorCode::Unauthorized,
            Self::Forbidden => ErrorCode::Forbidden,
            Self::RouteNotFound => ErrorCode::NotFound,
            Self::MethodNotAllowed => ErrorCode::MethodNotAllowed,
            Self::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            Self::SessionNotFound { .. } => ErrorCode::SessionNotFound,
            Self::Detached { .. } => ErrorCode::SandboxNotFound,
            Self::CommandNotFound { .. } => ErrorCode::CommandNotFound,
            Self::SnapshotNotFound { .. } => ErrorCode::SnapshotNotFound,
            Self::Conflict { .. } => ErrorCode::Conflict,
            Self::Provider(e) => e.code(),
            Self::Log(e) => e.code(),
            Self::Invariant { .. } => ErrorCode::Invariant,
            Self::ShuttingDown => ErrorCode::ShuttingDown,
            Self::Overloaded => ErrorCode::Overloaded,
            Self::Internal { .. } => ErrorCode::Internal,
        }
    }

    /// The clock that fired, for timeouts.
    pub fn clock(&self) -> Option<tether_provider::Clock> {
        match self {
            Self::Provider(e) => e.clock(),
            _ => None,
        }
    }

    /// The message returned to the client: internal details stay in the daemon's log.
    pub fn public_message(&self) -> String {
        match self.code() {
            ErrorCode::Internal => {
                "internal error (see the daemon's log for the request id)".to_owned()
            }
            _ => self.to_string(),
        }
    }

    /// The error body.
    pub fn body(&self, request_id: Option<&str>) -> ErrorBody {
        let code = self.code();
        ErrorBody {
            error: ErrorDetail {
                code,
                message: self.public_message(),
                retryable: code.retryable(),
                request_id: request_id.map(str::to_owned),
                clock: self.clock(),
            },
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        status_of(self.code())
    }
}

/// The HTTP status of a code ([`ErrorCode::http_status`], the one mapping).
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_status_and_internal_details_stay_inside() {
        for c in ErrorCode::ALL {
            let s = status_of(*c);
            assert!(s.is_client_error() || s.is_server_error(), "{c}: {s}");
        }
        let e = DaemonError::internal("secret path /var/lib/x");
        let b = e.body(Some("r1"));
        assert_eq!(b.error.code, ErrorCode::Internal);
        assert!(!b.error.message.contains("secret"));
        assert_eq!(b.error.request_id.as_deref(), Some("r1"));
    }
}
