//! What the microVM tests share: the configuration over this host's qemu, guest agent and
//! base template, or the reason the tests are skipped.

use std::path::{Path, PathBuf};

use tether_provider_microvm::MicrovmConfig;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The test configuration, or `None` (with the reason printed) where the host lacks
/// something.
pub fn config() -> Option<MicrovmConfig> {
    let ws = workspace();
    let agent = std::env::var_os("TETHER_GUEST_BIN").map_or_else(
        || ws.join("target/x86_64-unknown-linux-gnu/release/tether-guest"),
        PathBuf::from,
    );
    let templates = std::env::var_os("TETHER_TEMPLATE_DIR")
        .map_or_else(|| ws.join("target/tether-templates"), PathBuf::from);
    let base = templates.join("base");
    let missing = |what: String| {
        eprintln!("SKIPPED: {what}");
        None
    };
    for prog in ["qemu-system-x86_64", "qemu-img", "mkfs.ext4", "cpio"] {
        if !std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join(prog).is_file())
        {
            return missing(format!("{prog} is not installed"));
        }
    }
    if !Path::new("/bin/busybox").exists() {
        return missing("busybox-static is not installed".into());
    }
    if !agent.is_file() {
        return missing(format!("no guest agent at {}", agent.display()));
    }
    if !base.join(".tether-template-complete").exists() {
        return missing(format!("no base template at {}", base.display()));
    }
    let root = ws.join("target/microvm-test");
    let mut cfg = MicrovmConfig::with_root(root.canonicalize().unwrap_or(root));
    std::fs::create_dir_all(&cfg.root).unwrap();
    cfg.root = cfg.root.canonicalize().unwrap();
    cfg.agent_binary = Some(agent);
    cfg.base_template = Some(base);
    // Small VMs: the tests run several at once on a small host.
    cfg.memory_mib = 256;
    Some(cfg)
}
