//! tether's local provider: sandboxes as confined local processes.
//!
//! A sandbox is a private workspace directory on the host, presented to its commands at
//! `/home/user` through a mount namespace, plus the commands confined in it. Every
//! command starts through the confinement trampoline ([`confine`]): own user, mount and
//! (without network) network namespaces, a Landlock ruleset that allows reading the
//! system, writing the workspace and a private `/tmp`, and nothing else, its own process
//! group and cgroup so that `terminate()` reaches every descendant. What is enforced is
//! probed when a sandbox is created and reported in `SandboxInfo::enforcement`; less
//! than `full` is refused unless the configuration allows weaker isolation.
//!
//! File operations ([`LocalFs`]) act on the host workspace directory directly, with
//! path resolution that cannot leave it. The crate contains no daemon logic and no
//! `unsafe` code: confinement uses safe wrappers (`nix`, `rustix`, `landlock`) in a
//! separate, single-threaded process instead of `pre_exec`.

mod client;
mod config;
pub mod confine;
mod error;
mod fs;
mod process;
mod sandbox;

#[cfg(test)]
mod tests;

pub use client::CONFINE_BINARY;
pub use config::{
    DEFAULT_DEVICE_PATHS, DEFAULT_HIDDEN_PATHS, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_READ_ONLY_PATHS,
    DEFAULT_WORKSPACE_PATH, LocalConfig, PRIVATE_TMPFS_PATHS,
};
pub use confine::{CONFINE_SUBCOMMAND, ConfineSpec, LandlockLevel, ProbeReport};
pub use error::{CONFINE_FAILED_EXIT, CONFINE_FAILED_PREFIX, ConfineError};
pub use fs::{LocalFs, READ_CHUNK, TEMP_PREFIX};
pub use process::{DEFAULT_PATH, LocalCommand, LocalProcess};
pub use sandbox::{KIND, LocalProvider, LocalSandbox};
