//! Wire types of tether, and nothing else.
//!
//! This crate holds the serde types that cross a process boundary: the closed
//! [`ErrorCode`] set and the error body, file and process operation types, the
//! session-log events and the native HTTP API's requests and responses, and the
//! incremental decoders of two wire formats ([`connect`] envelopes, [`multipart`] bodies:
//! bytes in, values out). It must not contain I/O, async code or logic beyond
//! (de)serialisation: the daemon, the providers and external clients all depend on it.
//!
//! Change rules: a new optional field or a new enum variant that clients may ignore is
//! a minor change; a new mandatory field, a rename or a removal is a major change. An
//! [`ErrorCode`] is never renamed or reused (`tests::error_code_list_is_pinned`).
#![deny(missing_docs)]

pub mod api;
pub mod b64;
pub mod connect;
pub mod e2b;
pub mod error;
pub mod events;
pub mod fs;
pub mod limits;
pub mod multipart;
pub mod network;
pub mod process;

pub use error::{Clock, ErrorBody, ErrorCode, ErrorDetail};

/// Version of the native API, reported by `GET /v1/health`.
pub const API_VERSION: &str = "v1";

/// Version of the on-disk session log format (the header line's `version`).
pub const SESSION_LOG_VERSION: u32 = 2;
