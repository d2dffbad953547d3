//! Running commands in a session's sandbox: start, journal, bound, wait.
//!
//! Every command, whatever API started it (the `bash` tool, the processes API, the E2B
//! front), goes through [`start`]: the command is spawned in the sandbox, a tracked pump
//! task copies its output into the session's output journal (byte offsets per stream), and
//! the command's clocks run there:
//!
//! - the **total** deadline (`DEADLINE_EXCEEDED`), and
//! - the **output idle** watchdog (`IDLE_TIMEOUT`): armed while the pump waits for output,
//!   so a command that prints nothing for that long is ended.
//!
//! When a clock fires, or the command is killed, or the session closes, the pump
//! terminates the process group (TERM, grace, KILL, verify), keeps journaling what the
//! command still prints, and records `process/exited` with the clock that fired. Partial
//! output is never lost and an expiry is never reported as success.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tether_protocol::ErrorCode;
use tether_protocol::events::EventBody;
use tether_protocol::process::{ExitStatus, ProcessEvent, ProcessSpec, StreamKind};
use tether_provider::clock::{CancelReason, CancelToken, IdleWatchdog, deadline, timeout_of};
use tether_provider::{CallCtx, ProcessHandle, StreamOffsets};
use tokio::sync::watch;
use tracing::Instrument;

use crate::error::{DaemonError, Result};
use crate::session_log::OutputJournal;
use crate::session_manager::Session;
use tether_provider::Clock;

/// Limits of one command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecLimits {
    /// Total deadline; `None` = unbounded (background commands).
    pub total: Option<Duration>,
    /// Output-idle limit; `None` = off.
    pub output_idle: Option<Duration>,
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutcome {
    /// The exit status, when the command was seen to exit.
    pub status: Option<ExitStatus>,
    /// The clock that ended it, if one did.
    pub clock: Option<Clock>,
    /// The limit of that clock, ms.
    pub timeout_ms: Option<u64>,
    /// Set when the command was ended by a kill request or session close.
    pub killed: Option<String>,
    /// The kill was the daemon's shutdown.
    pub by_shutdown: bool,
    /// The sandbox limit the command ran into, when the provider can tell.
    pub limit: Option<tether_protocol::limits::LimitKind>,
    /// Bytes of stdout (or pty) journaled.
    pub stdout_bytes: u64,
    /// Bytes of stderr journaled.
    pub stderr_bytes: u64,
    /// An error of the pump itself (stream lost, journal failure), if any.
    pub error: Option<(ErrorCode, String)>,
}

impl CommandOutcome {
    /// The error code of this outcome, if it is not a normal exit.
    pub fn error_code(&self) -> Option<ErrorCode> {
        if let Some(c) = self.clock {
            return Some(c.code());
        }
        // A limit that ended the command (killed out of memory, a failed fork or write
        // that made it fail): classified, whatever signal or code it ended with.
        let failed = self.status.is_none_or(|s| s.code != Some(0));
        if self.limit.is_some() && failed {
            return Some(ErrorCode::LimitExceeded);
        }
        if self.killed.is_some() {
            // Ended by the daemon's shutdown: the session lives on after the next start,
            // so the caller may retry then.
            return Some(if self.by_shutdown {
                ErrorCode::ShuttingDown
            } else {
                ErrorCode::Cancelled
            });
        }
        self.error.as_ref().map(|(c, _)| *c)
    }
}

/// A command started through the daemon.
#[derive(Debug)]
pub struct RunningCommand {
    /// The command id.
    pub command_id: String,
    /// The pid in the sandbox.
    pub pid: u32,
    /// The spec.
    pub spec: ProcessSpec,
    /// The provider's handle (stdin, signals, resize).
    pub handle: Arc<dyn ProcessHandle>,
    /// The output journal.
    pub journal: Arc<OutputJournal>,
    outcome: watch::Receiver<Option<CommandOutcome>>,
    kill: CancelToken,
}

impl RunningCommand {
    /// The outcome, if the command has ended and its pump has finished.
    pub fn outcome(&self) -> Option<CommandOutcome> {
        self.outcome.borrow().clone()
    }

    /// Wait for the outcome.
    pub async fn wait(&self) -> CommandOutcome {
        let mut rx = self.outcome.clone();
        loop {
            if let Some(o) = rx.borrow_and_update().clone() {
                return o;
            }
            if rx.changed().await.is_err() {
                // The pump is gone without an outcome: only possible if its task panicked.
                return CommandOutcome {
                    status: None,
                    clock: None,
                    timeout_ms: None,
                    killed: None,
                    by_shutdown: false,
                    limit: None,
                    stdout_bytes: self.journal.len(StreamKind::Stdout),
                    stderr_bytes: self.journal.len(StreamKind::Stderr),
                    error: Some((ErrorCode::Internal, "the command's pump stopped".into())),
                };
            }
        }
    }

    /// End the command: its pump terminates the group (TERM, grace, KILL) and records why.
    pub fn kill(&self, why: &'static str) {
        self.kill.cancel(CancelReason::Caller(why));
    }

    /// Whether the command still runs.
    pub fn is_running(&self) -> bool {
        self.outcome.borrow().is_none()
    }

    /// The command's events from the journal, starting at `from`: output chunks (stdout
    /// and stderr, each in order), then `Exited` once the command has ended. Follows live
    /// output. Independent of the provider's stream, so it survives provider re-attach.
    pub fn events(
        self: &Arc<Self>,
        from: StreamOffsets,
    ) -> BoxStream<'static, Result<ProcessEvent>> {
        let pty = self.spec.pty.is_some();
        let first = if pty {
            StreamKind::Pty
        } else {
            StreamKind::Stdout
        };
        let out = self
            .journal
            .read(first, from.stdout, true)
            .map(move |r| (first, r));
        let err = self
            .journal
            .read(StreamKind::Stderr, from.stderr, true)
            .map(|r| (StreamKind::Stderr, r));
        let merged = futures_util::stream::select(out, err).map(|(stream, r)| {
            r.map(|(offset, data): (u64, Bytes)| ProcessEvent::Output {
                stream,
                offset,
                data: data.to_vec(),
            })
            .map_err(DaemonError::from)
        });
        let me = Arc::clone(self);
        let tail = futures_util::stream::once(async move {
            let o = me.wait().await;
            Ok(ProcessEvent::Exited {
                status: o.status.unwrap_or(ExitStatus {
                    code: None,
                    signal: Some(9),
                }),
                stdout_bytes: o.stdout_bytes,
                stderr_bytes: o.stderr_bytes,
            })
        });
        merged.chain(tail).boxed()
    }
}

/// How a command's `process/exited` event reaches the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExitRecord {
    /// Durable before the outcome is handed on (a caller may read the end from the log).
    Durable,
    /// Written with the caller's next durable event (a tool call's `tool/result` group),
    /// saving an `fdatasync`. Lost in a crash only together with that event; the restarted
    /// daemon then finds the command ended through its provider and logs the end itself.
    WithNext,
}

/// Start a command in the session's sandbox and its pump. `ctx` bounds only the start.
pub async fn start(
    session: &Arc<Session>,
    ctx: &CallCtx,
    spec: ProcessSpec,
    limits: ExecLimits,
) -> Result<Arc<RunningCommand>> {
    start_with(session, ctx, spec, limits, ExitRecord::Durable).await
}

async fn start_with(
    session: &Arc<Session>,
    ctx: &CallCtx,
    mut spec: ProcessSpec,
    limits: ExecLimits,
    exit: ExitRecord,
) -> Result<Arc<RunningCommand>> {
    let sandbox = session.sandbox()?;
    if spec.command_id.is_none() {
        spec.command_id = Some(uuid::Uuid::new_v4().simple().to_string());
    }
    if let Some(id) = &spec.command_id {
        // Everything that can refuse the command is checked before it runs: a command
        // that was spawned always has a pump, a journal and a deadline.
        crate::session_log::validate_id("command id", id)?;
        if session.command(id).is_some() {
            return Err(DaemonError::Conflict {
                message: format!("command id {id} is already in use"),
            });
        }
    }
    session.touch();
    let span = tracing::info_span!(
        "process.start",
        session.id = %session.id,
        sandbox.id = %sandbox.info().id,
        provider.kind = %session.provider_kind,
        outcome = tracing::field::Empty,
        error.code = tracing::field::Empty,
    );
    // The command joins the trace as a child of `process.start` when spans are exported,
    // else it carries the caller's context through unchanged.
    let span_trace = crate::telemetry::current_trace_context(&span);
    let trace = if span_trace.traceparent.is_some() {
        &span_trace
    } else {
        &ctx.trace
    };
    if let Some(tp) = &trace.traceparent {
        spec.env
            .entry("TRACEPARENT".into())
            .or_insert_with(|| Some(tp.clone()));
        if let Some(ts) = &trace.tracestate {
            spec.env
                .entry("TRACESTATE".into())
                .or_insert_with(|| Some(ts.clone()));
        }
    }
    let handle = match sandbox
        .process()
        .spawn(ctx, spec.clone())
        .instrument(span.clone())
        .await
    {
        Ok(h) => {
            span.record("outcome", "ok");
            h
        }
        Err(e) => {
            span.record("outcome", e.code().as_str());
            span.record("error.code", e.code().as_str());
            return Err(e.into());
        }
    };
    let command_id = handle.command_id().to_owned();
    let recorded = async {
        let journal = session.log.journal(&command_id).await?;
        session
            .log
            .append(EventBody::ProcessStarted {
                command_id: command_id.clone(),
                pid: handle.pid(),
                spec: spec.clone(),
                deadline_ms: limits.total.map(|t| {
                    crate::leases::now_ms()
                        .saturating_add(i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
                }),
                output_idle_ms: limits
                    .output_idle
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            })
            .await?;
        Ok::<_, DaemonError>(journal)
    }
    .await;
    let journal = match recorded {
        Ok(j) => j,
        Err(e) => {
            // It runs but cannot be supervised: end it rather than leave it unlisted.
            terminate(session, &handle).await;
            return Err(e);
        }
    };
    Ok(supervise(
        session,
        handle,
        journal,
        spec,
        limits,
        StreamOffsets::default(),
        exit,
    ))
}

/// Supervise again, after a restart, a command the log says was started and never ended:
/// its provider found it (`handle`); its pump resumes at the journal's lengths under what
/// is left of its deadline (an expired one ends it at once).
pub async fn resume(
    session: &Arc<Session>,
    handle: Arc<dyn ProcessHandle>,
    spec: ProcessSpec,
    deadline_ms: Option<i64>,
    output_idle_ms: Option<u64>,
) -> Result<Arc<RunningCommand>> {
    let command_id = handle.command_id().to_owned();
    let journal = session.log.journal(&command_id).await?;
    let from = StreamOffsets {
        stdout: journal
            .len(StreamKind::Stdout)
            .max(journal.len(StreamKind::Pty)),
        stderr: journal.len(StreamKind::Stderr),
    };
    let limits = ExecLimits {
        total: deadline_ms.map(|at| {
            Duration::from_millis(
                u64::try_from(at.saturating_sub(crate::leases::now_ms()))
                    .unwrap_or(0)
                    .max(1),
            )
        }),
        output_idle: output_idle_ms.map(Duration::from_millis),
    };
    Ok(supervise(
        session,
        handle,
        journal,
        spec,
        limits,
        from,
        ExitRecord::Durable,
    ))
}

/// The running command's record and its pump task, reading the provider's events from
/// `from` into the journal under `limits`, then logging `process/exited`.
fn supervise(
    session: &Arc<Session>,
    handle: Arc<dyn ProcessHandle>,
    journal: Arc<OutputJournal>,
    spec: ProcessSpec,
    limits: ExecLimits,
    from: StreamOffsets,
    exit: ExitRecord,
) -> Arc<RunningCommand> {
    let command_id = handle.command_id().to_owned();
    let (tx, rx) = watch::channel(None);
    let kill = session.cancel.child();
    let cmd = Arc::new(RunningCommand {
        command_id: command_id.clone(),
        pid: handle.pid(),
        spec,
        handle: Arc::clone(&handle),
        journal: Arc::clone(&journal),
        outcome: rx,
        kill: kill.clone(),
    });
    session.insert_command(Arc::clone(&cmd));
    let cmd_grace = cmd.spec.grace_ms;
    let pump_span = tracing::info_span!(
        "process.stream",
        session.id = %session.id,
        command.id = %command_id,
        provider.kind = %session.provider_kind,
        outcome = tracing::field::Empty,
        timeout.clock = tracing::field::Empty,
        exit_code = tracing::field::Empty,
        bytes.out = tracing::field::Empty,
    );
    let session2 = Arc::clone(session);
    session.tasks().spawn(
        async move {
            let grace = Duration::from_millis(cmd_grace);
            let outcome = pump(&session2, handle, &journal, kill, limits, grace, from).await;
            let span = tracing::Span::current();
            span.record("outcome", outcome.error_code().map_or("ok", |c| c.as_str()));
            if let Some(c) = outcome.clock {
                span.record("timeout.clock", c.name());
            }
            if let Some(code) = outcome.status.and_then(|s| s.code) {
                span.record("exit_code", i64::from(code));
            }
            span.record("bytes.out", i64::try_from(outcome.stdout_bytes + outcome.stderr_bytes).unwrap_or(i64::MAX));
            let _ = journal.sync().await;
            journal.finish().await;
            let ended = EventBody::ProcessExited {
                command_id: command_id.clone(),
                status: outcome.status.unwrap_or(ExitStatus { code: None, signal: None }),
                stdout_bytes: outcome.stdout_bytes,
                stderr_bytes: outcome.stderr_bytes,
                clock: outcome.clock,
                limit: outcome.limit,
            };
            let logged = match exit {
                ExitRecord::Durable => session2.log.append(ended).await.map(drop),
                ExitRecord::WithNext => {
                    session2.log.stage(ended).await;
                    Ok(())
                }
            };
            if let Err(e) = logged {
                tracing::warn!(command.id = %command_id, error = %e, "Could not log the end of a command");
            }
            if let Some(c) = outcome.clock {
                session2.metrics().timeout(c, &session2.provider_kind);
            }
            let _ = tx.send(Some(outcome));
        }
        .instrument(pump_span),
    );
    cmd
}

/// Copy the command's events into the journal under its clocks; terminate on expiry.
/// Tells the provider, every `step` bytes journaled, that it may free its copy of the
/// output the journal now holds durably (after a sync: a crash must never leave output
/// that is in neither copy).
struct Release {
    step: u64,
    at: u64,
}

impl Release {
    fn new(step: u64, from: StreamOffsets) -> Self {
        Self {
            step,
            at: from.stdout + from.stderr,
        }
    }

    async fn after_append(&mut self, journal: &OutputJournal, handle: &Arc<dyn ProcessHandle>) {
        let offsets = StreamOffsets {
            stdout: journal
                .len(StreamKind::Stdout)
                .max(journal.len(StreamKind::Pty)),
            stderr: journal.len(StreamKind::Stderr),
        };
        let total = offsets.stdout + offsets.stderr;
        if self.step == 0 || total < self.at + self.step {
            return;
        }
        if journal.sync().await.is_ok() {
            handle.release(offsets).await;
            self.at = total;
        }
    }
}

async fn pump(
    session: &Arc<Session>,
    handle: Arc<dyn ProcessHandle>,
    journal: &OutputJournal,
    kill: CancelToken,
    limits: ExecLimits,
    grace: Duration,
    from: StreamOffsets,
) -> CommandOutcome {
    let total_ms = limits.total.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
    let total = match deadline(Some(&kill), total_ms, Clock::Total) {
        Ok(d) => d,
        Err(e) => return pump_error(journal, ErrorCode::InvalidRequest, e.to_string()),
    };
    let idle = match limits.output_idle {
        Some(d) if !d.is_zero() => match IdleWatchdog::new(
            Some(total.token()),
            d.as_secs_f64() * 1000.0,
            Clock::OutputIdle,
        ) {
            Ok(w) => Some(w),
            Err(e) => return pump_error(journal, ErrorCode::InvalidRequest, e.to_string()),
        },
        _ => None,
    };
    let token = idle
        .as_ref()
        .map_or_else(|| total.token().clone(), |w| w.token().clone());
    let mut events = handle.events(from);
    let mut release = Release::new(session.deadlines.output_release_bytes, from);
    let mut status = None;
    let mut error = None;
    let mut fired: Option<CancelReason> = None;
    let mut capped = false;
    loop {
        let demand = async {
            tokio::select! {
                biased;
                e = events.next() => Some(e),
                _ = token.cancelled(), if fired.is_none() => None,
            }
        };
        let next = match &idle {
            Some(w) if fired.is_none() => w.next(demand).await.unwrap_or(None),
            _ => demand.await,
        };
        match next {
            Some(Some(Ok(ProcessEvent::Output {
                stream,
                offset,
                data,
            }))) => {
                if capped {
                    continue;
                }
                if !session.output_allowed() {
                    // The session's output cap: nothing more is stored, the command ends.
                    capped = true;
                    error = Some((
                        ErrorCode::LimitExceeded,
                        format!(
                            "the command was ended: the session's output cap of {} bytes is reached",
                            session.deadlines.session_output_max_bytes
                        ),
                    ));
                    fired.get_or_insert(CancelReason::Caller("session output cap"));
                    terminate(session, &handle).await;
                    continue;
                }
                let before = journal.len(stream);
                if let Err(e) = journal.append(stream, offset, &data).await {
                    error = Some((e.code(), e.to_string()));
                    fired.get_or_insert(CancelReason::Caller("journal failure"));
                    terminate(session, &handle).await;
                }
                session.add_output(journal.len(stream).saturating_sub(before));
                release.after_append(journal, &handle).await;
            }
            Some(Some(Ok(ProcessEvent::Exited { status: s, .. }))) => {
                status = Some(s);
                break;
            }
            Some(Some(Ok(ProcessEvent::Started { .. }))) => {}
            Some(Some(Err(e))) => {
                // The provider's stream is lost (after its own re-attach attempts): the
                // command can no longer be watched, so it is ended, never left running
                // without a pump, a deadline or a journal.
                error = Some((e.code(), e.to_string()));
                crate::ops::count_provider_clock(session.metrics(), &e, &session.provider_kind);
                terminate(session, &handle).await;
                break;
            }
            Some(None) => break,
            None => {
                fired = token.reason();
                terminate(session, &handle).await;
                // Keep journaling what the command still prints until it is gone.
                let drain = async {
                    while let Some(ev) = events.next().await {
                        match ev {
                            Ok(ProcessEvent::Output {
                                stream,
                                offset,
                                data,
                            }) => {
                                let _ = journal.append(stream, offset, &data).await;
                            }
                            Ok(ProcessEvent::Exited { status: s, .. }) => return Some(s),
                            Ok(ProcessEvent::Started { .. }) => {}
                            Err(_) => return None,
                        }
                    }
                    None
                };
                status =
                    tokio::time::timeout(grace + session.deadlines.drain_after_terminate, drain)
                        .await
                        .ok()
                        .flatten();
                break;
            }
        }
    }
    let (clock, timeout_ms, mut killed) = match &fired {
        Some(r) => match timeout_of(r, None) {
            Some(t) => (Some(t.clock), Some(t.timeout_ms), None),
            None => (None, None, Some(r.to_string())),
        },
        None => (None, None, None),
    };
    if capped {
        // Ended by the session's output cap: classified as that limit, not as a kill.
        killed = None;
    }
    let pty = journal.len(StreamKind::Pty);
    CommandOutcome {
        status,
        clock,
        timeout_ms,
        killed,
        by_shutdown: matches!(fired, Some(CancelReason::Shutdown)),
        limit: if capped {
            Some(tether_protocol::limits::LimitKind::Disk)
        } else {
            handle.limit_hit()
        },
        stdout_bytes: journal.len(StreamKind::Stdout) + pty,
        stderr_bytes: journal.len(StreamKind::Stderr),
        error,
    }
}

async fn terminate(session: &Arc<Session>, handle: &Arc<dyn ProcessHandle>) {
    let ctx = CallCtx::new(format!("terminate-{}", handle.command_id()))
        .with_timeout(session.deadlines.terminate, Clock::Total);
    let span = tracing::info_span!("process.kill", session.id = %session.id, command.id = %handle.command_id());
    match handle.terminate(&ctx).instrument(span).await {
        Ok(r) if r.survivors > 0 => {
            tracing::error!(command.id = %handle.command_id(), survivors = r.survivors, "Processes survived terminate")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(command.id = %handle.command_id(), error = %e, "Terminate failed"),
    }
}

fn pump_error(journal: &OutputJournal, code: ErrorCode, message: String) -> CommandOutcome {
    CommandOutcome {
        status: None,
        clock: None,
        timeout_ms: None,
        killed: None,
        by_shutdown: false,
        limit: None,
        stdout_bytes: journal.len(StreamKind::Stdout),
        stderr_bytes: journal.len(StreamKind::Stderr),
        error: Some((code, message)),
    }
}

/// Start a command and wait for it under `ctx`: if `ctx` is cancelled (a tool's own
/// deadline, the caller going away), the command is killed and its partial outcome
/// returned once its group is gone; the caller classifies the cancellation.
pub async fn run(
    session: &Arc<Session>,
    ctx: &CallCtx,
    spec: ProcessSpec,
    limits: ExecLimits,
) -> Result<(Arc<RunningCommand>, CommandOutcome)> {
    let cmd = start_with(session, ctx, spec, limits, ExitRecord::WithNext).await?;
    let outcome = tokio::select! {
        o = cmd.wait() => o,
        _ = ctx.cancel.cancelled() => {
            match ctx.cancel.reason() {
                // The caller's own deadline (`Tether-Timeout-Ms`, an E2B
                // `Connect-Timeout-Ms`): the command ends as that deadline, with its clock.
                Some(r @ CancelReason::Timeout(t)) if t.clock == Clock::Total => {
                    cmd.kill.cancel(r);
                }
                // A tool's own deadline or a caller going away: the caller classifies it.
                _ => cmd.kill("call cancelled"),
            }
            cmd.wait().await
        }
    };
    Ok((cmd, outcome))
}
