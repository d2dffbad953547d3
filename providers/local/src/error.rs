//! Backend errors of the local provider (I/O, `errno`, the trampoline) mapped to
//! [`ProviderError`] with stable codes.
//!
//! The seam's error type is the crate's error type: these are conversion helpers.

use std::io;

use tether_protocol::ErrorCode;
use tether_provider::ProviderError;

/// Exit code of the sandbox init (`tether-confine holder|pid1`) when a set-up step failed.
pub const CONFINE_FAILED_EXIT: i32 = 121;

/// An I/O error on sandbox path `path`, as an `FS_*` error. An escape attempt the kernel
/// refused (`EXDEV` from `RESOLVE_BENEATH`/`RESOLVE_NO_XDEV`, `ELOOP` from
/// `RESOLVE_NO_SYMLINKS`) reads as `FS_PERMISSION_DENIED`.
pub(crate) fn fs_io(path: &str, e: io::Error) -> ProviderError {
    match e.raw_os_error() {
        Some(code) if code == rustix::io::Errno::XDEV.raw_os_error() => ProviderError::Fs {
            code: ErrorCode::FsPermissionDenied,
            path: path.to_owned(),
            message: "path leaves the workspace".into(),
            source: Some(e),
        },
        _ => ProviderError::from_io(path, e),
    }
}

/// An `errno` on sandbox path `path`, as an `FS_*` error.
pub(crate) fn fs_errno(path: &str, e: rustix::io::Errno) -> ProviderError {
    fs_io(path, io::Error::from(e))
}

/// A path that names something outside the workspace.
pub(crate) fn outside(path: &str) -> ProviderError {
    ProviderError::fs(
        ErrorCode::FsPermissionDenied,
        path,
        "path is outside the workspace",
    )
}

/// A malformed path.
pub(crate) fn bad_path(path: &str, why: &str) -> ProviderError {
    ProviderError::InvalidRequest {
        message: format!("{path:?}: {why}"),
    }
}

/// An unexpected failure of the provider itself.
pub(crate) fn internal(
    message: impl Into<String>,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> ProviderError {
    ProviderError::Internal {
        message: message.into(),
        source: Some(source.into()),
    }
}

/// A failed `spawn`.
pub(crate) fn spawn_failed(message: impl Into<String>, source: Option<io::Error>) -> ProviderError {
    ProviderError::SpawnFailed {
        message: message.into(),
        source,
    }
}

/// A blocking task that panicked or was cancelled.
pub(crate) fn join(e: tokio::task::JoinError) -> ProviderError {
    internal("a blocking file operation did not complete", e)
}
