//! Processes of a microVM sandbox: envd's, spoken to the guest agent
//! (`tether-envd-client`'s `EnvdProcess`: commands in their own process group, output
//! with byte offsets, re-attach by tag after a broken stream). One per VM: it holds the
//! VM's command table.

pub use tether_envd_client::EnvdProcess as VmProcess;
