//! The configuration tests and benchmarks use on a build host: the workspace's guest
//! agent and `base` template, and one cache (`target/microvm-test`) of the guest image
//! and the saved templates, shared by every test crate so that each template boots once.

use std::path::{Path, PathBuf};

use crate::MicrovmConfig;

/// The cache directory under the workspace.
pub const TEST_ROOT: &str = "target/microvm-test";

/// The test configuration over `workspace`'s build outputs (the guest agent from
/// `TETHER_GUEST_BIN`, default `target/x86_64-unknown-linux-gnu/release/tether-guest`;
/// the templates from `TETHER_TEMPLATE_DIR`, default `target/tether-templates`), with
/// 256 MiB guests (tests run several at once on a small host). `Err` says what this host
/// lacks (qemu, busybox, the agent or the template): the caller skips and prints it.
pub fn test_config(workspace: &Path) -> Result<MicrovmConfig, String> {
    let agent = std::env::var_os("TETHER_GUEST_BIN").map_or_else(
        || workspace.join("target/x86_64-unknown-linux-gnu/release/tether-guest"),
        PathBuf::from,
    );
    let base = std::env::var_os("TETHER_TEMPLATE_DIR")
        .map_or_else(|| workspace.join("target/tether-templates"), PathBuf::from)
        .join("base");
    let path = std::env::var_os("PATH").unwrap_or_default();
    for prog in ["qemu-system-x86_64", "qemu-img", "mkfs.ext4", "cpio"] {
        if !std::env::split_paths(&path).any(|d| d.join(prog).is_file()) {
            return Err(format!("{prog} is not installed"));
        }
    }
    if !Path::new("/bin/busybox").exists() {
        return Err("busybox-static is not installed".into());
    }
    if !agent.is_file() {
        return Err(format!("no guest agent at {}", agent.display()));
    }
    if !base.join(".tether-template-complete").exists() {
        return Err(format!("no base template at {}", base.display()));
    }
    let root = workspace.join(TEST_ROOT);
    std::fs::create_dir_all(&root)
        .and_then(|()| root.canonicalize())
        .map(|root| {
            let mut cfg = MicrovmConfig::with_root(root);
            cfg.agent_binary = Some(agent);
            cfg.base_template = Some(base);
            cfg.memory_mib = 256;
            cfg
        })
        .map_err(|e| format!("cannot make {}: {e}", workspace.join(TEST_ROOT).display()))
}
