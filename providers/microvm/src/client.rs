//! The raw transport to a VM: the qemu process (its command line, spawn, kill), its QMP
//! socket (JSON over a unix socket: greeting, `qmp_capabilities`, commands, events), the
//! host's cgroup for it, and the guest agent's `/health` and `/init` over the slirp
//! host forward.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};
use tether_provider::{Clock, ProviderError, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::time::Instant;

use crate::config::{AGENT_PORT, Accel, MicrovmConfig};
use crate::error::{internal, qmp_error, timeout, unavailable};
use crate::image::GuestImage;

// === accel ===

/// Whether `/dev/kvm` is real hardware virtualisation: the CPU has vmx or svm and KVM is
/// not PVM (whose emulation path runs stock kernels far slower than TCG).
pub fn kvm_usable() -> bool {
    let dev = Path::new("/dev/kvm").exists();
    let flags = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| {
            c.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        })
        .unwrap_or(false);
    dev && flags && !Path::new("/sys/module/kvm_pvm").exists()
}

/// The host TSC frequency in kHz (`cpu MHz` of /proc/cpuinfo): under TCG the guest's
/// TSC is the host's, and the kernel's PIT calibration fails on a loaded host.
pub fn tsc_khz() -> Option<u64> {
    let c = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = c
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    Some((mhz * 1000.0) as u64)
}

/// Whether a VM of `cfg` runs under KVM.
pub fn use_kvm(cfg: &MicrovmConfig) -> bool {
    match cfg.accel {
        Accel::Kvm => true,
        Accel::Tcg => false,
        Accel::Auto => kvm_usable(),
    }
}

// === command line ===

/// How a VM's network is attached. The guest's side is the same for all (10.0.2.15/24,
/// gateway 10.0.2.2, DNS 10.0.2.3), so one saved state restores into each of them, as
/// long as it was not saved under slirp (whose connection state is part of the saved
/// state, which only a slirp VM loads): templates are booted under `passt` where it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetBackend {
    /// slirp, `restrict=on`: the host forward to the agent and nothing else.
    #[default]
    Slirp,
    /// slirp, `restrict=off`: egress, and the host's loopback as 10.0.2.2 with it.
    SlirpOpen,
    /// `passt` on a socket pair: egress and the host forward to the agent; the gateway
    /// is not mapped to the host (`--no-map-gw`), so the host's loopback is out of reach.
    Passt,
}

impl NetBackend {
    /// Whether the guest has egress.
    pub fn egress(self) -> bool {
        !matches!(self, Self::Slirp)
    }
    /// Whether a saved state of a VM attached so loads into a VM attached as `to`.
    pub fn restores_into(self, to: Self) -> bool {
        match self {
            Self::Slirp | Self::SlirpOpen => to != Self::Passt,
            Self::Passt => true,
        }
    }
}

/// The fd number of qemu's end of the socket pair with `passt`, in both processes.
const PASST_FD: i32 = 3;

/// What one qemu process is.
#[derive(Debug, Clone)]
pub struct VmLaunch {
    /// The VM's own directory (sockets, logs, pid file).
    pub dir: PathBuf,
    /// Its disk (a qcow2 overlay).
    pub disk: PathBuf,
    /// The host port forwarded to the agent's port.
    pub port: u16,
    /// How the guest's network is attached.
    pub net: NetBackend,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// Restore from this saved state (`-incoming`).
    pub incoming: Option<PathBuf>,
}

impl VmLaunch {
    /// The QMP socket.
    pub fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    /// The pid file qemu writes.
    pub fn pidfile(&self) -> PathBuf {
        self.dir.join("qemu.pid")
    }
    /// The guest's console.
    pub fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    /// qemu's own stdout and stderr.
    pub fn log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
}

/// The kernel command line. It is part of the saved state, so a restore keeps the boot's.
pub fn kernel_cmdline(kvm: bool) -> String {
    let mut s = String::from("console=ttyS0 reboot=t panic=-1 quiet init_on_free=1");
    if !kvm && let Some(khz) = tsc_khz() {
        s.push_str(&format!(" tsc_early_khz={khz}"));
    }
    s
}

/// Every argument of qemu for `l`. A restore must use the same machine and devices as
/// the boot it was saved from; only paths, the forwarded port and the network backend
/// differ.
pub fn qemu_args(
    cfg: &MicrovmConfig,
    image: &GuestImage,
    l: &VmLaunch,
    cmdline: &str,
) -> Vec<OsString> {
    let kvm = use_kvm(cfg);
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |s: &str| a.push(s.into());
    push("-M");
    push("microvm,pit=on,pic=on,rtc=on");
    if kvm {
        push("-accel");
        push("kvm");
        push("-cpu");
        push("host");
    } else {
        push("-accel");
        push(&format!("tcg,tb-size={}", cfg.tcg_tb_mib));
        push("-cpu");
        push("max");
    }
    push("-m");
    push(&l.memory_mib.to_string());
    push("-smp");
    push(&l.vcpus.to_string());
    for s in ["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"] {
        push(s);
    }
    push("-serial");
    push(&format!("file:{}", l.console().display()));
    push("-qmp");
    // Relative to qemu's working directory (the VM's): `sun_path` holds 108 bytes.
    push("unix:qmp.sock,server=on,wait=off");
    push("-pidfile");
    push(&l.pidfile().display().to_string());
    push("-kernel");
    push(&image.kernel.display().to_string());
    push("-initrd");
    push(&image.initrd.display().to_string());
    push("-append");
    push(cmdline);
    push("-netdev");
    match l.net {
        NetBackend::Slirp | NetBackend::SlirpOpen => push(&format!(
            "user,id=n0,restrict={},hostfwd=tcp:127.0.0.1:{}-:{AGENT_PORT}",
            if l.net == NetBackend::SlirpOpen {
                "off"
            } else {
                "on"
            },
            l.port
        )),
        NetBackend::Passt => push(&format!(
            "stream,id=n0,server=off,addr.type=fd,addr.str={PASST_FD}"
        )),
    }
    push("-device");
    push("virtio-net-device,netdev=n0");
    push("-drive");
    push(&format!(
        "id=d0,file={},format=qcow2,if=none,cache=writeback",
        l.disk.display()
    ));
    push("-device");
    push("virtio-blk-device,drive=d0");
    if let Some(state) = &l.incoming {
        push("-incoming");
        push(&format!(
            "exec:cat {}",
            sh_quote(&state.display().to_string())
        ));
    }
    a
}

/// `s` quoted for `sh` (qemu runs `exec:` migration URIs through `/bin/sh -c`).
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A free TCP port on 127.0.0.1 (the kernel's pick; slirp binds it right after).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| internal("cannot pick a port", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| internal("cannot pick a port", e))
}

// === the qemu process ===

/// Every argument of `passt` for `l`: one guest on the socket pair's fd, the guest's
/// addresses as its initramfs sets them (IPv4 only), DNS forwarded to the host's
/// resolver, the agent's port forwarded from the host's loopback, and the gateway not
/// mapped to the host, so that nothing of the host's loopback is reachable.
pub fn passt_args(l: &VmLaunch) -> Vec<OsString> {
    let fwd = format!("127.0.0.1/{}:{AGENT_PORT}", l.port);
    let fd = PASST_FD.to_string();
    [
        "--foreground",
        "--quiet",
        "--ipv4-only",
        "--fd",
        &fd,
        "--address",
        "10.0.2.15",
        "--netmask",
        "24",
        "--gateway",
        "10.0.2.2",
        "--no-map-gw",
        "--dns-forward",
        "10.0.2.3",
        "--tcp-ports",
        &fwd,
        "--udp-ports",
        "none",
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

/// `passt` as configured, else on `PATH`.
pub fn passt_binary(cfg: &MicrovmConfig) -> Option<PathBuf> {
    match &cfg.passt {
        Some(p) => crate::image::which(&p.to_string_lossy()),
        None => crate::image::which("passt"),
    }
}

/// A running qemu.
#[derive(Debug)]
pub struct QemuProcess {
    /// Its pid.
    pub pid: u32,
    child: Option<tokio::process::Child>,
    /// Its `passt`, when this process started it. It ends by itself when qemu's end of
    /// their socket pair closes (qemu exited); it is killed with qemu all the same.
    passt: Option<tokio::process::Child>,
}

/// `prog` in `cgroup` (when given): a shell enters the cgroup and execs it, so that
/// there is no moment outside it.
fn command_in(prog: &Path, cgroup: Option<&Cgroup>) -> tokio::process::Command {
    match cgroup {
        Some(cg) => {
            let mut c = tokio::process::Command::new("/bin/sh");
            c.arg("-c")
                .arg(r#"echo $$ > "$0" && exec "$@""#)
                .arg(cg.procs())
                .arg(prog);
            c
        }
        None => tokio::process::Command::new(prog),
    }
}

/// Logs of a child: one file for stdout and stderr.
fn log_to(cmd: &mut tokio::process::Command, path: &Path) -> Result<()> {
    let log = std::fs::File::create(path).map_err(|e| internal("cannot create a log", e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| internal("cannot dup a log", e))?;
    cmd.stdout(log).stderr(log2);
    Ok(())
}

impl QemuProcess {
    /// Start qemu for `l` (in `cgroup` when given). qemu runs in its own process group
    /// and is not tied to this process's life: a daemon that dies leaves it to the next
    /// one's reconcile, which finds it in the VM table.
    pub fn spawn(
        cfg: &MicrovmConfig,
        image: &GuestImage,
        l: &VmLaunch,
        cmdline: &str,
        cgroup: Option<&Cgroup>,
    ) -> Result<Self> {
        use command_fds::{CommandFdExt, FdMapping};
        let spawn_failed = |what: &str, e: std::io::Error| ProviderError::Unavailable {
            message: format!("microvm: cannot start {what}: {e}"),
            retry_after: None,
            source: Some(Box::new(e)),
        };
        let mut cmd = command_in(Path::new(&cfg.qemu), cgroup);
        cmd.args(qemu_args(cfg, image, l, cmdline))
            .current_dir(&l.dir)
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(false);
        log_to(&mut cmd, &l.log())?;
        let mut passt = None;
        if l.net == NetBackend::Passt {
            let prog = passt_binary(cfg).ok_or_else(|| unavailable("microvm: passt is missing"))?;
            // Close-on-exec both: each reaches its child only through its mapping.
            let (ours, theirs) = std::os::unix::net::UnixStream::pair()
                .map_err(|e| internal("cannot create the network's socket pair", e))?;
            let (ours, theirs) = (
                std::os::fd::OwnedFd::from(ours),
                std::os::fd::OwnedFd::from(theirs),
            );
            let mut p = command_in(&prog, cgroup);
            p.args(passt_args(l))
                .current_dir(&l.dir)
                .stdin(std::process::Stdio::null())
                .process_group(0)
                .kill_on_drop(false);
            log_to(&mut p, &l.dir.join("passt.log"))?;
            p.fd_mappings(vec![FdMapping {
                parent_fd: theirs,
                child_fd: PASST_FD,
            }])
            .map_err(|e| internal("cannot pass the socket to passt", e))?;
            passt = Some(
                p.spawn()
                    .map_err(|e| spawn_failed(&prog.display().to_string(), e))?,
            );
            cmd.fd_mappings(vec![FdMapping {
                parent_fd: ours,
                child_fd: PASST_FD,
            }])
            .map_err(|e| internal("cannot pass the socket to qemu", e))?;
        }
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                if let Some(p) = &mut passt {
                    let _ = p.start_kill();
                }
                return Err(spawn_failed(&cfg.qemu, e));
            }
        };
        let pid = child
            .id()
            .ok_or_else(|| unavailable("microvm: qemu exited at once"))?;
        Ok(Self {
            pid,
            child: Some(child),
            passt,
        })
    }

    /// Whether the `passt` this process started has exited (it could not bind the
    /// agent's host port, say).
    pub fn passt_exited(&mut self) -> bool {
        self.passt
            .as_mut()
            .is_some_and(|p| !matches!(p.try_wait(), Ok(None)))
    }

    /// No qemu (a VM saved to disk).
    pub fn none() -> Self {
        Self::adopt(0)
    }

    /// A qemu this process did not start (found in the VM table).
    pub fn adopt(pid: u32) -> Self {
        Self {
            pid,
            child: None,
            passt: None,
        }
    }

    /// Whether it has exited (reaping it if it is our child).
    pub fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => !pid_alive(self.pid),
        }
    }

    /// SIGKILL it and wait (up to `limit`) until it is gone.
    pub async fn kill(&mut self, limit: Duration) -> bool {
        kill_pid(self.pid);
        if let Some(p) = &mut self.passt {
            let _ = p.start_kill();
        }
        self.wait_exit(limit).await
    }

    /// [`Self::kill`], for an adopted qemu only while its pid is still the qemu of the VM
    /// directory `dir` (never a reused pid; our own child's pid cannot be reused before
    /// it is reaped).
    pub async fn kill_vm(&mut self, dir: &Path, limit: Duration) -> bool {
        if self.child.is_none() && !pid_is_vm(self.pid, dir) {
            return true;
        }
        self.kill(limit).await
    }

    /// Wait up to `limit` for it to exit.
    pub async fn wait_exit(&mut self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            if self.exited() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for QemuProcess {
    fn drop(&mut self) {
        // Only our own child: an adopted qemu belongs to the VM table's owner.
        if let Some(c) = &mut self.child
            && matches!(c.try_wait(), Ok(None))
        {
            kill_pid(self.pid);
        }
    }
}

/// SIGKILL `pid` (nothing if it is gone).
pub fn kill_pid(pid: u32) {
    if let Ok(p) = i32::try_from(pid)
        && p > 1
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Whether `pid` is a live process (not a zombie).
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// Whether `pid` is a qemu of the VM directory `dir` (its command line names the dir),
/// so that a reused pid is never killed.
pub fn pid_is_vm(pid: u32, dir: &Path) -> bool {
    let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = dir.display().to_string();
    cmd.split(|b| *b == 0)
        .any(|arg| String::from_utf8_lossy(arg).contains(&needle))
        && pid_alive(pid)
}

/// The pid in a qemu pid file.
pub fn read_pidfile(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// CPU time (µs) and resident memory (bytes) of `pid`.
pub fn proc_usage(pid: u32) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is 0; utime 11, stime 12 (clock ticks).
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let hz = 100u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((ticks * 1_000_000 / hz, rss_kib * 1024))
}

// === cgroup ===

/// The cgroup a qemu process runs in, with a memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    dir: PathBuf,
}

/// The parent of the provider's cgroups.
const CGROUP_PARENT: &str = "tether-microvm";

impl Cgroup {
    /// A cgroup for sandbox `id` limited to `limit` bytes: the v1 memory controller where
    /// it is mounted, else cgroup v2 with the memory controller enabled. `None` where the
    /// host allows neither (reported as partial enforcement).
    pub fn create(root: &Path, id: &str, limit: u64) -> Option<Self> {
        let v1 = root.join("memory");
        if v1.join("memory.limit_in_bytes").exists() {
            let dir = v1.join(CGROUP_PARENT).join(id);
            std::fs::create_dir_all(&dir).ok()?;
            std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string()).ok()?;
            return Some(Self { dir });
        }
        let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).ok()?;
        if !controllers.split_whitespace().any(|c| c == "memory") {
            return None;
        }
        let parent = root.join(CGROUP_PARENT);
        let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
        std::fs::create_dir_all(&parent).ok()?;
        let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
        let dir = parent.join(id);
        std::fs::create_dir_all(&dir).ok()?;
        if std::fs::write(dir.join("memory.max"), limit.to_string()).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(Self { dir })
    }

    /// The cgroup of sandbox `id` if it exists.
    pub fn find(root: &Path, id: &str) -> Option<Self> {
        [
            root.join("memory").join(CGROUP_PARENT).join(id),
            root.join(CGROUP_PARENT).join(id),
        ]
        .into_iter()
        .find(|d| d.is_dir())
        .map(|dir| Self { dir })
    }

    /// Its `cgroup.procs`.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Remove it once its processes are gone; what is still in it after half a second
    /// is its VM's (qemu's helpers: nothing else joins it) and is killed first.
    pub fn remove(&self) {
        for round in 0..2 {
            for _ in 0..50 {
                if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if round == 0 {
                let procs = std::fs::read_to_string(self.procs()).unwrap_or_default();
                procs
                    .lines()
                    .filter_map(|l| l.trim().parse::<u32>().ok())
                    .for_each(kill_pid);
            }
        }
        tracing::warn!(cgroup = %self.dir.display(), "Could not remove a VM's cgroup");
    }
}

// === QMP ===

/// One QMP connection (qemu serves one client at a time; the provider opens one per
/// operation, under the VM's lock).
#[derive(Debug)]
pub struct Qmp {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    /// Events seen while waiting for answers (their names).
    pub events: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct Envelope {
    #[serde(rename = "return", default)]
    ret: Option<IgnoredAny>,
    #[serde(default)]
    error: Option<QmpErrorBody>,
    #[serde(default)]
    event: Option<String>,
    #[serde(rename = "QMP", default)]
    greeting: Option<IgnoredAny>,
}

#[derive(Debug, Deserialize)]
struct QmpErrorBody {
    class: String,
    desc: String,
}

#[derive(Debug, Deserialize)]
struct Return<T> {
    #[serde(rename = "return")]
    ret: T,
}

#[derive(Debug, Serialize)]
struct Execute<'a, A: Serialize> {
    execute: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<A>,
}

/// An empty QMP answer (`{}`).
#[derive(Debug, Deserialize)]
pub struct Empty {}

/// The answer of `query-status`.
#[derive(Debug, Deserialize)]
pub struct StatusInfo {
    /// `running`, `paused`, `postmigrate`, `inmigrate`, ...
    pub status: String,
    /// Whether the vCPUs run.
    pub running: bool,
}

/// The answer of `query-migrate`.
#[derive(Debug, Deserialize)]
pub struct MigrationInfo {
    /// `setup`, `active`, `completed`, `failed`, ... (absent before any migration).
    #[serde(default)]
    pub status: Option<String>,
    /// Why it failed.
    #[serde(rename = "error-desc", default)]
    pub error_desc: Option<String>,
}

/// The arguments of `migrate`.
#[derive(Debug, Serialize)]
pub struct MigrateArgs {
    /// The destination URI.
    pub uri: String,
}

impl Qmp {
    /// Connect to `path`, read the greeting and leave negotiation mode, within `limit`
    /// (the socket may not exist yet right after qemu starts).
    pub async fn connect(path: &Path, limit: Duration) -> Result<Self> {
        let end = Instant::now() + limit;
        let stream = loop {
            match connect_unix(path).await {
                Ok(s) => break s,
                Err(e) => {
                    if Instant::now() >= end {
                        return Err(ProviderError::Unavailable {
                            message: format!("qmp: cannot connect to {}: {e}", path.display()),
                            retry_after: None,
                            source: Some(Box::new(e)),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let (r, w) = stream.into_split();
        let mut q = Self {
            r: BufReader::new(r),
            w,
            events: Vec::new(),
        };
        let left = end.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, async {
            loop {
                let line = q.line().await?;
                let env: Envelope = parse(&line)?;
                if env.greeting.is_some() {
                    break;
                }
            }
            q.execute::<(), Empty>("qmp_capabilities", None)
                .await
                .map(|_| ())
        })
        .await
        .map_err(|_| timeout(Clock::Connect, limit))??;
        Ok(q)
    }

    /// Run `command` with `args`; its typed answer.
    pub async fn execute<A: Serialize, R: DeserializeOwned>(
        &mut self,
        command: &str,
        args: Option<A>,
    ) -> Result<R> {
        let mut msg = serde_json::to_vec(&Execute {
            execute: command,
            arguments: args,
        })
        .map_err(|e| internal("cannot encode a QMP command", e))?;
        msg.push(b'\n');
        self.w
            .write_all(&msg)
            .await
            .map_err(|e| qmp_io(command, e))?;
        loop {
            let line = self.line().await?;
            let env: Envelope = parse(&line)?;
            if let Some(ev) = env.event {
                self.events.push(ev);
                continue;
            }
            if let Some(err) = env.error {
                return Err(qmp_error(command, &err.class, &err.desc));
            }
            if env.ret.is_some() {
                let r: Return<R> = parse(&line)?;
                return Ok(r.ret);
            }
        }
    }

    /// Wait for the event `name` (one seen before counts).
    pub async fn wait_event(&mut self, name: &str) -> Result<()> {
        loop {
            if self.events.iter().any(|e| e == name) {
                return Ok(());
            }
            let line = self.line().await?;
            let env: Envelope = parse(&line)?;
            if let Some(ev) = env.event {
                self.events.push(ev);
            }
        }
    }

    async fn line(&mut self) -> Result<String> {
        let mut s = String::new();
        let n = self
            .r
            .read_line(&mut s)
            .await
            .map_err(|e| qmp_io("read", e))?;
        if n == 0 {
            return Err(unavailable("qmp: qemu closed the connection"));
        }
        Ok(s)
    }
}

/// Connect to the unix socket at `path` however long the path is (`sun_path` holds 108
/// bytes): through `/proc/self/fd/<dir fd>/<name>` of its directory.
async fn connect_unix(path: &Path) -> std::io::Result<UnixStream> {
    use std::os::fd::AsRawFd;
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return UnixStream::connect(path).await;
    };
    let dir = std::fs::File::open(parent)?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    let r = UnixStream::connect(&short).await;
    drop(dir);
    r
}

fn parse<T: DeserializeOwned>(line: &str) -> Result<T> {
    serde_json::from_str(line).map_err(|e| ProviderError::Backend {
        message: format!("qmp: malformed message: {e}"),
        source: Some(Box::new(e)),
    })
}

fn qmp_io(what: &str, e: std::io::Error) -> ProviderError {
    ProviderError::Unavailable {
        message: format!("qmp {what}: {e}"),
        retry_after: None,
        source: Some(Box::new(e)),
    }
}

/// Run one QMP command on the VM at `socket` over a fresh connection, all within `limit`.
pub async fn qmp_call<A: Serialize, R: DeserializeOwned>(
    socket: &Path,
    command: &str,
    args: Option<A>,
    limit: Duration,
) -> Result<R> {
    tokio::time::timeout(limit, async {
        let mut q = Qmp::connect(socket, limit).await?;
        q.execute(command, args).await
    })
    .await
    .map_err(|_| timeout(Clock::Total, limit))?
}

/// Save the VM's state into `file` (`migrate` to `exec:cat > file`) and wait until the
/// migration completes (the VM is left stopped, in `postmigrate`), within `limit`.
pub async fn save_state(socket: &Path, file: &Path, limit: Duration, poll: Duration) -> Result<()> {
    tokio::time::timeout(limit, async {
        let mut q = Qmp::connect(socket, limit).await?;
        let uri = format!("exec:cat > {}", sh_quote(&file.display().to_string()));
        q.execute::<_, Empty>("migrate", Some(MigrateArgs { uri }))
            .await?;
        loop {
            let m: MigrationInfo = q.execute::<(), _>("query-migrate", None).await?;
            match m.status.as_deref() {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(ProviderError::Backend {
                        message: format!(
                            "qmp migrate: {}",
                            m.error_desc.unwrap_or_else(|| "failed".into())
                        ),
                        source: None,
                    });
                }
                _ => tokio::time::sleep(poll).await,
            }
        }
    })
    .await
    .map_err(|_| timeout(Clock::Total, limit))?
}

/// Wait until the incoming migration of the qemu at `socket` (just started with
/// `-incoming`) is loaded: its status is no longer `inmigrate` (its QMP socket may not be
/// there yet at first).
pub async fn wait_incoming(socket: &Path, limit: Duration, poll: Duration) -> Result<StatusInfo> {
    let end = Instant::now() + limit;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timeout(Clock::Total, limit));
        }
        if let Ok(s) = qmp_call::<(), StatusInfo>(socket, "query-status", None, left).await
            && s.status != "inmigrate"
        {
            return Ok(s);
        }
        tokio::time::sleep(poll).await;
    }
}

// === the guest agent ===

/// One `/health` probe of the agent at `agent`, bounded by `limit`.
pub async fn probe(http: &reqwest::Client, agent: SocketAddr, limit: Duration) -> bool {
    let url = format!("http://{agent}/health");
    matches!(
        http.get(url).timeout(limit).send().await,
        Ok(r) if r.status().is_success()
    )
}

/// Probe until the agent answers, `qemu` exits, or `limit` passes (short per-attempt
/// limits: slirp accepts at once and a connection to a guest not listening yet stalls).
pub async fn wait_ready(
    http: &reqwest::Client,
    agent: SocketAddr,
    qemu: &mut QemuProcess,
    per_probe: Duration,
    limit: Duration,
    console: &Path,
) -> Result<()> {
    let end = Instant::now() + limit;
    loop {
        if probe(http, agent, per_probe).await {
            return Ok(());
        }
        if qemu.exited() {
            let log = console.with_file_name("qemu.log");
            return Err(unavailable(format!(
                "microvm: qemu exited before the guest agent answered (qemu: {}; {})",
                std::fs::read_to_string(&log).unwrap_or_default().trim(),
                console_tail(console)
            )));
        }
        if Instant::now() >= end {
            return Err(ProviderError::Timeout {
                reason: tether_provider::clock::TimeoutReason {
                    clock: Clock::Connect,
                    timeout_ms: limit.as_millis() as u64,
                },
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `POST /init` to the agent at `agent` (`current_token`: the token the guest holds
/// already, if any).
pub async fn init_agent(
    http: &reqwest::Client,
    agent: SocketAddr,
    body: &tether_protocol::e2b::InitRequest,
    current_token: Option<&str>,
    limit: Duration,
) -> Result<()> {
    let url = format!("http://{agent}/init");
    let mut req = http.post(url).json(body);
    // A VM restored from a sandbox's snapshot holds that sandbox's token: the agent takes
    // a new one from a caller that proves it holds the current one.
    if let Some(t) = current_token {
        req = req.header("X-Access-Token", t);
    }
    let r = req.timeout(limit).send().await.map_err(|e| {
        if e.is_timeout() {
            timeout(Clock::Total, limit)
        } else {
            ProviderError::Unavailable {
                message: format!("microvm: /init: {e}"),
                retry_after: None,
                source: Some(Box::new(e)),
            }
        }
    })?;
    if r.status().is_success() {
        Ok(())
    } else {
        Err(ProviderError::Backend {
            message: format!("microvm: the guest agent refused /init ({})", r.status()),
            source: None,
        })
    }
}

/// 32 random bytes of the host's RNG, base64.
pub fn entropy() -> Result<String> {
    use base64::Engine;
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| internal("cannot read /dev/urandom", e))?;
    Ok(base64::engine::general_purpose::STANDARD.encode(b))
}

/// The last lines of a console log (for an error message).
pub fn console_tail(console: &Path) -> String {
    let text = std::fs::read(console).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(3)..];
    if tail.is_empty() {
        "console empty".into()
    } else {
        format!("console: {}", tail.join(" | "))
    }
}

/// Run `qemu-img` with `args`.
pub async fn qemu_img(cfg: &MicrovmConfig, args: &[&std::ffi::OsStr]) -> Result<()> {
    let out = tokio::process::Command::new(&cfg.qemu_img)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| ProviderError::Unavailable {
            message: format!("microvm: cannot run {}: {e}", cfg.qemu_img),
            retry_after: None,
            source: Some(Box::new(e)),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ProviderError::Backend {
            message: format!(
                "microvm: qemu-img failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            source: None,
        })
    }
}

/// A new qcow2 overlay at `overlay` over `backing` (a qcow2 file).
pub async fn create_overlay(
    cfg: &MicrovmConfig,
    backing: &Path,
    format: &str,
    overlay: &Path,
) -> Result<()> {
    qemu_img(
        cfg,
        &[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-b".as_ref(),
            backing.as_os_str(),
            "-F".as_ref(),
            format.as_ref(),
            overlay.as_os_str(),
        ],
    )
    .await
}
