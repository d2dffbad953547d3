//! tether's microVM provider: each sandbox is a qemu `-M microvm` VM on the daemon's own
//! host, KVM where the host has real hardware virtualisation and TCG otherwise.
//!
//! The guest is Debian's cloud kernel, a busybox initramfs and an ext4 root made from the
//! local provider's `base` template, with the static guest agent `tether-guest` as PID 1
//! serving envd on port 49983 ([`image`]). qemu is driven over QMP ([`client`]). A booted
//! template VM is saved once; every sandbox restores from it with its own qcow2 overlay,
//! and `/init` gives it a fresh access token, the time and entropy ([`sandbox`]). Files
//! and processes are envd's, spoken to the agent through slirp's host forward ([`fs`],
//! [`process`]).
//!
//! It must not contain daemon logic, and depends on no other provider.

pub mod client;
pub mod config;
mod error;
pub mod fs;
pub mod image;
pub mod process;
pub mod sandbox;
#[cfg(feature = "testkit")]
pub mod testkit;

#[cfg(test)]
mod tests;

pub use config::{Accel, MicrovmConfig};
pub use image::{GuestImage, GuestProgress, GuestSpec, build_guest, find_guest};
pub use sandbox::{AgentRoute, KIND, MicrovmProvider, MicrovmSandbox, VmCore, VmStamp};
