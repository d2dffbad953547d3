//! tetherd, the tether daemon, as a library (the `tetherd` and `tether` binaries are thin
//! wrappers over it).
//!
//! It holds the configuration, the HTTP server (the native API and the E2B front), the
//! session store and its crash-safe logs, the tool pipeline and its guards, command
//! execution with its clocks, leases, and telemetry. It must not contain provider
//! (backend) code: providers are reached only through the `tether-provider` seam.

// The session log and telemetry are crates of their own; these names keep their paths
// short here.
pub use tether_session_log as session_log;
pub use tether_session_log::invariants;
pub use tether_telemetry as telemetry;

pub mod api;
pub mod auth;
pub mod cli;
pub mod config;
pub mod e2b_front;
pub mod error;
pub mod exec;
pub mod http;
pub mod leases;
pub mod ops;
pub mod pipeline;
pub mod providers;
pub mod server;
pub mod session_manager;
pub mod state;
#[cfg(test)]
pub(crate) mod testutil;
