//! The server's errors: what a host reports ([`Failure`]), envd's REST error body
//! ([`RestError`]) and the one mapping of tether's codes to Connect's.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{ApiError, ConnectCode};
use tether_provider::ProviderError;

/// What a host or its provider reports: a stable code and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The code.
    pub code: ErrorCode,
    /// The message; an `INTERNAL` one stays in the log and is not sent.
    pub message: String,
}

impl Failure {
    /// A failure of `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The message a client is sent, after the failure is logged (loud when it is the
    /// server's).
    pub(crate) fn public_message(&self) -> String {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::warn!(code = %self.code, error = %self.message, "envd request failed");
        } else {
            tracing::debug!(code = %self.code, error = %self.message, "envd request refused");
        }
        match self.code {
            ErrorCode::Internal => "internal error (see the log for the request id)".to_owned(),
            _ => self.message.clone(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Failure {}

impl From<ProviderError> for Failure {
    fn from(e: ProviderError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// An error of envd's REST endpoints (and of the E2B control plane): `{"code": status,
/// "message"}`, the body every SDK parser expects.
#[derive(Debug)]
pub struct RestError {
    status: StatusCode,
    message: String,
    error_code: Option<&'static str>,
}

impl RestError {
    /// An error with `status`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            error_code: None,
        }
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// With the body's `errorCode` (the control plane's `sandbox_create_failed`).
    pub fn with_error_code(mut self, error_code: &'static str) -> Self {
        self.error_code = Some(error_code);
        self
    }

    /// An envd REST error: envd's statuses (400 for a bad path or a directory, 404, 401,
    /// 403, 507 when out of space).
    pub fn from_envd(e: &Failure) -> Self {
        Self::new(envd_status(e.code), e.public_message())
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let body = ApiError {
            code: self.status.as_u16(),
            message: self.message,
            error_code: self.error_code.map(str::to_owned),
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// envd's REST status of a code.
fn envd_status(code: ErrorCode) -> StatusCode {
    use ErrorCode as C;
    match code {
        C::InvalidRequest
        | C::FsIsDirectory
        | C::FsNotDirectory
        | C::FsNotRegularFile
        | C::FsNotText => StatusCode::BAD_REQUEST,
        C::FsTooLarge | C::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        c => StatusCode::from_u16(c.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    }
}

/// The Connect code of a tether error code: the one mapping the envd services use.
/// Exhaustive, so a new code forces a decision.
pub fn connect_code(code: ErrorCode) -> ConnectCode {
    use ConnectCode as K;
    use ErrorCode as C;
    match code {
        C::InvalidRequest
        | C::UnknownTool
        | C::FsNotDirectory
        | C::FsIsDirectory
        | C::FsNotRegularFile
        | C::FsNotText
        | C::SpawnFailed => K::InvalidArgument,
        C::Unauthorized => K::Unauthenticated,
        C::Forbidden | C::FsPermissionDenied | C::ToolDenied => K::PermissionDenied,
        C::NotFound
        | C::SessionNotFound
        | C::SandboxNotFound
        | C::CommandNotFound
        | C::SnapshotNotFound
        | C::FsNotFound
        | C::FsEditNotFound => K::NotFound,
        C::MethodNotAllowed | C::Unsupported => K::Unimplemented,
        C::PayloadTooLarge
        | C::FsTooLarge
        | C::RateLimited
        | C::FsNoSpace
        | C::StorageFull
        | C::LimitExceeded => K::ResourceExhausted,
        C::Conflict | C::FsAlreadyExists => K::AlreadyExists,
        C::FsVersionMismatch | C::FsNotEmpty | C::FsAmbiguousEdit | C::IsolationUnavailable => {
            K::FailedPrecondition
        }
        C::FsAborted => K::Aborted,
        C::ToolTimeout
        | C::IdleTimeout
        | C::ConnectTimeout
        | C::TransportIdleTimeout
        | C::DeadlineExceeded => K::DeadlineExceeded,
        C::Cancelled => K::Canceled,
        C::ProviderUnavailable | C::ShuttingDown | C::Overloaded => K::Unavailable,
        C::ToolNotStarted | C::ToolOutcomeUnknown | C::OutcomeUnknown | C::ProviderError => {
            K::Unknown
        }
        C::FsIoError | C::Invariant | C::Internal => K::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_connect_codes_and_internal_messages_stay_inside() {
        use ConnectCode as K;
        use ErrorCode as C;
        assert_eq!(connect_code(C::FsNotFound), K::NotFound);
        assert_eq!(connect_code(C::FsPermissionDenied), K::PermissionDenied);
        assert_eq!(connect_code(C::DeadlineExceeded), K::DeadlineExceeded);
        assert_eq!(connect_code(C::IdleTimeout), K::DeadlineExceeded);
        assert_eq!(connect_code(C::FsAlreadyExists), K::AlreadyExists);
        assert_eq!(connect_code(C::Unsupported), K::Unimplemented);
        assert_eq!(connect_code(C::Unauthorized), K::Unauthenticated);
        let e = RestError::from_envd(&Failure::new(C::Internal, "secret path /var/lib/x"));
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!e.message().contains("secret"));
        let e = RestError::from_envd(&Failure::new(C::FsIsDirectory, "/x is a directory"));
        assert_eq!(
            (e.status(), e.message()),
            (StatusCode::BAD_REQUEST, "/x is a directory")
        );
        assert_eq!(
            RestError::from_envd(&Failure::new(C::FsNoSpace, "full")).status(),
            StatusCode::INSUFFICIENT_STORAGE
        );
    }
}
