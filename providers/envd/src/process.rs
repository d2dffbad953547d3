//! Commands in a sandbox through its envd: started over envd's `process.Process/Start` stream,
//! resumable after a broken stream, signalled and terminated as a process group.
//!
//! Every command runs under a small bash wrapper ([`WRAPPER`]) that
//!
//! - puts it in a process group of its own whose id is envd's pid (`setsid`, unless envd
//!   already made it a group or session leader), so a signal reaches every descendant;
//! - copies its stdout and stderr, as they pass to envd, into files of a per-command
//!   directory inside the sandbox (`tee`), and marks each copy complete when it ends. The
//!   provider makes these directories ahead, off the commands' path, so that the wrapper
//!   need not start `mkdir`; a file in each names its command.
//!   envd's streams cannot replay output from an offset; these copies can, so after a
//!   broken stream the output is read back from exactly the offset that was reached,
//!   without loss or duplication, and the stream's tail that envd may drop when the
//!   process exits is recovered the same way;
//! - where configured (`signal_relay`), forks a signal relay ([`RELAY`]) in the command's
//!   own namespace (in a process group of its own, so group signals spare it), which
//!   makes and listens on a FIFO in that directory. envd can only send SIGTERM and
//!   SIGKILL to one pid, and a backend may confine each command in its own user
//!   namespace, where a `kill` from another command is refused; the relay delivers any
//!   signal to the whole group. It makes its FIFO off the command's path; a signal sent
//!   before that waits for it. Without a relay a control command signals the group;
//! - then `exec`s the command, so envd's pid and end event are the command's own (its
//!   exit code, or the signal that killed it).
//!
//! Output is delivered to readers with whole-stream byte offsets per stream, from memory
//! for the most recent `output_buffer_bytes` and from the in-sandbox copy before that.
//! Commands under a pty are not copied (a `tee` would take the terminal away from them):
//! they resume live after a broken stream.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    DataEvent, Empty, EndEvent, FileType, ListDirRequest, ListDirResponse, ListResponse,
    ProcessConfig, ProcessEventMsg, ProcessEventResponse, ProcessInfoMsg, ProcessInput,
    ProcessOutcome, ProcessSelector as Selector, PtyMsg, PtySizeMsg, SelectRequest,
    SendInputRequest, SendSignalRequest, SignalMsg, StartRequest, UpdateRequest,
};
use tether_protocol::process::{
    Command, ExitStatus, ProcessEvent, ProcessInfo, ProcessSpec, PtySize, StdinMode, StreamKind,
};
use tether_provider::clock::{CancelReason, CancelToken, IdleWatchdog, TimeoutReason};
use tether_provider::{
    CallCtx, EventStream, Process, ProcessHandle, ProcessSelector, ProviderError, Result, Signal,
    StreamOffsets, TerminateReport,
};
use tokio::sync::{Notify, watch};

use crate::client::{ConnectStream, StreamItem, within_connect};
use crate::error::{Op, malformed, unavailable};
use crate::fs::{READ_BACK_CHUNK, open_read, resolve};
use crate::sandbox::SandboxCore;
use tether_provider::Clock;

/// The wrapper every command runs under (`bash -c WRAPPER tether RELAY DIR MARK TEE
/// OUT_CAP ERR_CAP N [names to unset...] argv...`; `RELAY` empty: no relay). The copies
/// hold at most the capture caps, so a chatty long-running command cannot fill the
/// sandbox's disk; envd still gets everything.
///
/// `DIR` is the command's directory: one the provider made ahead (then the wrapper only
/// creates the file `MARK` in it, which names the command: see [`EnvdProcess::adopt`]),
/// or one named after the command that the wrapper makes.
///
/// It is on the path of every command, so it starts as few programs as it can: one `tee`
/// per stream, `mkdir` only when `DIR` was not made ahead, and everything else as bash
/// builtins. A cap that is a whole number of KiB is enforced by the copy's file size
/// limit (`ulimit -f`; `tee` ignores `SIGXFSZ`, drops the copy at the limit and goes on
/// feeding envd); any other cap is cut by `head -c`. The relay is a forked subshell in a process group of its own
/// (`set -m`), which makes its FIFO itself, off the command's path.
pub const WRAPPER: &str = r#"r=$1 d=$2 k=${3:-id} t=$4 co=$5 ce=$6 n=$7
shift 7
x=()
while [ "$n" -gt 0 ]; do x+=(-u "$1"); shift; n=$((n-1)); done
g=$$
tc() {
  if [ $(($1 % 1024)) = 0 ]; then
    set +o posix
    if ulimit -S -f $(($1 / 1024)) 2>/dev/null; then tee -p -- "$2" 2>/dev/null; return; fi
  fi
  { tee -p /dev/fd/4 | head -c "$1" >"$2"; } 4>&1
}
if [ -n "$d" ] && { : >"$d/$k" || { mkdir -p -- "$d" && : >"$d/$k"; }; } 2>/dev/null; then
  if [ -n "$r" ] && : 2>/dev/null >"$d/ctl.wait"; then
    set -m
    ( set -- "$g" "$d/ctl"; eval "$r" ) </dev/null >/dev/null 2>&1 &
    set +m
  fi
  if [ "$t" = 1 ]; then
    exec > >(trap '' HUP INT QUIT TERM USR1 USR2 PIPE XFSZ; tc "$co" "$d/out"; : >"$d/out.done") \
      2> >(exec >&2; trap '' HUP INT QUIT TERM USR1 USR2 PIPE XFSZ; tc "$ce" "$d/err"; : >"$d/err.done")
  fi
fi
unset -f tc
if [ ${#x[@]} -gt 0 ]; then set -- env "${x[@]}" -- "$@"; fi
p=
read -r _ _ _ _ p _ </proc/$$/stat 2>/dev/null
if [ "$p" = "$$" ] || ! command -v setsid >/dev/null 2>&1; then exec "$@"; fi
exec setsid -- "$@""#;

/// The signal relay (`RELAY GROUP FIFO`): makes its FIFO (opened before it takes its
/// name, so that nothing written to it is lost), reads `SIG <name>` lines from it and
/// signals the group; ends when the group is gone. `FIFO.wait` says that a relay is
/// coming, `FIFO.failed` that it could not.
pub const RELAY: &str = r#"g=$1 f=$2
trap '' HUP INT QUIT TERM USR1 USR2 PIPE TSTP TTIN TTOU
if ! { mkfifo -m 600 -- "$f.new" && exec 9<>"$f.new" && mv -f -- "$f.new" "$f"; } 2>/dev/null; then
  : >"$f.failed"
  exit 1
fi
while :; do
  if read -r -t 0.5 op s <&9; then
    if [ "$op" = SIG ]; then kill -s "$s" -- "-$g" 2>/dev/null || kill -s "$s" "$g" 2>/dev/null; fi
  elif ! kill -0 -- "-$g" 2>/dev/null && ! kill -0 "$g" 2>/dev/null; then
    break
  fi
done
rm -f -- "$f" "$f.wait""#;

/// Wait (up to about a second) for a relay that is still making its FIFO: `sh` function
/// `relay FIFO`, true when the FIFO is there.
pub(crate) const AWAIT_RELAY: &str = r#"relay() {
  i=0
  while [ ! -p "$1" ] && [ -e "$1.wait" ] && [ ! -e "$1.failed" ] && [ "$i" -lt 100 ]; do sleep 0.01; i=$((i+1)); done
  [ -p "$1" ]
}
"#;

/// Deliver one signal to a command's group (`sh -c SIGNAL tether FIFO PGID NAME`):
/// through its relay, else directly. Exit 0 when handed over. (`kill -NAME -PGID`: the
/// one spelling every `sh` accepts; dash has no `--` and no `-s` before a group.)
pub(crate) const SIGNAL_SCRIPT: &str = r#"if relay "$1"; then printf 'SIG %s\n' "$3" 1<>"$1" && exit 0; fi
kill -"$3" -"$2" 2>/dev/null && exit 0
kill -"$3" "$2" 2>/dev/null && exit 0
exit 3"#;

/// TERM, grace, KILL, verify, for a whole group (`sh -c LADDER tether FIFO PGID
/// GRACE_STEPS VERIFY_STEPS STEP_S`). Exit status: bit 0 TERM sent, bit 1 KILL sent,
/// bit 2 survivors (their count on stdout).
const LADDER_SCRIPT: &str = r#"f=$1 g=$2 gs=$3 vs=$4 st=$5
count() {
  n=0
  for p in /proc/[0-9]*/stat; do
    read -r l < "$p" 2>/dev/null || continue
    r=${l##*) }
    set -- $r
    if [ "$3" = "$g" ] && [ "$1" != Z ] && [ "$1" != X ]; then n=$((n+1)); fi
  done
}
send() {
  if relay "$f"; then printf 'SIG %s\n' "$1" 1<>"$f"; fi
  kill -"$1" -"$g" 2>/dev/null
  return 0
}
count
[ "$n" -eq 0 ] && exit 0
send TERM
send CONT
rc=1 i=0
while [ "$i" -lt "$gs" ]; do count; [ "$n" -eq 0 ] && break; sleep "$st"; i=$((i+1)); done
count
if [ "$n" -gt 0 ]; then
  send KILL
  rc=3 i=0
  while [ "$i" -lt "$vs" ]; do count; [ "$n" -eq 0 ] && break; sleep "$st"; i=$((i+1)); done
  count
fi
if [ "$n" -gt 0 ]; then echo "$n"; exit $((rc+4)); fi
exit $rc"#;

/// The shell of the wrapper and of shell command lines.
const BASH: &str = "/bin/bash";

/// How long `terminate` waits for the killed processes to disappear.
const KILL_VERIFY: Duration = Duration::from_secs(5);

/// Largest piece of stdin sent in one `SendInput`.
const STDIN_CHUNK: usize = 256 * 1024;

/// Largest piece of buffered output handed to a reader at once.
const READ_CHUNK: usize = 64 * 1024;

/// Output kept in memory per stream once a command (with output copies) has finished.
const FINISHED_WINDOW: u64 = 64 * 1024;

/// How often a re-attached command's output copies are polled between live events.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

const OUT: usize = 0;
const ERR: usize = 1;

/// The error of a `SendInput` that failed after `delivered` of `len` bytes went through.
///
/// Stdin is not idempotent: once the request may have reached envd (it was sent and no
/// answer came, or the connection broke after it was sent), or earlier pieces were taken,
/// sending the same bytes again could deliver them twice. Such a failure is
/// `OUTCOME_UNKNOWN`, never a retryable code. A request that never left (no connection)
/// or that envd refused with an answer, before any piece was taken, keeps its own code.
fn stdin_outcome(e: ProviderError, delivered: usize, len: usize) -> ProviderError {
    let maybe_sent = match &e {
        ProviderError::Timeout { .. } => e.retryable(),
        ProviderError::Unavailable {
            source: Some(source),
            ..
        } => source
            .downcast_ref::<crate::error::WireError>()
            .is_some_and(|w| matches!(w, crate::error::WireError::Http(h) if !h.is_connect())),
        _ => false,
    };
    if !(maybe_sent || (delivered > 0 && e.retryable())) {
        return e;
    }
    ProviderError::OutcomeUnknown {
        op: "write_stdin",
        message: format!(
            "{e}; {delivered} of {len} bytes were taken and the rest may have been: never send them again"
        ),
    }
}

/// The exit status of envd's end event (Go's `ProcessState`).
pub(crate) fn exit_status(e: &EndEvent) -> ExitStatus {
    match e.outcome() {
        ProcessOutcome::Exited(code) => ExitStatus {
            code: Some(code),
            signal: None,
        },
        ProcessOutcome::Signaled(sig) => ExitStatus {
            code: None,
            signal: Some(sig),
        },
        ProcessOutcome::Unknown => ExitStatus {
            code: None,
            signal: None,
        },
    }
}

fn signal_name(s: Signal) -> &'static str {
    match s {
        Signal::Term => "TERM",
        Signal::Kill => "KILL",
        Signal::Int => "INT",
        Signal::Hup => "HUP",
        Signal::Quit => "QUIT",
        Signal::Usr1 => "USR1",
        Signal::Usr2 => "USR2",
        Signal::Stop => "STOP",
        Signal::Cont => "CONT",
    }
}

/// A file-name-safe form of a command id.
fn dir_name(id: &str) -> String {
    let safe = !id.is_empty()
        && id.len() <= 96
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if safe {
        id.to_owned()
    } else {
        use sha2::Digest;
        hex::encode(&sha2::Sha256::digest(id.as_bytes())[..16])
    }
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty() && !k.contains('=') && !k.contains('\0')
}

/// The parts of a wrapped command's arguments.
struct Wrapped {
    dir: String,
    tee: bool,
    argv: Vec<String>,
}

/// Recognise a command started by this wrapper from envd's `ProcessConfig`.
fn unwrap_config(c: &ProcessConfig) -> Option<Wrapped> {
    let a = &c.args;
    if c.cmd != BASH || a.len() < 10 || a[0] != "-c" || a[1] != WRAPPER || a[2] != "tether" {
        return None;
    }
    let n: usize = a[9].parse().ok()?;
    let argv = a.get(10 + n..)?.to_vec();
    Some(Wrapped {
        dir: a[4].clone(),
        tee: a[6] == "1",
        argv,
    })
}

// === output windows ===

/// The most recent output of one stream, kept in memory.
#[derive(Debug, Default)]
pub(crate) struct Window {
    /// Offset of the first byte held.
    start: u64,
    chunks: VecDeque<Bytes>,
    len: u64,
    /// Bytes to keep at least (older chunks are dropped beyond it).
    limit: u64,
}

impl Window {
    /// An empty window keeping at least `limit` bytes.
    pub(crate) fn with_limit(limit: u64) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    /// Offset of the first byte held.
    #[cfg(test)]
    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    pub(crate) fn push(&mut self, b: Bytes) {
        self.len += b.len() as u64;
        self.chunks.push_back(b);
        self.trim();
    }

    /// Keep less from now on.
    pub(crate) fn shrink(&mut self, limit: u64) {
        self.limit = self.limit.min(limit);
        self.trim();
    }

    fn trim(&mut self) {
        while self.len > self.limit {
            let Some(front) = self.chunks.front() else {
                break;
            };
            let n = front.len() as u64;
            if self.len - n < self.limit {
                break;
            }
            self.chunks.pop_front();
            self.len -= n;
            self.start += n;
        }
    }

    /// Up to `max` bytes at `pos`, if still held.
    pub(crate) fn read(&self, pos: u64, max: usize) -> Option<Bytes> {
        if pos < self.start {
            return None;
        }
        let mut off = self.start;
        for c in &self.chunks {
            let end = off + c.len() as u64;
            if pos < end {
                let from = (pos - off) as usize;
                let to = c.len().min(from + max);
                return Some(c.slice(from..to));
            }
            off = end;
        }
        None
    }
}

/// What a command has produced so far and how it ended.
#[derive(Debug, Clone, Default)]
struct Progress {
    /// Bytes deliverable per stream (the capture cap applies).
    avail: [u64; 2],
    /// True totals per stream.
    total: [u64; 2],
    exited: Option<ExitStatus>,
    failed: Option<Failure>,
}

/// Why a command's output can no longer be followed (cloneable, for every reader).
#[derive(Debug, Clone)]
enum Failure {
    Timeout(TimeoutReason),
    Cancelled(CancelReason),
    SandboxGone(String),
    Unavailable(String),
    Other(String),
}

impl Failure {
    fn of(e: &ProviderError) -> Self {
        match e {
            ProviderError::Timeout { reason } => Self::Timeout(*reason),
            ProviderError::Cancelled { reason } => Self::Cancelled(reason.clone()),
            ProviderError::SandboxNotFound { id } => Self::SandboxGone(id.clone()),
            ProviderError::Unavailable { message, .. } => Self::Unavailable(message.clone()),
            other => Self::Other(other.to_string()),
        }
    }

    fn error(&self) -> ProviderError {
        match self {
            Self::Timeout(r) => ProviderError::Timeout { reason: *r },
            Self::Cancelled(r) => ProviderError::Cancelled { reason: r.clone() },
            Self::SandboxGone(id) => ProviderError::SandboxNotFound { id: id.clone() },
            Self::Unavailable(m) => unavailable(m.clone(), None, None),
            Self::Other(m) => ProviderError::Backend {
                message: m.clone(),
                source: None,
            },
        }
    }
}

/// An exit status when envd no longer knows how the command ended.
const UNKNOWN_STATUS: ExitStatus = ExitStatus {
    code: None,
    signal: None,
};

const STDIN_NONE: u8 = 0;
const STDIN_PIPE: u8 = 1;
const STDIN_PTY: u8 = 2;
const STDIN_CLOSED: u8 = 3;

// === impl CommandCore ===

/// One command of a sandbox with envd.
#[derive(Debug)]
pub struct EnvdCommand {
    id: String,
    pid: u32,
    sandbox: Arc<SandboxCore>,
    user: Option<String>,
    info: ProcessInfo,
    dir: Option<String>,
    tee: bool,
    caps: [u64; 2],
    grace: Duration,
    stdin: AtomicU8,
    progress: watch::Sender<Progress>,
    windows: RwLock<[Window; 2]>,
    terminating: tokio::sync::Mutex<Option<TerminateReport>>,
    /// Ends the command's background work (cancelled with the sandbox).
    stop: CancelToken,
    /// Order of completion, for forgetting the oldest finished commands.
    finished_seq: AtomicU64,
    /// This command, for readers that outlive a borrow of it.
    me: std::sync::Weak<EnvdCommand>,
}

static FINISH_SEQ: AtomicU64 = AtomicU64::new(1);

struct NewCommand {
    id: String,
    pid: u32,
    user: Option<String>,
    info: ProcessInfo,
    dir: Option<String>,
    tee: bool,
    caps: [u64; 2],
    grace: Duration,
    stdin: u8,
}

impl EnvdCommand {
    fn new(sandbox: Arc<SandboxCore>, n: NewCommand) -> Arc<Self> {
        let buffer = sandbox.cfg.output_buffer_bytes;
        // Without a copy in the sandbox, everything deliverable stays in memory.
        let limits = if n.tee { [buffer, buffer] } else { n.caps };
        let windows = [
            Window::with_limit(limits[OUT]),
            Window::with_limit(limits[ERR]),
        ];
        let stop = sandbox.closed.child();
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            id: n.id,
            pid: n.pid,
            user: n.user,
            info: n.info,
            dir: n.dir,
            tee: n.tee,
            caps: n.caps,
            grace: n.grace,
            stdin: AtomicU8::new(n.stdin),
            progress: watch::channel(Progress::default()).0,
            windows: RwLock::new(windows),
            terminating: tokio::sync::Mutex::new(None),
            stop,
            finished_seq: AtomicU64::new(0),
            sandbox,
        })
    }

    fn out_kind(&self) -> StreamKind {
        if self.info.pty {
            StreamKind::Pty
        } else {
            StreamKind::Stdout
        }
    }

    fn user(&self) -> Option<&str> {
        self.user.as_deref().or(self.sandbox.user())
    }

    fn fifo(&self) -> String {
        self.dir
            .as_ref()
            .map(|d| format!("{d}/ctl"))
            .unwrap_or_default()
    }

    /// A context for the command's own background calls: cancelled with the sandbox.
    fn bg_ctx(&self) -> CallCtx {
        CallCtx::with_cancel(format!("command-{}", self.id), self.stop.clone())
    }

    /// A bounded context for one background call.
    fn call_ctx(&self) -> CallCtx {
        self.bg_ctx()
            .with_timeout(self.sandbox.cfg.request_timeout(), Clock::Total)
    }

    fn selector(&self) -> Selector {
        if self.id.starts_with("pid-") {
            Selector::Pid(self.pid)
        } else {
            Selector::Tag(self.id.clone())
        }
    }

    fn op(&self, op: &'static str) -> Op<'_> {
        Op::Process { op, id: &self.id }
    }

    /// Output arrived on stream `s` at the current end of that stream.
    fn append(&self, s: usize, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let off = self.progress.borrow().total[s];
        let cap = self.caps[s];
        let keep = if off < cap {
            (cap - off).min(data.len() as u64) as usize
        } else {
            0
        };
        if keep > 0 {
            let mut w = self.windows.write().unwrap_or_else(|e| e.into_inner());
            w[s].push(data.slice(..keep));
        }
        self.progress.send_modify(|p| {
            p.total[s] += data.len() as u64;
            p.avail[s] += keep as u64;
        });
    }

    /// The stream is known to have reached `size` bytes (beyond the cap: counted only).
    fn count_to(&self, s: usize, size: u64) {
        self.progress.send_if_modified(|p| {
            if size > p.total[s] {
                p.total[s] = size;
                true
            } else {
                false
            }
        });
    }

    fn finish(&self, status: ExitStatus) {
        self.finished_seq.store(
            FINISH_SEQ.fetch_add(1, Ordering::Relaxed),
            Ordering::Release,
        );
        if self.tee && self.dir.is_some() {
            // A finished command is read back from its copy: keep only a little in memory.
            let mut w = self.windows.write().unwrap_or_else(|e| e.into_inner());
            for win in w.iter_mut() {
                win.shrink(FINISHED_WINDOW);
            }
        }
        self.progress.send_modify(|p| {
            if p.exited.is_none() && p.failed.is_none() {
                p.exited = Some(status);
            }
        });
    }

    fn fail(&self, e: &ProviderError) {
        tracing::warn!(command.id = %self.id, error = %e, "Lost the output stream of a command");
        self.progress.send_modify(|p| {
            if p.exited.is_none() && p.failed.is_none() {
                p.failed = Some(Failure::of(e));
            }
        });
    }

    // --- the pump ---

    /// Follow the command to its end: the live stream, then (if it broke) a re-attach,
    /// then the last of the output copies.
    async fn pump(self: Arc<Self>, stream: Option<ConnectStream>) {
        let status = match stream {
            Some(s) => match self.read_live(s).await {
                Ok(s) => Ok(Some(s)),
                Err(e) => {
                    tracing::info!(command.id = %self.id, error = %e, "A command's stream broke; re-attaching");
                    self.recover(e).await
                }
            },
            // Adopted: there never was a stream of ours.
            None => {
                self.recover(unavailable(
                    "no stream to the adopted command could be opened",
                    None,
                    None,
                ))
                .await
            }
        };
        match status {
            Ok(s) => {
                self.settle().await;
                self.finish(s.unwrap_or(UNKNOWN_STATUS));
            }
            Err(e) => self.fail(&e),
        }
    }

    /// Read the live stream to its end event; an error when it breaks first.
    async fn read_live(&self, mut stream: ConnectStream) -> Result<ExitStatus> {
        loop {
            match stream.next::<ProcessEventResponse>().await? {
                StreamItem::Message(m) => match m.event {
                    ProcessEventMsg::Data(d) => self.on_data(d),
                    ProcessEventMsg::End(e) => return Ok(exit_status(&e)),
                    ProcessEventMsg::Start(_) | ProcessEventMsg::Keepalive(_) => {}
                },
                StreamItem::End => {
                    return Err(unavailable(
                        "the process stream ended without an end event",
                        None,
                        None,
                    ));
                }
            }
        }
    }

    fn on_data(&self, d: DataEvent) {
        match d {
            DataEvent::Stdout(b) | DataEvent::Pty(b) => self.append(OUT, Bytes::from(b)),
            DataEvent::Stderr(b) => self.append(ERR, Bytes::from(b)),
        }
    }

    /// Re-attach after a broken stream: `Ok(Some(status))` once the command ended,
    /// `Ok(None)` when it ended and envd no longer knows how, the stream's own error when
    /// every attempt failed.
    async fn recover(&self, first: ProviderError) -> Result<Option<ExitStatus>> {
        let attempts = self.sandbox.cfg.reattach_attempts.max(1);
        let mut delay = Duration::from_millis(100);
        for attempt in 0..attempts {
            if self.stop.is_cancelled() {
                return Err(ProviderError::SandboxNotFound {
                    id: self.sandbox.id.clone(),
                });
            }
            if attempt > 0 {
                tokio::select! {
                    _ = self.stop.cancelled() => continue,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            let ctx = self.bg_ctx();
            let req = SelectRequest {
                process: Some(self.selector()),
            };
            let opened = self
                .sandbox
                .envd
                .server_stream(
                    &ctx,
                    &self.stop,
                    "process.Process/Connect",
                    &req,
                    self.user(),
                    self.op("connect"),
                )
                .await;
            let stream = match opened {
                Ok(s) => s,
                Err(e) if e.code() == ErrorCode::CommandNotFound => return Ok(None),
                Err(e) => {
                    tracing::debug!(command.id = %self.id, error = %e, attempt, "Re-attach failed");
                    continue;
                }
            };
            match self.follow(stream).await {
                Ok(end) => return Ok(end),
                Err(e) => {
                    tracing::debug!(command.id = %self.id, error = %e, attempt, "The re-attached stream broke")
                }
            }
        }
        Err(first)
    }

    /// Follow a `Connect` stream to the command's end. Its data cannot be placed (envd
    /// does not say at which offset it starts), so with output copies it only says when
    /// to read them; without copies (a pty) it is appended as it comes.
    async fn follow(&self, mut stream: ConnectStream) -> Result<Option<ExitStatus>> {
        let ctx = self.bg_ctx();
        let wake = Notify::new();
        let reader = async {
            loop {
                match stream.next::<ProcessEventResponse>().await {
                    Ok(StreamItem::Message(m)) => match m.event {
                        ProcessEventMsg::Data(d) => {
                            if self.tee {
                                wake.notify_one();
                            } else {
                                self.on_data(d);
                            }
                        }
                        ProcessEventMsg::End(e) => return Ok(Some(exit_status(&e))),
                        ProcessEventMsg::Start(_) | ProcessEventMsg::Keepalive(_) => {}
                    },
                    Ok(StreamItem::End) => {
                        return Err(unavailable(
                            "the re-attached stream ended without an end event",
                            None,
                            None,
                        ));
                    }
                    Err(e) if e.code() == ErrorCode::CommandNotFound => return Ok(None),
                    Err(e) => return Err(e),
                }
            }
        };
        let poller = async {
            if !self.tee {
                return std::future::pending::<()>().await;
            }
            loop {
                if let Err(e) = self.catch_up(&ctx).await {
                    tracing::debug!(command.id = %self.id, error = %e, "Could not read a command's output copy");
                }
                let _ = tokio::time::timeout(FOLLOW_POLL, wake.notified()).await;
            }
        };
        tokio::select! {
            r = reader => r,
            () = poller => Ok(None),
        }
    }

    /// Read what the output copies hold beyond what was delivered. `Ok(true)` once both
    /// copies are complete and fully read.
    async fn catch_up(&self, ctx: &CallCtx) -> Result<bool> {
        let Some(dir) = self.dir.as_deref().filter(|_| self.tee) else {
            return Ok(true);
        };
        let req = ListDirRequest {
            path: dir.to_owned(),
            depth: 1,
        };
        let cctx = ctx.with_timeout(self.sandbox.cfg.request_timeout(), Clock::Total);
        let listing: ListDirResponse = self
            .sandbox
            .envd
            .unary(
                &cctx,
                "filesystem.Filesystem/ListDir",
                &req,
                self.user(),
                Op::Fs {
                    op: "list",
                    path: dir,
                },
            )
            .await?;
        let mut sizes = [0u64; 2];
        let mut done = [false; 2];
        for e in &listing.entries {
            match e.name.as_str() {
                "out" => sizes[OUT] = u64::try_from(e.size).unwrap_or(0),
                "err" => sizes[ERR] = u64::try_from(e.size).unwrap_or(0),
                "out.done" => done[OUT] = true,
                "err.done" => done[ERR] = true,
                _ => {}
            }
        }
        for (s, name) in [(OUT, "out"), (ERR, "err")] {
            let total = self.progress.borrow().total[s];
            if sizes[s] <= total {
                continue;
            }
            let cap = self.caps[s];
            if total < cap {
                let path = format!("{dir}/{name}");
                let to = sizes[s].min(cap);
                let mut body = open_read(
                    &self.sandbox,
                    self.sandbox.user(),
                    &cctx,
                    &self.stop,
                    &path,
                    total,
                    Some(to),
                )
                .await?;
                while let Some(chunk) = body.next().await {
                    self.append(s, chunk?);
                }
            }
            self.count_to(s, sizes[s]);
        }
        Ok(done[OUT] && done[ERR])
    }

    /// After the end: wait (bounded) for the output copies to be complete, and deliver
    /// what envd's stream did not carry.
    async fn settle(&self) {
        if !self.tee || self.dir.is_none() {
            return;
        }
        let ctx = self.bg_ctx();
        let until = tokio::time::Instant::now()
            + Duration::from_millis(self.sandbox.cfg.drain_after_exit_ms);
        // The copies are complete a moment after the end (their `tee`s see end of file
        // when the command's last descriptor closes): look again soon, then less often.
        let mut step = Duration::from_millis(1);
        loop {
            match self.catch_up(&ctx).await {
                Ok(true) => return,
                Ok(false) => {}
                // No copies at all: the wrapper could not make its directory.
                Err(e) if e.code() == ErrorCode::FsNotFound => return,
                Err(e) => {
                    tracing::debug!(command.id = %self.id, error = %e, "Could not read a command's output copy")
                }
            }
            if tokio::time::Instant::now() >= until || self.stop.is_cancelled() {
                return;
            }
            tokio::time::sleep(step).await;
            step = (step * 2).min(Duration::from_millis(50));
        }
    }

    /// Bytes of stream `s` at `pos` (below what is available): from memory, else read
    /// back from the sandbox's copy.
    async fn read_at(&self, s: usize, pos: u64, avail: u64) -> Result<Bytes> {
        let start = {
            let w = self.windows.read().unwrap_or_else(|e| e.into_inner());
            if let Some(b) = w[s].read(pos, READ_CHUNK) {
                return Ok(b);
            }
            w[s].start
        };
        let Some(dir) = self.dir.as_deref().filter(|_| self.tee) else {
            return Err(ProviderError::Internal {
                message: format!(
                    "output of command {} at offset {pos} is no longer held",
                    self.id
                ),
                source: None,
            });
        };
        let path = format!("{dir}/{}", if s == OUT { "out" } else { "err" });
        let end = start.min(avail).min(pos + READ_BACK_CHUNK);
        // The copy is written just after the bytes went to envd: allow it a moment. A range
        // read is idempotent, so a broken connection is retried too; bytes that arrived
        // before a break are valid at `pos` and are returned as they are.
        let mut last_err = None;
        for attempt in 0..20u32 {
            let ctx = self.call_ctx();
            let mut buf = Vec::new();
            let read = async {
                let mut body = open_read(
                    &self.sandbox,
                    self.sandbox.user(),
                    &ctx,
                    &ctx.cancel,
                    &path,
                    pos,
                    Some(end),
                )
                .await?;
                while let Some(chunk) = body.next().await {
                    buf.extend_from_slice(&chunk?);
                }
                Ok::<(), ProviderError>(())
            }
            .await;
            if !buf.is_empty() {
                return Ok(Bytes::from(buf));
            }
            match read {
                Ok(()) => {}
                Err(e) if e.retryable() && !self.stop.is_cancelled() => {
                    tracing::debug!(command.id = %self.id, error = %e, attempt, "Reading an output copy failed; retrying");
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
            tokio::time::sleep(Duration::from_millis(10 * u64::from(attempt + 1))).await;
        }
        Err(last_err.unwrap_or_else(|| {
            malformed(format!(
                "the output copy {path} is shorter than {end} bytes"
            ))
        }))
    }

    // --- control ---

    async fn send_signal(&self, ctx: &CallCtx, name: &str) -> Result<bool> {
        // No known group (a finished command found only by its copies): nothing to signal,
        // and `kill -0` would mean our own group.
        if self.pid <= 1 {
            return Ok(false);
        }
        let pid = self.pid.to_string();
        let fifo = self.fifo();
        let script = format!("{AWAIT_RELAY}{SIGNAL_SCRIPT}");
        let out = self
            .sandbox
            .control(ctx, self.user(), &script, &[&fifo, &pid, name])
            .await?;
        Ok(out.status.code == Some(0))
    }

    async fn ladder(&self, ctx: &CallCtx, grace: Duration) -> Result<TerminateReport> {
        if self.pid <= 1 {
            return Ok(TerminateReport::default());
        }
        let step = if grace <= Duration::from_secs(1) {
            Duration::from_millis(20)
        } else {
            Duration::from_millis(50)
        };
        let steps = |d: Duration| (d.as_millis().div_ceil(step.as_millis().max(1))).to_string();
        let (gs, vs) = (steps(grace), steps(KILL_VERIFY));
        let st = format!("{:.3}", step.as_secs_f64());
        let pid = self.pid.to_string();
        let fifo = self.fifo();
        let tctx = ctx.with_timeout(
            grace + KILL_VERIFY + self.sandbox.cfg.request_timeout(),
            Clock::Total,
        );
        let script = format!("{AWAIT_RELAY}{LADDER_SCRIPT}");
        let out = self
            .sandbox
            .control(&tctx, self.user(), &script, &[&fifo, &pid, &gs, &vs, &st])
            .await?;
        let rc = out.status.code.unwrap_or(4);
        let survivors = if rc & 4 != 0 {
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .unwrap_or(1)
        } else {
            0
        };
        Ok(TerminateReport {
            term_sent: rc & 1 != 0,
            killed: rc & 2 != 0,
            survivors,
        })
    }

    fn info_now(&self) -> ProcessInfo {
        ProcessInfo {
            exit: self.try_status(),
            ..self.info.clone()
        }
    }
}

#[async_trait]
impl ProcessHandle for EnvdCommand {
    fn command_id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn events(&self, from: StreamOffsets) -> EventStream {
        let Some(me) = self.me.upgrade() else {
            return futures_util::stream::empty().boxed();
        };
        let started = (from == StreamOffsets::default()).then(|| ProcessEvent::Started {
            command_id: self.id.clone(),
            pid: self.pid,
        });
        let idle_ms = self.sandbox.cfg.output_idle_ms;
        let watchdog = (idle_ms > 0)
            .then(|| IdleWatchdog::new(None, idle_ms as f64, Clock::OutputIdle).ok())
            .flatten();
        let reader = Reader {
            cmd: me,
            rx: self.progress.subscribe(),
            pos: [from.stdout, from.stderr],
            started,
            done: false,
            watchdog,
        };
        futures_util::stream::unfold(
            reader,
            |mut r| async move { r.next().await.map(|ev| (ev, r)) },
        )
        .boxed()
    }

    async fn write_stdin(&self, ctx: &CallCtx, data: Bytes) -> Result<()> {
        ctx.check()?;
        let pty = match self.stdin.load(Ordering::Acquire) {
            STDIN_PIPE => false,
            STDIN_PTY => true,
            _ => {
                return Err(ProviderError::InvalidRequest {
                    message: format!("command {} has no open stdin", self.id),
                });
            }
        };
        let mut delivered = 0;
        for chunk in data.chunks(STDIN_CHUNK) {
            let input = if pty {
                ProcessInput::Pty(chunk.to_vec())
            } else {
                ProcessInput::Stdin(chunk.to_vec())
            };
            let req = SendInputRequest {
                process: Some(Selector::Pid(self.pid)),
                input: Some(input),
            };
            let _: Empty = self
                .sandbox
                .envd
                .unary(
                    ctx,
                    "process.Process/SendInput",
                    &req,
                    self.user(),
                    self.op("write_stdin"),
                )
                .await
                .map_err(|e| stdin_outcome(e, delivered, data.len()))?;
            delivered += chunk.len();
        }
        Ok(())
    }

    async fn close_stdin(&self, ctx: &CallCtx) -> Result<()> {
        ctx.check()?;
        match self.stdin.load(Ordering::Acquire) {
            STDIN_PIPE => {
                if !self.sandbox.envd.version.close_stdin() {
                    return Err(ProviderError::Unsupported { op: "close_stdin" });
                }
                let req = SelectRequest {
                    process: Some(Selector::Pid(self.pid)),
                };
                let r: Result<Empty> = self
                    .sandbox
                    .envd
                    .unary(
                        ctx,
                        "process.Process/CloseStdin",
                        &req,
                        self.user(),
                        self.op("close_stdin"),
                    )
                    .await;
                match r {
                    Ok(_) | Err(ProviderError::CommandNotFound { .. }) => {
                        self.stdin.store(STDIN_CLOSED, Ordering::Release);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            // A pty has no half-close: the end-of-file character does it.
            STDIN_PTY => self.write_stdin(ctx, Bytes::from_static(&[0x04])).await,
            _ => Ok(()),
        }
    }

    #[tracing::instrument(name = "process.signal", skip_all, fields(provider.kind = self.sandbox.kind, sandbox.id = %self.sandbox.id, command.id = %self.id))]
    async fn signal(&self, ctx: &CallCtx, signal: Signal) -> Result<()> {
        ctx.check()?;
        let delivered = self.send_signal(ctx, signal_name(signal)).await?;
        if !delivered
            && self.pid > 1
            && matches!(signal, Signal::Term | Signal::Kill)
            && self.try_status().is_none()
        {
            // No relay and no permission: envd itself can still send these two.
            let sig = if signal == Signal::Kill {
                SignalMsg::Sigkill
            } else {
                SignalMsg::Sigterm
            };
            let req = SendSignalRequest {
                process: Some(Selector::Pid(self.pid)),
                signal: sig,
            };
            let _: Empty = self
                .sandbox
                .envd
                .unary(
                    ctx,
                    "process.Process/SendSignal",
                    &req,
                    self.user(),
                    self.op("signal"),
                )
                .await?;
        }
        Ok(())
    }

    async fn resize(&self, ctx: &CallCtx, size: PtySize) -> Result<()> {
        ctx.check()?;
        if !self.info.pty {
            return Err(ProviderError::InvalidRequest {
                message: format!("command {} has no pty", self.id),
            });
        }
        if size.rows == 0 || size.cols == 0 {
            return Err(ProviderError::InvalidRequest {
                message: "pty size must be positive".into(),
            });
        }
        let req = UpdateRequest {
            process: Some(Selector::Pid(self.pid)),
            pty: Some(PtyMsg {
                size: Some(PtySizeMsg {
                    cols: u32::from(size.cols),
                    rows: u32::from(size.rows),
                }),
            }),
        };
        let _: Empty = self
            .sandbox
            .envd
            .unary(
                ctx,
                "process.Process/Update",
                &req,
                self.user(),
                self.op("resize"),
            )
            .await?;
        Ok(())
    }

    /// Runs to completion whatever `ctx` says (it is the cleanup after a cancel), bounded
    /// by the grace period, the kill verification and the call limit.
    #[tracing::instrument(name = "process.terminate", skip_all, fields(provider.kind = self.sandbox.kind, sandbox.id = %self.sandbox.id, command.id = %self.id))]
    async fn terminate(&self, ctx: &CallCtx) -> Result<TerminateReport> {
        let mut done = self.terminating.lock().await;
        let tctx = CallCtx::new(ctx.request_id.clone()).with_trace(ctx.trace.clone());
        if let Some(r) = *done {
            let again = self.ladder(&tctx, Duration::ZERO).await?;
            if again.survivors == 0 {
                return Ok(TerminateReport { survivors: 0, ..r });
            }
        }
        let mut report = self.ladder(&tctx, self.grace).await?;
        if report.survivors > 0 && self.pid > 1 && self.try_status().is_none() {
            // The relay is gone and a direct kill is refused: envd's own SIGKILL is the
            // last resort (a backend that confines commands applies it to the group).
            let req = SendSignalRequest {
                process: Some(Selector::Pid(self.pid)),
                signal: SignalMsg::Sigkill,
            };
            let r: Result<Empty> = self
                .sandbox
                .envd
                .unary(
                    &tctx,
                    "process.Process/SendSignal",
                    &req,
                    self.user(),
                    self.op("terminate"),
                )
                .await;
            if r.is_ok() {
                report.killed = true;
                let again = self.ladder(&tctx, Duration::ZERO).await?;
                report.survivors = again.survivors;
            }
        }
        if report.survivors > 0 {
            tracing::warn!(command.id = %self.id, survivors = report.survivors, "Processes survived terminate");
        }
        // The end event follows the kill: wait for it (bounded) so the status is known.
        let mut rx = self.progress.subscribe();
        let _ = tokio::time::timeout(
            KILL_VERIFY,
            rx.wait_for(|p| p.exited.is_some() || p.failed.is_some()),
        )
        .await;
        *done = Some(report);
        Ok(report)
    }

    async fn wait(&self, ctx: &CallCtx) -> Result<ExitStatus> {
        let mut rx = self.progress.subscribe();
        tokio::select! {
            r = rx.wait_for(|p| p.exited.is_some() || p.failed.is_some()) => match r {
                Ok(p) => match (&p.exited, &p.failed) {
                    (Some(s), _) => Ok(*s),
                    (None, Some(f)) => Err(f.error()),
                    (None, None) => Err(ProviderError::Internal { message: "exit status vanished".into(), source: None }),
                },
                Err(_) => Err(ProviderError::CommandNotFound { id: self.id.clone() }),
            },
            _ = ctx.cancel.cancelled() => Err(ctx.check().err().unwrap_or(ProviderError::Cancelled { reason: CancelReason::Caller("wait") })),
        }
    }

    fn try_status(&self) -> Option<ExitStatus> {
        self.progress.borrow().exited
    }
}

// === impl Reader ===

/// One independent reader of a command's events.
struct Reader {
    cmd: Arc<EnvdCommand>,
    rx: watch::Receiver<Progress>,
    pos: [u64; 2],
    started: Option<ProcessEvent>,
    done: bool,
    watchdog: Option<IdleWatchdog>,
}

impl Reader {
    async fn next(&mut self) -> Option<Result<ProcessEvent>> {
        if self.done {
            return None;
        }
        if let Some(ev) = self.started.take() {
            return Some(Ok(ev));
        }
        let r = match self.watchdog.take() {
            None => self.step().await,
            Some(wd) => {
                let token = wd.token().clone();
                let r = wd
                    .next(async {
                        tokio::select! {
                            biased;
                            _ = token.cancelled() => None,
                            r = self.step() => Some(r),
                        }
                    })
                    .await;
                self.watchdog = Some(wd);
                match r {
                    Ok(Some(r)) => r,
                    Ok(None) => Err(ProviderError::from_reason(
                        token.reason().unwrap_or(CancelReason::Caller("events")),
                    )),
                    Err(e) => Err(ProviderError::Internal {
                        message: "output watchdog misuse".into(),
                        source: Some(Box::new(e)),
                    }),
                }
            }
        };
        match r {
            Ok(Some(ev)) => {
                if matches!(ev, ProcessEvent::Exited { .. }) {
                    self.done = true;
                }
                Some(Ok(ev))
            }
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }

    async fn step(&mut self) -> Result<Option<ProcessEvent>> {
        loop {
            let p = self.rx.borrow_and_update().clone();
            for s in [OUT, ERR] {
                if self.pos[s] < p.avail[s] {
                    let data = self.cmd.read_at(s, self.pos[s], p.avail[s]).await?;
                    let offset = self.pos[s];
                    self.pos[s] += data.len() as u64;
                    let stream = if s == OUT {
                        self.cmd.out_kind()
                    } else {
                        StreamKind::Stderr
                    };
                    return Ok(Some(ProcessEvent::Output {
                        stream,
                        offset,
                        data: data.to_vec(),
                    }));
                }
            }
            if let Some(status) = p.exited {
                return Ok(Some(ProcessEvent::Exited {
                    status,
                    stdout_bytes: p.total[OUT],
                    stderr_bytes: p.total[ERR],
                }));
            }
            if let Some(f) = &p.failed {
                return Err(f.error());
            }
            if self.rx.changed().await.is_err() {
                return Ok(None);
            }
        }
    }
}

// === impl EnvdProcess ===

/// The `Process` of a sandbox with envd.
#[derive(Debug)]
pub struct EnvdProcess {
    core: Arc<SandboxCore>,
    table: tokio::sync::Mutex<HashMap<String, Arc<EnvdCommand>>>,
    spares: Arc<tokio::sync::Mutex<Spares>>,
}

/// How many command directories are made ahead, for the sandbox's default user.
const SPARE_DIRS: usize = 2;

/// Command directories made ahead (`filesystem.Filesystem/MakeDir`, off the commands'
/// path), so that the wrapper need not start `mkdir` for each command: it is one
/// program start of the few on every command's path. Made for the sandbox's default
/// user, and used only by that user's commands (the copies are written as the
/// command's user).
#[derive(Debug, Default)]
struct Spares {
    ready: Vec<String>,
    making: bool,
    /// Making one failed: the backend cannot, so the wrapper makes each directory.
    off: bool,
}

/// The name of the file that names a command in its directory (the wrapper's `MARK`).
fn marker(id: &str) -> String {
    format!("id.{}", dir_name(id))
}

impl EnvdProcess {
    pub(crate) fn new(core: Arc<SandboxCore>) -> Self {
        Self {
            core,
            table: tokio::sync::Mutex::new(HashMap::new()),
            spares: Arc::default(),
        }
    }

    /// A directory made ahead for a command of `user`, if one is ready.
    async fn take_spare(&self, user: Option<&str>) -> Option<String> {
        if user != self.core.user() {
            return None;
        }
        self.spares.lock().await.ready.pop()
    }

    /// Make directories ahead up to [`SPARE_DIRS`], one at a time, in the background.
    async fn make_spares(&self) {
        {
            let mut s = self.spares.lock().await;
            if s.off || s.making || s.ready.len() >= SPARE_DIRS {
                return;
            }
            s.making = true;
        }
        let core = self.core.clone();
        let spares = self.spares.clone();
        self.core.tasks.spawn(async move {
            loop {
                let nonce = uuid::Uuid::new_v4().simple().to_string();
                // A leading dot: no command's directory is named so (see `dir_name`).
                let dir = format!("{}/.spare.{}", core.cfg.state_dir(), &nonce[..12]);
                let made = core
                    .background_fs_call("filesystem.Filesystem/MakeDir", "mkdir", &dir, core.user())
                    .await;
                let mut s = spares.lock().await;
                match made {
                    Ok(_) => s.ready.push(dir),
                    Err(e) => {
                        tracing::debug!(path = %dir, error = %e, "Could not make a command directory ahead");
                        s.off = true;
                    }
                }
                if s.off || s.ready.len() >= SPARE_DIRS {
                    s.making = false;
                    return;
                }
            }
        });
    }

    /// Remember a command; forget the oldest finished ones beyond the limit (and remove
    /// their output copies).
    async fn remember(&self, cmd: Arc<EnvdCommand>) {
        let mut t = self.table.lock().await;
        t.insert(cmd.id.clone(), cmd);
        let keep = self.core.cfg.finished_commands_kept;
        let mut finished: Vec<(u64, String)> = t
            .values()
            .filter(|c| c.try_status().is_some())
            .map(|c| (c.finished_seq.load(Ordering::Acquire), c.id.clone()))
            .collect();
        if finished.len() <= keep {
            return;
        }
        finished.sort();
        let excess = finished.len() - keep;
        for (_, id) in finished.into_iter().take(excess) {
            if let Some(old) = t.remove(&id) {
                self.forget_copies(&old);
            }
        }
    }

    fn forget_copies(&self, cmd: &EnvdCommand) {
        let Some(dir) = cmd.dir.clone() else { return };
        let core = self.core.clone();
        let user = cmd.user.clone();
        self.core.tasks.spawn(async move {
            let r = core
                .background_fs_call("filesystem.Filesystem/Remove", "remove", &dir, user.as_deref().or(core.user()))
                .await;
            if let Err(e) = r {
                tracing::debug!(path = %dir, error = %e, "Could not remove a command's output copies");
            }
        });
    }

    fn new_command(&self, n: NewCommand) -> Arc<EnvdCommand> {
        EnvdCommand::new(self.core.clone(), n)
    }

    /// After a start whose answer was lost: the command may be running. Look it up by
    /// its tag rather than starting it again.
    async fn after_broken_start(
        &self,
        ctx: &CallCtx,
        id: &str,
        e: ProviderError,
        n: NewCommand,
    ) -> Result<Arc<dyn ProcessHandle>> {
        let maybe_started = matches!(
            e.code(),
            ErrorCode::ConnectTimeout
                | ErrorCode::TransportIdleTimeout
                | ErrorCode::DeadlineExceeded
                | ErrorCode::Cancelled
                | ErrorCode::ShuttingDown
                | ErrorCode::ProviderUnavailable
        );
        if !maybe_started {
            return Err(e);
        }
        let lctx = CallCtx::new(ctx.request_id.clone())
            .with_timeout(self.core.cfg.connect_timeout(), Clock::Connect);
        let found = self
            .lookup_running(&lctx, &ProcessSelector::CommandId(id.to_owned()))
            .await
            .ok()
            .flatten();
        let Some(p) = found else {
            // Not (yet) seen at the backend. A start that was refused or never connected
            // ran nothing; one whose answer timed out may still be on its way and run:
            // its outcome is unknown, and a retry must re-attach by the id, never re-run.
            return Err(match e.code() {
                ErrorCode::ConnectTimeout
                | ErrorCode::TransportIdleTimeout
                | ErrorCode::DeadlineExceeded => ProviderError::OutcomeUnknown {
                    op: "process.start",
                    message: format!(
                        "{e}; the command may be running: re-attach by its id {id}, never start it again"
                    ),
                },
                _ => e,
            });
        };
        if ctx.cancel.is_cancelled() {
            // The caller gave up on the start: the command must not run on unobserved.
            let req = SendSignalRequest {
                process: Some(Selector::Pid(p.pid)),
                signal: SignalMsg::Sigkill,
            };
            let _: Result<Empty> = self
                .core
                .envd
                .unary(
                    &lctx,
                    "process.Process/SendSignal",
                    &req,
                    n.user.as_deref(),
                    Op::Process { op: "start", id },
                )
                .await;
            return Err(e);
        }
        tracing::info!(command.id = %id, pid = p.pid, "A command's start answer was lost; adopting the running command");
        let cmd = self.new_command(NewCommand { pid: p.pid, ..n });
        self.remember(cmd.clone()).await;
        self.core.tasks.spawn(cmd.clone().pump(None));
        Ok(cmd)
    }

    async fn lookup_running(
        &self,
        ctx: &CallCtx,
        which: &ProcessSelector,
    ) -> Result<Option<ProcessInfoMsg>> {
        let list: ListResponse = self
            .core
            .envd
            .unary(
                ctx,
                "process.Process/List",
                &Empty {},
                self.core.user(),
                Op::Process { op: "list", id: "" },
            )
            .await?;
        Ok(list.processes.into_iter().find(|p| match which {
            ProcessSelector::CommandId(id) => p.tag.as_deref() == Some(id.as_str()),
            ProcessSelector::Pid(pid) => p.pid == *pid,
        }))
    }

    /// Find a command this handle did not start (after a restart, say) and follow it from
    /// offset 0.
    async fn adopt(
        &self,
        ctx: &CallCtx,
        which: &ProcessSelector,
    ) -> Result<Option<Arc<EnvdCommand>>> {
        let cfg = &self.core.cfg;
        if let Some(p) = self.lookup_running(ctx, which).await? {
            let wrapped = unwrap_config(&p.config);
            let id = p.tag.clone().unwrap_or_else(|| format!("pid-{}", p.pid));
            let (dir, tee, argv) = match wrapped {
                Some(w) => (Some(w.dir).filter(|d| !d.is_empty()), w.tee, w.argv),
                None => (
                    None,
                    false,
                    std::iter::once(p.config.cmd.clone())
                        .chain(p.config.args.clone())
                        .collect(),
                ),
            };
            let cmd = self.new_command(NewCommand {
                id: id.clone(),
                pid: p.pid,
                user: None,
                info: ProcessInfo {
                    command_id: id,
                    pid: p.pid,
                    command: Command::Argv(argv),
                    cwd: p.config.cwd.clone(),
                    pty: !tee && dir.is_some(),
                    exit: None,
                },
                dir,
                tee,
                caps: [cfg.max_output_bytes, cfg.max_output_bytes],
                grace: Duration::from_millis(
                    tether_protocol::process::DEFAULT_GRACE_MS.min(cfg.max_grace_ms),
                ),
                stdin: STDIN_NONE,
            });
            self.core.tasks.spawn(cmd.clone().pump(None));
            return Ok(Some(cmd));
        }
        // Not running: a finished command of ours, if its copies or its end remain.
        let ProcessSelector::CommandId(id) = which else {
            return Ok(None);
        };
        // Its directory: named after it (made by the wrapper), or made ahead and holding
        // the file that names it, one level down.
        let state = cfg.state_dir();
        let req = ListDirRequest {
            path: state.clone(),
            depth: 2,
        };
        let listing: Result<ListDirResponse> = self
            .core
            .envd
            .unary(
                ctx,
                "filesystem.Filesystem/ListDir",
                &req,
                self.core.user(),
                Op::Fs {
                    op: "list",
                    path: &state,
                },
            )
            .await;
        let prefix = format!("{}.", dir_name(id));
        let mark = marker(id);
        let dir = listing
            .ok()
            .and_then(|l| {
                l.entries
                    .into_iter()
                    .filter_map(|e| {
                        // The directories hold files only: a directory is one level
                        // down, a marker two.
                        let dir = if e.name == mark && e.kind == FileType::File {
                            e.path.rsplit_once('/')?.0.to_owned()
                        } else if e.name.starts_with(&prefix) && e.kind == FileType::Directory {
                            e.path.clone()
                        } else {
                            return None;
                        };
                        Some((e.modified_time, dir))
                    })
                    .max_by(|a, b| a.0.cmp(&b.0))
            })
            .map(|(_, dir)| dir);
        let sreq = SelectRequest {
            process: Some(Selector::Tag(id.clone())),
        };
        let end = match self
            .core
            .envd
            .server_stream(
                ctx,
                &ctx.cancel,
                "process.Process/Connect",
                &sreq,
                self.core.user(),
                Op::Process { op: "connect", id },
            )
            .await
        {
            Ok(mut s) => {
                let mut end = None;
                loop {
                    match within_connect(
                        ctx,
                        cfg.connect_timeout(),
                        s.next::<ProcessEventResponse>(),
                    )
                    .await
                    {
                        Ok(StreamItem::Message(ProcessEventResponse {
                            event: ProcessEventMsg::End(e),
                        })) => {
                            end = Some(exit_status(&e));
                            break;
                        }
                        Ok(StreamItem::Message(_)) => {}
                        _ => break,
                    }
                }
                end
            }
            Err(_) => None,
        };
        if dir.is_none() && end.is_none() {
            return Ok(None);
        }
        let cmd = self.new_command(NewCommand {
            id: id.clone(),
            pid: 0,
            user: None,
            info: ProcessInfo {
                command_id: id.clone(),
                pid: 0,
                command: Command::Argv(Vec::new()),
                cwd: None,
                pty: false,
                exit: None,
            },
            tee: dir.is_some(),
            dir,
            caps: [cfg.max_output_bytes, cfg.max_output_bytes],
            grace: Duration::ZERO,
            stdin: STDIN_NONE,
        });
        let c = cmd.clone();
        self.core.tasks.spawn(async move {
            c.settle().await;
            c.finish(end.unwrap_or(UNKNOWN_STATUS));
        });
        Ok(Some(cmd))
    }
}

#[async_trait]
impl Process for EnvdProcess {
    #[tracing::instrument(name = "process.start", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id, command.id = tracing::field::Empty))]
    async fn spawn(&self, ctx: &CallCtx, spec: ProcessSpec) -> Result<Arc<dyn ProcessHandle>> {
        ctx.check()?;
        let core = &self.core;
        let cfg = &core.cfg;
        if core.closed.is_cancelled() {
            return Err(ProviderError::SandboxNotFound {
                id: core.id.clone(),
            });
        }
        let argv = match &spec.command {
            Command::Argv(v) if v.first().is_some_and(|p| !p.is_empty()) => v.clone(),
            Command::Argv(_) => {
                return Err(ProviderError::InvalidRequest {
                    message: "argv needs a program name at argv[0]".into(),
                });
            }
            Command::Shell(s) => vec![BASH.to_owned(), "-lc".to_owned(), s.clone()],
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(ProviderError::InvalidRequest {
                message: "argv contains a NUL byte".into(),
            });
        }
        if let Some(PtySize { rows: 0, .. } | PtySize { cols: 0, .. }) = spec.pty {
            return Err(ProviderError::InvalidRequest {
                message: "pty size must be positive".into(),
            });
        }
        let mut envs = BTreeMap::new();
        let mut unset = Vec::new();
        if let Some(tp) = &ctx.trace.traceparent {
            envs.insert("TRACEPARENT".to_owned(), tp.clone());
        }
        if let Some(ts) = &ctx.trace.tracestate {
            envs.insert("TRACESTATE".to_owned(), ts.clone());
        }
        for (k, v) in &spec.env {
            if !valid_env_name(k) || v.as_ref().is_some_and(|v| v.contains('\0')) {
                return Err(ProviderError::InvalidRequest {
                    message: format!("invalid environment variable {k:?}"),
                });
            }
            match v {
                Some(v) => {
                    envs.insert(k.clone(), v.clone());
                }
                None => {
                    envs.remove(k);
                    unset.push(k.clone());
                }
            }
        }
        let id = spec
            .command_id
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        tracing::Span::current().record("command.id", id.as_str());
        {
            let mut t = self.table.lock().await;
            if let Some(old) = t.get(&id) {
                if old.try_status().is_none() && old.progress.borrow().failed.is_none() {
                    return Err(ProviderError::InvalidRequest {
                        message: format!("command id {id} is in use"),
                    });
                }
                if let Some(old) = t.remove(&id) {
                    self.forget_copies(&old);
                }
            }
        }
        let pty = spec.pty.is_some();
        let tee = !pty;
        let caps = [
            spec.stdout_max_bytes.unwrap_or(cfg.max_output_bytes),
            spec.stderr_max_bytes.unwrap_or(cfg.max_output_bytes),
        ];
        let user = spec
            .user
            .clone()
            .filter(|u| !u.is_empty())
            .or_else(|| cfg.user.clone());
        let dir = match self.take_spare(user.as_deref()).await {
            Some(d) => d,
            None => {
                let nonce = &uuid::Uuid::new_v4().simple().to_string()[..8];
                format!("{}/{}.{nonce}", cfg.state_dir(), dir_name(&id))
            }
        };
        let mut args = vec![
            "-c".to_owned(),
            WRAPPER.to_owned(),
            "tether".to_owned(),
            if cfg.signal_relay { RELAY } else { "" }.to_owned(),
            dir.clone(),
            marker(&id),
            if tee { "1" } else { "0" }.to_owned(),
            caps[OUT].to_string(),
            caps[ERR].to_string(),
            unset.len().to_string(),
        ];
        args.extend(unset);
        args.extend(argv.iter().cloned());
        let workspace = cfg.workspace.trim_end_matches('/');
        let cwd = spec
            .cwd
            .as_deref()
            .map(|c| resolve(workspace, c))
            .unwrap_or_else(|| workspace.to_owned());
        let stdin = if pty {
            STDIN_PTY
        } else if matches!(spec.stdin, StdinMode::Ignore) {
            STDIN_NONE
        } else {
            STDIN_PIPE
        };
        let req = StartRequest {
            process: Some(ProcessConfig {
                cmd: BASH.to_owned(),
                args,
                envs,
                cwd: Some(cwd.clone()),
            }),
            pty: spec.pty.map(|s| PtyMsg {
                size: Some(PtySizeMsg {
                    cols: u32::from(s.cols),
                    rows: u32::from(s.rows),
                }),
            }),
            tag: Some(id.clone()),
            stdin: Some(stdin != STDIN_NONE),
        };
        let new = NewCommand {
            id: id.clone(),
            pid: 0,
            user: user.clone(),
            info: ProcessInfo {
                command_id: id.clone(),
                pid: 0,
                command: spec.command.clone(),
                cwd: Some(cwd),
                pty,
                exit: None,
            },
            dir: Some(dir),
            tee,
            caps,
            grace: Duration::from_millis(spec.grace_ms.min(cfg.max_grace_ms)),
            stdin,
        };
        // The stream belongs to the command, not to the call: it ends with the sandbox.
        let stop = core.closed.child();
        let op = Op::Process {
            op: "start",
            id: &id,
        };
        let opened = async {
            let mut s = core
                .envd
                .server_stream(
                    ctx,
                    &stop,
                    "process.Process/Start",
                    &req,
                    user.as_deref(),
                    op,
                )
                .await?;
            match within_connect(ctx, cfg.connect_timeout(), s.next::<ProcessEventResponse>())
                .await?
            {
                StreamItem::Message(ProcessEventResponse {
                    event: ProcessEventMsg::Start(st),
                }) => Ok((s, st.pid)),
                StreamItem::Message(_) => Err(malformed(
                    "a process stream that did not begin with its start event",
                )),
                StreamItem::End => Err(malformed(
                    "a process stream that ended before its start event",
                )),
            }
        }
        .await;
        let (stream, pid) = match opened {
            Ok(v) => v,
            Err(e) => return self.after_broken_start(ctx, &id, e, new).await,
        };
        let cmd = self.new_command(NewCommand {
            pid,
            info: ProcessInfo { pid, ..new.info },
            ..new
        });
        self.remember(cmd.clone()).await;
        core.tasks.spawn(cmd.clone().pump(Some(stream)));
        self.make_spares().await;
        if let StdinMode::Data { data } = spec.stdin {
            let c = cmd.clone();
            core.tasks.spawn(async move {
                let ctx = c.bg_ctx();
                if !data.is_empty()
                    && let Err(e) = c.write_stdin(&ctx, Bytes::from(data)).await
                {
                    tracing::debug!(command.id = %c.id, error = %e, "Could not write a command's stdin data");
                }
                if let Err(e) = c.close_stdin(&ctx).await {
                    tracing::debug!(command.id = %c.id, error = %e, "Could not close a command's stdin");
                }
            });
        }
        tracing::debug!(sandbox.id = %core.id, command.id = %id, pid, "Started a command");
        Ok(cmd)
    }

    #[tracing::instrument(name = "process.attach", skip_all, fields(provider.kind = self.core.kind, sandbox.id = %self.core.id))]
    async fn attach(
        &self,
        ctx: &CallCtx,
        which: ProcessSelector,
    ) -> Result<Arc<dyn ProcessHandle>> {
        ctx.check()?;
        {
            let t = self.table.lock().await;
            let found = match &which {
                ProcessSelector::CommandId(id) => t.get(id).cloned(),
                ProcessSelector::Pid(pid) => t
                    .values()
                    .filter(|c| c.pid == *pid)
                    .max_by_key(|c| c.try_status().is_none())
                    .cloned(),
            };
            // A command whose stream was lost for good is looked up afresh.
            if let Some(c) = found.filter(|c| c.progress.borrow().failed.is_none()) {
                return Ok(c);
            }
        }
        match self.adopt(ctx, &which).await? {
            Some(c) => {
                self.remember(c.clone()).await;
                Ok(c)
            }
            None => Err(ProviderError::CommandNotFound {
                id: match which {
                    ProcessSelector::CommandId(id) => id,
                    ProcessSelector::Pid(pid) => pid.to_string(),
                },
            }),
        }
    }

    async fn list(&self, ctx: &CallCtx) -> Result<Vec<ProcessInfo>> {
        ctx.check()?;
        let mut out: Vec<ProcessInfo> = self
            .table
            .lock()
            .await
            .values()
            .map(|c| c.info_now())
            .collect();
        let remote: ListResponse = self
            .core
            .envd
            .unary(
                ctx,
                "process.Process/List",
                &Empty {},
                self.core.user(),
                Op::Process { op: "list", id: "" },
            )
            .await?;
        for p in remote.processes {
            let Some(tag) = p.tag.clone() else { continue };
            if out.iter().any(|o| o.command_id == tag) {
                continue;
            }
            let argv = unwrap_config(&p.config).map(|w| w.argv).unwrap_or_else(|| {
                std::iter::once(p.config.cmd.clone())
                    .chain(p.config.args.clone())
                    .collect()
            });
            out.push(ProcessInfo {
                command_id: tag,
                pid: p.pid,
                command: Command::Argv(argv),
                cwd: p.config.cwd.clone(),
                pty: false,
                exit: None,
            });
        }
        out.sort_by_key(|p| p.pid);
        Ok(out)
    }
}
