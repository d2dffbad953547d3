//! The confinement trampoline: what runs between the daemon and every sandboxed command.
//!
//! `unsafe_code` is forbidden, so there is no `pre_exec` hook in the daemon. Instead
//! every command is spawned as `tether-confine __confine run <spec.json>` (or as the
//! daemon itself with the same hidden subcommand), and this single-threaded program
//! confines itself with safe syscall wrappers, then `exec`s the command:
//!
//! 1. join the command's cgroup (so `terminate()` reaches processes that leave the
//!    process group), and for a pty, `setsid` plus `TIOCSCTTY` on the terminal;
//! 2. `unshare` a user namespace (uid and gid mapped to themselves: the command keeps
//!    its uid but loses every capability over the host), a mount namespace, and a
//!    network namespace when the sandbox has no network;
//! 3. make `/` recursively private, hide the host's `/home` (the workspace's first path
//!    component) and `/run` behind empty tmpfs mounts, give the command private `/tmp`
//!    and `/dev/shm`, and bind-mount the sandbox's workspace directory at `/home/user`;
//! 4. restrict itself with Landlock (target ABI 6): read and execute on the system
//!    paths, read-write on the workspace, the private tmpfs mounts, a few device nodes
//!    and, under a pty, its own terminal (no other one), nothing else; signals and
//!    abstract Unix sockets scoped to the sandbox; TCP bind and connect denied when the
//!    sandbox has no network;
//! 5. `chdir`, replace the environment with the spec's (never the daemon's), `exec`.
//!
//! It fails closed: if a step fails, or the enforcement reached is below what the
//! sandbox promised, it prints one line starting with [`CONFINE_FAILED_PREFIX`] on
//! stderr and exits with [`CONFINE_FAILED_EXIT`] without running anything. `probe`
//! performs the same steps, prints a [`ProbeReport`] as JSON and exits.
//!
//! A process that calls [`main`] must still be single-threaded (user namespaces demand
//! it): `tetherd` dispatches `__confine` before it starts its runtime.

use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, path_beneath_rules,
};
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use serde::{Deserialize, Serialize};
use tether_provider::Enforcement;

use crate::error::{CONFINE_FAILED_EXIT, CONFINE_FAILED_PREFIX, ConfineError};

/// The hidden subcommand that routes a binary's `main` here.
pub const CONFINE_SUBCOMMAND: &str = "__confine";

/// The Landlock ABI whose rights tether asks for. Everything it defines is what
/// `full` means: all file-system rights including `IOCTL_DEV` (ABI 5), TCP bind and
/// connect (ABI 4), signal and abstract-socket scoping (ABI 6). A kernel with an older
/// ABI enforces a subset, which is reported as `partial`.
pub const LANDLOCK_ABI: ABI = ABI::V6;

/// What to confine and run. Written by the provider to a file in the sandbox's private
/// state directory; the trampoline deletes it once read (it holds the environment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfineSpec {
    /// The sandbox's workspace directory on the host.
    pub workspace_host: PathBuf,
    /// Where the workspace appears inside (`/home/user`).
    pub workspace_path: PathBuf,
    /// Host directories covered by an empty tmpfs (`/home`, `/run`).
    pub hidden: Vec<PathBuf>,
    /// Private writable tmpfs mounts (`/tmp`, `/dev/shm`).
    pub private_tmpfs: Vec<PathBuf>,
    /// Paths the command may read and execute.
    pub read_only: Vec<PathBuf>,
    /// Device nodes the command may read and write.
    pub devices: Vec<PathBuf>,
    /// Whether the command may use the network.
    pub network: bool,
    /// Whether to apply Landlock.
    pub landlock: bool,
    /// The cgroup (v2 directory) to join first, if tracked by cgroup.
    pub cgroup: Option<PathBuf>,
    /// The least enforcement to accept; below it, nothing runs.
    pub require: Enforcement,
    /// Whether stdin is a pty slave to become the controlling terminal of a new session.
    pub pty: bool,
    /// Working directory (a sandbox path).
    pub cwd: PathBuf,
    /// The complete environment of the command.
    pub env: Vec<(String, String)>,
    /// Program and arguments (the program is looked up on the spec's `PATH`).
    pub argv: Vec<String>,
}

/// How far the Landlock ruleset was enforced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LandlockLevel {
    /// Not applied (disabled, unsupported, or failed).
    #[default]
    None,
    /// Applied, but the kernel lacks some requested rights.
    Partial,
    /// Every requested right is enforced.
    Full,
}

/// What the trampoline managed to set up, reported by `probe`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// Joined the requested cgroup.
    pub cgroup: bool,
    /// Runs in its own user namespace (no capabilities over the host).
    pub user_ns: bool,
    /// Runs in its own mount namespace with the workspace mounted.
    pub mount_ns: bool,
    /// Runs in its own (empty) network namespace.
    pub net_ns: bool,
    /// Landlock enforcement.
    pub landlock: LandlockLevel,
    /// The kernel's Landlock support, as the landlock crate reports it.
    pub landlock_status: String,
    /// The resulting enforcement.
    pub enforcement: Enforcement,
    /// What did not work.
    pub problems: Vec<String>,
}

impl Default for ProbeReport {
    fn default() -> Self {
        Self {
            cgroup: false,
            user_ns: false,
            mount_ns: false,
            net_ns: false,
            landlock: LandlockLevel::None,
            landlock_status: String::new(),
            enforcement: Enforcement::None,
            problems: Vec::new(),
        }
    }
}

/// The trampoline's entry point: `[argv0] [__confine] run|probe <spec.json>`.
///
/// `run` does not return on success (it `exec`s the command).
pub fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == CONFINE_SUBCOMMAND) {
        args.remove(0);
    }
    let (verb, path) = match args.as_slice() {
        [verb, path] => (verb.to_string_lossy().into_owned(), PathBuf::from(path)),
        _ => return fail(&ConfineError::Usage),
    };
    match verb.as_str() {
        "run" => run(&path),
        "probe" => probe(&path),
        _ => fail(&ConfineError::Usage),
    }
}

fn run(path: &Path) -> ExitCode {
    let spec = match read_spec(path, true) {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    let report = match confine(&spec) {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    if report.enforcement < spec.require {
        return fail(&ConfineError::Weaker {
            reached: report.enforcement.as_str(),
            required: spec.require.as_str(),
        });
    }
    exec(&spec)
}

fn probe(path: &Path) -> ExitCode {
    let report = match read_spec(path, false).and_then(|spec| confine(&spec)) {
        Ok(r) => r,
        Err(e) => ProbeReport {
            problems: vec![chain(&e)],
            ..ProbeReport::default()
        },
    };
    match serde_json::to_string(&report) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&ConfineError::step("report", e)),
    }
}

fn fail(e: &ConfineError) -> ExitCode {
    eprintln!("{CONFINE_FAILED_PREFIX} {}", chain(e));
    ExitCode::from(CONFINE_FAILED_EXIT as u8)
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn read_spec(path: &Path, consume: bool) -> Result<ConfineSpec, ConfineError> {
    let err = |source: Box<dyn std::error::Error + Send + Sync>| ConfineError::Spec {
        path: path.display().to_string(),
        source,
    };
    let bytes = std::fs::read(path).map_err(|e| err(e.into()))?;
    if consume {
        // The spec carries the command's environment; it has no business lingering.
        std::fs::remove_file(path).map_err(|e| err(e.into()))?;
    }
    serde_json::from_slice(&bytes).map_err(|e| err(e.into()))
}

/// Perform every confinement step on the current process.
fn confine(spec: &ConfineSpec) -> Result<ProbeReport, ConfineError> {
    let mut report = ProbeReport::default();

    // 1. Tracking first, while the cgroup file system is still writable to us.
    if let Some(cg) = &spec.cgroup {
        std::fs::write(cg.join("cgroup.procs"), format!("{}\n", std::process::id()))
            .map_err(|e| ConfineError::step(format!("join cgroup {}", cg.display()), e))?;
        report.cgroup = true;
    }
    if spec.pty {
        nix::unistd::setsid().map_err(|e| ConfineError::step("setsid", e))?;
        rustix::process::ioctl_tiocsctty(std::io::stdin().as_fd()).map_err(|e| {
            ConfineError::step("acquire the controlling terminal", std::io::Error::from(e))
        })?;
    }

    // 2. Namespaces.
    let uid = nix::unistd::geteuid();
    let gid = nix::unistd::getegid();
    let mut flags = CloneFlags::CLONE_NEWNS;
    if !spec.network {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    match unshare(flags | CloneFlags::CLONE_NEWUSER) {
        Ok(()) => {
            // Map our own ids only: root stays uid 0 for file ownership, but holds
            // capabilities over this namespace alone, never over the host.
            let _ = std::fs::write("/proc/self/setgroups", "deny");
            std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1\n"))
                .map_err(|e| ConfineError::step("write uid_map", e))?;
            std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1\n"))
                .map_err(|e| ConfineError::step("write gid_map", e))?;
            report.user_ns = true;
        }
        // Root without user namespaces can still build the mount namespace; the
        // command then keeps host capabilities, which is reported as partial.
        Err(e) if uid.is_root() => {
            report.problems.push(format!("user namespace: {e}"));
            unshare(flags).map_err(|e| ConfineError::step("unshare", e))?;
        }
        Err(e) => return Err(ConfineError::step("unshare", e)),
    }
    report.net_ns = !spec.network;

    // 3. Mounts.
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(|e| ConfineError::step("make / private", e))?;
    // The workspace may sit under a directory about to be hidden (/home, /tmp): hold it
    // open and bind-mount it through /proc/self/fd. Opened only now, so that the
    // descriptor names a mount of the new namespace (a bind from the old one is EINVAL).
    let workspace = rustix::fs::open(
        &spec.workspace_host,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| {
        ConfineError::step(
            format!("open the workspace {}", spec.workspace_host.display()),
            std::io::Error::from(e),
        )
    })?;

    let tmpfs_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for dir in &spec.hidden {
        if dir.is_dir() {
            mount(
                Some("tmpfs"),
                dir,
                Some("tmpfs"),
                tmpfs_flags,
                Some("mode=0755,size=1m"),
            )
            .map_err(|e| ConfineError::step(format!("hide {}", dir.display()), e))?;
        }
    }
    for dir in &spec.private_tmpfs {
        if dir.is_dir() {
            mount(
                Some("tmpfs"),
                dir,
                Some("tmpfs"),
                tmpfs_flags,
                Some("mode=1777"),
            )
            .map_err(|e| ConfineError::step(format!("private {}", dir.display()), e))?;
        }
    }
    std::fs::create_dir_all(&spec.workspace_path)
        .map_err(|e| ConfineError::step(format!("create {}", spec.workspace_path.display()), e))?;
    let source = format!("/proc/self/fd/{}", workspace.as_raw_fd());
    mount(
        Some(source.as_str()),
        &spec.workspace_path,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(|e| {
        ConfineError::step(
            format!("mount the workspace at {}", spec.workspace_path.display()),
            e,
        )
    })?;
    drop(workspace);
    report.mount_ns = true;

    // 4. Landlock.
    if spec.landlock {
        match restrict(spec) {
            Ok((level, status)) => {
                report.landlock = level;
                report.landlock_status = status;
            }
            Err(e) => report.problems.push(format!("landlock: {}", chain(&e))),
        }
        if report.landlock != LandlockLevel::Full {
            report.problems.push(format!(
                "landlock is {:?} ({})",
                report.landlock, report.landlock_status
            ));
        }
    } else {
        report
            .problems
            .push("landlock is disabled by configuration".into());
    }

    report.enforcement = match (report.landlock, report.user_ns) {
        (LandlockLevel::Full, true) => Enforcement::Full,
        _ => Enforcement::Partial,
    };
    Ok(report)
}

fn restrict(spec: &ConfineSpec) -> Result<(LandlockLevel, String), landlock::RulesetError> {
    let abi = LANDLOCK_ABI;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))?;
    if !spec.network {
        ruleset = ruleset.handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)?;
    }
    let ruleset = ruleset.scope(Scope::from_all(abi))?;
    let mut writable: Vec<&Path> = vec![spec.workspace_path.as_path()];
    writable.extend(spec.private_tmpfs.iter().map(PathBuf::as_path));
    // Under a pty, the command's own terminal (for reopening it, as `/dev/tty` or by
    // name), and no other one.
    let mut devices: Vec<PathBuf> = spec.devices.clone();
    if spec.pty
        && let Ok(tty) = std::fs::read_link("/proc/self/fd/0")
        && tty.starts_with("/dev/pts/")
    {
        devices.push(tty);
    }
    let status = ruleset
        .create()?
        .add_rules(path_beneath_rules(
            &spec.read_only,
            AccessFs::from_read(abi),
        ))?
        .add_rules(path_beneath_rules(writable, AccessFs::from_all(abi)))?
        .add_rules(path_beneath_rules(&devices, AccessFs::from_all(abi)))?
        .restrict_self()?;
    let level = match (status.ruleset, status.no_new_privs) {
        (RulesetStatus::FullyEnforced, true) => LandlockLevel::Full,
        (RulesetStatus::NotEnforced, _) => LandlockLevel::None,
        _ => LandlockLevel::Partial,
    };
    Ok((level, format!("{:?}", status.landlock)))
}

fn exec(spec: &ConfineSpec) -> ExitCode {
    let Some((program, args)) = spec.argv.split_first() else {
        eprintln!("tether-confine: empty command");
        return ExitCode::from(127);
    };
    if let Err(e) = std::env::set_current_dir(&spec.cwd) {
        eprintln!(
            "tether-confine: cannot change directory to {}: {e}",
            spec.cwd.display()
        );
        return ExitCode::from(126);
    }
    let err = std::process::Command::new(program)
        .args(args)
        .env_clear()
        .envs(spec.env.iter().cloned())
        .exec();
    eprintln!("tether-confine: cannot execute {program}: {err}");
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}
