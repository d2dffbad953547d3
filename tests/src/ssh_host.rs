//! A real OpenSSH server on a test host of our own: a network namespace with a veth pair
//! to the test process's namespace, a throwaway user and key, and Debian's `sshd` in the
//! foreground inside the namespace with its own config and host key. Everything (the
//! server and every process of the user, the namespace and its link, the user and its
//! home, the files) is removed on drop.
//!
//! Faults on the real network path: [`SshHost::blackhole`] takes the link down (packets
//! are dropped, nothing is reset), [`SshHost::kill_connections`] kills sshd's
//! per-connection processes (the TCP connections end), and [`DelayRelay`] adds a fixed
//! one-way delay in each direction in front of the server. (This kernel has no `netem`
//! qdisc and no netfilter, so the delay is added by a relay on the path and the blackhole
//! by the link state.)
//!
//! Needs root, `ip` (iproute2), `useradd`/`userdel` and `/usr/sbin/sshd`: a missing piece
//! is a test failure with the reason, never a silent skip.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The port sshd listens on inside the namespace.
pub const SSHD_PORT: u16 = 2222;
const SSHD: &str = "/usr/sbin/sshd";

static SEQ: AtomicU32 = AtomicU32::new(0);
/// useradd/userdel lock /etc/passwd; run them one at a time within this process.
static USERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn try_run(cmd: &mut Command) -> bool {
    cmd.output().is_ok_and(|o| o.status.success())
}

fn require_tools() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the SSH test host needs root (network namespaces, a throwaway user)"
    );
    for tool in ["ip", "useradd", "userdel", "usermod", "ssh-keygen"] {
        assert!(
            try_run(Command::new("sh").args(["-c", &format!("command -v {tool}")])),
            "the SSH test host needs `{tool}` (packages iproute2, passwd, openssh-client)"
        );
    }
    assert!(
        Path::new(SSHD).exists(),
        "the SSH test host needs {SSHD} (package openssh-server)"
    );
}

/// A throwaway SSH host in a network namespace.
#[derive(Debug)]
pub struct SshHost {
    /// The namespace's name.
    pub netns: String,
    /// The host-side end of the veth pair.
    pub veth: String,
    /// The server's address (inside the namespace).
    pub addr: SocketAddr,
    /// The throwaway user.
    pub user: String,
    /// Its uid.
    pub uid: u32,
    /// The client's private key (ed25519, no passphrase).
    pub key: PathBuf,
    /// A known_hosts file listing the server's key.
    pub known_hosts: PathBuf,
    /// The server's public host key line (`ssh-ed25519 AAAA...`).
    pub host_key: String,
    /// The fixture directory (config, keys, log).
    pub dir: tempfile::TempDir,
    sshd: Option<std::process::Child>,
}

impl SshHost {
    /// Make the namespace, the user and the keys, and start sshd.
    pub async fn start() -> Self {
        require_tools();
        // A random tag and /30 of 10.200.0.0/13 per host, re-drawn until both are free
        // (several test processes make hosts at once).
        let (tag, local, remote, netns) = loop {
            let r = uuid::Uuid::new_v4().as_u128();
            let n = SEQ.fetch_add(1, Ordering::Relaxed);
            let k = ((r as u32) ^ n) & 0x7ffff;
            let (b, c, d) = (200 + (k >> 16), (k >> 8) & 0xff, (k & 0x3f) * 4);
            let tag = format!("{:08x}", (r >> 64) as u32);
            let local = format!("10.{b}.{c}.{}", d + 1);
            let remote = format!("10.{b}.{c}.{}", d + 2);
            let used = run("addrs", Command::new("ip").args(["-o", "addr"]));
            if used.contains(&format!("{local}/")) || used.contains(&format!("{remote}/")) {
                continue;
            }
            let netns = format!("tsh{tag}");
            if try_run(Command::new("ip").args(["netns", "add", &netns])) {
                break (tag, local, remote, netns);
            }
        };
        let veth = format!("tsh{tag}a");
        let peer = format!("tsh{tag}b");
        let user = format!("tsh{tag}");
        let dir = tempfile::Builder::new()
            .prefix("tether-ssh-host-")
            .tempdir()
            .expect("tempdir");
        let mut host = SshHost {
            netns: netns.clone(),
            veth: veth.clone(),
            addr: format!("{remote}:{SSHD_PORT}").parse().expect("addr"),
            user: user.clone(),
            uid: 0,
            key: dir.path().join("client_ed25519"),
            known_hosts: dir.path().join("known_hosts"),
            host_key: String::new(),
            dir,
            sshd: None,
        };
        run(
            "veth",
            Command::new("ip").args([
                "link", "add", &veth, "type", "veth", "peer", "name", &peer, "netns", &netns,
            ]),
        );
        run(
            "addr",
            Command::new("ip").args(["addr", "add", &format!("{local}/30"), "dev", &veth]),
        );
        run("up", Command::new("ip").args(["link", "set", &veth, "up"]));
        let nsip = |args: &[&str]| {
            let mut c = Command::new("ip");
            c.args(["-n", &netns]).args(args);
            c
        };
        run(
            "peer addr",
            &mut nsip(&["addr", "add", &format!("{remote}/30"), "dev", &peer]),
        );
        run("peer up", &mut nsip(&["link", "set", &peer, "up"]));
        run("lo up", &mut nsip(&["link", "set", "lo", "up"]));
        {
            let _g = USERS.lock().await;
            // Other test processes lock /etc/passwd too: retry a busy lock.
            let mut made = false;
            for _ in 0..100 {
                if try_run(Command::new("useradd").args(["-m", "-s", "/bin/bash", &user])) {
                    made = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(made, "useradd {user} kept failing");
            let mut unlocked = false;
            for _ in 0..100 {
                if try_run(Command::new("usermod").args(["-p", "*", &user])) {
                    unlocked = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(unlocked, "usermod -p '*' {user} kept failing");
        }
        host.uid = run("id", Command::new("id").args(["-u", &user]))
            .trim()
            .parse()
            .expect("uid");
        let p = host.dir.path().to_owned();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        for name in ["host_ed25519", "client_ed25519"] {
            run(
                "keygen",
                Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", ""])
                    .arg("-f")
                    .arg(p.join(name)),
            );
        }
        std::fs::copy(p.join("client_ed25519.pub"), p.join("authorized_keys")).expect("keys");
        let pubkey = std::fs::read_to_string(p.join("host_ed25519.pub")).expect("host key");
        let mut it = pubkey.split_whitespace();
        host.host_key = format!(
            "{} {}",
            it.next().unwrap_or_default(),
            it.next().unwrap_or_default()
        );
        std::fs::write(
            &host.known_hosts,
            format!("[{remote}]:{SSHD_PORT} {}\n", host.host_key),
        )
        .expect("known_hosts");
        let cfg = format!(
            "Port {SSHD_PORT}\nListenAddress {remote}\nHostKey {hk}\nPidFile {pid}\n\
             AuthorizedKeysFile {ak}\nAllowUsers {user}\nPubkeyAuthentication yes\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
             StrictModes no\nPermitRootLogin no\nSubsystem sftp internal-sftp\n\
             MaxSessions 64\nMaxStartups 64:30:128\nLogLevel VERBOSE\n",
            hk = p.join("host_ed25519").display(),
            pid = p.join("sshd.pid").display(),
            ak = p.join("authorized_keys").display(),
        );
        std::fs::write(p.join("sshd_config"), cfg).expect("sshd_config");
        std::fs::create_dir_all("/run/sshd").expect("/run/sshd");
        run(
            "sshd -t",
            Command::new(SSHD)
                .arg("-t")
                .arg("-f")
                .arg(p.join("sshd_config")),
        );
        let log = std::fs::File::create(p.join("sshd.log")).expect("log");
        let child = Command::new("ip")
            .args(["netns", "exec", &netns, SSHD, "-D", "-e", "-f"])
            .arg(p.join("sshd_config"))
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start sshd");
        host.sshd = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Ok(mut s)) =
                tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(host.addr))
                    .await
            {
                let mut banner = [0u8; 4];
                if s.read_exact(&mut banner).await.is_ok() && &banner == b"SSH-" {
                    break;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sshd did not come up: {}",
                host.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        host
    }

    /// The SSH provider's config for this host (named `name`): its address, user, key and
    /// `known_hosts`, workspaces under `.tether/sandboxes`, every other setting the default.
    pub fn provider_config(&self, name: &str) -> tether_provider_ssh::SshConfig {
        tether_provider_ssh::SshConfig {
            hosts: vec![tether_provider_ssh::HostConfig {
                name: Some(name.into()),
                address: self.addr.ip().to_string(),
                port: self.addr.port(),
                user: self.user.clone(),
                auth: tether_provider_ssh::AuthConfig::KeyFile {
                    path: self.key.clone(),
                    passphrase: None,
                },
                workspace_root: ".tether/sandboxes".into(),
            }],
            known_hosts: Some(self.known_hosts.clone()),
            ..tether_provider_ssh::SshConfig::default()
        }
    }

    /// The user's home on the host.
    pub fn home(&self) -> PathBuf {
        PathBuf::from(format!("/home/{}", self.user))
    }

    /// sshd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sshd.log")).unwrap_or_default()
    }

    /// The pids of the processes in the namespace.
    fn netns_pids(&self) -> Vec<i32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.netns])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    fn sshd_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.path().join("sshd.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// Kill sshd's per-connection processes: every established connection ends (the
    /// listener and the user's own processes stay). Returns how many were killed.
    ///
    /// Each connection is served by two sshd processes, the privileged monitor (a child of
    /// the listener) and the user's unprivileged child, and both hold its socket. Both are
    /// killed: a child whose monitor alone was killed can go on serving the connection
    /// for a while, so the connection would not end and a later cut would find no monitor.
    pub fn kill_connections(&self) -> usize {
        let Some(listener) = self.sshd_pid() else {
            return 0;
        };
        let mut n = 0;
        for pid in self.netns_pids() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if pid == listener || comm.trim_end() != "sshd" {
                continue;
            }
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(") ")
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            // A connection is counted once, by its monitor, or by its child when the
            // monitor is already gone.
            if ppid == Some(listener) || !is_sshd(ppid) {
                n += 1;
            }
        }
        n
    }

    /// Take the link down: packets in both directions are dropped, nothing is reset.
    pub fn blackhole(&self) {
        run(
            "link down",
            Command::new("ip").args(["link", "set", &self.veth, "down"]),
        );
    }

    /// Bring the link back up.
    pub fn restore(&self) {
        run(
            "link up",
            Command::new("ip").args(["link", "set", &self.veth, "up"]),
        );
    }

    /// Processes of the user still alive on the host.
    pub fn user_pids(&self) -> Vec<i32> {
        let mut v = Vec::new();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
                let uid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|l| l.split_whitespace().next())
                    .and_then(|u| u.parse::<u32>().ok());
                let zombie = status
                    .lines()
                    .any(|l| l.starts_with("State:") && l.contains('Z'));
                if uid == Some(self.uid) && self.uid != 0 && !zombie {
                    v.push(pid);
                }
            }
        }
        v
    }
}

impl Drop for SshHost {
    fn drop(&mut self) {
        let kill = |pid: i32| {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        };
        if let Some(mut c) = self.sshd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for _ in 0..50 {
            let left: Vec<i32> = self
                .netns_pids()
                .into_iter()
                .chain(self.user_pids())
                .collect();
            if left.is_empty() {
                break;
            }
            left.into_iter().for_each(kill);
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .output();
        if self.uid != 0 {
            for _ in 0..20 {
                if try_run(Command::new("userdel").args(["-r", "-f", &self.user])) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// A TCP listener that accepts and never says a word (a server that never answers the
/// handshake).
#[derive(Debug)]
pub struct SilentServer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl SilentServer {
    /// Start on an ephemeral port of 127.0.0.1.
    pub async fn start() -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                tokio::select! {
                    _ = s.cancelled() => break,
                    c = l.accept() => if let Ok((sock, _)) = c { held.push(sock) },
                }
            }
        });
        Self { addr, stop }
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A TCP relay that delays every byte by a fixed time in each direction, in front of an
/// upstream (the SSH host).
#[derive(Debug)]
pub struct DelayRelay {
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl DelayRelay {
    /// Relay to `upstream` with `delay` each way.
    pub async fn start(upstream: SocketAddr, delay: Duration) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            loop {
                let (down, _) = tokio::select! {
                    _ = s.cancelled() => break,
                    c = l.accept() => match c { Ok(c) => c, Err(_) => continue },
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = down.set_nodelay(true);
                    let _ = up.set_nodelay(true);
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::select! {
                        _ = s.cancelled() => {}
                        _ = pipe(dr, uw, delay) => {}
                        _ = pipe(ur, dw, delay) => {}
                    }
                });
            }
        });
        Self { addr, stop }
    }
}

/// Copy `r` to `w`, each chunk released `delay` after it was read (order kept).
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx
                        .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, data)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if w.write_all(&data).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Whether `pid` is a live sshd process.
fn is_sshd(pid: Option<i32>) -> bool {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
        .is_some_and(|c| c.trim_end() == "sshd")
}
