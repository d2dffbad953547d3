//! The microVM provider's configuration section (`kind = "microvm"`).
//!
//! Where the provider keeps its state (the guest image, the saved template VMs, one
//! directory per sandbox VM, snapshots), which qemu to run and how, the size of each VM
//! (memory, vCPUs, disk) and one limit per phase of a VM's life (boot, restore, a QMP
//! command, a state save, the stop grace). Durations are integer milliseconds, as
//! everywhere in tether's configuration.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_envd_client::EnvdClientConfig;
use tether_provider::ProviderError;

/// Default qemu binary (Debian's `qemu-system-x86`).
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";
/// Default `qemu-img` binary (Debian's `qemu-utils`).
pub const DEFAULT_QEMU_IMG: &str = "qemu-img";
/// Default memory of a VM, MiB.
pub const DEFAULT_MEMORY_MIB: u64 = 512;
/// Default vCPUs of a VM.
pub const DEFAULT_VCPUS: u32 = 1;
/// Default size of the guest's root file system (the ext4 image every overlay grows
/// into), MiB.
pub const DEFAULT_DISK_MIB: u64 = 2048;
/// Default limit of a cold boot until the guest agent answers `/health`.
pub const DEFAULT_BOOT_TIMEOUT_MS: u64 = 180_000;
/// Default limit of a restore from a saved state until the agent answers `/health`.
pub const DEFAULT_RESTORE_TIMEOUT_MS: u64 = 60_000;
/// Default limit of one `/health` probe. Short on purpose: slirp accepts a connection at
/// once even while the guest is not listening yet, and that connection just stalls.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 150;
/// Default limit of one QMP command (connect, handshake, answer).
pub const DEFAULT_QMP_TIMEOUT_MS: u64 = 10_000;
/// Default limit of saving a VM's state to a file (a snapshot, the template).
pub const DEFAULT_SAVE_TIMEOUT_MS: u64 = 120_000;
/// Default time a VM gets to quit after QMP `quit` before it is killed.
pub const DEFAULT_STOP_GRACE_MS: u64 = 3_000;
/// Default limit of the guest agent's `/init` call after a restore.
pub const DEFAULT_INIT_TIMEOUT_MS: u64 = 10_000;
/// Default time a sandbox stays paused in memory before its state is saved to its
/// directory and its qemu stopped (its memory given back); resume restores it.
pub const DEFAULT_PAUSE_TO_DISK_AFTER_MS: u64 = 300_000;
/// Default time to live recorded for a new sandbox (the daemon's leases enforce it).
pub const DEFAULT_TTL_MS: u64 = 3_600_000;
/// Default translation-cache size of TCG, MiB (qemu's own default is 1 GiB per VM).
pub const DEFAULT_TCG_TB_MIB: u64 = 64;
/// Memory the qemu process may use beyond the guest's RAM (TCG code cache, device
/// state, qemu itself) before its cgroup limit is hit, MiB.
pub const DEFAULT_QEMU_OVERHEAD_MIB: u64 = 384;
/// Default uid/gid shift of the local provider's `base` template (files owned by
/// `uid_base + n` in the template are owned by `n` in the guest).
pub const DEFAULT_TEMPLATE_UID_BASE: u32 = 100_000;
/// The guest agent's port (envd's).
pub const AGENT_PORT: u16 = 49983;

/// How qemu runs guest code.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    /// KVM where `/dev/kvm` is real hardware virtualisation (vmx/svm, not PVM), else TCG.
    #[default]
    Auto,
    /// Always KVM (fails where it is not usable).
    Kvm,
    /// Always TCG (software emulation).
    Tcg,
}

/// The `[providers.NAME] kind = "microvm"` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MicrovmConfig {
    /// State directory (image, templates, VMs, snapshots). Default
    /// `<state_dir>/sandboxes/<provider name>`.
    #[serde(default)]
    pub root: PathBuf,
    /// Directory of the built guest image. Default `<root>/image`.
    #[serde(default)]
    pub image_dir: Option<PathBuf>,
    /// The local provider's `base` template directory the guest's root file system is
    /// made from (`tether template build base`). Default
    /// `<state_dir>/sandboxes/local-templates/base`.
    #[serde(default)]
    pub base_template: Option<PathBuf>,
    /// uid/gid shift of the files of `base_template`.
    #[serde(default = "d_uid_base")]
    pub template_uid_base: u32,
    /// The static guest agent (`tether-guest`). Default: `tether-guest` beside the
    /// running binary.
    #[serde(default)]
    pub agent_binary: Option<PathBuf>,
    /// The qemu binary.
    #[serde(default = "d_qemu")]
    pub qemu: String,
    /// The `qemu-img` binary.
    #[serde(default = "d_qemu_img")]
    pub qemu_img: String,
    /// The userspace network of sandboxes with egress (`passt`, on a socket pair with
    /// qemu): egress and the agent's host forward, the host's loopback out of reach.
    /// Default: `passt` on `PATH`; without it, egress needs `allow_weaker_isolation`.
    #[serde(default)]
    pub passt: Option<PathBuf>,
    /// `auto` (KVM only where it is real hardware virtualisation), `kvm` or `tcg`.
    #[serde(default)]
    pub accel: Accel,
    /// Memory of a VM without its own limit, MiB.
    #[serde(default = "d_memory")]
    pub memory_mib: u64,
    /// vCPUs of a VM.
    #[serde(default = "d_vcpus")]
    pub vcpus: u32,
    /// Size of the guest's root file system, MiB.
    #[serde(default = "d_disk")]
    pub disk_mib: u64,
    /// TCG translation-cache size, MiB.
    #[serde(default = "d_tb")]
    pub tcg_tb_mib: u64,
    /// Put each qemu process in a cgroup with a memory limit (guest RAM plus
    /// `qemu_overhead_mib`) where the host's hierarchy allows it.
    #[serde(default = "d_true")]
    pub cgroup: bool,
    /// Memory qemu may use beyond the guest's RAM, MiB.
    #[serde(default = "d_overhead")]
    pub qemu_overhead_mib: u64,
    /// Limit of a cold boot until the agent answers, ms.
    #[serde(default = "d_boot")]
    pub boot_timeout_ms: u64,
    /// Limit of a restore until the agent answers, ms.
    #[serde(default = "d_restore")]
    pub restore_timeout_ms: u64,
    /// Limit of one readiness probe, ms.
    #[serde(default = "d_probe")]
    pub probe_timeout_ms: u64,
    /// Limit of one QMP command, ms.
    #[serde(default = "d_qmp")]
    pub qmp_timeout_ms: u64,
    /// Limit of saving a VM's state, ms.
    #[serde(default = "d_save")]
    pub save_timeout_ms: u64,
    /// Time a VM gets to quit before it is killed, ms.
    #[serde(default = "d_grace")]
    pub stop_grace_ms: u64,
    /// Limit of the agent's `/init`, ms.
    #[serde(default = "d_init")]
    pub init_timeout_ms: u64,
    /// Time to live recorded for a new sandbox without its own, ms.
    #[serde(default = "d_ttl")]
    pub default_ttl_ms: u64,
    /// Time a sandbox stays paused in memory (QMP `stop`) before its state is saved to
    /// disk and its qemu stopped, ms; 0: never. Resume restores a saved one.
    #[serde(default = "d_pause_to_disk")]
    pub pause_to_disk_after_ms: u64,
    /// Allow sandboxes that ask for network where `passt` is missing. slirp without
    /// `restrict` gives the guest egress, and the host's loopback as 10.0.2.2 with it, so
    /// such a sandbox reports `partial` enforcement; without this, asking for network
    /// without `passt` is `ISOLATION_UNAVAILABLE`.
    #[serde(default)]
    pub allow_weaker_isolation: bool,
    /// The envd client's clocks and settings (`[providers.NAME.envd]`): connect, transport
    /// idle, output idle and total limits of every call to the guest agent.
    #[serde(default)]
    pub envd: EnvdClientConfig,
}

fn d_uid_base() -> u32 {
    DEFAULT_TEMPLATE_UID_BASE
}
fn d_qemu() -> String {
    DEFAULT_QEMU.to_owned()
}
fn d_qemu_img() -> String {
    DEFAULT_QEMU_IMG.to_owned()
}
fn d_memory() -> u64 {
    DEFAULT_MEMORY_MIB
}
fn d_vcpus() -> u32 {
    DEFAULT_VCPUS
}
fn d_disk() -> u64 {
    DEFAULT_DISK_MIB
}
fn d_tb() -> u64 {
    DEFAULT_TCG_TB_MIB
}
fn d_true() -> bool {
    true
}
fn d_overhead() -> u64 {
    DEFAULT_QEMU_OVERHEAD_MIB
}
fn d_boot() -> u64 {
    DEFAULT_BOOT_TIMEOUT_MS
}
fn d_restore() -> u64 {
    DEFAULT_RESTORE_TIMEOUT_MS
}
fn d_probe() -> u64 {
    DEFAULT_PROBE_TIMEOUT_MS
}
fn d_qmp() -> u64 {
    DEFAULT_QMP_TIMEOUT_MS
}
fn d_save() -> u64 {
    DEFAULT_SAVE_TIMEOUT_MS
}
fn d_grace() -> u64 {
    DEFAULT_STOP_GRACE_MS
}
fn d_pause_to_disk() -> u64 {
    DEFAULT_PAUSE_TO_DISK_AFTER_MS
}
fn d_init() -> u64 {
    DEFAULT_INIT_TIMEOUT_MS
}
fn d_ttl() -> u64 {
    DEFAULT_TTL_MS
}

impl Default for MicrovmConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::new(),
            image_dir: None,
            base_template: None,
            template_uid_base: d_uid_base(),
            agent_binary: None,
            qemu: d_qemu(),
            qemu_img: d_qemu_img(),
            passt: None,
            accel: Accel::Auto,
            memory_mib: d_memory(),
            vcpus: d_vcpus(),
            disk_mib: d_disk(),
            tcg_tb_mib: d_tb(),
            cgroup: true,
            qemu_overhead_mib: d_overhead(),
            boot_timeout_ms: d_boot(),
            restore_timeout_ms: d_restore(),
            probe_timeout_ms: d_probe(),
            qmp_timeout_ms: d_qmp(),
            save_timeout_ms: d_save(),
            stop_grace_ms: d_grace(),
            init_timeout_ms: d_init(),
            default_ttl_ms: d_ttl(),
            pause_to_disk_after_ms: d_pause_to_disk(),
            allow_weaker_isolation: false,
            envd: EnvdClientConfig::default(),
        }
    }
}

impl MicrovmConfig {
    /// A configuration keeping its state under `root`, defaults otherwise.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            ..Self::default()
        }
    }

    /// The guest image directory.
    pub fn image_dir(&self) -> PathBuf {
        self.image_dir
            .clone()
            .unwrap_or_else(|| self.root.join("image"))
    }

    /// The guest agent binary.
    pub fn agent_binary(&self) -> Option<PathBuf> {
        self.agent_binary.clone().or_else(|| {
            let exe = std::env::current_exe().ok()?;
            Some(exe.parent()?.join("tether-guest"))
        })
    }

    /// Limit of a cold boot.
    pub fn boot_timeout(&self) -> Duration {
        Duration::from_millis(self.boot_timeout_ms)
    }
    /// Limit of a restore.
    pub fn restore_timeout(&self) -> Duration {
        Duration::from_millis(self.restore_timeout_ms)
    }
    /// Limit of one readiness probe.
    pub fn probe_timeout(&self) -> Duration {
        Duration::from_millis(self.probe_timeout_ms)
    }
    /// Limit of one QMP command.
    pub fn qmp_timeout(&self) -> Duration {
        Duration::from_millis(self.qmp_timeout_ms)
    }
    /// Limit of a state save.
    pub fn save_timeout(&self) -> Duration {
        Duration::from_millis(self.save_timeout_ms)
    }
    /// The stop grace.
    pub fn stop_grace(&self) -> Duration {
        Duration::from_millis(self.stop_grace_ms)
    }
    /// Limit of `/init`.
    pub fn init_timeout(&self) -> Duration {
        Duration::from_millis(self.init_timeout_ms)
    }
    /// Time paused in memory before a save to disk, if ever.
    pub fn pause_to_disk_after(&self) -> Option<Duration> {
        (self.pause_to_disk_after_ms > 0)
            .then(|| Duration::from_millis(self.pause_to_disk_after_ms))
    }

    /// Check the section; a bad value is an `INVALID_REQUEST` naming the field.
    pub fn validate(&self) -> Result<(), ProviderError> {
        let bad = |m: &str| {
            Err(ProviderError::InvalidRequest {
                message: format!("microvm: {m}"),
            })
        };
        if self.root.as_os_str().is_empty() || !self.root.is_absolute() {
            return bad("root must be an absolute directory");
        }
        if !(64..=1 << 20).contains(&self.memory_mib) {
            return bad("memory_mib must be between 64 and 1048576");
        }
        if !(1..=64).contains(&self.vcpus) {
            return bad("vcpus must be between 1 and 64");
        }
        if self.disk_mib < 256 {
            return bad("disk_mib must be at least 256");
        }
        if self.qemu.trim().is_empty() || self.qemu_img.trim().is_empty() {
            return bad("qemu and qemu_img must name programs");
        }
        let clocks = [
            ("boot_timeout_ms", self.boot_timeout_ms),
            ("restore_timeout_ms", self.restore_timeout_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
            ("qmp_timeout_ms", self.qmp_timeout_ms),
            ("save_timeout_ms", self.save_timeout_ms),
            ("init_timeout_ms", self.init_timeout_ms),
        ];
        for (name, v) in clocks {
            if v == 0 {
                return Err(ProviderError::InvalidRequest {
                    message: format!("microvm: {name} must be > 0"),
                });
            }
        }
        if self.probe_timeout_ms >= self.restore_timeout_ms {
            return bad("probe_timeout_ms must be below restore_timeout_ms");
        }
        self.envd.validate("microvm")
    }
}
