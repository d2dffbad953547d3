//! tether's local provider: every sandbox a machine of its own.
//!
//! A sandbox is a set of namespaces (user, with root inside mapped to an unprivileged
//! host uid range; mount; pid; UTS; IPC; network; cgroup) created once and held by a
//! small init that is pid 1 inside ([`init`]); it starts every command. Its root file
//! system is an overlay over a read-only template, whose upper layer lives on its own
//! size-limited ext4 image ([`rootfs`]); its cgroups carry memory, process and CPU
//! limits on cgroup v1 or v2 hierarchies; its network is its own loopback only, or
//! egress through a userspace NAT (`pasta`) that cannot reach the host's loopback.
//! What is enforced is reported in `SandboxInfo::enforcement`; less than `full` is
//! refused unless the configuration allows weaker isolation.
//!
//! A sandbox outlives a daemon that crashed by [`LocalConfig::orphan_grace_ms`]: its init
//! spools its commands' output meanwhile, and the next daemon takes it over, running
//! commands and all.
//!
//! File operations ([`LocalFs`]) act on the sandbox's root through its init's
//! `/proc/<pid>/root`, with path resolution that cannot leave it, as the sandbox's
//! user. The crate contains no `unsafe` code: namespaces, mounts and descriptor passing
//! use safe wrappers (`nix`, `rustix`) in a separate, single-threaded helper process.

mod cgroup;
mod client;
mod config;
pub mod confine;
mod elevated;
mod error;
mod fs;
pub mod init;
mod process;
pub mod rootfs;
mod sandbox;

#[cfg(test)]
mod tests;

pub use client::CONFINE_BINARY;
pub use config::{
    DEFAULT_DEVICE_PATHS, DEFAULT_DISK_BYTES, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MEMORY_BYTES,
    DEFAULT_ORPHAN_GRACE_MS, DEFAULT_PIDS, DEFAULT_READ_ONLY_PATHS, DEFAULT_TEMPLATE,
    DEFAULT_UID_BASE, DEFAULT_WORKSPACE_PATH, Isolation, LocalConfig,
};
pub use confine::CONFINE_SUBCOMMAND;
pub use error::CONFINE_FAILED_EXIT;
pub use fs::{LocalFs, READ_CHUNK, TEMP_PREFIX};
pub use init::InitSpec;
pub use process::{DEFAULT_PATH, LocalCommand, LocalProcess};
pub use rootfs::{BuildProgress, build_base};
pub use sandbox::{KIND, LocalProvider, LocalSandbox, end_orphaned_sandboxes};
