//! One benchmark command for tether: every path side by side with its floor, in one run.
//!
//! `cargo run --release -p tether-tests --bin bench [-- --quick] [--only GROUP] [--json FILE]`
//!
//! It starts what it needs on loopback: a release `tetherd` child process (the local
//! provider, its E2B front), an OpenSSH test host in a network namespace
//! (`tether_tests::ssh_host`), the official E2B Python and JS SDKs as long-lived drivers
//! (`tests/bench/e2b_driver.{py,mjs}`, so interpreter start-up is not measured), and the
//! providers in-process. Then it measures, round-robin across paths (call i of every path
//! before call i + 1 of any), hot (back to back) and cold (250 ms idle before each call):
//!
//! - `exec true`, `exec` printing 1 MiB, write and read of 1 KiB and of 256 MiB;
//! - 100 concurrent `exec true`; create + first command; create of 100 sandboxes;
//! - the floors: host fork/exec, `unshare -Urmn true`, a raw loopback TCP copy, write+fsync
//!   and a page-cache read of the same file;
//! - tetherd's RSS idle, with 1,000 idle sessions and during 100 concurrent streams;
//! - the session log's append rate at 1 writer against an fdatasync loop on the same disk.
//!
//! It prints one set of markdown tables (medians, p99, ratio to the floor) and the
//! performance targets as ratios from this run, each met or missed. `--json FILE` writes
//! every sample.
//! Groups (`--only`): exec, files, large, concurrent, create, memory, log, microvm.
//! As root (network namespace, a throwaway user for sshd, sandboxes with namespaces).

// A benchmark: a failed set-up is reported by a panic with the reason; failed measurements
// are recorded as errors in the table and the run goes on.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::{ByteStream, CallCtx, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_tests::ssh_host::SshHost;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::time::Instant;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
/// The size of the large transfers.
const LARGE: usize = 256 * MIB;
/// Idle time before each cold call (as between an agent's calls).
const COLD_IDLE: Duration = Duration::from_millis(250);
/// The command that prints 1 MiB.
const PRINT_1M: &str = "yes | head -c 1048576";
/// Concurrent calls in the concurrency rows.
const CONCURRENT: usize = 100;
/// Sandboxes created at once in the create row.
const CREATE_MANY: usize = 100;
/// Linux reports /proc/<pid>/stat times in USER_HZ, which is 100 on every architecture.
const USER_HZ: f64 = 100.0;
const API_KEY: &str = "e2b_tether_bench_key_0000";
const GROUPS: [&str; 8] = [
    "exec",
    "files",
    "large",
    "concurrent",
    "create",
    "memory",
    "log",
    "microvm",
];

// ---------------------------------------------------------------------------------------
// Options

/// Repetitions for one run (full or `--quick`).
#[derive(Debug, Clone, Copy, Serialize)]
struct Reps {
    hot: usize,
    cold: usize,
    large: usize,
    concurrent: usize,
    create_first: usize,
    create_many: usize,
    idle_sessions: usize,
    log_events: usize,
}

const FULL: Reps = Reps {
    hot: 60,
    cold: 20,
    large: 3,
    concurrent: 5,
    create_first: 10,
    create_many: 2,
    idle_sessions: 1000,
    log_events: 5000,
};

const QUICK: Reps = Reps {
    hot: 10,
    cold: 4,
    large: 1,
    concurrent: 1,
    create_first: 2,
    create_many: 1,
    idle_sessions: 100,
    log_events: 1000,
};

#[derive(Debug)]
struct Opts {
    quick: bool,
    only: Option<String>,
    json: Option<PathBuf>,
}

impl Opts {
    /// Three options: a hand-written parser is shorter than a dependency for them.
    fn parse() -> Result<Self, String> {
        let mut o = Self {
            quick: false,
            only: None,
            json: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => o.quick = true,
                "--only" => {
                    let g = args.next().ok_or("--only needs a group")?;
                    if !GROUPS.contains(&g.as_str()) {
                        return Err(format!(
                            "unknown group {g:?}; groups: {}",
                            GROUPS.join(", ")
                        ));
                    }
                    o.only = Some(g);
                }
                "--json" => o.json = Some(args.next().ok_or("--json needs a file")?.into()),
                "-h" | "--help" => {
                    return Err(format!(
                        "usage: bench [--quick] [--only {}] [--json FILE]",
                        GROUPS.join("|")
                    ));
                }
                other => return Err(format!("unknown argument {other:?} (try --help)")),
            }
        }
        Ok(o)
    }

    fn wants(&self, group: &str) -> bool {
        self.only.as_deref().is_none_or(|g| g == group)
    }
}

// ---------------------------------------------------------------------------------------
// Operations and statistics

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    ExecTrue,
    Exec1M,
    Write1K,
    Read1K,
    Write256M,
    Read256M,
}

impl Op {
    fn label(self) -> &'static str {
        match self {
            Self::ExecTrue => "exec true",
            Self::Exec1M => "exec printing 1 MiB",
            Self::Write1K => "write 1 KiB",
            Self::Read1K => "read 1 KiB",
            Self::Write256M => "write 256 MiB",
            Self::Read256M => "read 256 MiB",
        }
    }
    fn group(self) -> &'static str {
        match self {
            Self::ExecTrue | Self::Exec1M => "exec",
            Self::Write1K | Self::Read1K => "files",
            Self::Write256M | Self::Read256M => "large",
        }
    }
    fn size(self) -> usize {
        match self {
            Self::Write1K | Self::Read1K => KIB,
            Self::Write256M | Self::Read256M => LARGE,
            _ => 0,
        }
    }
    fn is_read(self) -> bool {
        matches!(self, Self::Read1K | Self::Read256M)
    }
    fn file(self) -> &'static str {
        if self.size() == KIB {
            "bench-1k.bin"
        } else {
            "bench-256m.bin"
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    Hot,
    Cold,
}

/// Median and p99 (nearest rank) of samples in seconds.
#[derive(Debug, Clone, Copy, Serialize)]
struct Stats {
    n: usize,
    median_s: f64,
    p99_s: f64,
}

fn stats(v: &[f64]) -> Option<Stats> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((s.len() as f64) * 0.99).ceil() as usize;
    Some(Stats {
        n: s.len(),
        median_s: if s.len() % 2 == 1 {
            s[s.len() / 2]
        } else {
            (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
        },
        p99_s: s[rank.clamp(1, s.len()) - 1],
    })
}

/// Samples of one (path, operation, mode), or why there are none.
#[derive(Debug, Clone, Default, Serialize)]
struct Series {
    samples_s: Vec<f64>,
    error: Option<String>,
}

impl Series {
    fn push(&mut self, r: Result<f64, String>) {
        match r {
            Ok(s) => self.samples_s.push(s),
            Err(e) => {
                if self.error.is_none() {
                    eprintln!("bench: {e}");
                }
                self.error.get_or_insert(e);
            }
        }
    }
    fn stats(&self) -> Option<Stats> {
        stats(&self.samples_s)
    }
}

// ---------------------------------------------------------------------------------------
// Small helpers

/// The spec of a sandbox that lives through the whole run (the E2B front's default
/// timeout is 5 minutes).
fn long_lived() -> SandboxSpec {
    SandboxSpec {
        ttl: Some(Duration::from_secs(3600)),
        ..SandboxSpec::default()
    }
}

fn ctx() -> CallCtx {
    CallCtx::new("bench")
}

fn payload(size: usize) -> Bytes {
    let block: Vec<u8> = (0..4096u64)
        .map(|i| ((i * 2_654_435_761) >> 24) as u8)
        .collect();
    let mut v = block.repeat(size.div_ceil(4096));
    v.truncate(size);
    Bytes::from(v)
}

fn chunks(data: &Bytes) -> ByteStream {
    let parts: Vec<_> = (0..data.len())
        .step_by(MIB)
        .map(|i| Ok(data.slice(i..(i + MIB).min(data.len()))))
        .collect();
    futures_util::stream::iter(parts).boxed()
}

/// Run a blocking child process from async code, timed.
fn run_cmd(cmd: &mut std::process::Command) -> Result<(f64, usize), String> {
    tokio::task::block_in_place(|| {
        let t = Instant::now();
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{cmd:?}: {e}"))?;
        let s = t.elapsed().as_secs_f64();
        if !out.status.success() {
            return Err(format!(
                "{cmd:?}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok((s, out.stdout.len()))
    })
}

fn expect_len(what: &str, got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got} bytes, {want} expected"))
    }
}

fn proc_rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// utime + stime of a process, seconds.
fn proc_cpu_s(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / USER_HZ)
}

fn sh(cmd: &str) -> String {
    std::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// The daemon under test: a release tetherd child process

#[derive(Debug)]
struct Tetherd {
    child: std::process::Child,
    base: String,
    dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Tetherd {
    async fn start(bin: &Path) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = tether_tests::free_port();
        let cfg = dir.path().join("tetherd.toml");
        std::fs::write(
            &cfg,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\non_shutdown = \"release\"\n\n[e2b_front]\ntemplates = [\"base\"]\n"
            ),
        )
        .expect("config");
        let log = std::fs::File::create(dir.path().join("tetherd.log")).expect("log");
        let child = std::process::Command::new(bin)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn tetherd");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .pool_max_idle_per_host(256)
            .build()
            .expect("client");
        tether_tests::wait_healthy(&http, &base).await;
        Self {
            child,
            base,
            dir,
            http,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn url(&self, p: &str) -> String {
        format!("{}{p}", self.base)
    }

    async fn new_session(&self) -> Result<String, String> {
        #[derive(Deserialize)]
        struct Created {
            id: String,
        }
        let r = self
            .http
            .post(self.url("/v1/sessions"))
            .json(&serde_json::json!({}))
            .send()
            .await
            .map_err(|e| format!("create session: {e}"))?;
        if !r.status().is_success() {
            return Err(format!(
                "create session: {}: {}",
                r.status(),
                r.text().await.unwrap_or_default()
            ));
        }
        r.json::<Created>()
            .await
            .map(|c| c.id)
            .map_err(|e| format!("create session: {e}"))
    }

    async fn delete_session(&self, id: &str) {
        let _ = self
            .http
            .delete(self.url(&format!("/v1/sessions/{id}")))
            .send()
            .await;
    }

    /// SIGTERM (sandboxes are released: `on_shutdown = "release"`), then wait; SIGKILL after 60 s.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..1200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("bench: tetherd did not stop in 60 s; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

/// Peak RSS of a process, sampled every 5 ms in the background.
#[derive(Debug)]
struct RssSampler {
    peak_kib: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let peak_kib = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak_kib.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(kib) = proc_rss_kib(pid) {
                    p.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Self { peak_kib, stop }
    }
    fn reset(&self) {
        self.peak_kib.store(0, Ordering::Relaxed);
    }
    fn peak_mib(&self) -> f64 {
        self.peak_kib.load(Ordering::Relaxed) as f64 / 1024.0
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------
// The SDK drivers

#[derive(Debug, Serialize)]
struct DriverCmd<'a> {
    op: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    cmd: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    size: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct DriverReply {
    #[serde(default)]
    s: Option<f64>,
    #[serde(default)]
    bytes: Option<usize>,
    #[serde(default)]
    exit: Option<i64>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    ready: Option<bool>,
}

#[derive(Debug)]
struct Driver {
    name: &'static str,
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Driver {
    async fn start(
        name: &'static str,
        mut cmd: tokio::process::Command,
        base: &str,
    ) -> Result<Self, String> {
        let mut child = cmd
            .env("E2B_API_URL", base)
            .env("E2B_SANDBOX_URL", base)
            .env("E2B_API_KEY", API_KEY)
            .env_remove("E2B_DEBUG")
            .env_remove("E2B_DOMAIN")
            .env_remove("E2B_ACCESS_TOKEN")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{name}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut d = Self {
            name,
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        };
        let hello = d.read().await?;
        if hello.ready != Some(true) {
            return Err(format!("{name}: no ready line"));
        }
        d.call(DriverCmd {
            op: "open",
            cmd: None,
            path: None,
            size: None,
        })
        .await?;
        Ok(d)
    }

    async fn read(&mut self) -> Result<DriverReply, String> {
        let line = self
            .lines
            .next_line()
            .await
            .map_err(|e| format!("{}: {e}", self.name))?
            .ok_or_else(|| format!("{}: driver exited", self.name))?;
        serde_json::from_str(&line).map_err(|e| format!("{}: bad reply {line:?}: {e}", self.name))
    }

    async fn call(&mut self, c: DriverCmd<'_>) -> Result<DriverReply, String> {
        let mut line = serde_json::to_vec(&c).map_err(|e| e.to_string())?;
        line.push(b'\n');
        self.stdin
            .write_all(&line)
            .await
            .map_err(|e| format!("{}: {e}", self.name))?;
        let r = self.read().await?;
        if let Some(e) = r.error {
            return Err(format!("{} {}: {e}", self.name, c.op));
        }
        if r.s.is_none() {
            return Err(format!("{} {}: no timing", self.name, c.op));
        }
        Ok(r)
    }

    async fn close(mut self) {
        let _ = self
            .call(DriverCmd {
                op: "close",
                cmd: None,
                path: None,
                size: None,
            })
            .await;
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        let _ = self.child.kill().await;
    }
}

// ---------------------------------------------------------------------------------------
// Paths

/// How a path reaches its sandbox (or the host, for the floors).
enum Kind {
    /// The host itself: fork/exec, write+fsync, page-cache read.
    Host { dir: PathBuf },
    /// `unshare -Urmn true`.
    Unshare,
    /// A raw loopback TCP copy to and from a sink/source task.
    Tcp { conn: Mutex<TcpStream> },
    /// A provider called in-process through the seam.
    Seam {
        provider: Arc<dyn Provider>,
        sb: Arc<dyn Sandbox>,
        prefix: String,
    },
    /// tetherd's native API: processes and files.
    Native { sid: String },
    /// tetherd's native API: the `bash` tool call. A session runs its turns one after
    /// another (an agent's calls are a sequence), so concurrent calls go to sessions of
    /// their own (`pool`, made on first use).
    NativeTool {
        sid: String,
        pool: tokio::sync::OnceCell<Vec<String>>,
    },
    /// The `tether` CLI (`tether exec`, `tether cp`), one process per call.
    Cli {
        bin: PathBuf,
        sid: String,
        dir: PathBuf,
    },
    /// An official E2B SDK's long-lived driver.
    Sdk(Box<Mutex<Option<Driver>>>),
    /// OpenSSH's `ssh` and `sftp` command-line clients, one connection per call.
    SshCli {
        args: Vec<String>,
        dest: String,
        port: u16,
        ws: String,
        dir: PathBuf,
    },
}

impl std::fmt::Debug for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Host { .. } => "host",
            Self::Unshare => "unshare",
            Self::Tcp { .. } => "tcp",
            Self::Seam { .. } => "seam",
            Self::Native { .. } => "native",
            Self::NativeTool { .. } => "native-tool",
            Self::Cli { .. } => "cli",
            Self::Sdk(_) => "sdk",
            Self::SshCli { .. } => "ssh-cli",
        })
    }
}

#[derive(Debug)]
struct BPath {
    name: &'static str,
    floor: bool,
    kind: Kind,
}

/// Shared state every path needs for a call.
#[derive(Debug)]
struct World {
    d: Tetherd,
    cli_bin: PathBuf,
    small: Bytes,
    large: Bytes,
    /// Local files holding `small` / `large` (CLI and sftp sources).
    small_file: PathBuf,
    large_file: PathBuf,
}

impl World {
    fn data(&self, size: usize) -> &Bytes {
        if size == KIB {
            &self.small
        } else {
            &self.large
        }
    }
    fn local_file(&self, size: usize) -> &Path {
        if size == KIB {
            &self.small_file
        } else {
            &self.large_file
        }
    }
}

impl BPath {
    fn supports(&self, op: Op) -> bool {
        match &self.kind {
            Kind::Unshare => op == Op::ExecTrue,
            Kind::Tcp { .. } => op.size() > 0,
            Kind::NativeTool { .. } => op == Op::ExecTrue,
            _ => true,
        }
    }

    fn supports_concurrent(&self) -> bool {
        matches!(
            self.kind,
            Kind::Host { .. }
                | Kind::Unshare
                | Kind::Seam { .. }
                | Kind::Native { .. }
                | Kind::NativeTool { .. }
        )
    }

    async fn run(&self, w: &World, op: Op) -> Result<f64, String> {
        match op {
            Op::ExecTrue => self.exec(w, "true", 0).await,
            Op::Exec1M => self.exec(w, PRINT_1M, MIB).await,
            _ if op.is_read() => self.read(w, op).await,
            _ => self.write(w, op).await,
        }
    }

    async fn exec(&self, w: &World, cmd: &str, want: usize) -> Result<f64, String> {
        let (s, n) = match &self.kind {
            Kind::Host { .. } => {
                if cmd == "true" {
                    run_cmd(&mut std::process::Command::new("true"))?
                } else {
                    run_cmd(std::process::Command::new("sh").args(["-c", cmd]))?
                }
            }
            Kind::Unshare => run_cmd(std::process::Command::new("unshare").args(["-Urmn", cmd]))?,
            Kind::Tcp { .. } => return Err("n/a".into()),
            Kind::Seam { sb, .. } => seam_exec(sb.as_ref(), cmd).await?,
            Kind::Native { sid } => native_exec(&w.d, sid, cmd).await?,
            Kind::NativeTool { sid, .. } => (native_tool(&w.d, sid, cmd).await?, want),
            Kind::Cli { bin, sid, .. } => {
                let mut c = std::process::Command::new(bin);
                c.env_remove("TETHER_TOKEN")
                    .args(["--url", &w.d.base, "exec", sid]);
                if cmd == "true" {
                    c.arg("true");
                } else {
                    c.args(["sh", "-c", cmd]);
                }
                run_cmd(&mut c)?
            }
            Kind::Sdk(d) => {
                let mut g = d.lock().await;
                let d = g.as_mut().ok_or("driver closed")?;
                let r = d
                    .call(DriverCmd {
                        op: "exec",
                        cmd: Some(cmd),
                        path: None,
                        size: None,
                    })
                    .await?;
                if r.exit != Some(0) {
                    return Err(format!("{}: exit {:?}", d.name, r.exit));
                }
                (r.s.unwrap_or_default(), r.bytes.unwrap_or_default())
            }
            Kind::SshCli {
                args, dest, port, ..
            } => run_cmd(std::process::Command::new("ssh").args(args).args([
                "-p",
                &port.to_string(),
                dest,
                cmd,
            ]))?,
        };
        expect_len(&format!("{} {cmd}", self.name), n, want)?;
        Ok(s)
    }

    async fn write(&self, w: &World, op: Op) -> Result<f64, String> {
        let data = w.data(op.size());
        let file = op.file();
        let t = Instant::now();
        match &self.kind {
            Kind::Host { dir } => tokio::task::block_in_place(|| {
                let mut f = std::fs::File::create(dir.join(file)).map_err(|e| e.to_string())?;
                f.write_all(data).map_err(|e| e.to_string())?;
                f.sync_all().map_err(|e| e.to_string())
            })?,
            Kind::Tcp { conn } => {
                let mut c = conn.lock().await;
                c.write_all(b"W").await.map_err(|e| e.to_string())?;
                c.write_all(&(data.len() as u64).to_be_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                c.write_all(data).await.map_err(|e| e.to_string())?;
                let mut ack = [0u8; 1];
                c.read_exact(&mut ack).await.map_err(|e| e.to_string())?;
            }
            Kind::Seam { sb, prefix, .. } => {
                sb.fs()
                    .write(
                        &ctx(),
                        &format!("{prefix}{file}"),
                        chunks(data),
                        WriteGuard::None,
                    )
                    .await
                    .map_err(|e| format!("{}: write: {e}", self.name))?;
            }
            Kind::Native { sid } => {
                let r =
                    w.d.http
                        .put(w.d.url(&format!("/v1/sessions/{sid}/files")))
                        .query(&[("path", format!("/home/user/{file}"))])
                        .body(data.clone())
                        .send()
                        .await
                        .map_err(|e| format!("PUT: {e}"))?;
                let st = r.status();
                let body = r.bytes().await.map_err(|e| format!("PUT: {e}"))?;
                if !st.is_success() {
                    return Err(format!("PUT: {st}: {}", String::from_utf8_lossy(&body)));
                }
            }
            Kind::Cli { bin, sid, .. } => {
                let mut c = std::process::Command::new(bin);
                c.env_remove("TETHER_TOKEN")
                    .args(["--url", &w.d.base, "cp"])
                    .arg(w.local_file(op.size()))
                    .arg(format!("{sid}:/home/user/{file}"));
                return run_cmd(&mut c).map(|r| r.0);
            }
            Kind::Sdk(d) => {
                let mut g = d.lock().await;
                let d = g.as_mut().ok_or("driver closed")?;
                let path = format!("/home/user/{file}");
                let r = d
                    .call(DriverCmd {
                        op: "write",
                        cmd: None,
                        path: Some(&path),
                        size: Some(op.size()),
                    })
                    .await?;
                return Ok(r.s.unwrap_or_default());
            }
            Kind::SshCli {
                args,
                dest,
                port,
                ws,
                dir,
            } => {
                let batch = dir.join("put.batch");
                std::fs::write(
                    &batch,
                    format!("put {} {ws}/{file}\n", w.local_file(op.size()).display()),
                )
                .map_err(|e| e.to_string())?;
                return run_cmd(
                    std::process::Command::new("sftp")
                        .args(args)
                        .args(["-P", &port.to_string(), "-b"])
                        .arg(&batch)
                        .arg(dest),
                )
                .map(|r| r.0);
            }
            Kind::Unshare | Kind::NativeTool { .. } => return Err("n/a".into()),
        }
        Ok(t.elapsed().as_secs_f64())
    }

    async fn read(&self, w: &World, op: Op) -> Result<f64, String> {
        let want = op.size();
        let file = op.file();
        let t = Instant::now();
        let n = match &self.kind {
            Kind::Host { dir } => tokio::task::block_in_place(|| std::fs::read(dir.join(file)))
                .map_err(|e| e.to_string())?
                .len(),
            Kind::Tcp { conn } => {
                let mut c = conn.lock().await;
                c.write_all(b"R").await.map_err(|e| e.to_string())?;
                c.write_all(&(want as u64).to_be_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                let mut buf = vec![0u8; want];
                c.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
                buf.len()
            }
            Kind::Seam { sb, prefix, .. } => {
                let mut s = sb
                    .fs()
                    .read(&ctx(), &format!("{prefix}{file}"), ByteRange::default())
                    .await
                    .map_err(|e| format!("{}: read: {e}", self.name))?;
                let mut back = Vec::with_capacity(want);
                while let Some(c) = s.next().await {
                    back.extend_from_slice(&c.map_err(|e| format!("{}: read: {e}", self.name))?);
                }
                back.len()
            }
            Kind::Native { sid } => {
                let r =
                    w.d.http
                        .get(w.d.url(&format!("/v1/sessions/{sid}/files")))
                        .query(&[("path", format!("/home/user/{file}"))])
                        .send()
                        .await
                        .map_err(|e| format!("GET: {e}"))?;
                if !r.status().is_success() {
                    return Err(format!("GET: {}", r.status()));
                }
                let mut s = r.bytes_stream();
                let mut back = Vec::with_capacity(want);
                while let Some(c) = s.next().await {
                    back.extend_from_slice(&c.map_err(|e| format!("GET: {e}"))?);
                }
                back.len()
            }
            Kind::Cli { bin, sid, dir } => {
                let out = dir.join(file);
                let mut c = std::process::Command::new(bin);
                c.env_remove("TETHER_TOKEN")
                    .args(["--url", &w.d.base, "cp"])
                    .arg(format!("{sid}:/home/user/{file}"))
                    .arg(&out);
                let (s, _) = run_cmd(&mut c)?;
                let n = std::fs::metadata(&out).map_err(|e| e.to_string())?.len() as usize;
                expect_len("tether cp", n, want)?;
                return Ok(s);
            }
            Kind::Sdk(d) => {
                let mut g = d.lock().await;
                let d = g.as_mut().ok_or("driver closed")?;
                let path = format!("/home/user/{file}");
                let r = d
                    .call(DriverCmd {
                        op: "read",
                        cmd: None,
                        path: Some(&path),
                        size: Some(want),
                    })
                    .await?;
                return Ok(r.s.unwrap_or_default());
            }
            Kind::SshCli {
                args,
                dest,
                port,
                ws,
                dir,
            } => {
                let batch = dir.join("get.batch");
                let out = dir.join(file);
                std::fs::write(&batch, format!("get {ws}/{file} {}\n", out.display()))
                    .map_err(|e| e.to_string())?;
                let (s, _) = run_cmd(
                    std::process::Command::new("sftp")
                        .args(args)
                        .args(["-P", &port.to_string(), "-b"])
                        .arg(&batch)
                        .arg(dest),
                )?;
                let n = std::fs::metadata(&out).map_err(|e| e.to_string())?.len() as usize;
                expect_len("sftp get", n, want)?;
                return Ok(s);
            }
            Kind::Unshare | Kind::NativeTool { .. } => return Err("n/a".into()),
        };
        let s = t.elapsed().as_secs_f64();
        expect_len(&format!("{} read", self.name), n, want)?;
        Ok(s)
    }

    /// `CONCURRENT` x `exec true` at once: wall time.
    async fn concurrent(&self, w: &World) -> Result<f64, String> {
        let t = Instant::now();
        match &self.kind {
            Kind::Host { .. } | Kind::Unshare => {
                let unshare = matches!(self.kind, Kind::Unshare);
                tokio::task::block_in_place(|| {
                    let mut kids = Vec::with_capacity(CONCURRENT);
                    for _ in 0..CONCURRENT {
                        let mut c = if unshare {
                            let mut c = std::process::Command::new("unshare");
                            c.args(["-Urmn", "true"]);
                            c
                        } else {
                            std::process::Command::new("true")
                        };
                        kids.push(c.spawn().map_err(|e| e.to_string())?);
                    }
                    for mut k in kids {
                        let st = k.wait().map_err(|e| e.to_string())?;
                        if !st.success() {
                            return Err(format!("{st}"));
                        }
                    }
                    Ok::<_, String>(())
                })?;
            }
            Kind::NativeTool { pool, .. } => {
                let sids = pool
                    .get_or_try_init(|| async {
                        let mut sids = Vec::with_capacity(CONCURRENT);
                        for _ in 0..CONCURRENT {
                            let sid = w.d.new_session().await?;
                            native_tool(&w.d, &sid, "true").await?;
                            sids.push(sid);
                        }
                        Ok::<_, String>(sids)
                    })
                    .await?;
                let t = Instant::now();
                let rs = join_all(sids.iter().map(|sid| native_tool(&w.d, sid, "true"))).await;
                if let Some(e) = rs.into_iter().find_map(Result::err) {
                    return Err(e);
                }
                return Ok(t.elapsed().as_secs_f64());
            }
            _ => {
                let rs = join_all((0..CONCURRENT).map(|_| self.exec(w, "true", 0))).await;
                if let Some(e) = rs.into_iter().find_map(Result::err) {
                    return Err(e);
                }
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Create a sandbox and run `true` in it (timed); destroy it afterwards (untimed).
    async fn create_first(&self, w: &World) -> Result<f64, String> {
        let t = Instant::now();
        match &self.kind {
            Kind::Seam { provider, .. } => {
                let sb = provider
                    .create(&ctx(), SandboxSpec::default())
                    .await
                    .map_err(|e| format!("{}: create: {e}", self.name))?;
                seam_exec(sb.as_ref(), "true").await?;
                let s = t.elapsed().as_secs_f64();
                let _ = provider.destroy(&ctx(), &sb.info().id).await;
                Ok(s)
            }
            Kind::Native { .. } => {
                let sid = w.d.new_session().await?;
                native_exec(&w.d, &sid, "true").await?;
                let s = t.elapsed().as_secs_f64();
                w.d.delete_session(&sid).await;
                Ok(s)
            }
            Kind::Cli { bin, .. } => {
                let out = tokio::task::block_in_place(|| {
                    std::process::Command::new(bin)
                        .env_remove("TETHER_TOKEN")
                        .args(["--url", &w.d.base, "sessions", "new"])
                        .output()
                })
                .map_err(|e| e.to_string())?;
                let sid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                if !out.status.success() || sid.is_empty() {
                    return Err(format!(
                        "tether sessions new: {}",
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
                let r = run_cmd(
                    std::process::Command::new(bin)
                        .env_remove("TETHER_TOKEN")
                        .args(["--url", &w.d.base, "exec", &sid, "true"]),
                );
                let s = t.elapsed().as_secs_f64();
                w.d.delete_session(&sid).await;
                r.map(|_| s)
            }
            Kind::Sdk(d) => {
                let mut g = d.lock().await;
                let d = g.as_mut().ok_or("driver closed")?;
                d.call(DriverCmd {
                    op: "create_first",
                    cmd: None,
                    path: None,
                    size: None,
                })
                .await
                .map(|r| r.s.unwrap_or_default())
            }
            _ => Err("n/a".into()),
        }
    }

    /// `CREATE_MANY` sandboxes at once (timed until the last is ready); destroyed afterwards.
    async fn create_many(&self, w: &World) -> Result<f64, String> {
        let t = Instant::now();
        match &self.kind {
            Kind::Seam { provider, .. } => {
                let c = ctx();
                let rs =
                    join_all((0..CREATE_MANY).map(|_| provider.create(&c, SandboxSpec::default())))
                        .await;
                let s = t.elapsed().as_secs_f64();
                let mut err = None;
                let mut ids = Vec::new();
                for r in rs {
                    match r {
                        Ok(sb) => ids.push(sb.info().id),
                        Err(e) => {
                            err.get_or_insert(format!("{}: create: {e}", self.name));
                        }
                    }
                }
                join_all(ids.iter().map(|id| provider.destroy(&c, id))).await;
                err.map_or(Ok(s), Err)
            }
            Kind::Native { .. } => {
                let rs = join_all((0..CREATE_MANY).map(|_| w.d.new_session())).await;
                let s = t.elapsed().as_secs_f64();
                let mut err = None;
                let mut ids = Vec::new();
                for r in rs {
                    match r {
                        Ok(id) => ids.push(id),
                        Err(e) => {
                            err.get_or_insert(e);
                        }
                    }
                }
                join_all(ids.iter().map(|id| w.d.delete_session(id))).await;
                err.map_or(Ok(s), Err)
            }
            _ => Err("n/a".into()),
        }
    }

    fn supports_create_many(&self) -> bool {
        matches!(self.kind, Kind::Seam { .. } | Kind::Native { .. })
    }

    fn supports_create_first(&self) -> bool {
        matches!(
            self.kind,
            Kind::Seam { .. } | Kind::Native { .. } | Kind::Cli { .. } | Kind::Sdk(_)
        )
    }

    async fn teardown(&self) {
        match &self.kind {
            Kind::Seam { provider, sb, .. } => {
                let _ = provider.destroy(&ctx(), &sb.info().id).await;
            }
            Kind::Sdk(d) => {
                if let Some(d) = d.lock().await.take() {
                    d.close().await;
                }
            }
            _ => {}
        }
    }
}

/// Run `cmd` through the seam; (seconds, stdout bytes).
async fn seam_exec(sb: &dyn Sandbox, cmd: &str) -> Result<(f64, usize), String> {
    let t = Instant::now();
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .map_err(|e| format!("spawn: {e}"))?;
    let mut ev = h.events(StreamOffsets::default());
    let mut n = 0;
    let mut code = None;
    while let Some(e) = ev.next().await {
        match e.map_err(|e| format!("events: {e}"))? {
            ProcessEvent::Output {
                stream: StreamKind::Stdout,
                data,
                ..
            } => n += data.len(),
            ProcessEvent::Exited { status, .. } => {
                code = status.code;
                break;
            }
            _ => {}
        }
    }
    let s = t.elapsed().as_secs_f64();
    if code != Some(0) {
        return Err(format!("{cmd}: exit {code:?}"));
    }
    Ok((s, n))
}

/// Run `cmd` through the native processes API, following its output; (seconds, stdout bytes).
/// One `bash` tool call of `cmd` in session `sid`; its latency.
async fn native_tool(d: &Tetherd, sid: &str, cmd: &str) -> Result<f64, String> {
    let t = Instant::now();
    let r = d
        .http
        .post(d.url(&format!("/v1/sessions/{sid}/tool-calls")))
        .json(&serde_json::json!({"calls": [{"id": uuid::Uuid::new_v4().simple().to_string(), "name": "bash", "arguments": {"command": cmd}}]}))
        .send()
        .await
        .map_err(|e| format!("tool call: {e}"))?;
    let ok = r.status().is_success();
    let body = r.bytes().await.map_err(|e| format!("tool call: {e}"))?;
    if !ok {
        return Err(format!("tool call: {}", String::from_utf8_lossy(&body)));
    }
    Ok(t.elapsed().as_secs_f64())
}

async fn native_exec(d: &Tetherd, sid: &str, cmd: &str) -> Result<(f64, usize), String> {
    #[derive(Deserialize)]
    struct Started {
        command_id: String,
    }
    let t = Instant::now();
    let r = d
        .http
        .post(d.url(&format!("/v1/sessions/{sid}/processes")))
        .json(&serde_json::json!({ "cmd": cmd }))
        .send()
        .await
        .map_err(|e| format!("start: {e}"))?;
    if !r.status().is_success() {
        return Err(format!(
            "start: {}: {}",
            r.status(),
            r.text().await.unwrap_or_default()
        ));
    }
    let p: Started = r.json().await.map_err(|e| format!("start: {e}"))?;
    let body = d
        .http
        .get(d.url(&format!(
            "/v1/sessions/{sid}/processes/{}/output?follow=true",
            p.command_id
        )))
        .send()
        .await
        .map_err(|e| format!("output: {e}"))?
        .bytes()
        .await
        .map_err(|e| format!("output: {e}"))?;
    let s = t.elapsed().as_secs_f64();
    let mut n = 0;
    let mut code = None;
    for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<ProcessEvent>(line).map_err(|e| format!("event: {e}"))? {
            ProcessEvent::Output {
                stream: StreamKind::Stdout,
                data,
                ..
            } => n += data.len(),
            ProcessEvent::Exited { status, .. } => code = status.code,
            _ => {}
        }
    }
    if code != Some(0) {
        return Err(format!("{cmd}: exit {code:?}"));
    }
    Ok((s, n))
}

/// The loopback TCP floor's far end: `W len` reads len bytes and acks; `R len` sends len bytes.
async fn tcp_peer() -> TcpStream {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        let _ = s.set_nodelay(true);
        let mut buf = vec![0u8; MIB];
        let src = payload(MIB);
        loop {
            let mut hdr = [0u8; 9];
            if s.read_exact(&mut hdr).await.is_err() {
                return;
            }
            let mut len = u64::from_be_bytes(hdr[1..].try_into().unwrap_or_default()) as usize;
            if hdr[0] == b'W' {
                while len > 0 {
                    let k = len.min(buf.len());
                    if s.read_exact(&mut buf[..k]).await.is_err() {
                        return;
                    }
                    len -= k;
                }
                if s.write_all(&[1]).await.is_err() {
                    return;
                }
            } else {
                while len > 0 {
                    let k = len.min(src.len());
                    if s.write_all(&src[..k]).await.is_err() {
                        return;
                    }
                    len -= k;
                }
            }
        }
    });
    let c = TcpStream::connect(addr).await.expect("connect");
    c.set_nodelay(true).expect("nodelay");
    c
}

// ---------------------------------------------------------------------------------------
// Results

#[derive(Debug, Default, Serialize)]
struct Report {
    machine: BTreeMap<String, String>,
    quick: bool,
    reps: Option<Reps>,
    /// (operation, mode) -> path -> samples.
    ops: Vec<OpResult>,
    concurrent: Vec<NamedSeries>,
    create_first: Vec<NamedSeries>,
    create_many: Vec<NamedSeries>,
    memory: Vec<MemRow>,
    log: Option<LogResult>,
    targets: Vec<Target>,
    skipped: Vec<String>,
    duration_s: f64,
}

#[derive(Debug, Serialize)]
struct OpResult {
    op: Op,
    mode: Mode,
    paths: Vec<NamedSeries>,
}

#[derive(Debug, Serialize)]
struct NamedSeries {
    path: String,
    floor: bool,
    #[serde(flatten)]
    series: Series,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<Stats>,
    /// tetherd's own CPU per call, ms (concurrent rows through the daemon).
    #[serde(skip_serializing_if = "Option::is_none")]
    daemon_cpu_ms_per_call: Option<f64>,
}

impl NamedSeries {
    fn new(p: &BPath, series: Series) -> Self {
        Self {
            path: p.name.to_owned(),
            floor: p.floor,
            stats: series.stats(),
            series,
            daemon_cpu_ms_per_call: None,
        }
    }
}

#[derive(Debug, Serialize)]
struct MemRow {
    what: String,
    rss_mib: f64,
    growth_mib: f64,
}

#[derive(Debug, Serialize)]
struct LogResult {
    events: usize,
    log_events_per_s: f64,
    fdatasync_floor_per_s: f64,
    log_fdatasyncs: u64,
}

#[derive(Debug, Serialize)]
struct Target {
    name: String,
    value: Option<f64>,
    limit: String,
    met: Option<bool>,
    note: String,
}

impl Report {
    fn op(&self, op: Op, mode: Mode) -> Option<&OpResult> {
        self.ops.iter().find(|o| o.op == op && o.mode == mode)
    }
    fn median(&self, op: Op, mode: Mode, path: &str) -> Option<f64> {
        self.op(op, mode)?
            .paths
            .iter()
            .find(|p| p.path == path)?
            .stats
            .map(|s| s.median_s)
    }
}

// Path names (also the JSON keys and the plot's labels).
const P_HOST: &str = "host (floor)";
const P_UNSHARE: &str = "unshare -Urmn (floor)";
const P_TCP: &str = "loopback TCP (floor)";
const P_LOCAL: &str = "local provider in-process";
const P_NATIVE: &str = "native API (processes, files)";
const P_TOOL: &str = "native API bash tool call";
const P_CLI: &str = "CLI tether exec / cp";
const P_E2B: &str = "tether E2B provider -> front";
const P_PY: &str = "Python SDK -> front";
const P_JS: &str = "JS SDK -> front";
const P_SSH: &str = "SSH provider -> sshd";
const P_SSH_CLI: &str = "ssh / sftp CLI -> sshd";
const P_SSH_MUX: &str = "ssh / sftp CLI, ControlMaster";

/// The floor latency an op's ratio is taken against: the host for exec and small files;
/// for 256 MiB the slower of loopback TCP and the host's file (the target's "whichever is
/// lower" throughput).
fn floor_of(r: &Report, op: Op, mode: Mode) -> Option<f64> {
    let host = r.median(op, mode, P_HOST);
    if op.size() == LARGE {
        let tcp = r.median(op, mode, P_TCP);
        match (host, tcp) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    } else {
        host
    }
}

fn ms(s: f64) -> String {
    let v = s * 1e3;
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn print_tables(r: &Report) {
    let m = &r.machine;
    println!("## tether bench{}", if r.quick { " (--quick)" } else { "" });
    println!();
    for (k, v) in m {
        println!("- {k}: {v}");
    }
    println!();
    let mut ops: Vec<Op> = r.ops.iter().map(|o| o.op).collect();
    ops.dedup();
    if !ops.is_empty() {
        println!("### Latency per operation (ms; median / p99; x floor = median / floor median)");
        println!();
        println!(
            "| operation | path | hot median | hot p99 | cold median | cold p99 | x floor hot | x floor cold | MiB/s hot |"
        );
        println!("|---|---|--:|--:|--:|--:|--:|--:|--:|");
        for op in ops {
            let hot = r.op(op, Mode::Hot);
            let cold = r.op(op, Mode::Cold);
            let names: Vec<&NamedSeries> = hot
                .or(cold)
                .map(|o| o.paths.iter().collect())
                .unwrap_or_default();
            for ns in names {
                let h = hot.and_then(|o| o.paths.iter().find(|p| p.path == ns.path));
                let c = cold.and_then(|o| o.paths.iter().find(|p| p.path == ns.path));
                let cell = |s: Option<&NamedSeries>, f: fn(&Stats) -> f64| {
                    s.map_or("-".into(), |s| match (&s.stats, &s.series.error) {
                        (Some(st), _) => ms(f(st)),
                        (None, Some(e)) => {
                            format!("error: {}", e.chars().take(60).collect::<String>())
                        }
                        (None, None) => "-".into(),
                    })
                };
                let ratio = |s: Option<&NamedSeries>, mode| match (
                    s.and_then(|s| s.stats),
                    floor_of(r, op, mode),
                ) {
                    (Some(st), Some(f)) if f > 0.0 => format!("{:.2}", st.median_s / f),
                    _ => "-".into(),
                };
                let mibs = match (op.size(), h.and_then(|h| h.stats)) {
                    (n, Some(st)) if n == LARGE => {
                        format!("{:.0}", n as f64 / MIB as f64 / st.median_s)
                    }
                    _ => "-".into(),
                };
                println!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    op.label(),
                    ns.path,
                    cell(h, |s| s.median_s),
                    cell(h, |s| s.p99_s),
                    cell(c, |s| s.median_s),
                    cell(c, |s| s.p99_s),
                    ratio(h, Mode::Hot),
                    ratio(c, Mode::Cold),
                    mibs
                );
            }
        }
        println!();
    }
    if !r.concurrent.is_empty() {
        println!("### {CONCURRENT} concurrent `exec true`");
        println!();
        println!(
            "(The bash tool call row: one call in each of {CONCURRENT} sessions; a session runs its turns in order.)"
        );
        println!();
        println!(
            "| path | wall median (ms) | wall p99 (ms) | calls/s | x floor rate | tetherd CPU/call (ms) |"
        );
        println!("|---|--:|--:|--:|--:|--:|");
        let floor = r
            .concurrent
            .iter()
            .find(|p| p.path == P_HOST)
            .and_then(|p| p.stats);
        for p in &r.concurrent {
            let (a, b, rate, x) = match p.stats {
                Some(s) => (
                    ms(s.median_s),
                    ms(s.p99_s),
                    format!("{:.0}", CONCURRENT as f64 / s.median_s),
                    floor.map_or("-".into(), |f| format!("{:.2}", f.median_s / s.median_s)),
                ),
                None => (
                    p.series.error.clone().unwrap_or_default(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ),
            };
            let cpu = p
                .daemon_cpu_ms_per_call
                .map_or("-".into(), |c| format!("{c:.2}"));
            println!("| {} | {a} | {b} | {rate} | {x} | {cpu} |", p.path);
        }
        println!();
    }
    if !r.create_first.is_empty() || !r.create_many.is_empty() {
        println!("### Sandbox creation (ms)");
        println!();
        println!(
            "| path | create + first command median | p99 | create {CREATE_MANY} at once: wall | sandboxes/s |"
        );
        println!("|---|--:|--:|--:|--:|");
        let mut names: Vec<&str> = r.create_first.iter().map(|p| p.path.as_str()).collect();
        for p in &r.create_many {
            if !names.contains(&p.path.as_str()) {
                names.push(&p.path);
            }
        }
        for n in names {
            let f = r.create_first.iter().find(|p| p.path == n);
            let m = r.create_many.iter().find(|p| p.path == n);
            let fmt = |s: Option<&NamedSeries>, f: fn(&Stats) -> String| {
                s.map_or("-".into(), |s| {
                    s.stats.as_ref().map_or_else(
                        || {
                            s.series.error.clone().map_or("-".into(), |e| {
                                format!("error: {}", e.chars().take(60).collect::<String>())
                            })
                        },
                        f,
                    )
                })
            };
            println!(
                "| {n} | {} | {} | {} | {} |",
                fmt(f, |s| ms(s.median_s)),
                fmt(f, |s| ms(s.p99_s)),
                fmt(m, |s| ms(s.median_s)),
                fmt(m, |s| format!("{:.1}", CREATE_MANY as f64 / s.median_s)),
            );
        }
        println!();
    }
    if !r.memory.is_empty() {
        println!("### tetherd memory (RSS)");
        println!();
        println!("| state | RSS (MiB) | over idle (MiB) |");
        println!("|---|--:|--:|");
        for m in &r.memory {
            println!("| {} | {:.1} | {:+.1} |", m.what, m.rss_mib, m.growth_mib);
        }
        println!();
    }
    if let Some(l) = &r.log {
        println!("### Session log, 1 writer, {} events", l.events);
        println!();
        println!("| appends/s | fdatasync loop/s (floor) | x floor | fdatasyncs |");
        println!("|--:|--:|--:|--:|");
        println!(
            "| {:.0} | {:.0} | {:.2} | {} |",
            l.log_events_per_s,
            l.fdatasync_floor_per_s,
            l.log_events_per_s / l.fdatasync_floor_per_s,
            l.log_fdatasyncs
        );
        println!();
    }
    if !r.targets.is_empty() {
        println!("### Targets (ratios from this run)");
        println!();
        for t in &r.targets {
            let mark = match t.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "not measured",
            };
            let v = t.value.map_or("-".into(), |v| format!("{v:.2}"));
            println!(
                "- **{mark}**: {} = {v} (target {}){}",
                t.name,
                t.limit,
                if t.note.is_empty() {
                    String::new()
                } else {
                    format!("; {}", t.note)
                }
            );
        }
        println!();
    }
    for s in &r.skipped {
        println!("- skipped: {s}");
    }
    println!();
    println!("run took {:.0} s", r.duration_s);
}

fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    let mut push =
        |name: &str, value: Option<f64>, limit: &str, ok: fn(f64) -> bool, note: String| {
            t.push(Target {
                name: name.to_owned(),
                value,
                limit: limit.to_owned(),
                met: value.map(ok),
                note,
            });
        };
    let c = Mode::Cold;
    let tool = r.median(Op::ExecTrue, c, P_TOOL);
    let native = r.median(Op::ExecTrue, c, P_NATIVE);
    let unshare = r.median(Op::ExecTrue, c, P_UNSHARE);
    let local = r.median(Op::ExecTrue, c, P_LOCAL);
    push(
        "native `bash true` tool call cold / `unshare -Urmn true` cold",
        tool.zip(unshare).map(|(a, b)| a / b),
        "<= 2",
        |v| v <= 2.0,
        String::new(),
    );
    push(
        "native processes API `true` cold / `unshare -Urmn true` cold",
        native.zip(unshare).map(|(a, b)| a / b),
        "<= 2",
        |v| v <= 2.0,
        String::new(),
    );
    push(
        "native `bash true` tool call cold - local provider in-process cold (ms)",
        tool.zip(local).map(|(a, b)| (a - b) * 1e3),
        "< 1 ms",
        |v| v < 1.0,
        String::new(),
    );
    push(
        "native processes API `true` cold - local provider in-process cold (ms)",
        native.zip(local).map(|(a, b)| (a - b) * 1e3),
        "< 1 ms",
        |v| v < 1.0,
        String::new(),
    );
    for mode in [Mode::Hot, Mode::Cold] {
        let e = r.median(Op::ExecTrue, mode, P_E2B);
        let py = r.median(Op::ExecTrue, mode, P_PY);
        push(
            &format!("tether E2B provider / Python SDK, exec true {mode:?} (latency)"),
            e.zip(py).map(|(a, b)| a / b),
            "<= 1",
            |v| v <= 1.0,
            String::new(),
        );
    }
    for op in [Op::Write256M, Op::Read256M] {
        let e = r.median(op, Mode::Hot, P_E2B);
        let py = r.median(op, Mode::Hot, P_PY);
        push(
            &format!("tether E2B provider / Python SDK, {} (latency)", op.label()),
            e.zip(py).map(|(a, b)| a / b),
            "<= 1",
            |v| v <= 1.0,
            "256 MiB stands in for the target's 64 MiB".into(),
        );
    }
    for op in [Op::Write256M, Op::Read256M] {
        let floor = floor_of(r, op, Mode::Hot);
        for p in [P_LOCAL, P_NATIVE, P_CLI, P_E2B, P_SSH] {
            let v = r.median(op, Mode::Hot, p);
            push(
                &format!(
                    "{} through {p}: throughput / min(loopback TCP, host file)",
                    op.label()
                ),
                v.zip(floor).map(|(v, f)| f / v),
                ">= 0.8",
                |v| v >= 0.8,
                String::new(),
            );
        }
    }
    if let Some(m) = r
        .memory
        .iter()
        .find(|m| m.what.starts_with("during 256 MiB"))
    {
        push(
            "tetherd RSS growth during 256 MiB transfers (MiB)",
            Some(m.growth_mib),
            "< 64",
            |v| v < 64.0,
            String::new(),
        );
    }
    let conc = |p: &str| {
        r.concurrent
            .iter()
            .find(|s| s.path == p)
            .and_then(|s| s.stats)
            .map(|s| s.median_s)
    };
    let floor = conc(P_HOST);
    for p in [P_NATIVE, P_TOOL, P_LOCAL] {
        push(
            &format!("{CONCURRENT} concurrent exec true through {p}: rate / host fork/exec rate"),
            conc(p).zip(floor).map(|(v, f)| f / v),
            ">= 0.5",
            |v| v >= 0.5,
            String::new(),
        );
    }
    if let Some(m) = r.memory.iter().find(|m| m.what.contains("idle sessions")) {
        push(
            &format!("tetherd RSS {}", m.what),
            Some(m.rss_mib),
            "< 100 MiB",
            |v| v < 100.0,
            if r.quick {
                "--quick makes fewer sessions than the target's 1,000".into()
            } else {
                String::new()
            },
        );
    }
    if let Some(l) = &r.log {
        push(
            "session log 1 writer / fdatasync floor",
            Some(l.log_events_per_s / l.fdatasync_floor_per_s),
            ">= 0.9",
            |v| v >= 0.9,
            String::new(),
        );
    }
    t
}

// ---------------------------------------------------------------------------------------
// Measurements

async fn measure_ops(
    w: &World,
    paths: &[BPath],
    opts: &Opts,
    reps: Reps,
    report: &mut Report,
    rss: &RssSampler,
    idle_rss: f64,
) {
    let ops: Vec<Op> = [
        Op::ExecTrue,
        Op::Exec1M,
        Op::Write1K,
        Op::Read1K,
        Op::Write256M,
        Op::Read256M,
    ]
    .into_iter()
    .filter(|o| opts.wants(o.group()))
    .collect();
    // The read rows read what the write rows wrote: a read is measured only with its write.
    for op in ops {
        let large = op.size() == LARGE;
        let modes: &[Mode] = if large {
            &[Mode::Hot]
        } else {
            &[Mode::Hot, Mode::Cold]
        };
        if op == Op::Write256M {
            rss.reset();
        }
        for &mode in modes {
            let n = match (large, mode) {
                (true, _) => reps.large,
                (false, Mode::Hot) => reps.hot,
                (false, Mode::Cold) => reps.cold,
            };
            let active: Vec<&BPath> = paths.iter().filter(|p| p.supports(op)).collect();
            eprintln!(
                "bench: {} {mode:?}: {n} rounds x {} paths",
                op.label(),
                active.len()
            );
            let mut series: Vec<Series> = vec![Series::default(); active.len()];
            // One unrecorded call per path (first-use costs are the create rows' business).
            if !large {
                for (i, p) in active.iter().enumerate() {
                    if let Err(e) = p.run(w, op).await {
                        series[i].push(Err(e));
                    }
                }
            }
            let pause = match mode {
                Mode::Cold => COLD_IDLE,
                Mode::Hot => Duration::ZERO,
            };
            interleaved(&active, n, pause, &mut series, |_, p| p.run(w, op)).await;
            report.ops.push(OpResult {
                op,
                mode,
                paths: active
                    .iter()
                    .zip(series)
                    .map(|(p, s)| NamedSeries::new(p, s))
                    .collect(),
            });
        }
        if large && op == Op::Read256M {
            let peak = rss.peak_mib();
            report.memory.push(MemRow {
                what: "during 256 MiB transfers (peak, every daemon path)".into(),
                rss_mib: peak,
                growth_mib: peak - idle_rss,
            });
        }
    }
}

/// `rounds` interleaved rounds over the `active` paths: each round measures every path
/// once (`f(index, path)`), each call after `pause`, in an order rotated by the round so
/// no path always runs right after the same one; a path that failed once is left out.
async fn interleaved<'p, F, Fut>(
    active: &[&'p BPath],
    rounds: usize,
    pause: Duration,
    series: &mut [Series],
    mut f: F,
) where
    F: FnMut(usize, &'p BPath) -> Fut,
    Fut: std::future::Future<Output = Result<f64, String>>,
{
    for round in 0..rounds {
        for k in 0..active.len() {
            let i = (round + k) % active.len();
            if series[i].error.is_some() {
                continue;
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let r = f(i, active[i]).await;
            series[i].push(r);
        }
    }
}

async fn measure_concurrent(w: &World, paths: &[BPath], reps: Reps, report: &mut Report) {
    let active: Vec<&BPath> = paths.iter().filter(|p| p.supports_concurrent()).collect();
    eprintln!(
        "bench: {CONCURRENT} concurrent exec true: {} rounds x {} paths",
        reps.concurrent,
        active.len()
    );
    let mut series: Vec<Series> = vec![Series::default(); active.len()];
    // The daemon's CPU time per path, microseconds (the measuring futures must be Send).
    let cpu_us: Vec<AtomicU64> = active.iter().map(|_| AtomicU64::new(0)).collect();
    // Warm-up round.
    for p in &active {
        let _ = p.concurrent(w).await;
    }
    interleaved(&active, reps.concurrent, COLD_IDLE, &mut series, |i, p| {
        let cpu_us = &cpu_us;
        async move {
            let c0 = proc_cpu_s(w.d.pid()).unwrap_or_default();
            let r = p.concurrent(w).await;
            let used = proc_cpu_s(w.d.pid()).unwrap_or_default() - c0;
            cpu_us[i].fetch_add((used * 1e6) as u64, Ordering::Relaxed);
            r
        }
    })
    .await;
    for ((p, s), c) in active.iter().zip(series).zip(
        cpu_us
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as f64 / 1e6),
    ) {
        let mut ns = NamedSeries::new(p, s);
        if matches!(p.kind, Kind::Native { .. } | Kind::NativeTool { .. })
            && !ns.series.samples_s.is_empty()
        {
            ns.daemon_cpu_ms_per_call =
                Some(c * 1e3 / (ns.series.samples_s.len() * CONCURRENT) as f64);
        }
        report.concurrent.push(ns);
    }
}

async fn measure_create(w: &World, paths: &[BPath], reps: Reps, report: &mut Report) {
    let active: Vec<&BPath> = paths.iter().filter(|p| p.supports_create_first()).collect();
    eprintln!(
        "bench: create + first command: {} rounds x {} paths",
        reps.create_first,
        active.len()
    );
    let mut series: Vec<Series> = vec![Series::default(); active.len()];
    interleaved(
        &active,
        reps.create_first,
        COLD_IDLE,
        &mut series,
        |_, p| p.create_first(w),
    )
    .await;
    report.create_first = active
        .iter()
        .zip(series)
        .map(|(p, s)| NamedSeries::new(p, s))
        .collect();
    let active: Vec<&BPath> = paths.iter().filter(|p| p.supports_create_many()).collect();
    eprintln!(
        "bench: create {CREATE_MANY} at once: {} rounds x {} paths",
        reps.create_many,
        active.len()
    );
    let mut series: Vec<Series> = vec![Series::default(); active.len()];
    let pause = Duration::from_secs(1);
    interleaved(&active, reps.create_many, pause, &mut series, |_, p| {
        p.create_many(w)
    })
    .await;
    report.create_many = active
        .iter()
        .zip(series)
        .map(|(p, s)| NamedSeries::new(p, s))
        .collect();
}

async fn measure_memory(w: &World, reps: Reps, report: &mut Report, rss: &RssSampler, idle: f64) {
    // Idle sessions: created 16 at a time through the native API.
    let n = reps.idle_sessions;
    eprintln!("bench: {n} idle sessions");
    let mut ids = Vec::with_capacity(n);
    let mut err = None;
    for batch in (0..n).collect::<Vec<_>>().chunks(16) {
        for r in join_all(batch.iter().map(|_| w.d.new_session())).await {
            match r {
                Ok(id) => ids.push(id),
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        }
        if err.is_some() {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with = proc_rss_kib(w.d.pid()).unwrap_or_default() as f64 / 1024.0;
    report.memory.push(MemRow {
        what: format!(
            "with {} idle sessions{}",
            ids.len(),
            err.map_or(String::new(), |e| format!(" (then failed: {e})"))
        ),
        rss_mib: with,
        growth_mib: with - idle,
    });
    for batch in ids.chunks(16) {
        join_all(batch.iter().map(|id| w.d.delete_session(id))).await;
    }
    // 100 concurrent streams: 100 commands printing 8 MiB each, each followed by a reader.
    eprintln!("bench: {CONCURRENT} concurrent streams");
    match w.d.new_session().await {
        Ok(sid) => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // Growth is over the RSS just before (the idle sessions' allocations may stay
            // with the allocator after they are gone).
            let before = proc_rss_kib(w.d.pid()).unwrap_or_default() as f64 / 1024.0;
            rss.reset();
            let rs =
                join_all((0..CONCURRENT).map(|_| native_exec(&w.d, &sid, "yes | head -c 8388608")))
                    .await;
            let peak = rss.peak_mib();
            let bad = rs
                .iter()
                .filter(|r| !matches!(r, Ok((_, n)) if *n == 8 * MIB))
                .count();
            report.memory.push(MemRow {
                what: format!(
                    "during {CONCURRENT} concurrent streams of 8 MiB (peak{})",
                    if bad > 0 {
                        format!(", {bad} failed")
                    } else {
                        String::new()
                    }
                ),
                rss_mib: peak,
                growth_mib: peak - before,
            });
            w.d.delete_session(&sid).await;
        }
        Err(e) => report.skipped.push(format!("concurrent streams: {e}")),
    }
}

async fn measure_log(reps: Reps, report: &mut Report) -> Result<(), String> {
    use tether_daemon::session_log::{LogConfig, SessionLog};
    use tether_protocol::events::EventBody;
    let n = reps.log_events;
    eprintln!("bench: session log, {n} events");
    let base = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dir = base.path().join("log");
    let log = SessionLog::create(
        &dir,
        SessionLog::new_header(
            "bench-log",
            tether_protocol::events::SessionParams {
                provider: "bench".into(),
                template: None,
                env: Default::default(),
                network: false,
                metadata: Default::default(),
                owner: None,
                expiry: Default::default(),
                limits: Default::default(),
                ports: Default::default(),
                snapshot: None,
                lifecycle: Default::default(),
                egress: Default::default(),
            },
        ),
        LogConfig::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    // The floor: the same number of appends of a line of the same size, each followed by
    // fdatasync, to a file in the same directory. Interleaved with the log in ten rounds,
    // so both see the same disk (others' writes make fdatasync times drift).
    let line = "{\"seq\":1234,\"time\":\"2026-01-01T00:00:00.000Z\",\"type\":\"fs/op\",\"data\":{\"op\":\"write\",\"path\":\"/home/user/src/module/file_1234.rs\",\"outcome\":\"ok\",\"bytes\":5330}}\n";
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(base.path().join("floor.jsonl"))
        .map(Arc::new)
        .map_err(|e| e.to_string())?;
    let mut at = 0u64;
    let (mut secs, mut floor) = (0.0, 0.0);
    let per_round = n.div_ceil(10);
    let mut i = 0;
    while i < n {
        let k = per_round.min(n - i);
        let t = Instant::now();
        for j in i..i + k {
            log.append(EventBody::FsOp {
                op: "write".into(),
                path: format!("/home/user/src/module/file_{j}.rs"),
                outcome: "ok".into(),
                bytes: Some(4096 + j as u64),
            })
            .await
            .map_err(|e| e.to_string())?;
        }
        secs += t.elapsed().as_secs_f64();
        // On a blocking-pool thread, as the log's writer runs its fdatasyncs.
        let file = f.clone();
        let start = at;
        let t = Instant::now();
        at = tokio::task::spawn_blocking(move || {
            let mut at = start;
            for _ in 0..k {
                // pwrite at the end, as the log's writer does.
                std::os::unix::fs::FileExt::write_all_at(&*file, line.as_bytes(), at)?;
                at += line.len() as u64;
                file.sync_data()?;
            }
            Ok::<_, std::io::Error>(at)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        floor += t.elapsed().as_secs_f64();
        i += k;
    }
    let st = log.stats();
    log.close().await;
    report.log = Some(LogResult {
        events: n,
        log_events_per_s: n as f64 / secs,
        fdatasync_floor_per_s: n as f64 / floor,
        log_fdatasyncs: st.fdatasyncs,
    });
    Ok(())
}

fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(
        "cpu".into(),
        sh("lscpu | sed -n 's/^Model name: *//p' | head -1"),
    );
    m.insert("cpus".into(), sh("nproc"));
    m.insert("kernel".into(), sh("uname -srm"));
    m.insert("memory".into(), sh("free -h | awk '/^Mem:/ {print $2}'"));
    m.insert("load at start".into(), sh("cut -d' ' -f1-3 /proc/loadavg"));
    m.insert(
        "state dir file system".into(),
        sh("df -hT \"${TMPDIR:-/tmp}\" | awk 'NR==2 {print $2\" on \"$1}'"),
    );
    m.insert("date".into(), sh("date -u +%Y-%m-%dT%H:%MZ"));
    m
}

fn ssh_args(host: &SshHost) -> Vec<String> {
    vec![
        "-i".into(),
        host.key.display().to_string(),
        "-o".into(),
        format!("UserKnownHostsFile={}", host.known_hosts.display()),
        "-o".into(),
        "StrictHostKeyChecking=yes".into(),
        "-o".into(),
        "BatchMode=yes".into(),
        "-o".into(),
        "LogLevel=ERROR".into(),
    ]
}

fn python() -> Option<PathBuf> {
    let root = tether_tests::workspace_root();
    let py = root.join(".venv-e2b/bin/python");
    let ok = |py: &PathBuf| {
        std::process::Command::new(py)
            .args(["-c", "import e2b"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let js = root.join("tests/e2b_sdk/js/node_modules/e2b");
    if !ok(&py) || !js.exists() {
        let _ = std::process::Command::new("bash")
            .arg(root.join("tests/e2b_sdk/setup.sh"))
            .stdout(Stdio::null())
            .status();
    }
    ok(&py).then_some(py)
}

async fn run(opts: Opts) {
    let started = Instant::now();
    let reps = if opts.quick { QUICK } else { FULL };
    let mut report = Report {
        machine: machine(),
        quick: opts.quick,
        reps: Some(reps),
        ..Report::default()
    };
    let root = tether_tests::workspace_root();
    eprintln!("bench: building the release tetherd and tether");
    let tetherd_bin = tether_tests::workspace_bin("tetherd");
    let cli_bin = tether_tests::workspace_bin("tether");
    let d = Tetherd::start(&tetherd_bin).await;
    let rss = RssSampler::start(d.pid());
    let work = tempfile::tempdir().expect("tempdir");
    let small = payload(KIB);
    let large = payload(LARGE);
    let small_file = work.path().join("src-1k.bin");
    let large_file = work.path().join("src-256m.bin");
    std::fs::write(&small_file, &small).expect("write source");
    std::fs::write(&large_file, &large).expect("write source");
    let w = World {
        d,
        cli_bin,
        small,
        large,
        small_file,
        large_file,
    };
    let needs_paths = ["exec", "files", "large", "concurrent", "create"]
        .iter()
        .any(|g| opts.wants(g));

    let mut paths: Vec<BPath> = Vec::new();
    let mut host = None;
    let mut mux: Option<(PathBuf, Vec<String>, String)> = None;
    if needs_paths {
        eprintln!("bench: starting the paths");
        let host_dir = work.path().join("host");
        std::fs::create_dir_all(&host_dir).expect("host dir");
        paths.push(BPath {
            name: P_HOST,
            floor: true,
            kind: Kind::Host { dir: host_dir },
        });
        paths.push(BPath {
            name: P_UNSHARE,
            floor: true,
            kind: Kind::Unshare,
        });
        paths.push(BPath {
            name: P_TCP,
            floor: true,
            kind: Kind::Tcp {
                conn: Mutex::new(tcp_peer().await),
            },
        });
        // The local provider in-process, confined by the same trampoline as tetherd's.
        let mut lc = tether_provider_local::LocalConfig::with_root(work.path().join("local"));
        lc.confine_helper = Some(tetherd_bin.clone());
        let local: Arc<dyn Provider> =
            Arc::new(tether_provider_local::LocalProvider::new(lc).expect("local provider"));
        let lsb = local
            .create(&ctx(), long_lived())
            .await
            .expect("local sandbox");
        paths.push(BPath {
            name: P_LOCAL,
            floor: false,
            kind: Kind::Seam {
                provider: local,
                sb: lsb,
                prefix: String::new(),
            },
        });
        let sid = w.d.new_session().await.expect("native session");
        paths.push(BPath {
            name: P_NATIVE,
            floor: false,
            kind: Kind::Native { sid: sid.clone() },
        });
        paths.push(BPath {
            name: P_TOOL,
            floor: false,
            kind: Kind::NativeTool {
                sid: sid.clone(),
                pool: tokio::sync::OnceCell::new(),
            },
        });
        let cli_dir = work.path().join("cli");
        std::fs::create_dir_all(&cli_dir).expect("cli dir");
        paths.push(BPath {
            name: P_CLI,
            floor: false,
            kind: Kind::Cli {
                bin: w.cli_bin.clone(),
                sid,
                dir: cli_dir,
            },
        });
        let e2b: Arc<dyn Provider> = Arc::new(
            tether_provider_e2b::E2bProvider::new(tether_provider_e2b::E2bConfig {
                api_url: Some(w.d.base.clone()),
                sandbox_url: Some(w.d.base.clone()),
                api_key: Some(API_KEY.into()),
                inherit_env: false,
                ..Default::default()
            })
            .expect("e2b provider"),
        );
        let esb = e2b.create(&ctx(), long_lived()).await.expect("e2b sandbox");
        paths.push(BPath {
            name: P_E2B,
            floor: false,
            kind: Kind::Seam {
                provider: e2b,
                sb: esb,
                prefix: "/home/user/".into(),
            },
        });
        match python() {
            Some(py) => {
                let mut c = tokio::process::Command::new(py);
                c.arg(root.join("tests/bench/e2b_driver.py"));
                match Driver::start("python-sdk", c, &w.d.base).await {
                    Ok(d) => paths.push(BPath {
                        name: P_PY,
                        floor: false,
                        kind: Kind::Sdk(Box::new(Mutex::new(Some(d)))),
                    }),
                    Err(e) => report.skipped.push(format!("{P_PY}: {e}")),
                }
            }
            None => report.skipped.push(format!(
                "{P_PY}: the E2B Python SDK is not installed (run tests/e2b_sdk/setup.sh)"
            )),
        }
        if root.join("tests/e2b_sdk/js/node_modules/e2b").exists() {
            let mut c = tokio::process::Command::new("node");
            c.arg(root.join("tests/bench/e2b_driver.mjs"));
            match Driver::start("js-sdk", c, &w.d.base).await {
                Ok(d) => paths.push(BPath {
                    name: P_JS,
                    floor: false,
                    kind: Kind::Sdk(Box::new(Mutex::new(Some(d)))),
                }),
                Err(e) => report.skipped.push(format!("{P_JS}: {e}")),
            }
        } else {
            report.skipped.push(format!(
                "{P_JS}: the E2B JS SDK is not installed (run tests/e2b_sdk/setup.sh)"
            ));
        }
        // SSH: a throwaway OpenSSH host in a network namespace.
        let h = SshHost::start().await;
        let cfg = h.provider_config("bench");
        let ssh: Arc<dyn Provider> =
            Arc::new(tether_provider_ssh::SshProvider::new(cfg).expect("ssh provider"));
        let ssb = ssh.create(&ctx(), long_lived()).await.expect("ssh sandbox");
        let ws = ssb.info().workspace;
        let ssh_ws = ws.clone();
        paths.push(BPath {
            name: P_SSH,
            floor: false,
            kind: Kind::Seam {
                provider: ssh,
                sb: ssb,
                prefix: String::new(),
            },
        });
        let ssh_dir = work.path().join("ssh");
        std::fs::create_dir_all(&ssh_dir).expect("ssh dir");
        paths.push(BPath {
            name: P_SSH_CLI,
            floor: false,
            kind: Kind::SshCli {
                args: ssh_args(&h),
                dest: format!("{}@{}", h.user, h.addr.ip()),
                port: h.addr.port(),
                ws,
                dir: ssh_dir.clone(),
            },
        });
        // The CLI's best case: one master connection, every call multiplexed over it.
        let sock = ssh_dir.join("mux");
        let st = std::process::Command::new("ssh")
            .args(ssh_args(&h))
            .args(["-M", "-f", "-N", "-S"])
            .arg(&sock)
            .args(["-p", &h.addr.port().to_string()])
            .arg(format!("{}@{}", h.user, h.addr.ip()))
            .status();
        if st.is_ok_and(|s| s.success()) {
            let mut args = ssh_args(&h);
            args.extend(["-o".into(), format!("ControlPath={}", sock.display())]);
            let mux_dir = work.path().join("ssh-mux");
            std::fs::create_dir_all(&mux_dir).expect("ssh dir");
            paths.push(BPath {
                name: P_SSH_MUX,
                floor: false,
                kind: Kind::SshCli {
                    args,
                    dest: format!("{}@{}", h.user, h.addr.ip()),
                    port: h.addr.port(),
                    ws: ssh_ws,
                    dir: mux_dir,
                },
            });
            mux = Some((sock, ssh_args(&h), format!("{}@{}", h.user, h.addr.ip())));
        } else {
            report
                .skipped
                .push(format!("{P_SSH_MUX}: the master connection did not start"));
        }
        host = Some(h);
    }
    // Idle RSS: after start-up and one session's worth of use.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = proc_rss_kib(w.d.pid()).unwrap_or_default() as f64 / 1024.0;
    report.memory.push(MemRow {
        what: "idle (after start-up and set-up)".into(),
        rss_mib: idle,
        growth_mib: 0.0,
    });

    measure_ops(&w, &paths, &opts, reps, &mut report, &rss, idle).await;
    if opts.wants("concurrent") {
        measure_concurrent(&w, &paths, reps, &mut report).await;
    }
    if opts.wants("create") {
        measure_create(&w, &paths, reps, &mut report).await;
    }
    if opts.wants("memory") {
        measure_memory(&w, reps, &mut report, &rss, idle).await;
    }
    if opts.wants("log")
        && let Err(e) = measure_log(reps, &mut report).await
    {
        report.skipped.push(format!("session log: {e}"));
    }
    if opts.wants("microvm") {
        let why = if root.join("providers/microvm/Cargo.toml").exists() {
            "its figures (cold boot, restore, exec true, 64 MiB, idle memory, beside the local provider and the host floor) are `cargo bench --profile dev -p tether-provider-microvm --bench figures`"
        } else {
            "the microVM provider is not built (providers/microvm is absent from this tree)"
        };
        report.skipped.push(format!("microVM provider rows: {why}"));
    }

    eprintln!("bench: tearing down");
    for p in &paths {
        p.teardown().await;
    }
    if let Kind::Native { sid } = &paths
        .iter()
        .find(|p| p.name == P_NATIVE)
        .map_or(&Kind::Unshare, |p| &p.kind)
    {
        w.d.delete_session(sid).await;
    }
    drop(paths);
    if let Some((sock, args, dest)) = mux {
        let _ = std::process::Command::new("ssh")
            .args(args)
            .arg("-S")
            .arg(sock)
            .args(["-O", "exit"])
            .arg(dest)
            .output();
    }
    drop(host);
    drop(rss);
    report
        .machine
        .insert("load at end".into(), sh("cut -d' ' -f1-3 /proc/loadavg"));
    report.duration_s = started.elapsed().as_secs_f64();
    report.targets = targets(&report);
    let World { d, .. } = w;
    tokio::task::block_in_place(|| d.stop());
    print_tables(&report);
    if let Some(path) = &opts.json {
        let f = std::fs::File::create(path).expect("json file");
        serde_json::to_writer_pretty(f, &report).expect("write json");
        eprintln!("bench: raw figures in {}", path.display());
    }
}

fn main() {
    let opts = match Opts::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    // On a worker thread, not the block_on thread: block_in_place (every blocking
    // measurement) is meant for workers; on the block_on thread fdatasync loops ran
    // several times slower than in a plain program.
    if let Err(e) = rt.block_on(rt.spawn(run(opts))) {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}
