//! Commands on an SSH host: each under `setsid` in a process group of its own, with an
//! output journal and an exit-status file on the host, so that a broken connection loses
//! nothing.
//!
//! A command is started by one exec channel running [`SPAWN`]. It forks the command
//! under `setsid` (its pid is the group's and the session's id), prints that pid as the
//! first line of the channel's stdout, feeds a piped stdin from the journal `<id>.stdin`
//! through the FIFO `<id>.in`, copies the command's stdout and stderr both to the
//! channel and to the journals `<id>.out` and `<id>.err` in the sandbox's command
//! directory on the host (`tee`, which goes on writing the journal when the channel is
//! gone), waits for the command from outside its group and writes its status to
//! `<id>.exit`; the channel's exit status is the command's.
//!
//! Output is delivered with whole-stream byte offsets. When the channel breaks before the
//! command's end, the handle re-attaches: a new channel runs [`FOLLOW`], which streams both
//! journals from the offsets reached until the command is gone, then the journals' last
//! bytes are read once more and the status is taken from the `.exit` file. A command
//! found again by id or pid (after a daemon restart, say) is read the same way from
//! offset 0.
//!
//! A piped stdin is a journal on the host too: each `write_stdin` is a step of its own
//! that appends at a byte offset and answers only once the bytes are in the journal, so a
//! write that returned has arrived, and one broken with its connection is sent again on
//! a fresh one (the offset makes the repeat add only what is missing). A write that still
//! failed is completed first by the next write or close (with the same bytes, that next
//! write is its retry). The command reads the journal through a FIFO and sees its end of
//! file only from `close_stdin`, never from a lost connection.
//!
//! Exit statuses come from bash's `wait`: a status above 128 is reported as the signal
//! `status - 128` (so `exit 130` reads as SIGINT, a limit shared with every shell).
//! Commands under a pty run in the channel's own pty (`resize` is the SSH window-change
//! request); they are not journaled and do not survive their connection.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tether_provider::Clock;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use russh::ChannelMsg;
use russh::client::Msg;
use serde::{Deserialize, Serialize};
use tether_protocol::process::{
    Command, ExitStatus, ProcessEvent, ProcessInfo, ProcessSpec, PtySize, StdinMode, StreamKind,
};
use tether_provider::{
    CallCtx, EventStream, Process, ProcessHandle, ProcessSelector, ProviderError, Result, Signal,
    StreamOffsets, TerminateReport,
};
use tokio::sync::{Mutex, watch};

use crate::client::Lease;
use crate::fs::normalize;
use crate::sandbox::SandboxCore;

/// Starts a command and records its end (`SPAWN DIR CWD STDIN META N_UNSET NAME...
/// N_SET NAME=VALUE... argv...`; STDIN 1 = piped). The command is forked as a subshell
/// that prints its own pid (the first line of the channel's stdout, before the command
/// can write anything) and execs `setsid`, so the command is the leader of a new session
/// and process group; its stdout and stderr pass through `tee` into the journals on their
/// way to the channel (`tee -p` goes on writing the journal when the channel is gone). A
/// piped stdin is a journal too, `<id>.stdin`, appended to by [`STDIN_APPEND`] and fed
/// into the command's FIFO by a `tail -f` that ends, after the journal's last byte, when
/// its holder does ([`STDIN_END`] kills the holder; the holder also ends with the
/// wrapper). The wrapper itself is outside the group, so a signal to the group never
/// reaches it: it waits for the command and writes its status.
pub const SPAWN: &str = r#"d=$1 cw=$2 si=$3 m=$4
shift 4
if ! printf '%s\n' "$m" 2>/dev/null >"$d.meta"; then echo "cannot write $d.meta" >&2; exit 90; fi
if ! cd -- "$cw" 2>/dev/null; then echo "no such directory: $cw" >&2; exit 91; fi
i=/dev/null h=
if [ "$si" = 1 ]; then
  if ! mkfifo -m 600 -- "$d.in" || ! : >"$d.stdin"; then echo "cannot create the stdin FIFO" >&2; exit 92; fi
  i=$d.in
  : >"$d.inhold"
  tail -s 1 --pid=$$ -f -- "$d.inhold" </dev/null >/dev/null 2>&1 &
  h=$!
  printf '%s\n' "$h" >"$d.inhold"
  tail -q -s 0.05 --pid="$h" -c +1 -f -- "$d.stdin" </dev/null >"$i" 2>/dev/null &
fi
sp=/usr/bin/setsid
[ -x "$sp" ] || sp=setsid
exec 3>&1
exec > >(exec tee -p -- "$d.out") 2> >(exec tee -p -- "$d.err" >&2)
(
  n=$1; shift
  while [ "$n" -gt 0 ]; do unset -v "$1"; shift; n=$((n-1)); done
  n=$1; shift
  while [ "$n" -gt 0 ]; do export "$1"; shift; n=$((n-1)); done
  printf '%s\n' "$BASHPID" >"$d.pid"; printf '%s\n' "$BASHPID" >&3
  exec 3>&-
  exec "$sp" "$@"
) <"$i" &
p=$!
exec 3>&-
wait "$p"; rc=$?
[ -n "$h" ] && kill "$h" 2>/dev/null
printf '%s\n' "$rc" >"$d.exit"
exit "$rc""#;

/// Appends to a command's stdin journal (`STDIN_APPEND DIR OFFSET`, the bytes on stdin):
/// the bytes from OFFSET on (`-`: the journal's end) that the journal lacks, so a repeat
/// of a write that partly arrived adds only the rest; prints the journal's new length.
/// Status 93: the input was closed or the command ended; 94: stdin is not piped; 95: the
/// journal is shorter than OFFSET.
const STDIN_APPEND: &str = r#"d=$1 o=$2
[ -e "$d.stdin" ] || exit 94
{ [ -e "$d.inend" ] || [ -s "$d.exit" ]; } && exit 93
s=$(stat -c %s -- "$d.stdin") || exit 94
[ "$o" = - ] && o=$s
[ "$s" -lt "$o" ] && exit 95
tail -c +$((s-o+1)) >>"$d.stdin" || exit 96
stat -c %s -- "$d.stdin""#;

/// Ends a command's stdin (`STDIN_END DIR`): the feeder delivers the journal's last
/// bytes, then the command reads its end of file. Repeating it is harmless.
const STDIN_END: &str = r#"d=$1
[ -e "$d.stdin" ] || exit 94
[ -e "$d.inend" ] && exit 0
: >"$d.inend"
[ -s "$d.exit" ] || { read -r h <"$d.inhold" 2>/dev/null && kill "$h" 2>/dev/null; }
exit 0"#;

/// Streams a command's journals from offsets until its runner is gone
/// (`FOLLOW DIR PID OUT_OFFSET ERR_OFFSET`); exits with the recorded status, or 255.
pub const FOLLOW: &str = r#"d=$1 p=$2 oo=$3 oe=$4
tail -q -s 0.05 --pid="$p" -c +$((oo+1)) -f -- "$d.out" &
t=$!
tail -q -s 0.05 --pid="$p" -c +$((oe+1)) -f -- "$d.err" >&2
wait "$t"
if [ -s "$d.exit" ]; then read -r rc <"$d.exit"; exit "$rc"; fi
exit 255"#;

/// The journals' bytes from offsets, stdout and stderr (`TAILS DIR OUT_OFFSET ERR_OFFSET`).
const TAILS: &str = r#"d=$1
tail -c +$(($2+1)) -- "$d.out"
tail -c +$(($3+1)) -- "$d.err" >&2
n=0
while [ ! -s "$d.exit" ] && [ "$n" -lt 40 ]; do sleep 0.05; n=$((n+1)); done
if [ -s "$d.exit" ]; then read -r rc <"$d.exit"; exit "$rc"; fi
exit 255"#;

/// A piece of one journal (`SLICE FILE OFFSET LENGTH`).
const SLICE: &str = r#"tail -c +$(($2+1)) -- "$1" | head -c "$3""#;

/// Starts a command under the channel's pty (`PTY DIR CWD META argv...`).
pub const PTY: &str = r#"d=$1 cw=$2 m=$3
shift 3
if ! printf '%s\n' "$m" 2>/dev/null >"$d.meta"; then echo "cannot write $d.meta"; exit 90; fi
if ! cd -- "$cw" 2>/dev/null; then echo "no such directory: $cw"; exit 91; fi
printf '%s\n' "$$" >"$d.pid"
printf '%s\n' "$$"
exec "$@""#;

/// Lists the commands of a sandbox (`LIST CMD_DIR [NAME]`): one line per command,
/// `id TAB pid TAB status TAB meta`, status a number, `run`, or `gone`.
const LIST: &str = r#"for f in "$1"/*.pid; do
  d=${f%.pid}; n=${d##*/}
  if [ -n "$2" ] && [ "$n" != "$2" ]; then continue; fi
  [ -s "$d.pid" ] || continue
  read -r p <"$d.pid"; m=
  [ -s "$d.meta" ] && read -r m <"$d.meta"
  if [ -s "$d.exit" ]; then read -r s <"$d.exit"
  elif kill -0 "$p" 2>/dev/null; then s=run
  else s=gone; fi
  printf '%s\t%s\t%s\t%s\n' "$n" "$p" "$s" "$m"
done"#;

/// Sends a signal to a group (`SIGNAL PGID NAME`).
const SIGNAL: &str = r#"kill -s "$2" -- "-$1" 2>/dev/null || kill -s "$2" "$1" 2>/dev/null"#;

/// TERM, grace, KILL, verify, for a whole group (`LADDER PGID GRACE_STEPS VERIFY_STEPS
/// STEP_S`). Exit status: bit 0 TERM sent, bit 1 KILL sent, bit 2 survivors (their count
/// on stdout).
const LADDER: &str = r#"g=$1 gs=$2 vs=$3 st=$4
count() {
  n=0
  for p in /proc/[0-9]*/stat; do
    read -r l < "$p" 2>/dev/null || continue
    r=${l##*) }
    set -- $r
    if [ "$3" = "$g" ] && [ "$1" != Z ] && [ "$1" != X ]; then n=$((n+1)); fi
  done
}
count
[ "$n" -eq 0 ] && exit 0
kill -TERM -- "-$g" 2>/dev/null
kill -CONT -- "-$g" 2>/dev/null
rc=1 i=0
while [ "$i" -lt "$gs" ]; do count; [ "$n" -eq 0 ] && break; sleep "$st"; i=$((i+1)); done
count
if [ "$n" -gt 0 ]; then
  kill -KILL -- "-$g" 2>/dev/null
  rc=3 i=0
  while [ "$i" -lt "$vs" ]; do count; [ "$n" -eq 0 ] && break; sleep "$st"; i=$((i+1)); done
  count
fi
if [ "$n" -gt 0 ]; then echo "$n"; exit $((rc+4)); fi
exit $rc"#;

/// Step of the terminate ladder's polling.
const LADDER_STEP: Duration = Duration::from_millis(20);
/// How long `terminate` waits for killed processes to disappear.
const KILL_VERIFY: Duration = Duration::from_secs(5);
/// Largest piece of output handed to a reader at once.
const READ_CHUNK: usize = 64 * 1024;
/// Largest piece of the journal fetched in one read-back.
const SLICE_CHUNK: u64 = 4 * 1024 * 1024;
/// Pause between re-attach attempts (the first is immediate).
const REATTACH_PAUSE: Duration = Duration::from_millis(200);
/// Upper bound of a command's grace period.
const MAX_GRACE: Duration = Duration::from_secs(300);

const OUT: usize = 0;
const ERR: usize = 1;

/// What the host keeps about a command (its `meta` file), for `list` and `attach`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CommandMeta {
    command: Command,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    pty: bool,
    #[serde(default)]
    grace_ms: u64,
    /// Capture caps of stdout and stderr (`None`: everything).
    #[serde(default)]
    caps: [Option<u64>; 2],
}

/// A signal number from an SSH exit-signal name.
fn sig_number(s: &russh::Sig) -> i32 {
    use russh::Sig as S;
    match s {
        S::HUP => 1,
        S::INT => 2,
        S::QUIT => 3,
        S::ILL => 4,
        S::ABRT => 6,
        S::FPE => 8,
        S::KILL => 9,
        S::USR1 => 10,
        S::SEGV => 11,
        S::PIPE => 13,
        S::ALRM => 14,
        S::TERM => 15,
        _ => 0,
    }
}

/// A bash exit status as an [`ExitStatus`] (above 128: killed by `status - 128`).
fn status_of(rc: u32) -> ExitStatus {
    if rc > 128 && rc < 128 + 65 {
        ExitStatus {
            code: None,
            signal: Some(rc as i32 - 128),
        }
    } else {
        ExitStatus {
            code: Some(rc as i32),
            signal: None,
        }
    }
}

fn killed() -> ExitStatus {
    ExitStatus {
        code: None,
        signal: Some(9),
    }
}

/// Output and state shared by a command's pump and its readers.
#[derive(Debug, Default)]
struct Buffers {
    data: [Vec<u8>; 2],
    /// Whole-stream offset of `data[i][0]`.
    base: [u64; 2],
    status: Option<ExitStatus>,
    /// The pump ended (after `status`, or with `error`).
    done: bool,
    error: Option<(tether_protocol::ErrorCode, String, Option<ProviderError>)>,
    /// Bytes the command wrote per stream, including any beyond its capture cap.
    total: [u64; 2],
}

impl Buffers {
    fn end(&self, i: usize) -> u64 {
        self.base[i] + self.data[i].len() as u64
    }
}

/// A command started by (or found again through) the SSH provider.
pub struct SshCommand {
    id: String,
    pid: u32,
    meta: CommandMeta,
    core: Arc<SandboxCore>,
    dir: String,
    buf: Arc<RwLock<Buffers>>,
    changed: watch::Sender<u64>,
    input: Mutex<Input>,
    window: u64,
}

/// Where a command's stdin goes.
enum Input {
    /// Nowhere: not piped, or closed.
    Closed,
    /// The input of the pty the command runs under: its channel.
    Pty(russh::ChannelWriteHalf<Msg>),
    /// The host's stdin journal, at `offset` (`None`: its end, for a command found again);
    /// `pending` holds a write that failed, of which a prefix may have arrived.
    Journal {
        offset: Option<u64>,
        pending: Option<Bytes>,
    },
}

impl std::fmt::Debug for SshCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshCommand")
            .field("id", &self.id)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

fn stdin_not_open() -> ProviderError {
    ProviderError::InvalidRequest {
        message: "the command's stdin is not open (not piped, closed, or the command ended)".into(),
    }
}

impl SshCommand {
    /// Appends `data` to the stdin journal at `offset`, sent again on a fresh connection
    /// when one breaks under it; `offset` moves to the journal's new end.
    async fn append(&self, ctx: &CallCtx, offset: &mut Option<u64>, data: Bytes) -> Result<()> {
        let at = offset.map_or_else(|| "-".to_owned(), |o| o.to_string());
        let host = &self.core.host;
        let line = host.line(STDIN_APPEND, &[&self.dir, &at]);
        let out = host.exec_repeatable(ctx, &line, Some(data.clone())).await?;
        match out.code {
            Some(0) => {
                let end = out
                    .out()
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| ProviderError::Backend {
                        message: format!("stdin: the host answered {:?}", out.out()),
                        source: None,
                    })?;
                if let Some(o) = *offset
                    && end != o + data.len() as u64
                {
                    return Err(ProviderError::Internal {
                        message: format!(
                            "stdin: the journal holds {end} bytes, {} were sent",
                            o + data.len() as u64
                        ),
                        source: None,
                    });
                }
                *offset = Some(end);
                Ok(())
            }
            Some(93 | 94) => Err(stdin_not_open()),
            code => Err(ProviderError::Backend {
                message: format!(
                    "stdin: appending to the journal failed (status {code:?}): {}",
                    out.err().trim()
                ),
                source: None,
            }),
        }
    }

    /// Ends the stdin journal: the command reads the rest of it, then its end of file.
    async fn end_input(&self, ctx: &CallCtx) -> Result<()> {
        let host = &self.core.host;
        let line = host.line(STDIN_END, &[&self.dir]);
        let out = host.exec_repeatable(ctx, &line, None).await?;
        match out.code {
            Some(0) => Ok(()),
            Some(94) => Err(stdin_not_open()),
            code => Err(ProviderError::Backend {
                message: format!("stdin: ending it failed (status {code:?})"),
                source: None,
            }),
        }
    }

    fn read_buf(&self) -> std::sync::RwLockReadGuard<'_, Buffers> {
        self.buf.read().unwrap_or_else(|e| e.into_inner())
    }

    fn info(&self) -> ProcessInfo {
        ProcessInfo {
            command_id: self.id.clone(),
            pid: self.pid,
            command: self.meta.command.clone(),
            cwd: self.meta.cwd.clone(),
            pty: self.meta.pty,
            exit: self.read_buf().status,
        }
    }

    /// Append output of stream `i`, up to its capture cap (dropping the oldest beyond
    /// the memory window).
    fn push(&self, i: usize, data: &[u8]) {
        let mut b = self.buf.write().unwrap_or_else(|e| e.into_inner());
        let window = self.window;
        b.total[i] += data.len() as u64;
        let room = match self.meta.caps[i] {
            Some(cap) => cap.saturating_sub(b.end(i)) as usize,
            None => data.len(),
        };
        let data = &data[..data.len().min(room)];
        b.data[i].extend_from_slice(data);
        let len = b.data[i].len() as u64;
        if len > window.saturating_mul(2) {
            let cut = (len - window) as usize;
            b.data[i].drain(..cut);
            b.base[i] += cut as u64;
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The pump: read the channel, re-attach from the journal after a break, record the end.
    async fn pump(self: Arc<Self>, mut rx: russh::ChannelReadHalf, lease: Lease, journal: bool) {
        let mut lease = Some(lease);
        let mut status: Option<ExitStatus> = None;
        let mut from_journal = journal;
        loop {
            let mut closed = false;
            while let Some(msg) = tokio::select! {
                m = rx.wait() => m,
                _ = self.core.cancel.cancelled() => None,
            } {
                match msg {
                    ChannelMsg::Data { data } => {
                        self.push(OUT, &data);
                        self.bump();
                    }
                    ChannelMsg::ExtendedData { data, ext: 1 } => {
                        self.push(ERR, &data);
                        self.bump();
                    }
                    ChannelMsg::ExitStatus { exit_status } => {
                        status = Some(if from_journal && exit_status == 255 {
                            killed()
                        } else {
                            status_of(exit_status)
                        });
                    }
                    ChannelMsg::ExitSignal { signal_name, .. } => {
                        status = Some(ExitStatus {
                            code: None,
                            signal: Some(sig_number(&signal_name)),
                        });
                    }
                    ChannelMsg::Close => {
                        closed = true;
                        break;
                    }
                    _ => {}
                }
            }
            if self.core.cancel.is_cancelled() {
                self.fail(ProviderError::SandboxNotFound {
                    id: self.core.info.id.clone(),
                });
                return;
            }
            let broken = lease.as_ref().is_some_and(|l| l.conn.closed_now()) || !closed;
            let idle = lease.as_ref().is_some_and(|l| l.conn.idle_closed());
            let cause = lease
                .as_ref()
                .map(|l| l.conn.lost("a command's output stream"));
            drop(lease.take());
            if status.is_some() && !broken {
                if from_journal {
                    // The tee may have written after the runner ended: read the tails.
                    if let Err(e) = self.catch_up().await {
                        self.fail(e);
                        return;
                    }
                }
                self.finish(status);
                return;
            }
            if self.meta.pty {
                let e = cause.unwrap_or_else(|| ProviderError::Unavailable {
                    message: "the pty channel ended".into(),
                    retry_after: None,
                    source: None,
                });
                self.fail(e);
                return;
            }
            // === re-attach ===
            tracing::info!(command = %self.id, idle, "Re-attaching a command after its channel broke");
            match self.reattach().await {
                Ok((r, l)) => {
                    rx = r;
                    lease = Some(l);
                    status = None;
                    from_journal = true;
                }
                Err(e) => {
                    // Report the clock that broke the stream when the link stays dead.
                    let e = if idle { cause.unwrap_or(e) } else { e };
                    self.fail(e);
                    return;
                }
            }
        }
    }

    async fn reattach(&self) -> Result<(russh::ChannelReadHalf, Lease)> {
        let attempts = self.core.host.settings().reattach_attempts.max(1);
        let mut last = None;
        for i in 0..attempts {
            if i > 0 {
                tokio::time::sleep(REATTACH_PAUSE).await;
            }
            match self.open_follow().await {
                Ok(x) => return Ok(x),
                Err(e) => {
                    tracing::warn!(command = %self.id, error = %e, "Re-attach attempt failed");
                    let stop = !e.retryable();
                    last = Some(e);
                    if stop {
                        break;
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| ProviderError::Unavailable {
            message: "re-attach failed".into(),
            retry_after: None,
            source: None,
        }))
    }

    async fn open_follow(&self) -> Result<(russh::ChannelReadHalf, Lease)> {
        let ctx = CallCtx::new(format!("follow-{}", self.id));
        let ctx = ctx.with_timeout(self.core.host.settings().request_timeout(), Clock::Total);
        let (oo, oe) = {
            let b = self.read_buf();
            (b.total[OUT].max(b.end(OUT)), b.total[ERR].max(b.end(ERR)))
        };
        let (ch, lease) = self.core.host.channel(&ctx).await?;
        let pid = self.pid.to_string();
        let (oo, oe) = (oo.to_string(), oe.to_string());
        let line = self.core.host.line(FOLLOW, &[&self.dir, &pid, &oo, &oe]);
        ctx.run(async {
            ch.exec(true, line.as_bytes())
                .await
                .map_err(|e| crate::error::russh_error("exec", e))
        })
        .await?;
        let (rx, _tx) = ch.split();
        Ok((rx, lease))
    }

    /// Read what the journals hold past the offsets reached.
    async fn catch_up(&self) -> Result<()> {
        let (oo, oe) = {
            let b = self.read_buf();
            (
                b.total[OUT].max(b.end(OUT)).to_string(),
                b.total[ERR].max(b.end(ERR)).to_string(),
            )
        };
        let ctx = CallCtx::new(format!("tails-{}", self.id));
        let out = self
            .core
            .host
            .exec_idempotent(&ctx, &self.core.host.line(TAILS, &[&self.dir, &oo, &oe]))
            .await?;
        self.push(OUT, &out.stdout);
        self.push(ERR, &out.stderr);
        Ok(())
    }

    fn finish(&self, status: Option<ExitStatus>) {
        {
            let mut b = self.buf.write().unwrap_or_else(|e| e.into_inner());
            b.status = Some(status.unwrap_or_else(killed));
            b.done = true;
        }
        self.bump();
    }

    fn fail(&self, e: ProviderError) {
        {
            let mut b = self.buf.write().unwrap_or_else(|e| e.into_inner());
            b.error = Some((e.code(), e.to_string(), Some(e)));
            b.done = true;
        }
        self.bump();
    }

    /// The error a reader or waiter gets when the pump failed.
    fn error_now(&self) -> Option<ProviderError> {
        let b = self.read_buf();
        let (code, msg, e) = b.error.as_ref()?;
        Some(match e {
            Some(ProviderError::Timeout { reason }) => ProviderError::Timeout { reason: *reason },
            Some(ProviderError::SandboxNotFound { id }) => {
                ProviderError::SandboxNotFound { id: id.clone() }
            }
            _ if *code == tether_protocol::ErrorCode::ProviderUnavailable => {
                ProviderError::Unavailable {
                    message: msg.clone(),
                    retry_after: None,
                    source: None,
                }
            }
            _ => ProviderError::Backend {
                message: msg.clone(),
                source: None,
            },
        })
    }

    /// Bytes `[from, from+len)` of stream `i` from the journal on the host.
    async fn slice(&self, i: usize, from: u64, len: u64) -> Result<Vec<u8>> {
        let file = format!("{}.{}", self.dir, if i == OUT { "out" } else { "err" });
        let ctx = CallCtx::new(format!("slice-{}", self.id));
        let out = self
            .core
            .host
            .exec_idempotent(
                &ctx,
                &self
                    .core
                    .host
                    .line(SLICE, &[&file, &from.to_string(), &len.to_string()]),
            )
            .await?;
        Ok(out.stdout)
    }
}

/// One reader's position.
struct Reader {
    cmd: Arc<SshCommand>,
    pos: [u64; 2],
    rx: watch::Receiver<u64>,
    started: bool,
    ended: bool,
}

enum Step {
    Yield(ProcessEvent),
    Fail(ProviderError),
    Fetch(usize, u64, u64),
    Wait,
    End,
}

impl Reader {
    fn step(&mut self) -> Step {
        let b = self.cmd.read_buf();
        for i in [OUT, ERR] {
            if self.pos[i] < b.base[i] {
                return Step::Fetch(i, self.pos[i], (b.base[i] - self.pos[i]).min(SLICE_CHUNK));
            }
            if self.pos[i] < b.end(i) {
                let start = (self.pos[i] - b.base[i]) as usize;
                let n = (b.data[i].len() - start).min(READ_CHUNK);
                let data = b.data[i][start..start + n].to_vec();
                let offset = self.pos[i];
                self.pos[i] += n as u64;
                let stream = match (i, self.cmd.meta.pty) {
                    (OUT, true) => StreamKind::Pty,
                    (OUT, false) => StreamKind::Stdout,
                    _ => StreamKind::Stderr,
                };
                return Step::Yield(ProcessEvent::Output {
                    stream,
                    offset,
                    data,
                });
            }
        }
        if b.done {
            if let Some(status) = b.status {
                return Step::Yield(ProcessEvent::Exited {
                    status,
                    stdout_bytes: b.total[OUT].max(b.end(OUT)),
                    stderr_bytes: b.total[ERR].max(b.end(ERR)),
                });
            }
            drop(b);
            return match self.cmd.error_now() {
                Some(e) => Step::Fail(e),
                None => Step::End,
            };
        }
        Step::Wait
    }

    async fn next(&mut self) -> Option<Result<ProcessEvent>> {
        if self.ended {
            return None;
        }
        if !self.started {
            self.started = true;
            if self.pos == [0, 0] {
                return Some(Ok(ProcessEvent::Started {
                    command_id: self.cmd.id.clone(),
                    pid: self.cmd.pid,
                }));
            }
        }
        loop {
            self.rx.borrow_and_update();
            match self.step() {
                Step::Yield(ev) => {
                    if matches!(ev, ProcessEvent::Exited { .. }) {
                        self.ended = true;
                    }
                    return Some(Ok(ev));
                }
                Step::Fail(e) => {
                    self.ended = true;
                    return Some(Err(e));
                }
                Step::End => {
                    self.ended = true;
                    return None;
                }
                Step::Fetch(i, from, len) => match self.cmd.slice(i, from, len).await {
                    Ok(data) if !data.is_empty() => {
                        self.pos[i] += data.len() as u64;
                        let stream = if i == OUT {
                            StreamKind::Stdout
                        } else {
                            StreamKind::Stderr
                        };
                        return Some(Ok(ProcessEvent::Output {
                            stream,
                            offset: from,
                            data,
                        }));
                    }
                    Ok(_) => {
                        self.ended = true;
                        return Some(Err(ProviderError::Backend {
                            message: "the command's journal is shorter than its output".into(),
                            source: None,
                        }));
                    }
                    Err(e) => {
                        self.ended = true;
                        return Some(Err(e));
                    }
                },
                Step::Wait => {
                    if self.rx.changed().await.is_err() {
                        self.ended = true;
                        return None;
                    }
                }
            }
        }
    }
}

#[async_trait]
impl ProcessHandle for SshCommand {
    fn command_id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn events(&self, from: StreamOffsets) -> EventStream {
        let cmd = self
            .core
            .command(&self.id)
            .unwrap_or_else(|| unreachable_cmd(self));
        let reader = Reader {
            rx: self.changed.subscribe(),
            cmd,
            pos: [from.stdout, from.stderr],
            started: false,
            ended: false,
        };
        futures_util::stream::unfold(
            reader,
            |mut r| async move { r.next().await.map(|ev| (ev, r)) },
        )
        .boxed()
    }

    async fn write_stdin(&self, ctx: &CallCtx, data: Bytes) -> Result<()> {
        let mut guard = self.input.lock().await;
        match &mut *guard {
            Input::Closed => Err(stdin_not_open()),
            Input::Pty(tx) => {
                ctx.run(async {
                    tx.data_bytes(data)
                        .await
                        .map_err(|e| crate::error::russh_error("stdin", e))
                })
                .await
            }
            Input::Journal { offset, pending } => {
                if let Some(p) = pending.take()
                    && p != data
                    && let Err(e) = self.append(ctx, offset, p.clone()).await
                {
                    *pending = Some(p);
                    return Err(e);
                }
                let r = self.append(ctx, offset, data.clone()).await;
                if r.is_err() {
                    *pending = Some(data);
                }
                r
            }
        }
    }

    async fn close_stdin(&self, ctx: &CallCtx) -> Result<()> {
        let mut guard = self.input.lock().await;
        match std::mem::replace(&mut *guard, Input::Closed) {
            Input::Closed => Ok(()),
            Input::Pty(tx) => {
                ctx.run(async {
                    tx.eof()
                        .await
                        .map_err(|e| crate::error::russh_error("stdin", e))
                })
                .await
            }
            Input::Journal {
                mut offset,
                pending,
            } => {
                let r = async {
                    if let Some(p) = pending.clone() {
                        self.append(ctx, &mut offset, p).await?;
                    }
                    self.end_input(ctx).await
                }
                .await;
                if r.is_err() {
                    *guard = Input::Journal { offset, pending };
                }
                r
            }
        }
    }

    async fn signal(&self, ctx: &CallCtx, signal: Signal) -> Result<()> {
        let name = format!("{signal:?}").to_ascii_uppercase();
        let out = self
            .core
            .host
            .exec(
                ctx,
                &self.core.host.line(SIGNAL, &[&self.pid.to_string(), &name]),
                None,
            )
            .await?;
        if out.code == Some(0) || self.try_status().is_some() {
            Ok(())
        } else {
            Err(ProviderError::CommandNotFound {
                id: self.id.clone(),
            })
        }
    }

    async fn resize(&self, ctx: &CallCtx, size: PtySize) -> Result<()> {
        if !self.meta.pty {
            return Err(ProviderError::InvalidRequest {
                message: "resize needs a command under a pty".into(),
            });
        }
        let guard = self.input.lock().await;
        let Input::Pty(tx) = &*guard else {
            return Err(ProviderError::CommandNotFound {
                id: self.id.clone(),
            });
        };
        ctx.run(async {
            tx.window_change(u32::from(size.cols), u32::from(size.rows), 0, 0)
                .await
                .map_err(|e| crate::error::russh_error("resize", e))
        })
        .await
    }

    async fn terminate(&self, ctx: &CallCtx) -> Result<TerminateReport> {
        let grace = Duration::from_millis(self.meta.grace_ms).min(MAX_GRACE);
        let step = LADDER_STEP;
        let gs = (grace.as_millis() / step.as_millis()).max(1).to_string();
        let vs = (KILL_VERIFY.as_millis() / step.as_millis()).to_string();
        let st = format!("{:.3}", step.as_secs_f64());
        let line = self
            .core
            .host
            .line(LADDER, &[&self.pid.to_string(), &gs, &vs, &st]);
        let lctx = ctx.with_timeout(
            grace + KILL_VERIFY + self.core.host.settings().request_timeout(),
            Clock::Total,
        );
        let out = self.core.host.exec(&lctx, &line, None).await?;
        let rc = out.code.unwrap_or(0);
        let report = TerminateReport {
            term_sent: rc & 1 != 0,
            killed: rc & 2 != 0,
            survivors: if rc & 4 != 0 {
                out.out().trim().parse().unwrap_or(1)
            } else {
                0
            },
        };
        if report.survivors == 0 {
            // The group is gone: its status follows from the stream; wait for it briefly.
            let wctx = ctx.with_timeout(KILL_VERIFY, Clock::Total);
            if self.wait(&wctx).await.is_err() && self.try_status().is_none() {
                let mut b = self.buf.write().unwrap_or_else(|e| e.into_inner());
                if b.status.is_none() && b.error.is_none() {
                    b.status = Some(killed());
                    b.done = true;
                }
                drop(b);
                self.bump();
            }
        }
        Ok(report)
    }

    async fn wait(&self, ctx: &CallCtx) -> Result<ExitStatus> {
        let mut rx = self.changed.subscribe();
        ctx.run(async {
            loop {
                rx.borrow_and_update();
                if let Some(s) = self.try_status() {
                    return Ok(s);
                }
                if let Some(e) = self.error_now() {
                    return Err(e);
                }
                if rx.changed().await.is_err() {
                    return Err(ProviderError::Internal {
                        message: "the command's pump is gone".into(),
                        source: None,
                    });
                }
            }
        })
        .await
    }

    fn try_status(&self) -> Option<ExitStatus> {
        self.read_buf().status
    }
}

/// A handle not in its sandbox's registry cannot exist (every constructor registers it).
fn unreachable_cmd(c: &SshCommand) -> Arc<SshCommand> {
    tracing::error!(command = %c.id, "A command handle is missing from its sandbox's registry");
    let (changed, _) = watch::channel(0);
    let b = c.read_buf();
    let buf = Buffers {
        data: b.data.clone(),
        base: b.base,
        status: b.status,
        done: true,
        error: None,
        total: b.total,
    };
    Arc::new(SshCommand {
        id: c.id.clone(),
        pid: c.pid,
        meta: c.meta.clone(),
        core: c.core.clone(),
        dir: c.dir.clone(),
        buf: Arc::new(RwLock::new(buf)),
        changed,
        input: Mutex::new(Input::Closed),
        window: c.window,
    })
}

/// A command's environment changes and argv.
#[derive(Debug)]
struct Launch {
    unsets: Vec<String>,
    sets: Vec<String>,
    cmd: Vec<String>,
}

/// Variables bash keeps read-only or to itself: set through `env` instead.
const SHELL_OWN: &[&str] = &[
    "BASHOPTS",
    "SHELLOPTS",
    "UID",
    "EUID",
    "PPID",
    "BASH_VERSINFO",
    "BASHPID",
    "BASH_ARGV0",
    "BASH_ENV",
    "ENV",
];

/// A name the shell can `export` and `unset` without side effects.
fn shell_name(k: &str) -> bool {
    if SHELL_OWN.contains(&k) {
        return false;
    }
    let mut c = k.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

impl Launch {
    /// `env -u NAME... -- NAME=VALUE... argv...`.
    fn env_argv(&self) -> Vec<String> {
        let mut v = vec!["env".to_owned()];
        for u in &self.unsets {
            v.push("-u".into());
            v.push(u.clone());
        }
        v.push("--".into());
        v.extend(self.sets.iter().cloned());
        v.extend(self.cmd.iter().cloned());
        v
    }

    /// [`SPAWN`]'s form: `N_UNSET NAME... N_SET NAME=VALUE... argv...`, applied by shell
    /// builtins (no `env` process), or `0 0 env ...` when a name is not a shell name.
    fn spawn_argv(&self) -> Vec<String> {
        let names_ok = self.unsets.iter().all(|u| shell_name(u))
            && self
                .sets
                .iter()
                .all(|kv| kv.split_once('=').is_some_and(|(k, _)| shell_name(k)));
        if !names_ok {
            let mut v = vec!["0".to_owned(), "0".to_owned()];
            v.extend(self.env_argv());
            return v;
        }
        let mut v = vec![self.unsets.len().to_string()];
        v.extend(self.unsets.iter().cloned());
        v.push(self.sets.len().to_string());
        v.extend(self.sets.iter().cloned());
        v.extend(self.cmd.iter().cloned());
        v
    }
}

/// The process side of an SSH sandbox.
#[derive(Debug)]
pub struct SshProcess {
    pub(crate) core: Arc<SandboxCore>,
}

impl SshProcess {
    fn build_launch(&self, spec: &ProcessSpec, id: &str) -> Result<Launch> {
        let core = &self.core;
        let mut unsets = Vec::new();
        for (k, v) in &spec.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ProviderError::InvalidRequest {
                    message: format!("invalid environment variable name {k:?}"),
                });
            }
            if v.is_none() {
                unsets.push(k.clone());
            }
        }
        let mut env: BTreeMap<String, String> = core.env.clone();
        env.insert("HOME".into(), core.workspace.clone());
        env.insert("TETHER_SSH_SANDBOX".into(), core.info.id.clone());
        env.insert("TETHER_SSH_COMMAND".into(), id.to_owned());
        for (k, v) in &spec.env {
            match v {
                Some(v) => {
                    env.insert(k.clone(), v.clone());
                }
                None => {
                    env.remove(k);
                }
            }
        }
        let sets = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let cmd = match &spec.command {
            Command::Shell(s) => vec!["/bin/bash".into(), "-c".into(), s.clone()],
            Command::Argv(a) => {
                if a.is_empty() {
                    return Err(ProviderError::InvalidRequest {
                        message: "empty argv".into(),
                    });
                }
                a.clone()
            }
        };
        Ok(Launch { unsets, sets, cmd })
    }

    fn cwd(&self, spec: &ProcessSpec) -> Result<String> {
        let ws = &self.core.workspace;
        match spec.cwd.as_deref() {
            None | Some("") => Ok(ws.clone()),
            Some(c) if c.starts_with('/') => normalize("/", c),
            Some(c) => normalize(ws, c),
        }
    }

    async fn spawn_inner(&self, ctx: &CallCtx, spec: ProcessSpec) -> Result<Arc<SshCommand>> {
        let core = &self.core;
        let id = match &spec.command_id {
            Some(id) => {
                if id.is_empty()
                    || !id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
                    || id.starts_with('.')
                {
                    return Err(ProviderError::InvalidRequest {
                        message: format!("command id {id:?}: letters, digits, - and _ only"),
                    });
                }
                if core.command(id).is_some() {
                    return Err(ProviderError::InvalidRequest {
                        message: format!("command id {id:?} is already in use"),
                    });
                }
                id.clone()
            }
            None => format!("c{}", uuid::Uuid::new_v4().simple()),
        };
        let launch = self.build_launch(&spec, &id)?;
        let cwd = self.cwd(&spec)?;
        let meta = CommandMeta {
            command: spec.command.clone(),
            cwd: Some(cwd.clone()),
            pty: spec.pty.is_some(),
            grace_ms: spec.grace_ms,
            caps: [spec.stdout_max_bytes, spec.stderr_max_bytes],
        };
        let meta_json = serde_json::to_string(&meta).map_err(|e| ProviderError::Internal {
            message: format!("encoding a command's meta: {e}"),
            source: Some(Box::new(e)),
        })?;
        let dir = core.cmd_dir(&id);
        let piped = matches!(spec.stdin, StdinMode::Pipe | StdinMode::Data { .. });
        let env_argv = launch.env_argv();
        let spawn_argv = launch.spawn_argv();
        let mut args: Vec<&str> = Vec::new();
        let line = match spec.pty {
            Some(_) => {
                args.extend([dir.as_str(), cwd.as_str(), meta_json.as_str()]);
                args.extend(env_argv.iter().map(String::as_str));
                self.core.host.line(PTY, &args)
            }
            None => {
                args.extend([
                    dir.as_str(),
                    cwd.as_str(),
                    if piped { "1" } else { "0" },
                    meta_json.as_str(),
                ]);
                args.extend(spawn_argv.iter().map(String::as_str));
                self.core.host.line(SPAWN, &args)
            }
        };
        let sctx = ctx.with_timeout(core.host.settings().request_timeout(), Clock::Total);
        let (ch, lease) = core.host.channel(&sctx).await?;
        let started = sctx
            .run(async {
                if let Some(size) = spec.pty {
                    ch.request_pty(
                        true,
                        "xterm-256color",
                        u32::from(size.cols),
                        u32::from(size.rows),
                        0,
                        0,
                        &[],
                    )
                    .await
                    .map_err(|e| crate::error::russh_error("pty", e))?;
                }
                ch.exec(true, line.as_bytes())
                    .await
                    .map_err(|e| crate::error::russh_error("exec", e))?;
                let (mut rx, tx) = ch.split();
                // The first line of stdout is the pid; whatever follows is output.
                let mut head = Vec::new();
                let mut err = Vec::new();
                let mut early = Vec::new();
                let pid = loop {
                    match rx.wait().await {
                        Some(ChannelMsg::Data { data }) => {
                            head.extend_from_slice(&data);
                            if let Some(n) = head.iter().position(|&b| b == b'\n') {
                                let line = String::from_utf8_lossy(&head[..n]).trim().to_owned();
                                let rest = head[n + 1..].to_vec();
                                match line.parse::<u32>() {
                                    Ok(pid) => break (pid, rest),
                                    Err(_) => {
                                        return Err(ProviderError::SpawnFailed {
                                            message: line,
                                            source: None,
                                        });
                                    }
                                }
                            }
                        }
                        Some(ChannelMsg::ExtendedData { data, .. }) => err.extend_from_slice(&data),
                        Some(ChannelMsg::ExitStatus { exit_status }) => {
                            early.push(exit_status);
                        }
                        Some(ChannelMsg::Close) | None => {
                            let msg = String::from_utf8_lossy(&err).trim().to_owned();
                            let msg = if msg.is_empty() {
                                String::from_utf8_lossy(&head).trim().to_owned()
                            } else {
                                msg
                            };
                            if lease.conn.closed_now() {
                                return Err(lease.conn.lost("starting a command"));
                            }
                            return Err(ProviderError::SpawnFailed {
                                message: format!("{msg} (status {early:?})"),
                                source: None,
                            });
                        }
                        Some(_) => {}
                    }
                };
                Ok((pid, rx, tx))
            })
            .await;
        let ((pid, rest), rx, tx) = started?;
        let input = if spec.pty.is_some() {
            Input::Pty(tx)
        } else {
            // Input goes through the host's journal, never this channel.
            let _ = tx.eof().await;
            if piped {
                Input::Journal {
                    offset: Some(0),
                    pending: None,
                }
            } else {
                Input::Closed
            }
        };
        let (changed, _) = watch::channel(0);
        let cmd = Arc::new(SshCommand {
            id: id.clone(),
            pid,
            meta,
            core: core.clone(),
            dir,
            buf: Arc::new(RwLock::new(Buffers::default())),
            changed,
            input: Mutex::new(input),
            window: core.host.settings().output_buffer_bytes.max(64 * 1024),
        });
        if !rest.is_empty() {
            cmd.push(OUT, &rest);
        }
        core.register(cmd.clone());
        core.tasks.spawn(cmd.clone().pump(rx, lease, false));
        if let StdinMode::Data { data } = &spec.stdin {
            let fed = async {
                cmd.write_stdin(ctx, Bytes::copy_from_slice(data)).await?;
                cmd.close_stdin(ctx).await
            }
            .await;
            if let Err(e) = fed {
                // The command waits for input it will never get: end it.
                let end = CallCtx::new(format!("stdin-{}", cmd.id))
                    .with_timeout(cmd.core.host.settings().request_timeout(), Clock::Total);
                let _ = cmd.terminate(&end).await;
                return Err(e);
            }
        }
        Ok(cmd)
    }

    /// A handle on a command found on the host (not started by this process).
    async fn adopt(
        &self,
        ctx: &CallCtx,
        id: &str,
        pid: u32,
        meta: CommandMeta,
    ) -> Result<Arc<SshCommand>> {
        let core = &self.core;
        let (changed, _) = watch::channel(0);
        let cmd = Arc::new(SshCommand {
            id: id.to_owned(),
            pid,
            meta,
            core: core.clone(),
            dir: core.cmd_dir(id),
            buf: Arc::new(RwLock::new(Buffers::default())),
            changed,
            input: Mutex::new(Input::Journal {
                offset: None,
                pending: None,
            }),
            window: core.host.settings().output_buffer_bytes.max(64 * 1024),
        });
        ctx.check()?;
        let (rx, lease) = cmd.open_follow().await?;
        core.register(cmd.clone());
        core.tasks.spawn(cmd.clone().pump(rx, lease, true));
        Ok(cmd)
    }

    async fn remote_list(
        &self,
        ctx: &CallCtx,
        only: Option<&str>,
    ) -> Result<Vec<(String, u32, String, Option<CommandMeta>)>> {
        let dir = format!("{}/cmd", self.core.state);
        let out = self
            .core
            .host
            .exec_ok(ctx, &self.core.host.line(LIST, &[&dir, only.unwrap_or("")]))
            .await?;
        let mut v = Vec::new();
        for line in out.out().lines() {
            let mut f = line.splitn(4, '\t');
            let (Some(id), Some(pid), Some(st)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            let Ok(pid) = pid.parse() else { continue };
            let meta = f.next().and_then(|m| serde_json::from_str(m).ok());
            v.push((id.to_owned(), pid, st.to_owned(), meta));
        }
        Ok(v)
    }
}

#[async_trait]
impl Process for SshProcess {
    async fn spawn(&self, ctx: &CallCtx, spec: ProcessSpec) -> Result<Arc<dyn ProcessHandle>> {
        ctx.check()?;
        Ok(self.spawn_inner(ctx, spec).await?)
    }

    async fn attach(
        &self,
        ctx: &CallCtx,
        which: ProcessSelector,
    ) -> Result<Arc<dyn ProcessHandle>> {
        let known = match &which {
            ProcessSelector::CommandId(id) => self.core.command(id),
            ProcessSelector::Pid(p) => self.core.command_by_pid(*p),
        };
        if let Some(c) = known {
            return Ok(c);
        }
        let only = match &which {
            ProcessSelector::CommandId(id) => {
                if id.is_empty() || id.contains('/') || id.starts_with('.') {
                    return Err(ProviderError::CommandNotFound { id: id.clone() });
                }
                Some(id.as_str())
            }
            ProcessSelector::Pid(_) => None,
        };
        let found = self
            .remote_list(ctx, only)
            .await?
            .into_iter()
            .find(|(id, pid, _, _)| match &which {
                ProcessSelector::CommandId(want) => id == want,
                ProcessSelector::Pid(p) => pid == p,
            });
        let Some((id, pid, _, meta)) = found else {
            return Err(ProviderError::CommandNotFound {
                id: match which {
                    ProcessSelector::CommandId(id) => id,
                    ProcessSelector::Pid(p) => p.to_string(),
                },
            });
        };
        let meta = meta.unwrap_or(CommandMeta {
            command: Command::Shell(String::new()),
            cwd: None,
            pty: false,
            grace_ms: tether_protocol::process::DEFAULT_GRACE_MS,
            caps: [None, None],
        });
        if meta.pty {
            return Err(ProviderError::Unsupported {
                op: "attach to a pty command started by another connection",
            });
        }
        Ok(self.adopt(ctx, &id, pid, meta).await?)
    }

    async fn list(&self, ctx: &CallCtx) -> Result<Vec<ProcessInfo>> {
        let mut out = Vec::new();
        for (id, pid, st, meta) in self.remote_list(ctx, None).await? {
            if let Some(c) = self.core.command(&id) {
                out.push(c.info());
                continue;
            }
            let exit = match st.as_str() {
                "run" => None,
                "gone" => Some(killed()),
                n => n.parse().ok().map(status_of),
            };
            let (command, cwd, pty) = match meta {
                Some(m) => (m.command, m.cwd, m.pty),
                None => (Command::Shell(String::new()), None, false),
            };
            out.push(ProcessInfo {
                command_id: id,
                pid,
                command,
                cwd,
                pty,
                exit,
            });
        }
        out.sort_by(|a, b| a.command_id.cmp(&b.command_id));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_above_128_are_signals() {
        assert_eq!(status_of(0).code, Some(0));
        assert_eq!(status_of(127).code, Some(127));
        assert_eq!(status_of(137).signal, Some(9));
        assert_eq!(status_of(255).code, Some(255));
    }

    #[test]
    fn environment_goes_through_builtins_unless_a_name_is_special() {
        let l = Launch {
            unsets: vec!["GONE".into()],
            sets: vec!["A=1".into(), "HOME=/w".into()],
            cmd: vec!["true".into()],
        };
        assert_eq!(l.spawn_argv(), ["1", "GONE", "2", "A=1", "HOME=/w", "true"]);
        let odd = Launch {
            unsets: vec![],
            sets: vec!["my.var=1".into()],
            cmd: vec!["true".into()],
        };
        assert_eq!(
            odd.spawn_argv(),
            ["0", "0", "env", "--", "my.var=1", "true"]
        );
        let ro = Launch {
            unsets: vec!["UID".into()],
            sets: vec![],
            cmd: vec!["true".into()],
        };
        assert_eq!(ro.spawn_argv()[..3], ["0", "0", "env"]);
    }
}
