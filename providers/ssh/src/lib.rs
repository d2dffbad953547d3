//! tether's SSH provider: plain hosts reached over SSH as sandboxes.
//!
//! A sandbox is a private workspace directory on a host ([`sandbox`]); commands run there
//! under `setsid` with an output journal and an exit-status file on the host, so a broken
//! connection loses nothing and a command is found again by id or pid ([`process`]); files
//! move over SFTP with atomic, guarded publication and every path confined to the
//! workspace ([`fs`]). The transport is russh with a connection pool per host, strict
//! host-key checking against known_hosts, keepalives, and one clock per phase of a call
//! (connect, transport idle, total) ([`client`], [`config`]).
//!
//! It must not contain daemon logic, and depends on no other provider.

mod client;
pub mod config;
mod error;
pub mod fs;
pub mod process;
pub mod sandbox;

#[cfg(test)]
mod tests;

pub use client::{bash_line, sh_quote};
pub use config::{AuthConfig, HostConfig, HostKeyPolicy, SshConfig};
pub use sandbox::{KIND, SandboxStamp, SshProvider, SshSandbox};
