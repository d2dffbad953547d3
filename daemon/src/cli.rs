//! `tether`, the command-line client of the native API.
//!
//! `tether run -- CMD` is tether's main job in one command: it starts an embedded daemon
//! on the local provider (unless `--url` names a running one), leases a sandbox, runs the
//! command there, prints its output, exit code and the time each step took, and cleans up.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use tether_protocol::api::*;
use tether_protocol::events::Event;
use tether_protocol::process::{ProcessEvent, StreamKind};
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// The tether CLI.
#[derive(Debug, Parser)]
#[command(
    name = "tether",
    version,
    about = "Client of tetherd, the remote-sandbox orchestration daemon"
)]
pub struct Cli {
    /// The daemon's URL.
    #[arg(
        long,
        env = "TETHER_URL",
        default_value = "http://127.0.0.1:7420",
        global = true
    )]
    pub url: String,
    /// Bearer token for the native API.
    #[arg(long, env = "TETHER_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Cmd,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run one command in a fresh sandbox and print its output, exit code and timings.
    /// Starts an embedded daemon on the local provider unless `--url` is given explicitly.
    Run {
        /// Use the daemon at --url instead of an embedded one.
        #[arg(long)]
        remote: bool,
        /// Provider name.
        #[arg(long)]
        provider: Option<String>,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
    /// Manage sessions.
    Sessions {
        /// new, ls or rm.
        #[command(subcommand)]
        op: SessionsOp,
    },
    /// Run a command in a session, stream its output, exit with its code.
    Exec {
        /// Session id.
        session: String,
        /// Total deadline, ms.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
    /// Call one tool: `tether call SESSION bash '{"command":"ls"}'`.
    Call {
        /// Session id.
        session: String,
        /// Tool name.
        tool: String,
        /// Arguments, a JSON object.
        arguments: String,
    },
    /// Print a session's log; `-f` follows it.
    Logs {
        /// Session id.
        session: String,
        /// Follow.
        #[arg(short, long)]
        follow: bool,
    },
    /// Fork a session.
    Fork {
        /// Session id.
        session: String,
        /// Inclusive boundary seq.
        #[arg(long)]
        at: Option<u64>,
    },
    /// Copy a file to or from a session: `tether cp ./a SESSION:/home/user/a` or back.
    Cp {
        /// Source: a local path or SESSION:PATH.
        src: String,
        /// Destination: a local path or SESSION:PATH. A local directory receives the
        /// file under its own name; a device or FIFO (`/dev/null`) is written in place.
        dst: String,
        /// Make a downloaded file durable (`fsync`) before exiting, as `rsync --fsync`.
        /// Without it the file is in place (renamed over the old one, never half written)
        /// when the copy ends, and the system writes it to disk in its own time, as `cp`.
        #[arg(long)]
        sync: bool,
    },
    /// Build a template of the local provider: `tether template build base`.
    Template {
        /// What to do with it.
        #[command(subcommand)]
        op: TemplateOp,
    },
}

/// `tether template ...`.
#[derive(Debug, Subcommand)]
pub enum TemplateOp {
    /// Build a template (`base`: a Debian root file system from Debian's packages),
    /// unless it is built already. Needs root and `debootstrap`.
    Build {
        /// The template (`base`).
        name: String,
        /// The templates directory of the local provider. Default: the default local
        /// provider's (`<state_dir>/sandboxes/local-templates`).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The Debian mirror to build from (debootstrap's default if unset).
        #[arg(long)]
        mirror: Option<String>,
        /// `microvm`: the static guest agent (default: `tether-guest` beside this binary).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// `microvm`: the image directory (default: the default microvm provider's,
        /// `<state_dir>/sandboxes/microvm/image`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Build a template, printing its progress on stderr.
fn build_template(op: TemplateOp) -> Result<i32, CliError> {
    let TemplateOp::Build {
        name,
        dir,
        mirror,
        agent,
        out,
    } = op;
    if name == "microvm" {
        return build_microvm(dir, agent, out);
    }
    if name != "base" {
        return Err(CliError {
            message: format!(
                "unknown template {name:?}: `base` or `microvm` (`host` needs no build)"
            ),
            code: 2,
        });
    }
    let dir = dir.unwrap_or_else(|| {
        PathBuf::from(crate::config::DEFAULT_STATE_DIR)
            .join("sandboxes")
            .join("local-templates")
    });
    let mut progress = |p: tether_provider_local::BuildProgress| match p {
        tether_provider_local::BuildProgress::Step(s) => eprintln!("==> {s}"),
        tether_provider_local::BuildProgress::Line(l) => eprintln!("    {l}"),
        tether_provider_local::BuildProgress::Done { bytes, seconds } => eprintln!(
            "==> built in {seconds:.0} s, {:.0} MiB",
            bytes as f64 / (1 << 20) as f64
        ),
    };
    let rootfs = tether_provider_local::build_base(
        &dir,
        mirror.as_deref(),
        tether_provider_local::DEFAULT_UID_BASE,
        &mut progress,
    )?;
    println!("{}", rootfs.display());
    Ok(0)
}

/// Build the microVM guest image (kernel, initramfs, ext4 root from the `base`
/// template with the guest agent in it), printing its progress on stderr.
fn build_microvm(
    templates: Option<PathBuf>,
    agent: Option<PathBuf>,
    out: Option<PathBuf>,
) -> Result<i32, CliError> {
    let state = PathBuf::from(crate::config::DEFAULT_STATE_DIR).join("sandboxes");
    let defaults = tether_provider_microvm::MicrovmConfig::with_root(state.join("microvm"));
    let Some(agent) = agent.or_else(|| defaults.agent_binary()) else {
        return Err(CliError {
            message: "no guest agent: pass --agent PATH".into(),
            code: 2,
        });
    };
    let spec = tether_provider_microvm::GuestSpec {
        out_dir: out.unwrap_or_else(|| defaults.image_dir()),
        template: templates
            .unwrap_or_else(|| state.join("local-templates"))
            .join("base"),
        template_uid_base: defaults.template_uid_base,
        agent,
        disk_mib: defaults.disk_mib,
    };
    let mut progress = |p: tether_provider_microvm::GuestProgress| match p {
        tether_provider_microvm::GuestProgress::Step(s) => eprintln!("==> {s}"),
        tether_provider_microvm::GuestProgress::Done {
            key,
            seconds,
            cached,
        } => eprintln!(
            "==> {} {key} in {seconds:.1} s",
            if cached { "found" } else { "built" }
        ),
    };
    let img = tether_provider_microvm::build_guest(&spec, &mut progress)?;
    println!("{}", img.dir.display());
    Ok(0)
}

/// `tether sessions ...`.
#[derive(Debug, Subcommand)]
pub enum SessionsOp {
    /// Create a session.
    New {
        /// Provider name.
        #[arg(long)]
        provider: Option<String>,
        /// TTL without activity, seconds.
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// List sessions.
    Ls,
    /// Close a session (destroys its sandbox).
    Rm {
        /// Session id.
        session: String,
    },
}

/// A CLI failure: a message and the exit code.
#[derive(Debug)]
pub struct CliError {
    /// What went wrong.
    pub message: String,
    /// Exit code.
    pub code: i32,
}

impl<E: std::fmt::Display> From<E> for CliError {
    fn from(e: E) -> Self {
        Self {
            message: e.to_string(),
            code: 1,
        }
    }
}

/// An HTTP client of the native API.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// A client of the daemon at `base`.
    pub fn new(base: &str, token: Option<String>) -> Result<Self, CliError> {
        let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        // A plain-HTTP daemon (the default, on loopback) needs no certificate store; loading
        // the system's (every file of /etc/ssl/certs) was most of the CLI's start-up.
        if base.starts_with("http://") {
            builder = builder.tls_certs_only([]);
        }
        let http = builder.build()?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            token,
            http,
        })
    }

    fn req(&self, m: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(m, format!("{}{}", self.base, path));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn check(resp: reqwest::Response) -> Result<reqwest::Response, CliError> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(Self::failure(resp).await.1)
    }

    /// An error answer: its stable code (when its body is tether's) and the CLI's error.
    async fn failure(resp: reqwest::Response) -> (Option<tether_protocol::ErrorCode>, CliError) {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let (code, message) = match serde_json::from_str::<tether_protocol::ErrorBody>(&text) {
            Ok(b) => (
                Some(b.error.code),
                format!("{}: {}", b.error.code, b.error.message),
            ),
            Err(_) => (None, format!("HTTP {status}: {text}")),
        };
        (code, CliError { message, code: 1 })
    }

    async fn json<T: serde::de::DeserializeOwned>(
        rb: reqwest::RequestBuilder,
    ) -> Result<T, CliError> {
        Ok(Self::check(rb.send().await?).await?.json::<T>().await?)
    }

    /// Create a session.
    pub async fn create_session(
        &self,
        req: &CreateSessionRequest,
    ) -> Result<SessionInfo, CliError> {
        Self::json(self.req(reqwest::Method::POST, "/v1/sessions").json(req)).await
    }

    /// Close a session.
    pub async fn delete_session(&self, id: &str) -> Result<(), CliError> {
        Self::check(
            self.req(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"))
                .send()
                .await?,
        )
        .await?;
        Ok(())
    }

    /// Start a process.
    pub async fn start_process(
        &self,
        id: &str,
        req: &StartProcessRequest,
    ) -> Result<StartProcessResponse, CliError> {
        Self::json(
            self.req(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/processes"),
            )
            .json(req),
        )
        .await
    }

    /// Follow a process's output, writing it to stdout/stderr; returns the exit code.
    pub async fn stream_output(&self, id: &str, cid: &str) -> Result<Option<i32>, CliError> {
        let resp = Self::check(
            self.req(
                reqwest::Method::GET,
                &format!("/v1/sessions/{id}/processes/{cid}/output?follow=true"),
            )
            .send()
            .await?,
        )
        .await?;
        let mut stdout = tokio::io::stdout();
        let mut stderr = tokio::io::stderr();
        let mut code = None;
        let mut lines = ndjson_lines(resp);
        while let Some(line) = lines.next().await {
            match serde_json::from_slice::<ProcessEvent>(&line?)? {
                ProcessEvent::Output {
                    stream: StreamKind::Stderr,
                    data,
                    ..
                } => {
                    stderr.write_all(&data).await?;
                    stderr.flush().await?;
                }
                ProcessEvent::Output { data, .. } => {
                    stdout.write_all(&data).await?;
                    stdout.flush().await?;
                }
                ProcessEvent::Exited { status, .. } => {
                    code = status.code.or(status.signal.map(|s| 128 + s))
                }
                ProcessEvent::Started { .. } => {}
            }
        }
        Ok(code)
    }
}

fn ndjson_lines(
    resp: reqwest::Response,
) -> futures_util::stream::BoxStream<'static, Result<Vec<u8>, CliError>> {
    let body = resp.bytes_stream().boxed();
    futures_util::stream::unfold(
        (body, Vec::<u8>::new(), false),
        |(mut body, mut buf, mut done)| async move {
            loop {
                if let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                    let mut line: Vec<u8> = buf.drain(..=pos).collect();
                    line.pop();
                    if line.is_empty() {
                        continue;
                    }
                    return Some((Ok(line), (body, buf, done)));
                }
                if done {
                    if buf.is_empty() {
                        return None;
                    }
                    let line = std::mem::take(&mut buf);
                    return Some((Ok(line), (body, buf, true)));
                }
                match body.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        return Some((Err(CliError::from(e)), (body, Vec::new(), true)));
                    }
                    None => done = true,
                }
            }
        },
    )
    .boxed()
}

fn split_remote(s: &str) -> Option<(&str, &str)> {
    let (sess, path) = s.split_once(':')?;
    if sess.is_empty() || sess.contains('/') || path.is_empty() {
        return None;
    }
    Some((sess, path))
}

/// Run the CLI; returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    match dispatch(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tether: {}", e.message);
            e.code
        }
    }
}

async fn dispatch(cli: Cli) -> Result<i32, CliError> {
    let client = Client::new(&cli.url, cli.token.clone())?;
    match cli.command {
        Cmd::Template { op } => tokio::task::spawn_blocking(move || build_template(op)).await?,
        Cmd::Run {
            remote,
            provider,
            argv,
        } => run_main_job(&cli.url, cli.token, remote, provider, argv).await,
        Cmd::Sessions {
            op: SessionsOp::New { provider, ttl },
        } => {
            let s = client
                .create_session(&CreateSessionRequest {
                    provider,
                    ttl_s: ttl,
                    ..Default::default()
                })
                .await?;
            println!("{}", s.id);
            Ok(0)
        }
        Cmd::Sessions { op: SessionsOp::Ls } => {
            let l: ListSessionsResponse =
                Client::json(client.req(reqwest::Method::GET, "/v1/sessions")).await?;
            println!(
                "{:<22} {:<10} {:<9} {:>7}  SANDBOX",
                "ID", "PROVIDER", "STATE", "EVENTS"
            );
            for s in l.sessions {
                println!(
                    "{:<22} {:<10} {:<9} {:>7}  {}",
                    s.id,
                    s.provider,
                    s.state,
                    s.events,
                    s.sandbox_id.unwrap_or_default()
                );
            }
            Ok(0)
        }
        Cmd::Sessions {
            op: SessionsOp::Rm { session },
        } => {
            client.delete_session(&session).await?;
            Ok(0)
        }
        Cmd::Exec {
            session,
            timeout_ms,
            argv,
        } => {
            let p = client
                .start_process(
                    &session,
                    &StartProcessRequest {
                        cmd: None,
                        argv: Some(argv),
                        cwd: None,
                        env: Default::default(),
                        stdin: Default::default(),
                        timeout_ms,
                        idle_timeout_ms: None,
                        pty: None,
                        command_id: None,
                    },
                )
                .await?;
            Ok(client
                .stream_output(&session, &p.command_id)
                .await?
                .unwrap_or(1))
        }
        Cmd::Call {
            session,
            tool,
            arguments,
        } => {
            let args: serde_json::Value = serde_json::from_str(&arguments)?;
            let req = ToolCallsRequest {
                calls: vec![ToolCallRequest {
                    id: format!("cli-{}", uuid::Uuid::new_v4().simple()),
                    name: tool,
                    arguments: args,
                }],
            };
            let r: ToolCallsResponse = Client::json(
                client
                    .req(
                        reqwest::Method::POST,
                        &format!("/v1/sessions/{session}/tool-calls"),
                    )
                    .json(&req),
            )
            .await?;
            println!("{}", serde_json::to_string_pretty(&r.results)?);
            Ok(if r.results.iter().any(|r| r.is_error) {
                1
            } else {
                0
            })
        }
        Cmd::Logs { session, follow } => {
            let resp = Client::check(
                client
                    .req(
                        reqwest::Method::GET,
                        &format!("/v1/sessions/{session}/events?follow={follow}"),
                    )
                    .send()
                    .await?,
            )
            .await?;
            let mut lines = ndjson_lines(resp);
            while let Some(line) = lines.next().await {
                let e: Event = serde_json::from_slice(&line?)?;
                println!("{}", serde_json::to_string(&e)?);
            }
            Ok(0)
        }
        Cmd::Fork { session, at } => {
            let s: SessionInfo = Client::json(
                client
                    .req(
                        reqwest::Method::POST,
                        &format!("/v1/sessions/{session}/fork"),
                    )
                    .json(&ForkRequest { at_seq: at }),
            )
            .await?;
            println!("{}", s.id);
            Ok(0)
        }
        Cmd::Cp { src, dst, sync } => copy(&client, &src, &dst, sync).await,
    }
}

fn progress(len: u64, label: &str) -> indicatif::ProgressBar {
    // A bar only for files large enough to be worth watching.
    if len < 8 * 1024 * 1024 {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        pb.set_style(style);
    }
    pb.set_message(label.to_owned());
    pb
}

/// Pieces of a download's body received and not yet written to the local file.
const DOWNLOAD_AHEAD: usize = 32;

/// Where a download of `remote` to the local `dst` lands.
#[derive(Debug, PartialEq)]
enum Landing {
    /// A regular file (new or replaced): written beside it, then renamed over it. A
    /// symlink's target is replaced, not the link.
    Replace(PathBuf),
    /// Something that is not a regular file (a device, a FIFO): written to as it is.
    InPlace(PathBuf),
}

fn landing(dst: &str, remote: &str) -> std::io::Result<Landing> {
    let mut path = PathBuf::from(dst);
    let mut meta = std::fs::metadata(&path);
    if matches!(&meta, Ok(m) if m.is_dir()) {
        let name = std::path::Path::new(remote).file_name().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{remote} has no file name to give it in {dst}"),
            )
        })?;
        path.push(name);
        meta = std::fs::metadata(&path);
    }
    match meta {
        Ok(m) if m.is_dir() => Err(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            format!("{} is a directory", path.display()),
        )),
        Ok(m) if m.is_file() => Ok(Landing::Replace(std::fs::canonicalize(&path)?)),
        Ok(_) => Ok(Landing::InPlace(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Landing::Replace(path)),
        Err(e) => Err(e),
    }
}

/// PUT the local file `src` (`len` bytes by its metadata, for the progress bar) to
/// `sess:path`; the bytes sent and the answer.
async fn upload(
    client: &Client,
    src: &str,
    len: u64,
    sess: &str,
    path: &str,
) -> Result<(u64, reqwest::Response), CliError> {
    let file = tokio::fs::File::open(src).await?;
    let pb = progress(len, "upload");
    let pb2 = pb.clone();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sent2 = sent.clone();
    let stream = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024).inspect(move |c| {
        if let Ok(c) = c {
            pb2.inc(c.len() as u64);
            sent2.fetch_add(c.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let url = format!("/v1/sessions/{sess}/files?path={}", urlencode(path));
    let resp = client
        .req(reqwest::Method::PUT, &url)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await?;
    pb.finish_and_clear();
    Ok((sent.load(std::sync::atomic::Ordering::Relaxed), resp))
}

async fn copy(client: &Client, src: &str, dst: &str, sync: bool) -> Result<i32, CliError> {
    match (split_remote(src), split_remote(dst)) {
        (None, Some((sess, path))) => {
            let meta = tokio::fs::metadata(src).await?;
            if meta.is_dir() {
                return Err(CliError {
                    message: format!("{src} is a directory; tether cp copies one file"),
                    code: 2,
                });
            }
            let name = std::path::Path::new(src)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned());
            // `SESSION:DIR/` names a directory: the file goes in it under its own name.
            let mut path = match (&name, path.ends_with('/')) {
                (Some(n), true) => format!("{path}{n}"),
                _ => path.to_owned(),
            };
            let mut retried = false;
            loop {
                let (sent, resp) = upload(client, src, meta.len(), sess, &path).await?;
                if resp.status().is_success() {
                    eprintln!("uploaded {sent} bytes to {sess}:{path}");
                    return Ok(0);
                }
                let (code, err) = Client::failure(resp).await;
                // `SESSION:DIR` (an existing directory) too, as `cp` does; a regular file
                // can be read again, a stream (`/dev/stdin`) cannot.
                match (&name, code) {
                    (Some(n), Some(tether_protocol::ErrorCode::FsIsDirectory))
                        if !retried && meta.is_file() =>
                    {
                        path = format!("{}/{n}", path.trim_end_matches('/'));
                        retried = true;
                    }
                    _ => return Err(err),
                }
            }
        }
        (Some((sess, path)), None) => {
            let url = format!("/v1/sessions/{sess}/files?path={}", urlencode(path));
            let resp = Client::check(client.req(reqwest::Method::GET, &url).send().await?).await?;
            let len = resp.content_length().unwrap_or(0);
            let pb = progress(len, "download");
            let (tmp, publish) = match landing(dst, path)? {
                Landing::Replace(to) => {
                    let mut tmp = to.clone().into_os_string();
                    tmp.push(".tether-part");
                    (PathBuf::from(tmp), Some(to))
                }
                Landing::InPlace(to) => (to, None),
            };
            // The file is written by a thread of its own while the body keeps coming, at
            // most `DOWNLOAD_AHEAD` pieces behind it: receiving and writing overlap.
            let file = if publish.is_some() {
                std::fs::File::create(&tmp)?
            } else {
                std::fs::OpenOptions::new().write(true).open(&tmp)?
            };
            let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(DOWNLOAD_AHEAD);
            let writer = tokio::task::spawn_blocking(move || {
                use std::io::Write;
                let mut file = file;
                while let Some(chunk) = rx.blocking_recv() {
                    file.write_all(&chunk)?;
                }
                if sync {
                    file.sync_all()?;
                }
                Ok::<_, std::io::Error>(())
            });
            let received = async {
                let mut body = resp.bytes_stream();
                let mut n: u64 = 0;
                while let Some(chunk) = body.next().await {
                    let chunk = chunk?;
                    n += chunk.len() as u64;
                    pb.inc(chunk.len() as u64);
                    if tx.send(chunk).await.is_err() {
                        // The writer stopped: its error is reported below.
                        break;
                    }
                }
                drop(tx);
                writer.await.map_err(std::io::Error::other)??;
                Ok::<_, CliError>(n)
            }
            .await;
            let Some(to) = publish else {
                let n = received?;
                pb.finish_and_clear();
                eprintln!("downloaded {n} bytes from {sess}:{path}");
                return Ok(0);
            };
            // A broken download leaves no partial file behind.
            let n = match received {
                Ok(n) => n,
                Err(e) => {
                    let _ = tokio::fs::remove_file(&tmp).await;
                    return Err(e);
                }
            };
            tokio::fs::rename(&tmp, &to).await?;
            if sync && let Some(dir) = to.parent() {
                // The rename itself is durable once its directory is.
                let dir = if dir.as_os_str().is_empty() {
                    std::path::Path::new(".")
                } else {
                    dir
                };
                tokio::fs::File::open(dir).await?.sync_all().await?;
            }
            pb.finish_and_clear();
            eprintln!("downloaded {n} bytes from {sess}:{path}");
            Ok(0)
        }
        _ => Err(CliError {
            message: "exactly one of SRC and DST must be SESSION:PATH".into(),
            code: 2,
        }),
    }
}

fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn run_main_job(
    url: &str,
    token: Option<String>,
    remote: bool,
    provider: Option<String>,
    argv: Vec<String>,
) -> Result<i32, CliError> {
    let t0 = Instant::now();
    let mut embedded = None;
    let mut _state_dir = None;
    let base = if remote {
        url.to_owned()
    } else {
        let dir = tempfile::Builder::new().prefix("tether-run-").tempdir()?;
        let mut cfg = crate::config::Config::default();
        cfg.server.state_dir = dir.path().to_owned();
        cfg.server.on_shutdown = crate::config::ShutdownPolicy::Release;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let d = crate::server::Daemon::start_on(cfg, listener)
            .await
            .map_err(|e| CliError {
                message: e.to_string(),
                code: 1,
            })?;
        let base = d.base_url();
        embedded = Some(d);
        _state_dir = Some(dir);
        base
    };
    let t_daemon = t0.elapsed();
    let client = Client::new(&base, token)?;
    let t1 = Instant::now();
    let s = client
        .create_session(&CreateSessionRequest {
            provider,
            ..Default::default()
        })
        .await?;
    let t_create = t1.elapsed();
    eprintln!(
        "[tether] sandbox {} on provider {} (isolation: {})",
        s.sandbox_id.as_deref().unwrap_or("?"),
        s.provider,
        s.enforcement.as_deref().unwrap_or("?")
    );
    let t2 = Instant::now();
    let p = client
        .start_process(
            &s.id,
            &StartProcessRequest {
                cmd: None,
                argv: Some(argv),
                cwd: None,
                env: Default::default(),
                stdin: Default::default(),
                timeout_ms: Some(600_000),
                idle_timeout_ms: None,
                pty: None,
                command_id: None,
            },
        )
        .await?;
    let code = client.stream_output(&s.id, &p.command_id).await?;
    let t_run = t2.elapsed();
    let t3 = Instant::now();
    client.delete_session(&s.id).await?;
    let t_destroy = t3.elapsed();
    if let Some(d) = embedded {
        d.shutdown().await;
    }
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "[tether] exit code: {}",
        code.map_or("none".to_owned(), |c| c.to_string())
    );
    let _ = writeln!(
        err,
        "[tether] timings: daemon start {:.1} ms, sandbox create {:.1} ms, command {:.1} ms, sandbox destroy {:.1} ms, total {:.1} ms",
        ms(t_daemon),
        ms(t_create),
        ms(t_run),
        ms(t_destroy),
        ms(t0.elapsed())
    );
    Ok(code.unwrap_or(1))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
