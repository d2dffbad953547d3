//! tether's E2B provider: a native Rust client for E2B and E2B-compatible backends.
//!
//! A sandbox is an E2B sandbox (a microVM in E2B's cloud, or whatever a self-hosted
//! E2B-compatible control plane runs, tetherd's own E2B front included). The crate speaks
//! both of E2B's planes itself: the control-plane REST API (create, connect, list, get,
//! kill, timeout, pause) and the in-sandbox envd API (its `/files` endpoints and its
//! `process.Process` and `filesystem.Filesystem` services over Connect with the JSON
//! codec). It reads the E2B SDKs' environment variables ([`config`]), probes what the
//! backend supports instead of hanging on what it lacks, bounds every remote call by
//! tether's per-phase clocks, and resumes a command's output after a broken stream from
//! the exact offset reached ([`process`]).
//!
//! It must not contain daemon logic, and depends on no other provider.

mod client;
pub mod config;
mod error;
mod fs;
pub mod process;
mod sandbox;

#[cfg(test)]
mod tests;

#[cfg(all(test, feature = "e2b-live"))]
mod integration_tests;

pub use client::{EnvdVersion, MAX_ENVELOPE_BYTES};
pub use config::{E2bConfig, Endpoints, RetryConfig};
pub use error::WireError;
pub use fs::{E2bFs, TEMP_PREFIX, VERSION_META, resolve, to_stat, version_of};
pub use process::{E2bCommand, E2bProcess, RELAY, WRAPPER};
pub use sandbox::{CREATE_MARKER, E2bProvider, E2bSandbox, KIND};
