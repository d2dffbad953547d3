//! The provider seam of tether.
//!
//! Every sandbox backend (local confined processes, E2B microVMs, SSH hosts) implements
//! the same four capability traits: [`Provider`], [`Sandbox`], [`Fs`] and [`Process`]
//! (with its [`ProcessHandle`]). Each method takes a [`CallCtx`] that carries the call's
//! deadline, cancellation signal and trace context, and returns a [`ProviderError`] with
//! a stable [`ErrorCode`](tether_protocol::ErrorCode).
//!
//! The crate also holds [`clock`], tether's cooperative deadlines and idle watchdogs, and
//! (feature `testkit`) the conformance suite every provider must pass.
//!
//! It must not contain any backend, HTTP server, or daemon logic.
#![deny(missing_docs)]

pub mod clock;
mod ctx;
mod error;
mod seam;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use clock::Clock;
pub use ctx::{CallCtx, TraceContext};
pub use error::{Origin, ProviderError, Result};
pub use seam::{
    ByteStream, Capabilities, Enforcement, EventStream, Fs, FsOp, PauseKind, PortIo, PortRoute,
    PortStream, Process, ProcessHandle, ProcessSelector, Provider, Sandbox, SandboxInfo,
    SandboxMetrics, SandboxSpec, Signal, StreamOffsets, TerminateReport,
};

/// Helpers shared by provider implementations.
pub mod util;
