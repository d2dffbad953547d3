//! Backend errors (qemu, QMP, the host's files, the guest agent's readiness) mapped to
//! `ProviderError`.

use std::time::Duration;

use tether_provider::clock::TimeoutReason;
use tether_provider::{Clock, ProviderError};

/// An unexpected local failure (a file of the state directory, a program of the host).
pub(crate) fn internal(
    what: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> ProviderError {
    ProviderError::Internal {
        message: format!("microvm: {what}: {e}"),
        source: Some(Box::new(e)),
    }
}

/// qemu, QMP or the guest cannot do what was asked now; may be retried.
pub(crate) fn unavailable(message: impl Into<String>) -> ProviderError {
    ProviderError::Unavailable {
        message: message.into(),
        retry_after: None,
        source: None,
    }
}

/// A clock of the provider's own fired (`clock` says which kind).
pub(crate) fn timeout(clock: Clock, limit: Duration) -> ProviderError {
    ProviderError::Timeout {
        reason: TimeoutReason {
            clock,
            timeout_ms: limit.as_millis() as u64,
        },
    }
}

/// QMP answered a command with an error.
pub(crate) fn qmp_error(command: &str, class: &str, desc: &str) -> ProviderError {
    ProviderError::Backend {
        message: format!("qmp {command}: {class}: {desc}"),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_protocol::ErrorCode;

    #[test]
    fn errors_carry_stable_codes() {
        assert_eq!(
            timeout(Clock::Connect, Duration::from_secs(1)).code(),
            ErrorCode::ConnectTimeout
        );
        assert_eq!(
            timeout(Clock::Total, Duration::from_secs(1)).code(),
            ErrorCode::DeadlineExceeded
        );
        assert_eq!(unavailable("x").code(), ErrorCode::ProviderUnavailable);
        assert_eq!(
            qmp_error("cont", "GenericError", "no").code(),
            ErrorCode::ProviderError
        );
        let io = std::io::Error::other("disk");
        assert_eq!(internal("write", io).code(), ErrorCode::Internal);
    }
}
