//! Shared helpers of tether's end-to-end tests: an in-process daemon on an ephemeral port
//! with its own state directory, a JSON client, and `wait_until`.
//!
//! Everything here runs real components: the daemon, the local provider, real files and
//! processes. Nothing is mocked.

// Test support: a panic is how a test (or a benchmark) reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tether_daemon::config::Config;
use tether_daemon::server::{Daemon, RunningDaemon};

pub mod fault_proxy;
pub mod http_fault;
pub mod otlp;
pub mod promql;
pub mod ssh_host;

/// The workspace root (for scripts and fixtures).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The directory of the built `base` template (`TETHER_TEMPLATE_DIR`, default
/// `target/tether-templates`), built there first if it is not (quick when it is:
/// `tests/run-all.sh` builds it before the tests); `None`, with the reason printed, when
/// Debian's packages cannot be fetched.
pub fn base_templates() -> Option<PathBuf> {
    let dir = std::env::var_os("TETHER_TEMPLATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target").join("tether-templates"));
    let mut progress = |p: tether_provider_local::BuildProgress| {
        eprintln!("base template: {p:?}");
    };
    match tether_provider_local::build_base(
        &dir,
        None,
        tether_provider_local::DEFAULT_UID_BASE,
        &mut progress,
    ) {
        Ok(_) => Some(dir),
        Err(e) => {
            eprintln!("SKIPPED: the base template cannot be built here: {e}");
            None
        }
    }
}

/// Make the daemon's local provider start sandboxes of the `base` template in
/// `templates` (Debian, user `user` with sudo: what E2B's own `base` is).
pub fn use_base_template(cfg: &mut Config, templates: PathBuf) {
    let mut local = match cfg.providers.remove("local") {
        Some(tether_daemon::config::ProviderConfig::Local(l)) => l,
        _ => tether_provider_local::LocalConfig::default(),
    };
    local.templates_dir = Some(templates);
    local.default_template = "base".into();
    cfg.providers.insert(
        "local".into(),
        tether_daemon::config::ProviderConfig::Local(local),
    );
}

/// A daemon running in this process, with a temporary state dir.
#[derive(Debug)]
pub struct TestDaemon {
    /// The daemon.
    pub daemon: Option<RunningDaemon>,
    /// Its state dir (removed on drop).
    pub dir: tempfile::TempDir,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// An HTTP client.
    pub http: reqwest::Client,
}

impl TestDaemon {
    /// Start with the default config (local provider).
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Start with a config adjusted by `f` (state dir and listener are set here).
    pub async fn start_with(f: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, f).await
    }

    /// Start on an existing state dir (restart tests).
    pub async fn start_in(dir: tempfile::TempDir, f: impl FnOnce(&mut Config)) -> Self {
        let mut cfg = Config::default();
        cfg.server.state_dir = dir.path().to_owned();
        cfg.server.shutdown_grace_ms = 5_000;
        f(&mut cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let daemon = Daemon::start_on(cfg, listener).await.expect("daemon start");
        let base = daemon.base_url();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("client");
        Self {
            daemon: Some(daemon),
            dir,
            base,
            http,
        }
    }

    /// `base + path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// POST JSON, return (status, JSON body or Null).
    pub async fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// GET, return (status, JSON body or Null).
    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let r = self.http.get(self.url(path)).send().await.expect("send");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// Create a sandbox through the E2B front with API key `key`; its id.
    pub async fn e2b_create(&self, key: &str) -> String {
        let r = self
            .http
            .post(self.url("/v2/sandboxes"))
            .header("x-api-key", key)
            .json(&serde_json::json!({"templateID": "base", "timeout": 120}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 201, "create through the E2B front");
        let body: serde_json::Value = r.json().await.expect("json");
        body["sandboxID"].as_str().expect("sandboxID").to_owned()
    }

    /// GET `path` of `port` of sandbox `sid` through the E2B front's port proxy (the
    /// `<port>-<id>.localhost` host), every 100 ms until it answers 200 (at most
    /// `tries` times): its body, or the last answer as the error.
    pub async fn get_port_until_served(
        &self,
        sid: &str,
        port: u16,
        path: &str,
        tries: u32,
    ) -> Result<String, String> {
        let mut last = String::new();
        for _ in 0..tries {
            let r = self
                .http
                .get(self.url(path))
                .header("host", format!("{port}-{sid}.localhost"))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let status = r.status().as_u16();
            let text = r.text().await.unwrap_or_default();
            if status == 200 {
                return Ok(text);
            }
            last = format!("{status} {text}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last)
    }

    /// Create a session on the local provider, return its id.
    pub async fn new_session(&self) -> String {
        let (st, body) = self.post("/v1/sessions", serde_json::json!({})).await;
        assert_eq!(st, 201, "create session: {body}");
        body["id"].as_str().expect("id").to_owned()
    }

    /// Graceful shutdown; returns the state dir for a restart.
    pub async fn stop(mut self) -> tempfile::TempDir {
        if let Some(d) = self.daemon.take() {
            d.shutdown().await;
        }
        self.dir
    }
}

/// Poll `f` until it returns true or `timeout` passes; panics with `what` on timeout.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The error code of an error body.
pub fn code(body: &serde_json::Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("<no code>")
}

/// Path of a workspace binary (`tetherd`, `tether`), built first if needed. Used by tests
/// that must run the daemon as a separate process (crash tests).
///
/// Tests get the debug build; benchmarks (compiled without debug assertions) get the
/// release build, so what they measure is what ships.
pub fn workspace_bin(name: &str) -> PathBuf {
    let root = workspace_root();
    let release = !cfg!(debug_assertions);
    let mut args = vec!["build", "-q", "-p", "tether-daemon", "--bin", name];
    if release {
        args.push("--release");
    }
    let status = std::process::Command::new(env!("CARGO"))
        .args(&args)
        .current_dir(&root)
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build of {name} failed");
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let path = target
        .join(if release { "release" } else { "debug" })
        .join(name);
    assert!(path.exists(), "{} missing", path.display());
    path
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for a child process).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// p50, p95 and mean of latency samples, in milliseconds (benchmarks).
pub fn latency_ms(mut samples: Vec<Duration>) -> (f64, f64, f64) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    if samples.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mean = samples.iter().map(|d| ms(*d)).sum::<f64>() / samples.len() as f64;
    (
        ms(samples[samples.len() / 2]),
        ms(samples[samples.len() * 95 / 100]),
        mean,
    )
}

/// A `tetherd serve` child process listening on 127.0.0.1:`port` over `state` (the
/// binary as a user runs it, for kill -9 tests). On drop it is stopped as a service
/// manager stops it (SIGTERM, then SIGKILL after 20 s) and reaped, and local sandboxes
/// that outlived a daemon killed earlier are ended (they would wait for a daemon that
/// never comes for their orphan grace).
#[derive(Debug)]
pub struct TetherdChild(pub std::process::Child, PathBuf);

impl TetherdChild {
    /// Start it; its output is discarded.
    pub fn spawn(state: &std::path::Path, port: u16) -> Self {
        Self::spawn_with(state, port, None)
    }

    /// Start it with the config file `config`, if any.
    pub fn spawn_with(state: &std::path::Path, port: u16, config: Option<&Path>) -> Self {
        let mut cmd = std::process::Command::new(workspace_bin("tetherd"));
        cmd.arg("serve");
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        let child = cmd
            .args(["--listen", &format!("127.0.0.1:{port}"), "--state-dir"])
            .arg(state)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn tetherd");
        Self(child, state.to_owned())
    }
}

impl TetherdChild {
    /// `kill -9` it and reap it: a crash, nothing flushed.
    pub fn kill_9(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.0.wait();
    }
}

impl Drop for TetherdChild {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        if let Ok(None) = self.0.try_wait() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            // Drop is synchronous: count 20 ms steps instead of reading a clock.
            for _ in 0..1000 {
                if !matches!(self.0.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
        tether_provider_local::end_orphaned_sandboxes(&self.1.join("sandboxes").join("local"));
    }
}

/// Wait (at most 30 s) until the daemon at `base` answers `/v1/health`.
pub async fn wait_healthy(http: &reqwest::Client, base: &str) {
    wait_until("tetherd health", Duration::from_secs(30), || async {
        http.get(format!("{base}/v1/health"))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false)
    })
    .await;
}

/// Read a file stream until it fails: the bytes that arrived before the error, and the
/// error. Panics (failing the test) when the stream ends without one.
pub async fn read_until_error(
    mut stream: tether_provider::ByteStream,
) -> (Vec<u8>, tether_provider::ProviderError) {
    use futures_util::StreamExt;
    let mut got = Vec::new();
    loop {
        match stream.next().await {
            Some(Ok(chunk)) => got.extend_from_slice(&chunk),
            Some(Err(e)) => return (got, e),
            None => panic!("the read ended without an error after {} bytes", got.len()),
        }
    }
}

/// The microVM provider's config for tests on this host (the cache of the provider's own
/// tests: image and saved template reused; 256 MiB guests), or `None` with the reason
/// printed (see [`tether_provider_microvm::testkit::test_config`]).
pub fn microvm_config() -> Option<tether_provider_microvm::MicrovmConfig> {
    tether_provider_microvm::testkit::test_config(&workspace_root())
        .map_err(|why| eprintln!("SKIPPED: {why}"))
        .ok()
}

/// Run a suite's process to its end within `limit`, streaming its stdout and stderr as
/// they come (each line prefixed `[tag]`; nextest shows them on failure). Returns its
/// status and its stdout lines. Panics when it outlives `limit` (it is killed).
pub async fn run_streamed(
    mut child: tokio::process::Child,
    tag: &str,
    limit: Duration,
) -> (std::process::ExitStatus, Vec<String>) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let out = child.stdout.take().expect("piped stdout");
    let err = child.stderr.take().expect("piped stderr");
    let t = tag.to_owned();
    let stdout_task = tokio::spawn(async move {
        let mut lines = BufReader::new(out).lines();
        let mut all = Vec::new();
        while let Ok(Some(l)) = lines.next_line().await {
            println!("[{t}] {l}");
            all.push(l);
        }
        all
    });
    let t = tag.to_owned();
    let stderr_task = tokio::spawn(async move {
        let mut lines = BufReader::new(err).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("[{t}] {l}");
        }
    });
    let status = match tokio::time::timeout(limit, child.wait()).await {
        Ok(s) => s.expect("wait for the suite"),
        Err(_) => {
            let _ = child.kill().await;
            panic!("the {tag} suite did not finish within {limit:?}");
        }
    };
    let lines = stdout_task.await.expect("stdout reader");
    let _ = stderr_task.await;
    (status, lines)
}

/// Wait until no E2B sandbox (a session with an owner) of `d` is live, within `within`.
pub async fn wait_no_e2b_sandboxes(d: &TestDaemon, within: Duration) {
    let state = &d.daemon.as_ref().expect("daemon").state;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let live: Vec<String> = state
            .sessions
            .list(tether_daemon::session_manager::Scope::Any)
            .iter()
            .filter(|s| s.owner.is_some())
            .map(|s| s.id.clone())
            .collect();
        if live.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sandboxes left running: {live:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every E2B session (one with an owner) of `d`, live or closed (read back from its log).
pub async fn e2b_sessions(
    d: &TestDaemon,
) -> Vec<std::sync::Arc<tether_daemon::session_manager::Session>> {
    let state = &d.daemon.as_ref().expect("daemon").state;
    let mut out = Vec::new();
    for info in state
        .sessions
        .infos(tether_daemon::session_manager::Scope::Any)
    {
        let s = state
            .sessions
            .lookup(&info.id, tether_daemon::session_manager::Scope::Any)
            .await
            .expect("a listed session opens");
        if s.owner.is_some() {
            out.push(s);
        }
    }
    out
}

/// The events of a closed E2B session, checked to run from its lease to its close (no
/// session ends without its sandbox released and its close logged).
pub async fn closed_session_events(
    s: &tether_daemon::session_manager::Session,
) -> Vec<tether_protocol::events::EventBody> {
    use tether_protocol::events::EventBody;
    assert_eq!(
        s.state(),
        tether_daemon::session_manager::SessionState::Closed,
        "{}",
        s.id
    );
    let events: Vec<EventBody> = s
        .log
        .events_after(None)
        .await
        .expect("the log reads back")
        .into_iter()
        .map(|e| e.body)
        .collect();
    assert!(
        matches!(events.first(), Some(EventBody::SandboxLeased { .. })),
        "{}: {:?}",
        s.id,
        events.first()
    );
    assert!(
        matches!(events.last(), Some(EventBody::SessionClosed { .. })),
        "{}: {:?}",
        s.id,
        events.last()
    );
    events
}
