//! The conformance suite every provider runs against itself.
//!
//! The suite uses the seam traits only, so the same cases judge the local, E2B and SSH
//! providers. Each case gets a fresh sandbox (except the lifecycle case, which makes
//! its own), runs under a time limit in its own task (a panic is a failure, never a
//! hang), and the sandbox is destroyed afterwards whatever happened.
//!
//! Two ways to run it:
//!
//! - [`conformance_tests!`](crate::conformance_tests) expands into one `#[tokio::test]`
//!   per case, so each case is reported separately by the test runner:
//!
//!   ```ignore
//!   tether_provider::conformance_tests!(|| async { make_provider().await });
//!   ```
//!
//!   where the closure's future yields a [`Fixture`] (or anything `Into<Fixture>`, such
//!   as an `Arc<dyn Provider>`).
//! - [`run_conformance`] runs every case and returns a [`ConformanceReport`].
//!
//! Optional capabilities ([`Capabilities`]) are honoured: a case that needs one the
//! provider lacks checks instead that the operation fails with `UNSUPPORTED` promptly,
//! and reports itself as skipped.

// Test support: assertions are the point of this module, and they panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::any::Any;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, FileKind, FsEventKind, WriteGuard};
use tether_protocol::process::{
    ExitStatus, ProcessEvent, ProcessSpec, PtySize, StdinMode, StreamKind,
};
use tokio::time::timeout;

use crate::clock::{CancelReason, Clock, IdleWatchdog};
use crate::ctx::CallCtx;
use crate::error::{ProviderError, Result};
use crate::seam::{
    ByteStream, Capabilities, ProcessHandle, ProcessSelector, Provider, Sandbox, SandboxSpec,
    StreamOffsets,
};

/// Every case, in the order [`run_conformance`] runs them.
pub const CASES: &[&str] = &[
    "lifecycle",
    "unsupported_ops_fail_fast",
    "fs_write_read_stat",
    "fs_streaming_write_is_byte_exact",
    "fs_write_guards",
    "fs_dirs_and_listing",
    "fs_rename_and_remove",
    "fs_error_codes",
    "fs_relative_paths",
    "fs_path_escapes_are_refused",
    "fs_and_processes_share_the_workspace",
    "fs_watch",
    "process_exit_codes",
    "process_stdout_stderr_offsets",
    "process_env_set_and_remove",
    "process_cwd",
    "process_stdin_pipe_and_data",
    "process_capture_cap",
    "process_signal",
    "process_terminate_reaches_grandchild",
    "process_deadline_mid_stream",
    "process_idle_watchdog",
    "process_cancel",
    "process_events_resume_from_offset",
    "process_attach_and_list",
    "process_pty",
];

/// Knobs of the suite for one provider.
#[derive(Debug, Clone)]
pub struct ConformanceOptions {
    /// The spec of every sandbox the suite creates (the suite adds its own `env` and
    /// `metadata` entries).
    pub spec: SandboxSpec,
    /// File operations are confined to the workspace (local and SSH providers); on an
    /// E2B microVM the whole VM is the sandbox's view, so path-escape cases are skipped.
    pub fs_confined_to_workspace: bool,
    /// Time limit of one case, sandbox creation included.
    pub case_timeout: Duration,
}

impl Default for ConformanceOptions {
    fn default() -> Self {
        Self {
            spec: SandboxSpec::default(),
            fs_confined_to_workspace: true,
            case_timeout: Duration::from_secs(90),
        }
    }
}

/// A provider under test, with its options and whatever must live as long as it (a
/// temporary directory, a server).
pub struct Fixture {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// The suite's options.
    pub options: ConformanceOptions,
    _guard: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fixture")
            .field("provider", &self.provider)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Fixture {
    /// A fixture with default options.
    pub fn new(provider: Arc<dyn Provider>) -> Self {
        Self {
            provider,
            options: ConformanceOptions::default(),
            _guard: None,
        }
    }

    /// Replace the options.
    pub fn with_options(mut self, options: ConformanceOptions) -> Self {
        self.options = options;
        self
    }

    /// Keep `guard` alive as long as the fixture.
    pub fn keep(mut self, guard: impl Any + Send + Sync) -> Self {
        self._guard = Some(Box::new(guard));
        self
    }
}

impl From<Arc<dyn Provider>> for Fixture {
    fn from(provider: Arc<dyn Provider>) -> Self {
        Self::new(provider)
    }
}

/// How one case went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// The provider lacks the capability; the case checked that it says so promptly.
    Skipped(String),
    /// An assertion failed, the case panicked, or it ran out of time.
    Failed(String),
}

/// One case's result.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case.
    pub name: &'static str,
    /// How it went.
    pub outcome: Outcome,
    /// How long it took.
    pub elapsed: Duration,
}

/// The results of [`run_conformance`].
#[derive(Debug, Clone, Default)]
pub struct ConformanceReport {
    /// One entry per case, in [`CASES`] order.
    pub cases: Vec<CaseReport>,
}

impl ConformanceReport {
    /// Whether no case failed.
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    /// The failed cases.
    pub fn failures(&self) -> impl Iterator<Item = &CaseReport> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_)))
    }
}

/// Run every case against `provider`.
pub async fn run_conformance(
    provider: Arc<dyn Provider>,
    opts: ConformanceOptions,
) -> ConformanceReport {
    let fixture = Fixture::new(provider).with_options(opts);
    let mut report = ConformanceReport::default();
    for name in CASES {
        let start = tokio::time::Instant::now();
        let outcome = run_case(&fixture, name).await;
        report.cases.push(CaseReport {
            name,
            outcome,
            elapsed: start.elapsed(),
        });
    }
    report
}

/// Run one case and panic if it fails (the body of each generated test).
pub async fn assert_case(fixture: &Fixture, name: &str) {
    match run_case(fixture, name).await {
        Outcome::Passed => {}
        Outcome::Skipped(why) => eprintln!("conformance case {name} skipped: {why}"),
        Outcome::Failed(why) => panic!("conformance case {name} failed: {why}"),
    }
}

/// Run one case by name.
pub async fn run_case(fixture: &Fixture, name: &str) -> Outcome {
    let Some(&(_, case, own_sandbox)) = TABLE.iter().find(|(n, _, _)| *n == name) else {
        return Outcome::Failed(format!("no conformance case named {name}"));
    };
    let provider = fixture.provider.clone();
    let options = Arc::new(fixture.options.clone());
    let limit = options.case_timeout;
    let sandbox = if own_sandbox {
        None
    } else {
        let spec = suite_spec(&options.spec);
        match timeout(limit, provider.create(&ctx(), spec)).await {
            Ok(Ok(s)) => Some(s),
            Ok(Err(e)) => return Outcome::Failed(format!("create failed: {} ({e})", e.code())),
            Err(_) => return Outcome::Failed("create did not finish in time".into()),
        }
    };
    let cx = Cx {
        provider: provider.clone(),
        sandbox: sandbox.clone(),
        options,
    };
    let task = tokio::spawn(case(cx));
    let abort = task.abort_handle();
    let outcome = match timeout(limit, task).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) if e.is_panic() => Outcome::Failed(panic_message(e.into_panic())),
        Ok(Err(e)) => Outcome::Failed(format!("the case task ended: {e}")),
        Err(_) => {
            abort.abort();
            Outcome::Failed(format!("the case did not finish within {limit:?}"))
        }
    };
    if let Some(s) = sandbox {
        let id = s.info().id;
        drop(s);
        match timeout(Duration::from_secs(30), provider.destroy(&ctx(), &id)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if outcome == Outcome::Passed => {
                return Outcome::Failed(format!("destroy failed: {e}"));
            }
            Err(_) if outcome == Outcome::Passed => {
                return Outcome::Failed("destroy did not finish in time".into());
            }
            _ => {}
        }
    }
    outcome
}

fn panic_message(p: Box<dyn Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .unwrap_or_else(|| "panic".into()),
    }
}

/// Expand into one `#[tokio::test]` per conformance case.
///
/// `$make` is a closure returning a future of a [`Fixture`] (or of anything
/// `Into<Fixture>`); it is called once per case.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            lifecycle,
            unsupported_ops_fail_fast,
            fs_write_read_stat,
            fs_streaming_write_is_byte_exact,
            fs_write_guards,
            fs_dirs_and_listing,
            fs_rename_and_remove,
            fs_error_codes,
            fs_relative_paths,
            fs_path_escapes_are_refused,
            fs_and_processes_share_the_workspace,
            fs_watch,
            process_exit_codes,
            process_stdout_stderr_offsets,
            process_env_set_and_remove,
            process_cwd,
            process_stdin_pipe_and_data,
            process_capture_cap,
            process_signal,
            process_terminate_reaches_grandchild,
            process_deadline_mid_stream,
            process_idle_watchdog,
            process_cancel,
            process_events_resume_from_offset,
            process_attach_and_list,
            process_pty,
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let fixture: $crate::testkit::Fixture = ($make)().await.into();
                $crate::testkit::assert_case(&fixture, stringify!($case)).await;
            }
        )*

        #[test]
        fn conformance_case_list_is_complete() {
            assert_eq!(&[$(stringify!($case)),*][..], $crate::testkit::CASES);
        }
    };
}

// === the cases ===

type CaseFn = fn(Cx) -> Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// Name, body, and whether the case manages its own sandbox.
const TABLE: &[(&str, CaseFn, bool)] = &[
    ("lifecycle", |cx| Box::pin(lifecycle(cx)), true),
    (
        "unsupported_ops_fail_fast",
        |cx| Box::pin(unsupported_ops_fail_fast(cx)),
        false,
    ),
    (
        "fs_write_read_stat",
        |cx| Box::pin(fs_write_read_stat(cx)),
        false,
    ),
    (
        "fs_streaming_write_is_byte_exact",
        |cx| Box::pin(fs_streaming_write_is_byte_exact(cx)),
        false,
    ),
    ("fs_write_guards", |cx| Box::pin(fs_write_guards(cx)), false),
    (
        "fs_dirs_and_listing",
        |cx| Box::pin(fs_dirs_and_listing(cx)),
        false,
    ),
    (
        "fs_rename_and_remove",
        |cx| Box::pin(fs_rename_and_remove(cx)),
        false,
    ),
    ("fs_error_codes", |cx| Box::pin(fs_error_codes(cx)), false),
    (
        "fs_relative_paths",
        |cx| Box::pin(fs_relative_paths(cx)),
        false,
    ),
    (
        "fs_path_escapes_are_refused",
        |cx| Box::pin(fs_path_escapes_are_refused(cx)),
        false,
    ),
    (
        "fs_and_processes_share_the_workspace",
        |cx| Box::pin(fs_and_processes_share_the_workspace(cx)),
        false,
    ),
    ("fs_watch", |cx| Box::pin(fs_watch(cx)), false),
    (
        "process_exit_codes",
        |cx| Box::pin(process_exit_codes(cx)),
        false,
    ),
    (
        "process_stdout_stderr_offsets",
        |cx| Box::pin(process_stdout_stderr_offsets(cx)),
        false,
    ),
    (
        "process_env_set_and_remove",
        |cx| Box::pin(process_env_set_and_remove(cx)),
        false,
    ),
    ("process_cwd", |cx| Box::pin(process_cwd(cx)), false),
    (
        "process_stdin_pipe_and_data",
        |cx| Box::pin(process_stdin_pipe_and_data(cx)),
        false,
    ),
    (
        "process_capture_cap",
        |cx| Box::pin(process_capture_cap(cx)),
        false,
    ),
    ("process_signal", |cx| Box::pin(process_signal(cx)), false),
    (
        "process_terminate_reaches_grandchild",
        |cx| Box::pin(process_terminate_reaches_grandchild(cx)),
        false,
    ),
    (
        "process_deadline_mid_stream",
        |cx| Box::pin(process_deadline_mid_stream(cx)),
        false,
    ),
    (
        "process_idle_watchdog",
        |cx| Box::pin(process_idle_watchdog(cx)),
        false,
    ),
    ("process_cancel", |cx| Box::pin(process_cancel(cx)), false),
    (
        "process_events_resume_from_offset",
        |cx| Box::pin(process_events_resume_from_offset(cx)),
        false,
    ),
    (
        "process_attach_and_list",
        |cx| Box::pin(process_attach_and_list(cx)),
        false,
    ),
    ("process_pty", |cx| Box::pin(process_pty(cx)), false),
];

/// What a case gets.
#[derive(Clone)]
struct Cx {
    provider: Arc<dyn Provider>,
    sandbox: Option<Arc<dyn Sandbox>>,
    options: Arc<ConformanceOptions>,
}

impl Cx {
    fn sandbox(&self) -> &Arc<dyn Sandbox> {
        self.sandbox
            .as_ref()
            .expect("this case runs in a suite-made sandbox")
    }

    fn caps(&self) -> Capabilities {
        self.provider.capabilities()
    }

    /// A sandbox path under the workspace.
    fn path(&self, rel: &str) -> String {
        format!("{}/{rel}", self.sandbox().info().workspace)
    }
}

/// Variables every suite sandbox carries (see `process_env_set_and_remove`).
const SANDBOX_ENV: &[(&str, &str)] = &[
    ("TETHER_CONFORMANCE_SANDBOX", "sandbox-level"),
    ("TETHER_CONFORMANCE_REMOVED", "present"),
];

fn suite_spec(base: &SandboxSpec) -> SandboxSpec {
    let mut spec = base.clone();
    for (k, v) in SANDBOX_ENV {
        spec.env.insert((*k).into(), (*v).into());
    }
    spec.metadata
        .insert("tether.conformance".into(), "1".into());
    spec
}

fn ctx() -> CallCtx {
    CallCtx::new(format!("conformance-{}", uuid::Uuid::new_v4().simple()))
}

/// The error code of a result that must be an error.
fn code<T: std::fmt::Debug>(r: Result<T>) -> ErrorCode {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e.code(),
    }
}

/// Check that an operation the provider does not support says so, promptly.
async fn expect_unsupported<T: std::fmt::Debug>(op: &str, fut: impl Future<Output = Result<T>>) {
    match timeout(Duration::from_secs(10), fut).await {
        Ok(r) => assert_eq!(
            code(r),
            ErrorCode::Unsupported,
            "{op} must fail with UNSUPPORTED"
        ),
        Err(_) => panic!("{op} hung instead of failing with UNSUPPORTED"),
    }
}

fn chunks_of(data: &[u8], sizes: &[usize]) -> ByteStream {
    let mut parts = Vec::new();
    let mut rest = data;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes[i % sizes.len()].min(rest.len());
        parts.push(Ok(Bytes::copy_from_slice(&rest[..n])));
        rest = &rest[n..];
        i += 1;
    }
    futures_util::stream::iter(parts).boxed()
}

async fn write(
    sb: &dyn Sandbox,
    path: &str,
    data: &[u8],
    guard: WriteGuard,
) -> Result<tether_protocol::fs::WriteOutcome> {
    sb.fs()
        .write(&ctx(), path, chunks_of(data, &[7, 4096, 65_536]), guard)
        .await
}

async fn read(sb: &dyn Sandbox, path: &str, range: ByteRange) -> Result<Vec<u8>> {
    let mut stream = sb.fs().read(&ctx(), path, range).await?;
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk?);
    }
    Ok(out)
}

/// Everything a command produced, checked for offset continuity on the way.
#[derive(Debug, Default)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    status: Option<ExitStatus>,
    stdout_bytes: u64,
    stderr_bytes: u64,
    first_stdout_offset: Option<u64>,
}

impl Collected {
    fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code)
    }

    /// Record one event; panics on an offset gap or overlap.
    fn push(&mut self, ev: ProcessEvent, from: StreamOffsets) {
        match ev {
            ProcessEvent::Started { .. } => {}
            ProcessEvent::Output {
                stream,
                offset,
                data,
            } => {
                let (buf, base) = match stream {
                    StreamKind::Stdout | StreamKind::Pty => (&mut self.stdout, from.stdout),
                    StreamKind::Stderr => (&mut self.stderr, from.stderr),
                };
                if matches!(stream, StreamKind::Stdout | StreamKind::Pty)
                    && self.first_stdout_offset.is_none()
                {
                    self.first_stdout_offset = Some(offset);
                }
                assert_eq!(
                    offset,
                    base + buf.len() as u64,
                    "{stream:?} chunk at a wrong offset"
                );
                buf.extend_from_slice(&data);
            }
            ProcessEvent::Exited {
                status,
                stdout_bytes,
                stderr_bytes,
            } => {
                assert!(self.status.is_none(), "two Exited events");
                self.status = Some(status);
                self.stdout_bytes = stdout_bytes;
                self.stderr_bytes = stderr_bytes;
            }
        }
    }
}

/// Read a command's events from `from` to the end.
async fn collect_from(h: &dyn ProcessHandle, from: StreamOffsets) -> Collected {
    let mut c = Collected::default();
    let mut events = h.events(from);
    while let Some(ev) = events.next().await {
        let ev = ev.expect("event stream error");
        assert!(c.status.is_none(), "an event after Exited: {ev:?}");
        c.push(ev, from);
    }
    assert!(c.status.is_some(), "the event stream ended without Exited");
    c
}

async fn run(sb: &dyn Sandbox, spec: ProcessSpec) -> Collected {
    let h = sb.process().spawn(&ctx(), spec).await.expect("spawn");
    collect_from(h.as_ref(), StreamOffsets::default()).await
}

async fn sh(sb: &dyn Sandbox, cmd: &str) -> Collected {
    run(sb, ProcessSpec::shell(cmd)).await
}

/// Read stdout until it contains `needle` (or the stream ends); returns what was read.
async fn read_until(events: &mut crate::seam::EventStream, needle: &str) -> String {
    let mut out = Vec::new();
    while let Some(ev) = events.next().await {
        if let ProcessEvent::Output {
            stream: StreamKind::Stdout | StreamKind::Pty,
            data,
            ..
        } = ev.expect("event")
        {
            out.extend_from_slice(&data);
            if String::from_utf8_lossy(&out).contains(needle) {
                break;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `pid` is alive in the sandbox, asked from a new command in that sandbox.
async fn alive_in_sandbox(sb: &dyn Sandbox, pid: &str) -> bool {
    let c = sh(sb, &format!("s=$(cut -d' ' -f3 /proc/{pid}/stat 2>/dev/null); [ -n \"$s\" ] && [ \"$s\" != Z ] && [ \"$s\" != X ]")).await;
    c.code() == Some(0)
}

/// Poll the workspace until `path` exists (a command's side effect).
async fn wait_for_file(sb: &dyn Sandbox, path: &str) -> Vec<u8> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(data) = read(sb, path, ByteRange::default()).await
            && data.ends_with(b"\n")
        {
            return data;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{path} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer side of a deadline or watchdog: read events until the stream ends or
/// `token` fires; return the output so far.
async fn consume(
    h: &dyn ProcessHandle,
    token: &crate::clock::CancelToken,
    idle: Option<&IdleWatchdog>,
) -> (Vec<u8>, bool) {
    let mut events = h.events(StreamOffsets::default());
    let mut out = Vec::new();
    loop {
        let demand = async {
            tokio::select! {
                biased;
                _ = token.cancelled() => None,
                ev = events.next() => Some(ev),
            }
        };
        let next = match idle {
            Some(wd) => wd.next(demand).await.expect("watchdog"),
            None => demand.await,
        };
        match next {
            None => return (out, true),
            Some(None) => return (out, false),
            Some(Some(ev)) => {
                if let ProcessEvent::Output { data, .. } = ev.expect("event") {
                    out.extend_from_slice(&data);
                }
            }
        }
    }
}

async fn lifecycle(cx: Cx) -> Outcome {
    let p = cx.provider.clone();
    p.healthcheck(&ctx()).await.expect("healthcheck");
    let mut spec = suite_spec(&cx.options.spec);
    spec.metadata
        .insert("tether.case".into(), "lifecycle".into());
    let sb = p.create(&ctx(), spec).await.expect("create");
    let info = sb.info();
    assert_eq!(info.provider, p.kind());
    assert!(
        info.workspace.starts_with('/'),
        "workspace {} is not absolute",
        info.workspace
    );
    assert!(info.created_ms > 0);
    assert_eq!(
        info.metadata.get("tether.case").map(String::as_str),
        Some("lifecycle")
    );
    let listed = p.list(&ctx()).await.expect("list");
    assert!(
        listed.iter().any(|s| s.id == info.id),
        "list does not show the new sandbox"
    );
    let again = p.connect(&ctx(), &info.id).await.expect("connect");
    assert_eq!(again.info().id, info.id);
    write(
        again.as_ref(),
        &format!("{}/kept.txt", info.workspace),
        b"kept",
        WriteGuard::None,
    )
    .await
    .expect("write");
    assert_eq!(
        read(
            sb.as_ref(),
            &format!("{}/kept.txt", info.workspace),
            ByteRange::default()
        )
        .await
        .expect("read"),
        b"kept"
    );
    if p.capabilities().renew {
        p.renew(&ctx(), &info.id, Duration::from_secs(600))
            .await
            .expect("renew");
        let renewed = p.connect(&ctx(), &info.id).await.expect("connect").info();
        assert!(
            renewed.expires_ms.is_some_and(|e| e > info.created_ms),
            "renew must set an expiry"
        );
    }
    drop((sb, again));
    p.destroy(&ctx(), &info.id).await.expect("destroy");
    let listed = p.list(&ctx()).await.expect("list");
    assert!(
        !listed.iter().any(|s| s.id == info.id),
        "a destroyed sandbox is still listed"
    );
    p.destroy(&ctx(), &info.id)
        .await
        .expect("destroying a destroyed sandbox succeeds");
    assert_eq!(
        code(p.connect(&ctx(), &info.id).await),
        ErrorCode::SandboxNotFound
    );
    assert_eq!(
        code(p.connect(&ctx(), "no-such-sandbox").await),
        ErrorCode::SandboxNotFound
    );
    Outcome::Passed
}

async fn unsupported_ops_fail_fast(cx: Cx) -> Outcome {
    let caps = cx.caps();
    let sb = cx.sandbox();
    let id = sb.info().id;
    let mut lacking = Vec::new();
    if !caps.pause {
        expect_unsupported(
            "pause",
            cx.provider.pause(&ctx(), &id, crate::PauseKind::Memory),
        )
        .await;
        expect_unsupported("resume", cx.provider.resume(&ctx(), &id)).await;
        lacking.push("pause");
    }
    if !caps.pause_filesystem {
        expect_unsupported(
            "pause (file system only)",
            cx.provider.pause(&ctx(), &id, crate::PauseKind::Filesystem),
        )
        .await;
        lacking.push("pause_filesystem");
    }
    if !caps.renew {
        expect_unsupported(
            "renew",
            cx.provider.renew(&ctx(), &id, Duration::from_secs(60)),
        )
        .await;
        lacking.push("renew");
    }
    if !caps.watch {
        let r = timeout(
            Duration::from_secs(10),
            sb.fs().watch(&ctx(), &sb.info().workspace, false),
        )
        .await
        .expect("watch hung");
        assert_eq!(
            r.err().map(|e| e.code()),
            Some(ErrorCode::Unsupported),
            "watch must fail with UNSUPPORTED"
        );
        lacking.push("watch");
    }
    if !caps.pty {
        let mut spec = ProcessSpec::shell("tty");
        spec.pty = Some(PtySize { rows: 24, cols: 80 });
        expect_unsupported("a pty spawn", async {
            sb.process()
                .spawn(&ctx(), spec)
                .await
                .map(|h| h.command_id().to_owned())
        })
        .await;
        lacking.push("pty");
    }
    if !caps.reattach {
        let c = ctx();
        let r = sb
            .process()
            .attach(&c, ProcessSelector::CommandId("x".into()));
        expect_unsupported("attach", async {
            r.await.map(|h| h.command_id().to_owned())
        })
        .await;
        lacking.push("reattach");
    }
    if lacking.is_empty() {
        return Outcome::Skipped("the provider has every optional capability".into());
    }
    Outcome::Passed
}

async fn fs_write_read_stat(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let path = cx.path("a.txt");
    let w = write(sb, &path, b"hello world", WriteGuard::None)
        .await
        .expect("write");
    assert_eq!(w.path, path);
    assert_eq!(w.size, 11);
    assert!(w.created);
    let st = sb.fs().stat(&ctx(), &path).await.expect("stat");
    assert_eq!(st.kind, FileKind::File);
    assert_eq!(st.size, 11);
    assert_eq!(st.name, "a.txt");
    assert_eq!(st.path, path);
    assert_eq!(
        st.version, w.version,
        "stat and write must agree on the version"
    );
    assert_eq!(
        read(sb, &path, ByteRange::default()).await.unwrap(),
        b"hello world"
    );
    assert_eq!(
        read(
            sb,
            &path,
            ByteRange {
                offset: 6,
                length: Some(3)
            }
        )
        .await
        .unwrap(),
        b"wor"
    );
    assert_eq!(
        read(
            sb,
            &path,
            ByteRange {
                offset: 6,
                length: None
            }
        )
        .await
        .unwrap(),
        b"world"
    );
    assert_eq!(
        read(
            sb,
            &path,
            ByteRange {
                offset: 100,
                length: None
            }
        )
        .await
        .unwrap(),
        b""
    );
    let w2 = write(sb, &path, b"HELLO", WriteGuard::None)
        .await
        .expect("overwrite");
    assert!(!w2.created);
    assert_ne!(w2.version, w.version, "a new content needs a new version");
    assert_eq!(
        read(sb, &path, ByteRange::default()).await.unwrap(),
        b"HELLO"
    );
    let ws = sb
        .fs()
        .stat(&ctx(), &sb.info().workspace)
        .await
        .expect("stat of the workspace");
    assert_eq!(ws.kind, FileKind::Dir);
    Outcome::Passed
}

async fn fs_streaming_write_is_byte_exact(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let path = cx.path("big/blob.bin");
    // 5 MiB of deterministic noise, streamed in uneven chunks.
    let mut x: u32 = 0x1234_5678;
    let data: Vec<u8> = (0..5 * 1024 * 1024 + 13)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    let stream = chunks_of(&data, &[1, 100_003, 65_536, 1_048_577]);
    let w = sb
        .fs()
        .write(&ctx(), &path, stream, WriteGuard::CreateIfAbsent)
        .await
        .expect("write");
    assert_eq!(w.size, data.len() as u64);
    let mut stream = sb
        .fs()
        .read(&ctx(), &path, ByteRange::default())
        .await
        .expect("read");
    let mut back = Vec::new();
    let mut chunks = 0;
    while let Some(c) = stream.next().await {
        back.extend_from_slice(&c.unwrap());
        chunks += 1;
    }
    assert!(
        back == data,
        "read-back differs from what was written ({} vs {} bytes)",
        back.len(),
        data.len()
    );
    assert!(chunks > 1, "a 5 MiB read must stream in several chunks");
    let mid = read(
        sb,
        &path,
        ByteRange {
            offset: 3_000_001,
            length: Some(70_000),
        },
    )
    .await
    .unwrap();
    assert!(mid == data[3_000_001..3_070_001], "range read differs");
    // A range over several read requests of any provider (64 KiB to 255 KiB each).
    let wide = read(
        sb,
        &path,
        ByteRange {
            offset: 1_000_003,
            length: Some(700_001),
        },
    )
    .await
    .unwrap();
    assert!(
        wide == data[1_000_003..1_700_004],
        "a wide range read differs"
    );
    Outcome::Passed
}

async fn fs_write_guards(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let path = cx.path("guarded.txt");
    let v1 = write(sb, &path, b"one", WriteGuard::CreateIfAbsent)
        .await
        .expect("create_if_absent on a new path");
    assert!(v1.created);
    assert_eq!(
        code(write(sb, &path, b"two", WriteGuard::CreateIfAbsent).await),
        ErrorCode::FsAlreadyExists
    );
    assert_eq!(
        read(sb, &path, ByteRange::default()).await.unwrap(),
        b"one",
        "a refused write must change nothing"
    );
    let stale = tether_protocol::fs::Version(format!("{}-stale", v1.version));
    assert_eq!(
        code(
            write(
                sb,
                &path,
                b"three",
                WriteGuard::ReplaceIfVersion { version: stale }
            )
            .await
        ),
        ErrorCode::FsVersionMismatch
    );
    assert_eq!(read(sb, &path, ByteRange::default()).await.unwrap(), b"one");
    // Same size, immediately after: the version must still change.
    let v2 = write(
        sb,
        &path,
        b"two",
        WriteGuard::ReplaceIfVersion {
            version: v1.version.clone(),
        },
    )
    .await
    .expect("matching version");
    assert_ne!(v2.version, v1.version);
    assert_eq!(
        code(
            write(
                sb,
                &path,
                b"old",
                WriteGuard::ReplaceIfVersion {
                    version: v1.version.clone()
                }
            )
            .await
        ),
        ErrorCode::FsVersionMismatch,
        "an old version must no longer match"
    );
    let v3 = write(
        sb,
        &path,
        b"six",
        WriteGuard::ReplaceIfVersion {
            version: v2.version.clone(),
        },
    )
    .await
    .expect("chained replace");
    assert_ne!(v3.version, v1.version);
    assert_ne!(v3.version, v2.version);
    assert_eq!(read(sb, &path, ByteRange::default()).await.unwrap(), b"six");
    assert_eq!(
        code(
            write(
                sb,
                &cx.path("absent.txt"),
                b"x",
                WriteGuard::ReplaceIfVersion {
                    version: v3.version
                }
            )
            .await
        ),
        ErrorCode::FsVersionMismatch,
        "replace_if_version of a missing file"
    );
    Outcome::Passed
}

async fn fs_dirs_and_listing(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let fs = sb.fs();
    let d = fs
        .mkdir(&ctx(), &cx.path("d1/d2/d3"), true)
        .await
        .expect("mkdir -p");
    assert_eq!(d.kind, FileKind::Dir);
    assert_eq!(
        code(fs.mkdir(&ctx(), &cx.path("d1/d2"), false).await),
        ErrorCode::FsAlreadyExists
    );
    assert_eq!(
        code(fs.mkdir(&ctx(), &cx.path("nope/child"), false).await),
        ErrorCode::FsNotFound
    );
    for f in ["d1/a.txt", "d1/d2/b.txt", "d1/d2/d3/c.txt"] {
        write(sb, &cx.path(f), f.as_bytes(), WriteGuard::None)
            .await
            .unwrap();
    }
    let names = |entries: &[tether_protocol::fs::DirEntry]| -> Vec<(String, u32)> {
        entries
            .iter()
            .map(|e| (e.stat.path.clone(), e.depth))
            .collect()
    };
    let one = fs
        .list(&ctx(), &cx.path("d1"), 1)
        .await
        .expect("list depth 1");
    assert_eq!(
        names(&one),
        vec![(cx.path("d1/a.txt"), 1), (cx.path("d1/d2"), 1)]
    );
    let two = fs
        .list(&ctx(), &cx.path("d1"), 2)
        .await
        .expect("list depth 2");
    assert_eq!(
        names(&two),
        vec![
            (cx.path("d1/a.txt"), 1),
            (cx.path("d1/d2"), 1),
            (cx.path("d1/d2/b.txt"), 2),
            (cx.path("d1/d2/d3"), 2)
        ]
    );
    let a = two.iter().find(|e| e.stat.name == "a.txt").unwrap();
    assert_eq!(a.stat.kind, FileKind::File);
    assert_eq!(a.stat.size, 8);
    assert_eq!(
        code(fs.list(&ctx(), &cx.path("d1/a.txt"), 1).await),
        ErrorCode::FsNotDirectory
    );
    assert_eq!(
        code(fs.list(&ctx(), &cx.path("missing"), 1).await),
        ErrorCode::FsNotFound
    );
    Outcome::Passed
}

async fn fs_rename_and_remove(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let fs = sb.fs();
    write(sb, &cx.path("r/a.txt"), b"A", WriteGuard::None)
        .await
        .unwrap();
    write(sb, &cx.path("r/b.txt"), b"B", WriteGuard::None)
        .await
        .unwrap();
    let st = fs
        .rename(&ctx(), &cx.path("r/a.txt"), &cx.path("r/c.txt"))
        .await
        .expect("rename");
    assert_eq!(st.path, cx.path("r/c.txt"));
    assert_eq!(
        code(fs.stat(&ctx(), &cx.path("r/a.txt")).await),
        ErrorCode::FsNotFound
    );
    fs.rename(&ctx(), &cx.path("r/c.txt"), &cx.path("r/b.txt"))
        .await
        .expect("rename over a file");
    assert_eq!(
        read(sb, &cx.path("r/b.txt"), ByteRange::default())
            .await
            .unwrap(),
        b"A"
    );
    fs.rename(&ctx(), &cx.path("r"), &cx.path("s"))
        .await
        .expect("rename a directory");
    assert_eq!(
        read(sb, &cx.path("s/b.txt"), ByteRange::default())
            .await
            .unwrap(),
        b"A"
    );
    assert_eq!(
        code(fs.rename(&ctx(), &cx.path("missing"), &cx.path("x")).await),
        ErrorCode::FsNotFound
    );
    assert_eq!(
        code(fs.remove(&ctx(), &cx.path("s"), false).await),
        ErrorCode::FsNotEmpty
    );
    fs.remove(&ctx(), &cx.path("s/b.txt"), false)
        .await
        .expect("remove a file");
    assert_eq!(
        code(fs.stat(&ctx(), &cx.path("s/b.txt")).await),
        ErrorCode::FsNotFound
    );
    write(sb, &cx.path("s/t/u/v.txt"), b"v", WriteGuard::None)
        .await
        .unwrap();
    fs.remove(&ctx(), &cx.path("s"), true)
        .await
        .expect("remove recursively");
    assert_eq!(
        code(fs.stat(&ctx(), &cx.path("s")).await),
        ErrorCode::FsNotFound
    );
    assert_eq!(
        code(fs.remove(&ctx(), &cx.path("s"), true).await),
        ErrorCode::FsNotFound
    );
    Outcome::Passed
}

async fn fs_error_codes(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let fs = sb.fs();
    assert_eq!(
        code(fs.stat(&ctx(), &cx.path("nothing.txt")).await),
        ErrorCode::FsNotFound
    );
    assert_eq!(
        code(read(sb, &cx.path("nothing.txt"), ByteRange::default()).await),
        ErrorCode::FsNotFound
    );
    fs.mkdir(&ctx(), &cx.path("adir"), false).await.unwrap();
    assert_eq!(
        code(read(sb, &cx.path("adir"), ByteRange::default()).await),
        ErrorCode::FsIsDirectory
    );
    assert_eq!(
        code(write(sb, &cx.path("adir"), b"x", WriteGuard::None).await),
        ErrorCode::FsIsDirectory
    );
    write(sb, &cx.path("afile"), b"x", WriteGuard::None)
        .await
        .unwrap();
    let under_file = code(write(sb, &cx.path("afile/child.txt"), b"x", WriteGuard::None).await);
    assert!(
        matches!(
            under_file,
            ErrorCode::FsNotDirectory | ErrorCode::FsAlreadyExists
        ),
        "writing below a file: {under_file}"
    );
    Outcome::Passed
}

async fn fs_relative_paths(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let w = write(sb, "rel/x.txt", b"relative", WriteGuard::None)
        .await
        .expect("relative write");
    assert_eq!(
        w.path,
        cx.path("rel/x.txt"),
        "relative paths resolve against the workspace"
    );
    assert_eq!(
        read(sb, &cx.path("rel/x.txt"), ByteRange::default())
            .await
            .unwrap(),
        b"relative"
    );
    assert_eq!(
        read(sb, "./rel/../rel/x.txt", ByteRange::default())
            .await
            .unwrap(),
        b"relative"
    );
    let st = sb.fs().stat(&ctx(), "rel").await.unwrap();
    assert_eq!(st.path, cx.path("rel"));
    Outcome::Passed
}

async fn fs_path_escapes_are_refused(cx: Cx) -> Outcome {
    if !cx.options.fs_confined_to_workspace {
        return Outcome::Skipped("the provider's file view is the whole machine".into());
    }
    let sb = cx.sandbox().as_ref();
    let refused =
        |c: ErrorCode| matches!(c, ErrorCode::FsPermissionDenied | ErrorCode::InvalidRequest);
    let ws = sb.info().workspace;
    // Symlinks made from inside, the way an untrusted command would.
    let made = sh(sb, "ln -s /etc/passwd abs_link && ln -s ../../../../../../etc/passwd rel_link && ln -s / root_link && ln -s .. up_link && echo ok").await;
    assert_eq!(
        made.out().trim(),
        "ok",
        "cannot create symlinks: {}",
        made.err()
    );
    for path in [
        "../x".to_owned(),
        "/etc/passwd".to_owned(),
        format!("{ws}/../../etc/passwd"),
        "abs_link".to_owned(),
        "rel_link".to_owned(),
        "root_link/etc/passwd".to_owned(),
        "up_link/x".to_owned(),
    ] {
        match read(sb, &path, ByteRange::default()).await {
            Ok(data) => panic!("read of {path} succeeded with {} bytes", data.len()),
            Err(e) => assert!(
                refused(e.code()),
                "read of {path}: {} is not a refusal",
                e.code()
            ),
        }
    }
    for path in [
        "../tether-escape".to_owned(),
        "/etc/tether-escape".to_owned(),
        format!("{ws}/../../tmp/tether-escape"),
        "abs_link".to_owned(),
        "rel_link".to_owned(),
        "root_link/tmp/tether-escape".to_owned(),
        "up_link/tether-escape".to_owned(),
    ] {
        let c = code(write(sb, &path, b"x", WriteGuard::None).await);
        assert!(refused(c), "write of {path}: {c}");
    }
    for path in ["/etc", "root_link", "../"] {
        let c = code(sb.fs().list(&ctx(), path, 1).await);
        assert!(refused(c), "list of {path}: {c}");
    }
    assert!(refused(code(
        sb.fs().mkdir(&ctx(), "/tether-escape-dir", true).await
    )));
    assert!(refused(code(
        sb.fs().remove(&ctx(), "/etc/hostname", false).await
    )));
    assert!(refused(code(
        sb.fs()
            .rename(&ctx(), &cx.path("abs_link"), "/tmp/tether-escape")
            .await
    )));
    // The links themselves are workspace entries: they can be inspected and removed.
    let st = sb
        .fs()
        .stat(&ctx(), "abs_link")
        .await
        .expect("stat of a link does not follow it");
    assert_eq!(st.kind, FileKind::Symlink);
    sb.fs()
        .remove(&ctx(), "abs_link", false)
        .await
        .expect("remove the link");
    Outcome::Passed
}

async fn fs_and_processes_share_the_workspace(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    write(
        sb,
        &cx.path("shared/from-fs.txt"),
        b"written by fs",
        WriteGuard::None,
    )
    .await
    .unwrap();
    let c = sh(
        sb,
        "cat shared/from-fs.txt && printf 'written by a process' > shared/from-proc.txt && pwd",
    )
    .await;
    assert_eq!(c.code(), Some(0), "stderr: {}", c.err());
    assert!(c.out().starts_with("written by fs"));
    assert!(
        c.out().trim_end().ends_with(&sb.info().workspace),
        "the default cwd is the workspace: {}",
        c.out()
    );
    assert_eq!(
        read(sb, &cx.path("shared/from-proc.txt"), ByteRange::default())
            .await
            .unwrap(),
        b"written by a process"
    );
    Outcome::Passed
}

async fn fs_watch(cx: Cx) -> Outcome {
    if !cx.caps().watch {
        return Outcome::Skipped(
            "no watch capability (checked in unsupported_ops_fail_fast)".into(),
        );
    }
    let sb = cx.sandbox().as_ref();
    sb.fs()
        .mkdir(&ctx(), &cx.path("watched"), false)
        .await
        .unwrap();
    let mut events = sb
        .fs()
        .watch(&ctx(), &cx.path("watched"), false)
        .await
        .expect("watch");
    write(sb, &cx.path("watched/new.txt"), b"1", WriteGuard::None)
        .await
        .unwrap();
    expect_event(
        &mut events,
        &[FsEventKind::Create, FsEventKind::Write],
        "new.txt",
    )
    .await;
    write(sb, &cx.path("watched/new.txt"), b"2", WriteGuard::None)
        .await
        .unwrap();
    expect_event(&mut events, &[FsEventKind::Write], "new.txt").await;
    sh(sb, "echo from-process > watched/proc.txt").await;
    expect_event(
        &mut events,
        &[FsEventKind::Create, FsEventKind::Write],
        "proc.txt",
    )
    .await;
    sb.fs()
        .remove(&ctx(), &cx.path("watched/new.txt"), false)
        .await
        .unwrap();
    expect_event(&mut events, &[FsEventKind::Remove], "new.txt").await;
    Outcome::Passed
}

async fn expect_event(
    events: &mut futures_util::stream::BoxStream<'static, Result<tether_protocol::fs::FsEvent>>,
    kinds: &[FsEventKind],
    name: &str,
) {
    loop {
        let ev = timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap_or_else(|_| panic!("no {kinds:?} event for {name}"))
            .expect("the watch ended")
            .expect("watch event");
        if ev.name == name && kinds.contains(&ev.kind) {
            return;
        }
    }
}

async fn process_exit_codes(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    assert_eq!(sh(sb, "true").await.code(), Some(0));
    assert_eq!(sh(sb, "exit 3").await.code(), Some(3));
    assert_eq!(
        run(sb, ProcessSpec::argv(["sh", "-c", "exit 7"]))
            .await
            .code(),
        Some(7)
    );
    let killed = sh(sb, "kill -KILL $$").await;
    assert_eq!(
        killed.status.and_then(|s| s.signal),
        Some(9),
        "{:?}",
        killed.status
    );
    assert!(!killed.status.unwrap().success());
    match sb
        .process()
        .spawn(&ctx(), ProcessSpec::argv(["/nonexistent/tether-program"]))
        .await
    {
        Err(e) => assert_eq!(e.code(), ErrorCode::SpawnFailed),
        Ok(h) => {
            let c = collect_from(h.as_ref(), StreamOffsets::default()).await;
            assert_eq!(
                c.code(),
                Some(127),
                "a missing program: {:?} {}",
                c.status,
                c.err()
            );
        }
    }
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("exit 4"))
        .await
        .unwrap();
    let st = h.wait(&ctx()).await.expect("wait");
    assert_eq!(st.code, Some(4));
    assert_eq!(h.try_status(), Some(st));
    Outcome::Passed
}

async fn process_stdout_stderr_offsets(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let c = sh(
        sb,
        "printf aaa >&2; printf out1; sleep 0.05; printf bbbb >&2; printf out22",
    )
    .await;
    assert_eq!(c.out(), "out1out22");
    assert_eq!(c.err(), "aaabbbb");
    assert_eq!(c.stdout_bytes, 9);
    assert_eq!(c.stderr_bytes, 7);
    assert_eq!(c.code(), Some(0));
    Outcome::Passed
}

async fn process_env_set_and_remove(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let mut spec = ProcessSpec::shell(
        "echo \"$TETHER_CONFORMANCE_SANDBOX|$TETHER_CONFORMANCE_CMD|${TETHER_CONFORMANCE_REMOVED-unset}|$HOME\"",
    );
    spec.env.insert(
        "TETHER_CONFORMANCE_CMD".into(),
        Some("command-level".into()),
    );
    spec.env.insert("TETHER_CONFORMANCE_REMOVED".into(), None);
    let c = run(sb, spec).await;
    assert_eq!(
        c.out().trim(),
        format!("sandbox-level|command-level|unset|{}", sb.info().workspace)
    );
    let plain = sh(sb, "echo ${TETHER_CONFORMANCE_REMOVED-unset}").await;
    assert_eq!(
        plain.out().trim(),
        "present",
        "sandbox-level variables reach every command"
    );
    Outcome::Passed
}

async fn process_cwd(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    sb.fs()
        .mkdir(&ctx(), &cx.path("sub/dir"), true)
        .await
        .unwrap();
    let mut spec = ProcessSpec::argv(["pwd"]);
    spec.cwd = Some("sub/dir".into());
    assert_eq!(run(sb, spec.clone()).await.out().trim(), cx.path("sub/dir"));
    spec.cwd = Some(cx.path("sub"));
    assert_eq!(run(sb, spec).await.out().trim(), cx.path("sub"));
    assert_eq!(
        run(sb, ProcessSpec::argv(["pwd"])).await.out().trim(),
        sb.info().workspace
    );
    Outcome::Passed
}

async fn process_stdin_pipe_and_data(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let mut spec = ProcessSpec::argv(["cat"]);
    spec.stdin = StdinMode::Pipe;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    h.write_stdin(&ctx(), Bytes::from_static(b"hello\n"))
        .await
        .expect("write_stdin");
    h.write_stdin(&ctx(), Bytes::from_static(b"world\n"))
        .await
        .expect("write_stdin");
    h.close_stdin(&ctx()).await.expect("close_stdin");
    let c = collect_from(h.as_ref(), StreamOffsets::default()).await;
    assert_eq!(c.out(), "hello\nworld\n");
    assert_eq!(c.code(), Some(0));
    let mut spec = ProcessSpec::argv(["wc", "-c"]);
    spec.stdin = StdinMode::Data {
        data: vec![b'z'; 12_345],
    };
    assert_eq!(run(sb, spec).await.out().trim(), "12345");
    let c = run(sb, ProcessSpec::argv(["cat"])).await;
    assert_eq!(
        (c.out().as_str(), c.code()),
        ("", Some(0)),
        "ignored stdin reads as empty"
    );
    Outcome::Passed
}

async fn process_capture_cap(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let mut spec =
        ProcessSpec::shell("head -c 300000 /dev/zero; head -c 5000 /dev/zero >&2; echo done >&2");
    spec.stdout_max_bytes = Some(1000);
    spec.stderr_max_bytes = Some(10);
    let c = run(sb, spec).await;
    assert_eq!(
        c.code(),
        Some(0),
        "the command must not block on a full pipe"
    );
    assert_eq!(c.stdout.len(), 1000, "delivered stdout == cap");
    assert_eq!(c.stderr.len(), 10, "delivered stderr == cap");
    assert_eq!(c.stdout_bytes, 300_000, "true stdout total");
    assert_eq!(c.stderr_bytes, 5005, "true stderr total");
    Outcome::Passed
}

async fn process_signal(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell(
                "trap 'echo got-usr1; exit 5' USR1; echo ready; while :; do sleep 0.05; done",
            ),
        )
        .await
        .unwrap();
    let mut events = h.events(StreamOffsets::default());
    read_until(&mut events, "ready").await;
    h.signal(&ctx(), crate::seam::Signal::Usr1)
        .await
        .expect("signal");
    let st = timeout(Duration::from_secs(10), h.wait(&ctx()))
        .await
        .expect("the signal was not delivered")
        .unwrap();
    assert_eq!(st.code, Some(5));
    let c = collect_from(h.as_ref(), StreamOffsets::default()).await;
    assert!(c.out().contains("got-usr1"), "{}", c.out());
    Outcome::Passed
}

async fn process_terminate_reaches_grandchild(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    // The grandchild ignores SIGTERM (and says so by writing its pid) and outlives its
    // parent's death by SIGTERM.
    let mut spec = ProcessSpec::shell(
        "sh -c 'trap \"\" TERM; echo $$ > grandchild.pid; exec sleep 1000' & echo started; wait",
    );
    spec.grace_ms = 300;
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let mut events = h.events(StreamOffsets::default());
    read_until(&mut events, "started").await;
    let pid = String::from_utf8(wait_for_file(sb, &cx.path("grandchild.pid")).await)
        .unwrap()
        .trim()
        .to_owned();
    assert!(
        alive_in_sandbox(sb, &pid).await,
        "the grandchild {pid} should be running before terminate"
    );
    let report = h.terminate(&ctx()).await.expect("terminate");
    assert!(report.term_sent, "{report:?}");
    assert!(
        report.killed,
        "a grandchild ignoring SIGTERM needs SIGKILL: {report:?}"
    );
    assert_eq!(report.survivors, 0, "{report:?}");
    assert!(
        !alive_in_sandbox(sb, &pid).await,
        "the grandchild {pid} survived terminate"
    );
    assert!(
        !alive_in_sandbox(sb, &h.pid().to_string()).await,
        "the leader survived terminate"
    );
    let st = timeout(Duration::from_secs(10), h.wait(&ctx()))
        .await
        .expect("wait after terminate")
        .unwrap();
    assert!(!st.success());
    let again = h.terminate(&ctx()).await.expect("terminate is idempotent");
    assert_eq!(again.survivors, 0);
    Outcome::Passed
}

async fn process_deadline_mid_stream(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("while :; do echo tick; sleep 0.05; done"),
        )
        .await
        .unwrap();
    let call = ctx().with_timeout(Duration::from_millis(300), Clock::Total);
    let started = tokio::time::Instant::now();
    let (out, fired) = consume(h.as_ref(), &call.cancel, None).await;
    assert!(fired, "the stream ended before the deadline");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the deadline fired late: {:?}",
        started.elapsed()
    );
    let err = call.check().expect_err("the deadline fired");
    assert_eq!(err.code(), ErrorCode::DeadlineExceeded);
    assert_eq!(err.clock(), Some(Clock::Total));
    assert!(
        String::from_utf8_lossy(&out).contains("tick"),
        "partial output is kept: {out:?}"
    );
    let report = h.terminate(&ctx()).await.expect("terminate");
    assert_eq!(report.survivors, 0);
    assert!(h.try_status().is_some(), "terminated command has a status");
    assert!(
        !alive_in_sandbox(sb, &h.pid().to_string()).await,
        "the group survived the deadline"
    );
    Outcome::Passed
}

async fn process_idle_watchdog(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("echo start; sleep 30; echo never"),
        )
        .await
        .unwrap();
    let call = ctx();
    let wd = IdleWatchdog::new(Some(&call.cancel), 400.0, Clock::OutputIdle).unwrap();
    let (out, fired) = consume(h.as_ref(), wd.token(), Some(&wd)).await;
    assert!(fired, "the watchdog did not fire");
    let err = ProviderError::from_reason(wd.token().reason().expect("a reason"));
    assert_eq!(err.code(), ErrorCode::IdleTimeout);
    assert_eq!(err.clock(), Some(Clock::OutputIdle));
    assert_eq!(
        String::from_utf8_lossy(&out),
        "start\n",
        "partial output is kept"
    );
    let report = h.terminate(&ctx()).await.expect("terminate");
    assert_eq!(report.survivors, 0);
    assert!(
        !alive_in_sandbox(sb, &h.pid().to_string()).await,
        "the group survived the watchdog"
    );
    Outcome::Passed
}

async fn process_cancel(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let h = sb
        .process()
        .spawn(
            &ctx(),
            ProcessSpec::shell("while :; do echo tick; sleep 0.05; done"),
        )
        .await
        .unwrap();
    let call = ctx();
    // The consumer cancels its own call once output flows (a client hanging up).
    let mut events = h.events(StreamOffsets::default());
    let mut out = read_until(&mut events, "tick").await;
    call.cancel.cancel(CancelReason::Caller("conformance"));
    tokio::select! {
        biased;
        _ = call.cancel.cancelled() => {}
        ev = events.next() => out.push_str(&format!("{ev:?}")),
    }
    assert_eq!(
        call.check().expect_err("cancelled").code(),
        ErrorCode::Cancelled
    );
    assert!(out.contains("tick"));
    let report = h.terminate(&ctx()).await.expect("terminate");
    assert_eq!(report.survivors, 0);
    assert!(
        !alive_in_sandbox(sb, &h.pid().to_string()).await,
        "the group survived the cancel"
    );
    // A cancelled context aborts a new start without starting anything.
    let dead = ctx();
    dead.cancel.cancel(CancelReason::Caller("conformance"));
    assert_eq!(
        code(
            sb.process()
                .spawn(&dead, ProcessSpec::shell("true"))
                .await
                .map(|h| h.pid())
        ),
        ErrorCode::Cancelled
    );
    Outcome::Passed
}

async fn process_events_resume_from_offset(cx: Cx) -> Outcome {
    let sb = cx.sandbox().as_ref();
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell("seq 1 30000; echo err-line >&2"))
        .await
        .unwrap();
    // Two readers at once, while it runs.
    let (a, b) = tokio::join!(
        collect_from(h.as_ref(), StreamOffsets::default()),
        collect_from(h.as_ref(), StreamOffsets::default())
    );
    assert_eq!(a.stdout, b.stdout);
    let full = a.stdout;
    assert!(full.len() > 100_000);
    let expected: String = (1..=30000).map(|i| format!("{i}\n")).collect();
    assert!(full == expected.as_bytes(), "seq output differs");
    for k in [
        1u64,
        4095,
        65_536,
        full.len() as u64 / 2,
        full.len() as u64 - 1,
        full.len() as u64,
    ] {
        let from = StreamOffsets {
            stdout: k,
            stderr: 0,
        };
        let c = collect_from(h.as_ref(), from).await;
        assert!(
            c.stdout == full[k as usize..],
            "resume from {k} is not the exact suffix"
        );
        if k < full.len() as u64 {
            assert_eq!(c.first_stdout_offset, Some(k));
        }
        assert_eq!(c.err(), "err-line\n");
        assert_eq!(c.stdout_bytes, full.len() as u64);
    }
    let c = collect_from(
        h.as_ref(),
        StreamOffsets {
            stdout: full.len() as u64,
            stderr: 4,
        },
    )
    .await;
    assert_eq!(c.err(), "line\n");
    Outcome::Passed
}

async fn process_attach_and_list(cx: Cx) -> Outcome {
    if !cx.caps().reattach {
        return Outcome::Skipped(
            "no reattach capability (checked in unsupported_ops_fail_fast)".into(),
        );
    }
    let sb = cx.sandbox().as_ref();
    let id = format!("conformance-{}", uuid::Uuid::new_v4().simple());
    let mut spec = ProcessSpec::shell("echo hello; sleep 0.3; echo bye");
    spec.command_id = Some(id.clone());
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    assert_eq!(h.command_id(), id);
    let listed = sb.process().list(&ctx()).await.unwrap();
    assert!(
        listed
            .iter()
            .any(|p| p.command_id == id && p.pid == h.pid()),
        "list misses the running command"
    );
    let by_id = sb
        .process()
        .attach(&ctx(), ProcessSelector::CommandId(id.clone()))
        .await
        .expect("attach by id");
    assert_eq!(by_id.pid(), h.pid());
    let by_pid = sb
        .process()
        .attach(&ctx(), ProcessSelector::Pid(h.pid()))
        .await
        .expect("attach by pid");
    assert_eq!(by_pid.command_id(), id);
    let c = collect_from(by_id.as_ref(), StreamOffsets::default()).await;
    assert_eq!(c.out(), "hello\nbye\n");
    let finished = sb
        .process()
        .attach(&ctx(), ProcessSelector::CommandId(id.clone()))
        .await
        .expect("attach after exit");
    assert_eq!(finished.try_status().and_then(|s| s.code), Some(0));
    let listed = sb.process().list(&ctx()).await.unwrap();
    let entry = listed
        .iter()
        .find(|p| p.command_id == id)
        .expect("finished command listed");
    assert_eq!(entry.exit.and_then(|s| s.code), Some(0));
    let missing = sb
        .process()
        .attach(&ctx(), ProcessSelector::CommandId("no-such-command".into()))
        .await;
    assert_eq!(
        missing.err().map(|e| e.code()),
        Some(ErrorCode::CommandNotFound)
    );
    Outcome::Passed
}

async fn process_pty(cx: Cx) -> Outcome {
    if !cx.caps().pty {
        return Outcome::Skipped("no pty capability (checked in unsupported_ops_fail_fast)".into());
    }
    let sb = cx.sandbox().as_ref();
    let mut spec = ProcessSpec::shell("tty; stty size; read line; stty size; echo \"got:$line\"");
    spec.pty = Some(PtySize { rows: 24, cols: 80 });
    let h = sb.process().spawn(&ctx(), spec).await.unwrap();
    let mut events = h.events(StreamOffsets::default());
    let first = read_until(&mut events, "24 80").await;
    assert!(first.contains("/dev/pts/"), "tty under a pty: {first:?}");
    h.resize(
        &ctx(),
        PtySize {
            rows: 50,
            cols: 132,
        },
    )
    .await
    .expect("resize");
    h.write_stdin(&ctx(), Bytes::from_static(b"go\n"))
        .await
        .expect("pty input");
    let c = collect_from(h.as_ref(), StreamOffsets::default()).await;
    let out = c.out();
    assert!(out.contains("50 132"), "stty size after resize: {out:?}");
    assert!(out.contains("got:go"), "{out:?}");
    assert_eq!(c.code(), Some(0));
    assert!(
        c.stderr.is_empty(),
        "a pty merges stderr into its one stream"
    );
    Outcome::Passed
}

/// The environment of the suite's sandboxes, for providers that want to check it.
pub fn suite_env() -> BTreeMap<String, String> {
    SANDBOX_ENV
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}
