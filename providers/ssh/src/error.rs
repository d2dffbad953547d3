//! Backend errors (russh, SFTP, the remote helper scripts) mapped to `ProviderError`.

use std::time::Duration;

use russh_sftp::protocol::StatusCode;
use tether_protocol::ErrorCode;
use tether_provider::ProviderError;

use crate::client::timeout_error;

/// The transport-idle clock fired on a connection.
pub(crate) fn transport_idle(limit: Duration) -> ProviderError {
    timeout_error(tether_provider::Clock::TransportIdle, limit)
}

/// A russh error during `what`.
pub(crate) fn russh_error(what: &str, e: russh::Error) -> ProviderError {
    use russh::Error as E;
    match e {
        E::IO(io) => ProviderError::Unavailable {
            message: format!("ssh: {what}: {io}"),
            retry_after: None,
            source: Some(Box::new(io)),
        },
        E::Disconnect | E::SendError | E::RecvError | E::HUP | E::ConnectionTimeout => {
            ProviderError::Unavailable {
                message: format!("ssh: {what}: {e}"),
                retry_after: None,
                source: Some(Box::new(e)),
            }
        }
        other => ProviderError::Backend {
            message: format!("ssh: {what}: {other}"),
            source: Some(Box::new(other)),
        },
    }
}

/// An SFTP error on `path`.
pub(crate) fn sftp_error(path: &str, e: russh_sftp::client::error::Error) -> ProviderError {
    use russh_sftp::client::error::Error as E;
    match e {
        E::Status(s) => {
            let code = match s.status_code {
                StatusCode::NoSuchFile => ErrorCode::FsNotFound,
                StatusCode::PermissionDenied => ErrorCode::FsPermissionDenied,
                StatusCode::Eof => ErrorCode::FsIoError,
                _ => ErrorCode::FsIoError,
            };
            ProviderError::fs(code, path, format!("sftp: {}", s.error_message))
        }
        E::Timeout => ProviderError::Unavailable {
            message: format!("sftp: no answer about {path}"),
            retry_after: None,
            source: None,
        },
        other => ProviderError::Unavailable {
            message: format!("sftp: {path}: {other}"),
            retry_after: None,
            source: Some(Box::new(other)),
        },
    }
}

/// The error a helper script reported as `E <CODE> <message>` on its last line.
pub(crate) fn script_error(path: &str, out: &str) -> Option<ProviderError> {
    let line = out.lines().rev().find(|l| l.starts_with("E "))?;
    let mut parts = line.splitn(3, ' ');
    parts.next();
    let tag = parts.next().unwrap_or("");
    let msg = parts.next().unwrap_or("").to_owned();
    let code = match tag {
        "NF" => ErrorCode::FsNotFound,
        "ND" => ErrorCode::FsNotDirectory,
        "ID" => ErrorCode::FsIsDirectory,
        "NR" => ErrorCode::FsNotRegularFile,
        "EX" => ErrorCode::FsAlreadyExists,
        "NE" => ErrorCode::FsNotEmpty,
        "PD" => ErrorCode::FsPermissionDenied,
        "VM" => ErrorCode::FsVersionMismatch,
        _ => ErrorCode::FsIoError,
    };
    Some(ProviderError::fs(code, path, msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_errors_map_to_fs_codes() {
        let e = script_error("/w/x", "junk\nE NF no such file\n").unwrap();
        assert_eq!(e.code(), ErrorCode::FsNotFound);
        assert_eq!(
            script_error("/w", "E PD outside").unwrap().code(),
            ErrorCode::FsPermissionDenied
        );
        assert_eq!(
            script_error("/w", "E VM").unwrap().code(),
            ErrorCode::FsVersionMismatch
        );
        assert!(script_error("/w", "fine\n").is_none());
        assert_eq!(
            transport_idle(Duration::from_secs(1)).code(),
            ErrorCode::TransportIdleTimeout
        );
    }
}
