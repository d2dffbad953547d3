//! Backend errors (HTTP statuses, Connect codes, transport failures) mapped onto the
//! seam's [`ProviderError`], by the operation they happened in.
//!
//! The E2B wire carries coarser errors than tether's codes (one `invalid_argument` for
//! "is a directory", "not a directory" and a bad path; one 404 for a missing sandbox, a
//! missing file and a missing route). The mapping here is the first step; where the
//! difference matters the callers refine it with one more request on the error path (a
//! `stat` to tell a directory from a file, a `get` to tell a missing sandbox from a
//! missing route), never by reading message text. The exceptions are the two messages
//! E2B's edge proxy uses as its protocol (`The sandbox was not found`, `port is not
//! open`), which the official SDKs key on too.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use tether_protocol::ErrorCode;
use tether_protocol::connect;
use tether_protocol::e2b::ConnectCode;
use tether_provider::ProviderError;
use tether_provider::clock::{CancelReason, TimeoutReason};

/// The underlying cause of a backend error, kept as the `source` of a [`ProviderError`].
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The HTTP transport failed (connect, TLS, a broken body).
    #[error("HTTP transport failure")]
    Http(#[from] reqwest::Error),
    /// The backend answered with an error status.
    #[error("HTTP {status}: {message}")]
    Status {
        /// The status.
        status: u16,
        /// The message of the error body, if any.
        message: String,
    },
    /// An envd RPC failed with a Connect error.
    #[error("Connect error {code}: {message}")]
    Connect {
        /// The Connect code.
        code: &'static str,
        /// Its message.
        message: String,
    },
    /// The answer does not follow the protocol.
    #[error("malformed answer: {0}")]
    Malformed(String),
    /// A JSON body does not match its type.
    #[error("undecodable JSON")]
    Json(#[from] serde_json::Error),
}

/// What a call was doing, to map its errors onto the right codes.
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    /// A control-plane call about one sandbox.
    Sandbox {
        /// The operation (`connect`, `kill`, ...).
        op: &'static str,
        /// The sandbox id.
        id: &'a str,
    },
    /// A control-plane call about no sandbox in particular (create, list, health).
    Api(&'static str),
    /// A file operation.
    Fs {
        /// The operation.
        op: &'static str,
        /// The sandbox path.
        path: &'a str,
    },
    /// A process operation.
    Process {
        /// The operation.
        op: &'static str,
        /// The command id or pid.
        id: &'a str,
    },
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Self::Sandbox { op, .. } | Self::Fs { op, .. } | Self::Process { op, .. } => op,
            Self::Api(op) => op,
        }
    }

    fn not_found(&self, message: &str) -> ProviderError {
        match *self {
            Self::Sandbox { id, .. } => ProviderError::SandboxNotFound { id: id.to_owned() },
            Self::Fs { path, .. } => ProviderError::fs(ErrorCode::FsNotFound, path, message),
            Self::Process { id, .. } => ProviderError::CommandNotFound { id: id.to_owned() },
            // A 404 on create is a missing template.
            Self::Api(_) => ProviderError::InvalidRequest {
                message: message.to_owned(),
            },
        }
    }

    fn fs_code(&self, code: ErrorCode, message: &str, source: WireError) -> ProviderError {
        match *self {
            Self::Fs { path, .. } => {
                let mut e = ProviderError::fs(code, path, message);
                if let ProviderError::Fs { source: s, .. } = &mut e {
                    *s = Some(std::io::Error::other(source));
                }
                e
            }
            _ => backend(message, source),
        }
    }
}

/// A backend error without a more specific code.
pub fn backend(message: impl Into<String>, source: WireError) -> ProviderError {
    ProviderError::Backend {
        message: message.into(),
        source: Some(Box::new(source)),
    }
}

/// A retryable "cannot reach the backend" error.
pub fn unavailable(
    message: impl Into<String>,
    retry_after: Option<Duration>,
    source: Option<WireError>,
) -> ProviderError {
    ProviderError::Unavailable {
        message: message.into(),
        retry_after,
        source: source.map(|s| Box::new(s) as Box<dyn std::error::Error + Send + Sync>),
    }
}

/// A protocol violation by the backend.
pub fn malformed(what: impl Into<String>) -> ProviderError {
    let what = what.into();
    ProviderError::Backend {
        message: format!("malformed answer: {what}"),
        source: Some(Box::new(WireError::Malformed(what))),
    }
}

/// A transport failure of reqwest. Always retryable as far as the transport goes; the
/// caller retries only idempotent calls.
pub fn from_reqwest(e: reqwest::Error, op: Op<'_>) -> ProviderError {
    let what = if e.is_connect() {
        "cannot connect to the backend"
    } else if e.is_body() || e.is_decode() {
        "the connection broke while reading the answer"
    } else if e.is_request() {
        "the request could not be sent"
    } else {
        "the HTTP call failed"
    };
    unavailable(
        format!("{} ({what})", op.name()),
        None,
        Some(WireError::Http(e)),
    )
}

/// `Retry-After` as delta-seconds (an HTTP date is ignored: the backoff applies).
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
}

/// The message and (if the body is a Connect error) the Connect code of an error body.
fn parse_body(body: &[u8]) -> (String, Option<ConnectCode>) {
    if let Some(e) = connect::decode_error(body) {
        return (e.message, Some(e.code));
    }
    /// A REST error body (`{"code": <status>, "message"}`), or any JSON with a message.
    #[derive(serde::Deserialize)]
    struct WithMessage {
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<WithMessage>(body) {
        Ok(m) => (m.message, None),
        Err(_) => (
            String::from_utf8_lossy(body).chars().take(300).collect(),
            None,
        ),
    }
}

/// An error answer of a REST endpoint (control plane, `/files`, `/health`), or a plain
/// HTTP error in front of an RPC.
pub fn from_status(
    op: Op<'_>,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
) -> ProviderError {
    let (message, connect_code) = parse_body(body);
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        message
    };
    // The edge proxy's answers (E2B's protocol: the SDKs key on these messages too).
    if status == StatusCode::BAD_GATEWAY && message.contains("was not found") {
        let id = match op {
            Op::Sandbox { id, .. } => id,
            _ => "",
        };
        return ProviderError::SandboxNotFound { id: id.to_owned() };
    }
    if let Some(code) = connect_code {
        return from_connect(op, code, &message);
    }
    let should_retry = headers
        .get("should-retry")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("true"));
    let wire = || WireError::Status {
        status: status.as_u16(),
        message: message.clone(),
    };
    if status.as_u16() == 429 && should_retry != Some(false) {
        return ProviderError::RateLimited {
            message: format!("{}: {message}", op.name()),
            retry_after: retry_after(headers),
        };
    }
    let retry_status = matches!(status.as_u16(), 502..=504);
    if should_retry == Some(true) || (retry_status && should_retry.is_none()) {
        return unavailable(
            format!("{}: {message}", op.name()),
            retry_after(headers),
            Some(wire()),
        );
    }
    match status.as_u16() {
        404 => op.not_found(&message),
        405 | 501 => ProviderError::Unsupported { op: op.name() },
        400 | 422 => match op {
            Op::Fs { .. } => op.fs_code(ErrorCode::InvalidRequest, &message, wire()),
            _ => ProviderError::InvalidRequest { message },
        },
        403 => op.fs_code(ErrorCode::FsPermissionDenied, &message, wire()),
        409 => op.fs_code(ErrorCode::FsAlreadyExists, &message, wire()),
        413 => op.fs_code(ErrorCode::FsTooLarge, &message, wire()),
        507 => op.fs_code(ErrorCode::FsIoError, &message, wire()),
        _ => match op {
            Op::Fs { .. } if status.is_server_error() => {
                op.fs_code(ErrorCode::FsIoError, &message, wire())
            }
            _ => backend(
                format!("{}: HTTP {}: {message}", op.name(), status.as_u16()),
                wire(),
            ),
        },
    }
}

/// An envd RPC error (unary error body, or the error of an end-of-stream frame).
pub fn from_connect(op: Op<'_>, code: ConnectCode, message: &str) -> ProviderError {
    use ConnectCode as K;
    let wire = || WireError::Connect {
        code: code.as_str(),
        message: message.to_owned(),
    };
    match code {
        K::NotFound => op.not_found(message),
        K::InvalidArgument | K::OutOfRange => match op {
            Op::Fs { .. } => op.fs_code(ErrorCode::InvalidRequest, message, wire()),
            Op::Process { op: "start", .. } => ProviderError::SpawnFailed {
                message: message.to_owned(),
                source: Some(std::io::Error::other(wire())),
            },
            _ => ProviderError::InvalidRequest {
                message: message.to_owned(),
            },
        },
        K::AlreadyExists => op.fs_code(ErrorCode::FsAlreadyExists, message, wire()),
        K::PermissionDenied => op.fs_code(ErrorCode::FsPermissionDenied, message, wire()),
        K::FailedPrecondition | K::Unknown | K::Internal | K::DataLoss => {
            op.fs_code(ErrorCode::FsIoError, message, wire())
        }
        K::Aborted => op.fs_code(ErrorCode::FsAborted, message, wire()),
        K::Unimplemented => ProviderError::Unsupported { op: op.name() },
        K::Unavailable | K::ResourceExhausted => {
            unavailable(format!("{}: {message}", op.name()), None, Some(wire()))
        }
        K::DeadlineExceeded => ProviderError::Timeout {
            reason: TimeoutReason {
                clock: tether_provider::Clock::Total,
                timeout_ms: 0,
            },
        },
        K::Canceled => ProviderError::Cancelled {
            reason: CancelReason::Caller("cancelled by the backend"),
        },
        K::Unauthenticated => backend(
            format!(
                "{}: the backend refused the credentials: {message}",
                op.name()
            ),
            wire(),
        ),
    }
}
