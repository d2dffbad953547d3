//! Resource limits of a sandbox, and which limit ended a command.

use serde::{Deserialize, Serialize};

/// Limits of one sandbox. `None` means "the provider's default" when a sandbox is
/// requested, and "no limit" in what a provider reports as applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    /// Memory (resident plus page cache charged to the sandbox), in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Processes and threads alive at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// CPU bandwidth in thousandths of a CPU (1000 = one full CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    /// Size of the sandbox's own writable file-system layer, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

impl ResourceLimits {
    /// These limits, each unset one taken from `defaults`.
    pub fn or(self, defaults: ResourceLimits) -> ResourceLimits {
        ResourceLimits {
            memory_bytes: self.memory_bytes.or(defaults.memory_bytes),
            pids: self.pids.or(defaults.pids),
            cpu_millis: self.cpu_millis.or(defaults.cpu_millis),
            disk_bytes: self.disk_bytes.or(defaults.disk_bytes),
        }
    }
}

/// A limit a command ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// The kernel's out-of-memory killer ended a process of the sandbox.
    Memory,
    /// A `fork` was refused at the process limit.
    Pids,
    /// The sandbox's file system is full.
    Disk,
}

impl LimitKind {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Disk => "disk",
        }
    }
}
