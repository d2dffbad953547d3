//! tether's envd client: the in-sandbox half of the E2B protocol, for every provider
//! whose sandboxes run E2B's in-sandbox daemon (envd) or an agent that speaks it.
//!
//! envd serves, on one port, the `process.Process` and `filesystem.Filesystem` services
//! over Connect with the JSON codec, and the REST endpoints `/files` (contents, streamed
//! both ways), `/health` and `/init`. This crate is a client of one sandbox's envd
//! ([`EnvdSandboxClient`], built from an [`EnvdEndpoint`] and an [`EnvdClientConfig`]),
//! and the seam's [`tether_provider::Fs`] and [`tether_provider::Process`] over it
//! ([`EnvdFs`], [`EnvdProcess`]): atomic writes with versions, re-attach to a command by
//! its tag, output resumed after a broken stream from the exact offset reached (from an
//! in-sandbox copy), signals to the whole process group, and every remote call bounded by
//! tether's per-phase clocks (connect / first byte, transport idle, output idle, total),
//! idempotent calls retried with `backon`. A readiness probe
//! ([`EnvdSandboxClient::probe_health`]) and `POST /init` ([`EnvdSandboxClient::init`])
//! serve providers that boot or restore the machine themselves.
//!
//! Users: the E2B provider (`tether-provider-e2b`, which adds E2B's control plane and
//! reuses [`Http`], [`retry`] and the error mapping for it) and the microVM provider
//! (`tether-provider-microvm`, whose guest agent speaks envd). A provider writes
//!
//! ```ignore
//! impl Sandbox for MySandbox {
//!     fn fs(&self) -> &dyn Fs { &self.fs }             // an EnvdFs
//!     fn process(&self) -> &dyn Process { &self.process } // an EnvdProcess
//! }
//! ```
//!
//! It must not contain daemon logic, and depends on no provider.

mod client;
pub mod config;
pub mod error;
mod fs;
pub mod process;
mod sandbox;

#[cfg(test)]
mod tests;

pub use client::{
    EnvdEndpoint, EnvdVersion, Http, MAX_ENVELOPE_BYTES, decode, join, retry, retry_unanswered,
};
pub use config::{EnvdClientConfig, RetryConfig};
pub use error::WireError;
pub use fs::{EnvdFs, TEMP_PREFIX, VERSION_META, resolve, to_stat, version_of};
pub use process::{EnvdCommand, EnvdProcess, RELAY, WRAPPER};
pub use sandbox::{EnvdSandboxClient, parse_time_ms};
