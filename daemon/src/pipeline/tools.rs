//! The tools: their registry, their output type, and the five built-in ones.
//!
//! | tool | arguments | runs |
//! |---|---|---|
//! | `bash` | `{command, timeout_ms?, cwd?}` | alone (exclusive) |
//! | `read_file` | `{path, offset?, limit?}` | in parallel |
//! | `write_file` | `{path, content}` | alone |
//! | `edit_file` | `{path, old_string, new_string}` | alone |
//! | `list_dir` | `{path, depth?}` | in parallel |
//!
//! Arguments are JSON objects; unknown fields are refused (`INVALID_REQUEST`, checked
//! before the call is dispatched). Paths are sandbox paths; relative ones resolve against
//! the workspace. `read_file` is line-based: `offset` is the 1-based first line (default 1),
//! `limit` the number of lines (default: to the end); a partial read ends with a note
//! naming the lines shown. Every file operation is bounded by `limits.fs_op_timeout_ms`
//! (`DEADLINE_EXCEEDED`, clock `total`) and traced as an `fs.*` span.
//!
//! A tool is anything implementing [`Tool`]; the registry is open so that a deployment
//! (or a test) can add its own.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::Value;
use tether_protocol::ErrorCode;
use tether_protocol::events::{ToolError, ToolResult};
use tether_protocol::fs::{ByteRange, FileKind, WriteGuard};
use tether_protocol::process::{ProcessSpec, StreamKind};
use tether_provider::clock::clamp_timeout;
use tether_provider::{CallCtx, Clock, ProviderError, util};

use crate::config::LimitsConfig;
use crate::error::DaemonError;
use crate::exec::{self, CommandOutcome, ExecLimits, RunningCommand};
use crate::ops::{self, FsOp, Surface};
use crate::session_manager::Session;

/// The default budget of the file tools' timeout policy, ms.
pub const DEFAULT_FS_TOOL_TIMEOUT_MS: u64 = 120_000;
/// The deepest `list_dir` accepts.
pub const MAX_LIST_DEPTH: u32 = 16;

/// How a tool touches a path (for the path policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads it.
    Read,
    /// Writes it.
    Write,
}

/// A path a call touches, as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathAccess {
    /// The path (relative ones resolve against the workspace).
    pub path: String,
    /// How.
    pub access: Access,
}

/// What a tool returns (before the pipeline adds the call id and additional contexts).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// Whether the call failed.
    pub is_error: bool,
    /// Model-visible text.
    pub content: String,
    /// The structured error, when `is_error`.
    pub error: Option<ToolError>,
    /// Output the tool had produced when it was cut off (a cancelled command's output),
    /// kept by the timeout policy when it replaces the result.
    pub partial: Option<String>,
}

// === impl ToolOutput ===

impl ToolOutput {
    /// A successful output.
    pub fn ok(content: impl Into<String>) -> Self {
        Self {
            is_error: false,
            content: content.into(),
            error: None,
            partial: None,
        }
    }

    /// An error output: the text is `Error: <message>`.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            is_error: true,
            content: format!("Error: {message}"),
            error: Some(ToolError {
                code,
                message,
                clock: None,
                timeout_ms: None,
            }),
            partial: None,
        }
    }

    /// Mark which clock fired (and its limit).
    pub fn with_clock(mut self, clock: Clock, timeout_ms: Option<u64>) -> Self {
        if let Some(e) = &mut self.error {
            e.clock = Some(clock);
            e.timeout_ms = timeout_ms;
        }
        self
    }

    /// The output of a provider error, keeping the clock of a timeout.
    pub fn from_provider(e: &ProviderError) -> Self {
        let out = Self::error(e.code(), e.to_string());
        match (e.clock(), timeout_ms_of(e)) {
            (Some(clock), ms) => out.with_clock(clock, ms),
            (None, _) => out,
        }
    }

    /// The output of a daemon error (internal details stay in the daemon's log).
    pub fn from_daemon(e: &DaemonError) -> Self {
        if let DaemonError::Provider(p) = e {
            return Self::from_provider(p);
        }
        if e.code() == ErrorCode::Internal {
            tracing::error!(error = %e, "A tool failed with an internal error");
        }
        Self::error(e.code(), e.public_message())
    }

    /// The error code, if the output is an error.
    pub fn code(&self) -> Option<ErrorCode> {
        self.error.as_ref().map(|e| e.code)
    }

    /// `ok`, or the error code: the `outcome` of spans and metrics.
    pub fn outcome(&self) -> &'static str {
        match (&self.error, self.is_error) {
            (Some(e), _) => e.code.as_str(),
            (None, true) => ErrorCode::Internal.as_str(),
            (None, false) => "ok",
        }
    }

    /// The wire result of the call `call_id`.
    pub fn into_result(self, call_id: &str) -> ToolResult {
        ToolResult {
            call_id: call_id.to_owned(),
            is_error: self.is_error,
            content: self.content,
            error: self.error,
            additional_contexts: Vec::new(),
        }
    }
}

/// The one path a file tool touches, when its arguments parse.
fn one_path(path: Result<String, String>, access: Access) -> Vec<PathAccess> {
    path.map(|path| vec![PathAccess { path, access }])
        .unwrap_or_default()
}

fn timeout_ms_of(e: &ProviderError) -> Option<u64> {
    use tether_provider::clock::CancelReason;
    match e {
        ProviderError::Timeout { reason }
        | ProviderError::Cancelled {
            reason: CancelReason::Timeout(reason),
        } => Some(reason.timeout_ms),
        _ => None,
    }
}

/// A tool the model can call.
#[async_trait]
pub trait Tool: Send + Sync + std::fmt::Debug {
    /// The name the model calls it by.
    fn name(&self) -> &str;

    /// Whether this call must run alone (never beside another call of the batch). Asked
    /// right before the call would start, so the answer may depend on state. When unsure
    /// (arguments that do not parse), say `true`: exclusive is the safe side.
    fn exclusive(&self, args: &Value) -> bool;

    /// The tool's own budget for the timeout policy, ms (`[pipeline.tool_timeouts]`
    /// overrides it). `None`: no budget.
    fn timeout_ms(&self) -> Option<u64> {
        None
    }

    /// Check the arguments before dispatch; `Err` makes an `INVALID_REQUEST` result.
    fn check_args(&self, args: &Value) -> Result<(), String> {
        let _ = args;
        Ok(())
    }

    /// The paths the call touches, for the path policy.
    fn paths(&self, args: &Value) -> Vec<PathAccess> {
        let _ = args;
        Vec::new()
    }

    /// Run the call. Watch `ctx.cancel`; settle only once everything the call started has
    /// stopped.
    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput;
}

/// The tools of a pipeline, by name.
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

// === impl ToolRegistry ===

impl ToolRegistry {
    /// The five built-in tools.
    pub fn builtin(limits: &LimitsConfig) -> Self {
        let mut r = Self::default();
        let limits = Arc::new(limits.clone());
        r.register(Arc::new(Bash {
            limits: Arc::clone(&limits),
        }));
        r.register(Arc::new(ReadFile {
            limits: Arc::clone(&limits),
        }));
        r.register(Arc::new(WriteFile {
            limits: Arc::clone(&limits),
        }));
        r.register(Arc::new(EditFile {
            limits: Arc::clone(&limits),
        }));
        r.register(Arc::new(ListDir { limits }));
        r
    }

    /// Add (or replace) a tool.
    pub fn register(&mut self, tool: Arc<dyn Tool>) {
        self.tools.insert(tool.name().to_owned(), tool);
    }

    /// A tool by name.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.get(name).cloned()
    }

    /// The names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }
}

/// Parse a tool's arguments, refusing unknown fields.
fn parse<'a, A: Deserialize<'a>>(tool: &str, args: &'a Value) -> Result<A, String> {
    A::deserialize(args).map_err(|e| format!("invalid arguments for {tool}: {e}"))
}

fn invalid(message: String) -> ToolOutput {
    ToolOutput::error(ErrorCode::InvalidRequest, message)
}

// === file operations ===

/// Run one file operation of a tool through the operation layer ([`ops::fs`]): the
/// deadline `limits.fs_op_timeout_ms`, the span and the metric.
async fn fs_op<T, F, Fut>(
    session: &Session,
    ctx: &CallCtx,
    limits: &LimitsConfig,
    op: FsOp,
    path: &str,
    span: tracing::Span,
    f: F,
) -> Result<T, ProviderError>
where
    F: FnOnce(CallCtx) -> Fut,
    Fut: Future<Output = Result<T, ProviderError>>,
{
    ops::fs(
        session,
        ctx,
        op,
        path,
        Surface::Tool,
        Duration::from_millis(limits.fs_op_timeout_ms),
        span,
        ops::no_bytes,
        f,
    )
    .await
}

/// Read a whole text file: refuses directories, files over `read_file_max_bytes`
/// (`FS_TOO_LARGE`) and non-text (`FS_NOT_TEXT`). Returns the text and its version.
async fn read_text(
    ctx: &CallCtx,
    session: &Arc<Session>,
    limits: &LimitsConfig,
    path: &str,
) -> Result<(String, tether_protocol::fs::Version), ToolOutput> {
    let sandbox = session.sandbox().map_err(|e| ToolOutput::from_daemon(&e))?;
    let stat = fs_op(
        session,
        ctx,
        limits,
        FsOp::Stat,
        path,
        ops::fs_span(FsOp::Stat, session, path),
        |c| {
            let sandbox = Arc::clone(&sandbox);
            let path = path.to_owned();
            async move { sandbox.fs().stat(&c, &path).await }
        },
    )
    .await
    .map_err(|e| ToolOutput::from_provider(&e))?;
    match stat.kind {
        FileKind::File => {}
        FileKind::Dir => {
            return Err(ToolOutput::error(
                ErrorCode::FsIsDirectory,
                format!("{path} is a directory (use list_dir)"),
            ));
        }
        FileKind::Symlink | FileKind::Other => {
            return Err(ToolOutput::error(
                ErrorCode::FsNotRegularFile,
                format!("{path} is not a regular file"),
            ));
        }
    }
    let max = limits.read_file_max_bytes;
    if stat.size > max {
        return Err(ToolOutput::error(
            ErrorCode::FsTooLarge,
            format!(
                "{path} is {} bytes, more than the {max}-byte limit of read_file (use bash to read parts of it)",
                stat.size
            ),
        ));
    }
    let span = ops::fs_span(FsOp::Read, session, path);
    let bytes = fs_op(session, ctx, limits, FsOp::Read, path, span.clone(), |c| {
        let sandbox = Arc::clone(&sandbox);
        let path = path.to_owned();
        async move {
            let stream = sandbox.fs().read(&c, &path, ByteRange::default()).await?;
            util::collect(&c, &path, stream, max).await
        }
    })
    .await
    .map_err(|e| ToolOutput::from_provider(&e))?;
    span.record("bytes.out", bytes.len() as u64);
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) if !t.contains('\0') => t.to_owned(),
        _ => {
            return Err(ToolOutput::error(
                ErrorCode::FsNotText,
                format!("{path} is not a UTF-8 text file"),
            ));
        }
    };
    Ok((text, stat.version))
}

/// Write `content` to `path` under `guard`.
async fn write_text(
    ctx: &CallCtx,
    session: &Arc<Session>,
    limits: &LimitsConfig,
    path: &str,
    content: String,
    guard: WriteGuard,
) -> Result<tether_protocol::fs::WriteOutcome, ToolOutput> {
    let sandbox = session.sandbox().map_err(|e| ToolOutput::from_daemon(&e))?;
    let span = ops::fs_span(FsOp::Write, session, path);
    span.record("bytes.in", content.len() as u64);
    fs_op(session, ctx, limits, FsOp::Write, path, span, |c| {
        let path = path.to_owned();
        async move {
            sandbox
                .fs()
                .write(&c, &path, util::once_bytes(content), guard)
                .await
        }
    })
    .await
    .map_err(|e| ToolOutput::from_provider(&e))
}

// === bash ===

/// `bash {command, timeout_ms?, cwd?}`: run a shell command in the sandbox.
///
/// The command's total deadline is `clamp_timeout(timeout_ms, limits.command_timeout_ms,
/// limits.command_timeout_max_ms)` and its output-idle limit `limits.output_idle_ms`. The
/// text is the exit code, then the tails of stdout and stderr (`limits.tool_output_bytes`
/// each). A non-zero exit is not an error (the model reads the code); a clock expiry is
/// (`DEADLINE_EXCEEDED` or `IDLE_TIMEOUT`, with the clock and the partial output).
#[derive(Debug)]
pub struct Bash {
    limits: Arc<LimitsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BashArgs {
    command: String,
    #[serde(default)]
    timeout_ms: Option<f64>,
    #[serde(default)]
    cwd: Option<String>,
}

impl Bash {
    fn plan(&self, args: &Value) -> Result<(BashArgs, u64), String> {
        let a: BashArgs = parse("bash", args)?;
        if a.command.trim().is_empty() {
            return Err("invalid arguments for bash: command must not be empty".into());
        }
        let total = clamp_timeout(
            a.timeout_ms,
            self.limits.command_timeout_ms as f64,
            self.limits.command_timeout_max_ms as f64,
            "bash: timeout_ms",
        )
        .map_err(|e| format!("invalid arguments for bash: {e}"))?;
        Ok((a, total.ceil() as u64))
    }
}

#[async_trait]
impl Tool for Bash {
    fn name(&self) -> &str {
        "bash"
    }

    fn exclusive(&self, _args: &Value) -> bool {
        true
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        self.plan(args).map(|_| ())
    }

    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput {
        let (a, total_ms) = match self.plan(args) {
            Ok(p) => p,
            Err(e) => return invalid(e),
        };
        let mut spec = ProcessSpec::shell(a.command);
        spec.cwd = a.cwd;
        let limits = ExecLimits {
            total: Some(Duration::from_millis(total_ms)),
            output_idle: (self.limits.output_idle_ms > 0)
                .then(|| Duration::from_millis(self.limits.output_idle_ms)),
        };
        match exec::run(session, ctx, spec, limits).await {
            Ok((cmd, outcome)) => bash_output(&cmd, &outcome, self.limits.tool_output_bytes).await,
            Err(e) => ToolOutput::from_daemon(&e),
        }
    }
}

/// The text of a finished command and its classification.
async fn bash_output(cmd: &RunningCommand, outcome: &CommandOutcome, max: u64) -> ToolOutput {
    let mut text = match outcome.status {
        Some(s) => match (s.code, s.signal) {
            (Some(code), _) => format!("exit code: {code}\n"),
            (None, Some(sig)) => format!("terminated by signal {sig}\n"),
            (None, None) => "exit code: unknown\n".to_owned(),
        },
        None => "exit code: none (the command did not finish)\n".to_owned(),
    };
    let mut any = false;
    for (stream, label, total) in [
        (StreamKind::Stdout, "stdout", outcome.stdout_bytes),
        (StreamKind::Stderr, "stderr", outcome.stderr_bytes),
    ] {
        let (bytes, truncated) = match cmd.journal.tail(stream, max).await {
            Ok(t) => t,
            Err(e) => return ToolOutput::from_daemon(&DaemonError::from(e)),
        };
        if bytes.is_empty() && !truncated {
            continue;
        }
        any = true;
        text.push_str(&format!("--- {label} ---\n"));
        if truncated {
            text.push_str(&format!(
                "[{label} truncated: the last {} of {total} bytes are shown]\n",
                bytes.len()
            ));
        }
        text.push_str(&tail_text(&bytes, truncated));
        if !text.ends_with('\n') {
            text.push('\n');
        }
    }
    if !any {
        text.push_str("(no output)\n");
    }
    let failure = match (outcome.error_code(), outcome.clock, outcome.timeout_ms) {
        (None, _, _) => return ToolOutput::ok(text),
        (Some(ErrorCode::IdleTimeout), Some(clock), ms) => ToolOutput::error(
            ErrorCode::IdleTimeout,
            format!(
                "the command produced no output for {}ms (output idle limit); it was terminated",
                ms.unwrap_or(0)
            ),
        )
        .with_clock(clock, ms),
        (Some(code), Some(clock), ms) => ToolOutput::error(
            code,
            format!(
                "the command timed out after {}ms; it was terminated",
                ms.unwrap_or(0)
            ),
        )
        .with_clock(clock, ms),
        (Some(ErrorCode::LimitExceeded), None, _) if outcome.error.is_some() => {
            let why = outcome.error.as_ref().map_or("", |(_, m)| m.as_str());
            ToolOutput::error(ErrorCode::LimitExceeded, why.to_owned())
        }
        (Some(ErrorCode::LimitExceeded), None, _) => {
            let what = match outcome.limit {
                Some(tether_protocol::limits::LimitKind::Memory) => {
                    "it was killed out of memory (the sandbox's memory limit)"
                }
                Some(tether_protocol::limits::LimitKind::Pids) => {
                    "it could not start a process (the sandbox's process limit)"
                }
                Some(tether_protocol::limits::LimitKind::Disk) => {
                    "it ran out of disk space (the sandbox's disk limit)"
                }
                None => "it ran into a limit of the sandbox",
            };
            ToolOutput::error(
                ErrorCode::LimitExceeded,
                format!("the command failed: {what}"),
            )
        }
        (Some(ErrorCode::Cancelled), None, _) => ToolOutput::error(
            ErrorCode::Cancelled,
            "the command was cancelled; it was terminated",
        ),
        (Some(code), None, _) => {
            let why = outcome
                .error
                .as_ref()
                .map_or("the command failed", |(_, m)| m.as_str());
            ToolOutput::error(code, why.to_owned())
        }
    };
    ToolOutput {
        content: format!("{}\n\n{text}", failure.content),
        partial: Some(text),
        ..failure
    }
}

/// Bytes of a tail as text: a cut through a multi-byte character at the start is dropped.
fn tail_text(bytes: &[u8], truncated: bool) -> String {
    let start = if truncated {
        bytes
            .iter()
            .take(3)
            .take_while(|b| (**b & 0xC0) == 0x80)
            .count()
    } else {
        0
    };
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

// === read_file ===

/// `read_file {path, offset?, limit?}`: a text file's lines.
#[derive(Debug)]
pub struct ReadFile {
    limits: Arc<LimitsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    path: String,
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default)]
    limit: Option<u64>,
}

fn read_args(args: &Value) -> Result<ReadArgs, String> {
    let a: ReadArgs = parse("read_file", args)?;
    if a.path.is_empty() {
        return Err("invalid arguments for read_file: path must not be empty".into());
    }
    if a.offset == Some(0) || a.limit == Some(0) {
        return Err("invalid arguments for read_file: offset and limit start at 1".into());
    }
    Ok(a)
}

#[async_trait]
impl Tool for ReadFile {
    fn name(&self) -> &str {
        "read_file"
    }

    fn exclusive(&self, args: &Value) -> bool {
        read_args(args).is_err()
    }

    fn timeout_ms(&self) -> Option<u64> {
        Some(DEFAULT_FS_TOOL_TIMEOUT_MS)
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        read_args(args).map(|_| ())
    }

    fn paths(&self, args: &Value) -> Vec<PathAccess> {
        one_path(read_args(args).map(|a| a.path), Access::Read)
    }

    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput {
        let a = match read_args(args) {
            Ok(a) => a,
            Err(e) => return invalid(e),
        };
        let text = match read_text(ctx, session, &self.limits, &a.path).await {
            Ok((t, _)) => t,
            Err(out) => return out,
        };
        if a.offset.is_none() && a.limit.is_none() {
            return ToolOutput::ok(text);
        }
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let total = lines.len() as u64;
        let first = a.offset.unwrap_or(1);
        if first > total.max(1) {
            return invalid(format!(
                "offset {first} is past the end of {} ({total} lines)",
                a.path
            ));
        }
        let last = a
            .limit
            .map_or(total, |l| first.saturating_add(l - 1).min(total));
        let mut out: String = lines[(first - 1) as usize..last as usize].concat();
        if first > 1 || last < total {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&format!("[lines {first}-{last} of {total}]"));
        }
        ToolOutput::ok(out)
    }
}

// === write_file ===

/// `write_file {path, content}`: create or replace a file atomically.
#[derive(Debug)]
pub struct WriteFile {
    limits: Arc<LimitsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteArgs {
    path: String,
    content: String,
}

fn write_args(args: &Value) -> Result<WriteArgs, String> {
    let a: WriteArgs = parse("write_file", args)?;
    if a.path.is_empty() {
        return Err("invalid arguments for write_file: path must not be empty".into());
    }
    Ok(a)
}

#[async_trait]
impl Tool for WriteFile {
    fn name(&self) -> &str {
        "write_file"
    }

    fn exclusive(&self, _args: &Value) -> bool {
        true
    }

    fn timeout_ms(&self) -> Option<u64> {
        Some(DEFAULT_FS_TOOL_TIMEOUT_MS)
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        write_args(args).map(|_| ())
    }

    fn paths(&self, args: &Value) -> Vec<PathAccess> {
        one_path(write_args(args).map(|a| a.path), Access::Write)
    }

    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput {
        let a = match write_args(args) {
            Ok(a) => a,
            Err(e) => return invalid(e),
        };
        match write_text(
            ctx,
            session,
            &self.limits,
            &a.path,
            a.content,
            WriteGuard::None,
        )
        .await
        {
            Ok(w) => ToolOutput::ok(format!(
                "{} {} ({} bytes, version {})",
                if w.created { "created" } else { "replaced" },
                w.path,
                w.size,
                w.version
            )),
            Err(out) => out,
        }
    }
}

// === edit_file ===

/// `edit_file {path, old_string, new_string}`: replace the one occurrence of `old_string`.
///
/// The file is read, the replacement made, and the result written only if the file is
/// still the version that was read: `FS_EDIT_NOT_FOUND` (no occurrence),
/// `FS_AMBIGUOUS_EDIT` (more than one, overlapping ones included), `FS_VERSION_MISMATCH`
/// (the file changed meanwhile: read it again).
#[derive(Debug)]
pub struct EditFile {
    limits: Arc<LimitsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EditArgs {
    path: String,
    old_string: String,
    new_string: String,
}

fn edit_args(args: &Value) -> Result<EditArgs, String> {
    let a: EditArgs = parse("edit_file", args)?;
    if a.path.is_empty() {
        return Err("invalid arguments for edit_file: path must not be empty".into());
    }
    if a.old_string.is_empty() {
        return Err("invalid arguments for edit_file: old_string must not be empty".into());
    }
    if a.old_string == a.new_string {
        return Err(
            "invalid arguments for edit_file: old_string and new_string are identical".into(),
        );
    }
    Ok(a)
}

/// Where `needle` occurs in `hay`: `None` when it does not, `Some(Err(()))` when it occurs
/// more than once (overlaps count), `Some(Ok(index))` when exactly once.
fn unique_match(hay: &str, needle: &str) -> Option<Result<usize, ()>> {
    let first = hay.find(needle)?;
    let step = hay[first..].chars().next().map_or(1, char::len_utf8);
    match hay[first + step..].find(needle) {
        Some(_) => Some(Err(())),
        None => Some(Ok(first)),
    }
}

#[async_trait]
impl Tool for EditFile {
    fn name(&self) -> &str {
        "edit_file"
    }

    fn exclusive(&self, _args: &Value) -> bool {
        true
    }

    fn timeout_ms(&self) -> Option<u64> {
        Some(DEFAULT_FS_TOOL_TIMEOUT_MS)
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        edit_args(args).map(|_| ())
    }

    fn paths(&self, args: &Value) -> Vec<PathAccess> {
        one_path(edit_args(args).map(|a| a.path), Access::Write)
    }

    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput {
        let a = match edit_args(args) {
            Ok(a) => a,
            Err(e) => return invalid(e),
        };
        let (text, version) = match read_text(ctx, session, &self.limits, &a.path).await {
            Ok(t) => t,
            Err(out) => return out,
        };
        let at = match unique_match(&text, &a.old_string) {
            None => {
                return ToolOutput::error(
                    ErrorCode::FsEditNotFound,
                    format!("old_string does not occur in {}", a.path),
                );
            }
            Some(Err(())) => {
                return ToolOutput::error(
                    ErrorCode::FsAmbiguousEdit,
                    format!(
                        "old_string occurs more than once in {}; include more context to make it unique",
                        a.path
                    ),
                );
            }
            Some(Ok(at)) => at,
        };
        let mut edited =
            String::with_capacity(text.len() - a.old_string.len() + a.new_string.len());
        edited.push_str(&text[..at]);
        edited.push_str(&a.new_string);
        edited.push_str(&text[at + a.old_string.len()..]);
        let guard = WriteGuard::ReplaceIfVersion { version };
        match write_text(ctx, session, &self.limits, &a.path, edited, guard).await {
            Ok(w) => ToolOutput::ok(format!(
                "edited {} (1 replacement, {} bytes, version {})",
                w.path, w.size, w.version
            )),
            Err(out) => out,
        }
    }
}

// === list_dir ===

/// `list_dir {path, depth?}`: a directory's entries to `depth` levels (default 1, at most
/// 16), one per line, relative to the directory, directories with a trailing `/`, symlinks
/// as `name -> target`. The listing is cut at `limits.tool_output_bytes`, with a note.
#[derive(Debug)]
pub struct ListDir {
    limits: Arc<LimitsConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListArgs {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

fn list_args(args: &Value) -> Result<ListArgs, String> {
    let a: ListArgs = parse("list_dir", args)?;
    if a.path.is_empty() {
        return Err("invalid arguments for list_dir: path must not be empty".into());
    }
    if let Some(d) = a.depth
        && !(1..=MAX_LIST_DEPTH).contains(&d)
    {
        return Err(format!(
            "invalid arguments for list_dir: depth must be between 1 and {MAX_LIST_DEPTH}"
        ));
    }
    Ok(a)
}

#[async_trait]
impl Tool for ListDir {
    fn name(&self) -> &str {
        "list_dir"
    }

    fn exclusive(&self, args: &Value) -> bool {
        list_args(args).is_err()
    }

    fn timeout_ms(&self) -> Option<u64> {
        Some(DEFAULT_FS_TOOL_TIMEOUT_MS)
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        list_args(args).map(|_| ())
    }

    fn paths(&self, args: &Value) -> Vec<PathAccess> {
        one_path(list_args(args).map(|a| a.path), Access::Read)
    }

    async fn call(&self, ctx: &CallCtx, session: &Arc<Session>, args: &Value) -> ToolOutput {
        let a = match list_args(args) {
            Ok(a) => a,
            Err(e) => return invalid(e),
        };
        let sandbox = match session.sandbox() {
            Ok(s) => s,
            Err(e) => return ToolOutput::from_daemon(&e),
        };
        let depth = a.depth.unwrap_or(1);
        let span = ops::fs_span(FsOp::List, session, &a.path);
        let listed = fs_op(session, ctx, &self.limits, FsOp::List, &a.path, span, |c| {
            let path = a.path.clone();
            async move { sandbox.fs().list(&c, &path, depth).await }
        })
        .await;
        let entries = match listed {
            Ok(e) => e,
            Err(e) => return ToolOutput::from_provider(&e),
        };
        if entries.is_empty() {
            return ToolOutput::ok("(empty directory)");
        }
        // The listed directory is the parent of any depth-1 entry.
        let base = entries
            .iter()
            .find(|e| e.depth == 1)
            .and_then(|e| e.stat.path.rsplit_once('/'))
            .map(|(parent, _)| format!("{parent}/"))
            .unwrap_or_default();
        let max = self.limits.tool_output_bytes as usize;
        let mut out = String::new();
        for (i, e) in entries.iter().enumerate() {
            let rel = e.stat.path.strip_prefix(&base).unwrap_or(&e.stat.path);
            let line = match (e.stat.kind, &e.stat.symlink_target) {
                (FileKind::Dir, _) => format!("{rel}/\n"),
                (FileKind::Symlink, Some(t)) => format!("{rel} -> {t}\n"),
                _ => format!("{rel}\n"),
            };
            if out.len() + line.len() > max {
                out.push_str(&format!(
                    "[listing truncated: {} more entries]\n",
                    entries.len() - i
                ));
                break;
            }
            out.push_str(&line);
        }
        ToolOutput::ok(out)
    }
}

/// Direct access to the file helpers, for tests of the contracts the tools rely on.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// `write_text`, as `edit_file` uses it.
    pub(crate) async fn write(
        ctx: &CallCtx,
        session: &Arc<Session>,
        limits: &LimitsConfig,
        path: &str,
        content: &str,
        guard: WriteGuard,
    ) -> Result<tether_protocol::fs::WriteOutcome, ToolOutput> {
        write_text(ctx, session, limits, path, content.to_owned(), guard).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_match_counts_overlaps() {
        assert_eq!(unique_match("abc", "x"), None);
        assert_eq!(unique_match("abc", "b"), Some(Ok(1)));
        assert_eq!(unique_match("abab", "ab"), Some(Err(())));
        assert_eq!(unique_match("aaa", "aa"), Some(Err(())));
        assert_eq!(unique_match("é-é", "é-"), Some(Ok(0)));
    }

    #[test]
    fn tail_text_drops_a_cut_character() {
        let s = "é!".as_bytes();
        assert_eq!(tail_text(&s[1..], true), "!");
        assert_eq!(tail_text(s, false), "é!");
    }
}
