//! tether's E2B provider: a native Rust client for E2B and E2B-compatible backends.
//!
//! A sandbox is an E2B sandbox (a microVM in E2B's cloud, or whatever a self-hosted
//! E2B-compatible control plane runs, tetherd's own E2B front included). The crate speaks
//! E2B's control-plane REST API itself (create, connect, list, get, kill, timeout, pause)
//! and the in-sandbox envd API (its `/files` endpoints and its `process.Process` and
//! `filesystem.Filesystem` services over Connect with the JSON codec) through
//! `tether-envd-client`, which the microVM provider shares. It reads the E2B SDKs'
//! environment variables ([`config`]), probes what the backend supports instead of
//! hanging on what it lacks, bounds every remote call by tether's per-phase clocks, and
//! resumes a command's output after a broken stream from the exact offset reached
//! ([`tether_envd_client::process`]).
//!
//! It must not contain daemon logic, and depends on no other provider.

mod client;
pub mod config;
mod ports;
mod sandbox;

#[cfg(test)]
mod tests;

#[cfg(all(test, feature = "e2b-live"))]
mod integration_tests;

pub use config::{E2bConfig, Endpoints, RetryConfig};
pub use sandbox::{CREATE_MARKER, E2bProvider, E2bSandbox, KIND};
/// The envd client's process module (its wrapper and relay scripts).
pub use tether_envd_client::process;
/// The envd half of the provider, under the names it has always had here.
pub use tether_envd_client::{
    EnvdCommand as E2bCommand, EnvdFs as E2bFs, EnvdProcess as E2bProcess, EnvdVersion,
    MAX_ENVELOPE_BYTES, RELAY, TEMP_PREFIX, VERSION_META, WRAPPER, WireError, resolve, to_stat,
    version_of,
};
