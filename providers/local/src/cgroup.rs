//! The cgroups of a sandbox: limits, accounting, freezing.
//!
//! A sandbox's init is placed in one cgroup per hierarchy when the sandbox is created;
//! every process of the sandbox descends from it and so inherits them (the per-command
//! cost of joining a cgroup is never paid). Two layouts are supported:
//!
//! - cgroup v1 controllers (`memory`, `pids`, `freezer`, `cpu`, `cpuacct`), each in its
//!   own hierarchy, plus the controller-less v2 hierarchy when mounted (a hybrid host);
//! - a pure cgroup v2 hierarchy with the `memory`, `pids` and `cpu` controllers
//!   delegated to the daemon's cgroup.
//!
//! The sandbox cgroups live at `<hierarchy>/<daemon's cgroup>/tether/<id>`.

use std::path::{Path, PathBuf};

use tether_protocol::limits::ResourceLimits;

/// Age beyond which an empty sandbox cgroup is stale.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a freeze may take to reach every process.
const FREEZE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A controller tether uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ctrl {
    Memory,
    Pids,
    Freezer,
    Cpu,
    Cpuacct,
    /// A v2 hierarchy (all controllers it has, or none on a hybrid host).
    Unified,
}

impl Ctrl {
    fn v1_name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Freezer => "freezer",
            Self::Cpu => "cpu",
            Self::Cpuacct => "cpuacct",
            Self::Unified => "",
        }
    }
}

/// Where tether's cgroups live on this host.
#[derive(Debug, Clone)]
pub(crate) struct CgroupTree {
    /// `(controller, <hierarchy>/<own>/tether)`.
    bases: Vec<(Ctrl, PathBuf)>,
    /// Whether the unified hierarchy carries the controllers (pure v2).
    pure_v2: bool,
}

/// Which limits a sandbox's cgroups actually enforce.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Applied {
    pub memory: bool,
    pub pids: bool,
    pub cpu: bool,
    pub freezer: bool,
}

impl CgroupTree {
    /// Find the hierarchies; `None` when there is no usable one.
    pub(crate) fn detect(parent: Option<&Path>) -> Option<Self> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let mut bases = Vec::new();
        let mut pure_v2 = false;
        for line in mountinfo.lines() {
            let Some((pre, post)) = line.split_once(" - ") else {
                continue;
            };
            let Some(mount_point) = pre.split(' ').nth(4) else {
                continue;
            };
            let mut post = post.split(' ');
            let fstype = post.next().unwrap_or_default();
            let _source = post.next();
            let options = post.next().unwrap_or_default();
            let rel = |key: &str| {
                own.lines().find_map(|l| {
                    let mut f = l.splitn(3, ':');
                    let _ = f.next();
                    let ctrls = f.next()?;
                    let path = f.next()?;
                    ctrls.split(',').any(|c| c == key).then(|| path.to_owned())
                })
            };
            let place = |rel: String| -> PathBuf {
                let rel = match parent {
                    Some(p) => p.to_string_lossy().into_owned(),
                    None => rel,
                };
                Path::new(mount_point)
                    .join(rel.trim_start_matches('/'))
                    .join("tether")
            };
            if fstype == "cgroup2" {
                let Some(r) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
                    continue;
                };
                let controllers =
                    std::fs::read_to_string(Path::new(mount_point).join("cgroup.controllers"))
                        .unwrap_or_default();
                pure_v2 = controllers.split_whitespace().any(|c| c == "memory");
                bases.push((Ctrl::Unified, place(r.to_owned())));
            } else if fstype == "cgroup" {
                for ctrl in [
                    Ctrl::Memory,
                    Ctrl::Pids,
                    Ctrl::Freezer,
                    Ctrl::Cpu,
                    Ctrl::Cpuacct,
                ] {
                    if options.split(',').any(|o| o == ctrl.v1_name())
                        && !bases.iter().any(|(c, _)| *c == ctrl)
                        && let Some(r) = rel(ctrl.v1_name())
                    {
                        bases.push((ctrl, place(r)));
                    }
                }
            }
        }
        if pure_v2 {
            bases.retain(|(c, _)| *c == Ctrl::Unified);
        }
        bases.retain(|(_, b)| std::fs::create_dir_all(b).is_ok());
        if pure_v2 && let Some((_, b)) = bases.first() {
            // Delegate the controllers down to the sandboxes. A cgroup with processes
            // of its own cannot enable controllers for its children ("no internal
            // processes"): the daemon then moves itself into a leaf `daemon` next to
            // `tether` first, as a service with `Delegate=yes` may. What still fails
            // leaves those limits unapplied, and reported so.
            const CONTROLLERS: &str = "+memory +pids +cpu";
            if let Some(parent) = b.parent()
                && std::fs::write(parent.join("cgroup.subtree_control"), CONTROLLERS).is_err()
            {
                let leaf = parent.join("daemon");
                let moved = std::fs::create_dir_all(&leaf).is_ok()
                    && std::fs::write(leaf.join("cgroup.procs"), std::process::id().to_string())
                        .is_ok();
                if moved {
                    let _ = std::fs::write(parent.join("cgroup.subtree_control"), CONTROLLERS);
                }
            }
            let _ = std::fs::write(b.join("cgroup.subtree_control"), CONTROLLERS);
        }
        (!bases.is_empty()).then_some(Self { bases, pure_v2 })
    }

    /// Create the cgroups of sandbox `id` with `limits`; reports what applies.
    pub(crate) fn create(&self, id: &str, limits: &ResourceLimits) -> (SandboxCgroup, Applied) {
        let mut dirs = Vec::new();
        for (ctrl, base) in &self.bases {
            let dir = base.join(id);
            match std::fs::create_dir(&dir) {
                Ok(()) => dirs.push((*ctrl, dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => dirs.push((*ctrl, dir)),
                Err(e) => {
                    tracing::warn!(error = %e, path = %dir.display(), "Cannot create a sandbox cgroup");
                }
            }
        }
        let cg = SandboxCgroup {
            dirs,
            pure_v2: self.pure_v2,
        };
        let applied = cg.apply(limits);
        (cg, applied)
    }

    /// Remove sandbox cgroups that hold no process and are older than
    /// [`STALE_AFTER`]: left by a daemon that exited without destroying its sandboxes
    /// (their processes ended with it). A live sandbox's cgroups are never empty, and a
    /// new one is filled within its creation, well inside the age bound.
    pub(crate) fn sweep(&self) {
        let now = std::time::SystemTime::now();
        for (_, base) in &self.bases {
            let Ok(rd) = std::fs::read_dir(base) else {
                continue;
            };
            for e in rd.flatten() {
                let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                if name.len() != 32 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
                    continue;
                }
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| now.duration_since(t).ok())
                    .is_some_and(|age| age > STALE_AFTER);
                let path = e.path();
                let empty = std::fs::read_to_string(path.join("cgroup.procs"))
                    .is_ok_and(|s| s.trim().is_empty());
                // A directory with children is not one of ours.
                let leaf = std::fs::read_dir(&path)
                    .map(|rd| {
                        !rd.flatten()
                            .any(|c| c.file_type().is_ok_and(|t| t.is_dir()))
                    })
                    .unwrap_or(false);
                if old && empty && leaf {
                    let _ = std::fs::remove_dir(&path);
                }
            }
        }
    }

    /// The cgroups of sandbox `id` that exist (after a restart).
    pub(crate) fn existing(&self, id: &str) -> SandboxCgroup {
        SandboxCgroup {
            dirs: self
                .bases
                .iter()
                .map(|(c, b)| (*c, b.join(id)))
                .filter(|(_, d)| d.is_dir())
                .collect(),
            pure_v2: self.pure_v2,
        }
    }
}

/// The cgroups of one sandbox.
#[derive(Debug, Clone)]
pub(crate) struct SandboxCgroup {
    dirs: Vec<(Ctrl, PathBuf)>,
    pure_v2: bool,
}

fn write(dir: &Path, file: &str, value: &str) -> bool {
    std::fs::write(dir.join(file), value).is_ok()
}

fn read_u64(dir: &Path, file: &str) -> Option<u64> {
    std::fs::read_to_string(dir.join(file))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The value of `key` in a flat-keyed file (`memory.events`, `memory.oom_control`).
fn keyed(dir: &Path, file: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(dir.join(file)).ok()?;
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

impl SandboxCgroup {
    fn dir(&self, ctrl: Ctrl) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| *c == ctrl)
            .map(|(_, d)| d.as_path())
    }

    /// The directory of a v2-style controller: the unified one on a pure v2 host.
    fn v2(&self) -> Option<&Path> {
        self.pure_v2.then(|| self.dir(Ctrl::Unified)).flatten()
    }

    fn apply(&self, limits: &ResourceLimits) -> Applied {
        let mut a = Applied::default();
        if let Some(d) = self.v2() {
            a.memory = limits
                .memory_bytes
                .is_none_or(|m| write(d, "memory.max", &m.to_string()))
                && d.join("memory.max").is_file();
            if a.memory {
                let _ = write(d, "memory.swap.max", "0");
            }
            a.pids = limits
                .pids
                .is_none_or(|p| write(d, "pids.max", &p.to_string()))
                && d.join("pids.max").is_file();
            a.cpu = limits
                .cpu_millis
                .is_none_or(|c| write(d, "cpu.max", &format!("{} 100000", c * 100)));
            a.freezer = d.join("cgroup.freeze").is_file();
            return a;
        }
        if let Some(d) = self.dir(Ctrl::Memory) {
            a.memory = limits
                .memory_bytes
                .is_none_or(|m| write(d, "memory.limit_in_bytes", &m.to_string()));
            if let Some(m) = limits.memory_bytes {
                // Without swap accounting this file is absent: memory alone is limited.
                let _ = write(d, "memory.memsw.limit_in_bytes", &m.to_string());
            }
        }
        if let Some(d) = self.dir(Ctrl::Pids) {
            a.pids = limits
                .pids
                .is_none_or(|p| write(d, "pids.max", &p.to_string()));
        }
        if let Some(d) = self.dir(Ctrl::Cpu) {
            a.cpu = limits.cpu_millis.is_none_or(|c| {
                write(d, "cpu.cfs_period_us", "100000")
                    && write(d, "cpu.cfs_quota_us", &(c * 100).to_string())
            });
        } else {
            a.cpu = limits.cpu_millis.is_none();
        }
        a.freezer = self.dir(Ctrl::Freezer).is_some();
        a
    }

    /// Put process `pid` (the sandbox's init) into every cgroup of the sandbox.
    pub(crate) fn join(&self, pid: u32) -> std::io::Result<()> {
        for (_, d) in &self.dirs {
            std::fs::write(d.join("cgroup.procs"), pid.to_string())?;
        }
        Ok(())
    }

    /// Processes in the sandbox's cgroups (host pids).
    pub(crate) fn pids(&self) -> Vec<i32> {
        let Some((_, d)) = self.dirs.first() else {
            return Vec::new();
        };
        std::fs::read_to_string(d.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Freeze (`true`) or thaw the whole sandbox; a freeze waits (bounded by
    /// [`FREEZE_WAIT`]) until every process is frozen.
    pub(crate) fn freeze(&self, frozen: bool) -> bool {
        let written = if let Some(d) = self.v2() {
            write(d, "cgroup.freeze", if frozen { "1" } else { "0" })
        } else {
            match self.dir(Ctrl::Freezer) {
                Some(d) => write(d, "freezer.state", if frozen { "FROZEN" } else { "THAWED" }),
                None => false,
            }
        };
        if written && frozen {
            let step = std::time::Duration::from_millis(1);
            for _ in 0..FREEZE_WAIT.as_millis() {
                if self.frozen() {
                    break;
                }
                std::thread::sleep(step);
            }
        }
        written
    }

    /// Whether the sandbox is frozen.
    pub(crate) fn frozen(&self) -> bool {
        if let Some(d) = self.v2() {
            return keyed(d, "cgroup.events", "frozen") == Some(1);
        }
        self.dir(Ctrl::Freezer).is_some_and(|d| {
            std::fs::read_to_string(d.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
        })
    }

    /// Out-of-memory kills so far.
    pub(crate) fn oom_kills(&self) -> u64 {
        if let Some(d) = self.v2() {
            return keyed(d, "memory.events", "oom_kill").unwrap_or(0);
        }
        self.dir(Ctrl::Memory)
            .and_then(|d| keyed(d, "memory.oom_control", "oom_kill"))
            .unwrap_or(0)
    }

    /// Forks refused at the process limit so far.
    pub(crate) fn pids_refusals(&self) -> u64 {
        let d = self.v2().or_else(|| self.dir(Ctrl::Pids));
        d.and_then(|d| keyed(d, "pids.events", "max")).unwrap_or(0)
    }

    /// CPU time used, in microseconds.
    pub(crate) fn cpu_usage_us(&self) -> u64 {
        if let Some(d) = self.v2() {
            return keyed(d, "cpu.stat", "usage_usec").unwrap_or(0);
        }
        self.dir(Ctrl::Cpuacct)
            .and_then(|d| read_u64(d, "cpuacct.usage"))
            .map(|ns| ns / 1000)
            .unwrap_or(0)
    }

    /// Memory charged now, and the limit.
    pub(crate) fn memory(&self) -> (u64, Option<u64>) {
        let (cur, max) = match self.v2() {
            Some(d) => (read_u64(d, "memory.current"), read_u64(d, "memory.max")),
            None => match self.dir(Ctrl::Memory) {
                Some(d) => (
                    read_u64(d, "memory.usage_in_bytes"),
                    read_u64(d, "memory.limit_in_bytes"),
                ),
                None => (None, None),
            },
        };
        // v1 reports "no limit" as a huge page-aligned number.
        (cur.unwrap_or(0), max.filter(|m| *m < (1 << 62)))
    }

    /// Processes alive now.
    pub(crate) fn pids_current(&self) -> u64 {
        let d = self.v2().or_else(|| self.dir(Ctrl::Pids));
        d.and_then(|d| read_u64(d, "pids.current"))
            .unwrap_or_else(|| self.pids().len() as u64)
    }

    /// Remove the cgroups (best effort: a cgroup with processes stays).
    pub(crate) fn remove(&self) {
        for (_, d) in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}
