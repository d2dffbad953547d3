//! The batch scheduler: dsh's `executeToolCalls`, a barrier plus a bounded rolling pool.
//!
//! The calls of one model reply run in groups. The first pending call is classified: an
//! exclusive call is a group of one (a barrier: it starts only when nothing else runs and
//! nothing starts beside it); a concurrency-safe call opens a rolling pool over the calls
//! that follow, at most `max_parallel_tool_calls` in flight. Each further call is
//! re-classified right before it would start; one that became exclusive ends the pool
//! (after the pool drains) and opens the next group.
//!
//! Starting a call is sequential and in model order: its `pre_execute` waterfall runs, its
//! arguments are checked, its `tool/call` is logged, and only then is it dispatched (or,
//! if refused, given its result). Only dispatches overlap, each in a task of its own.
//! Results are committed in model order: a finished call waits for every earlier call;
//! committing runs the `post_execute` waterfall and logs the `tool/result`.
//!
//! Cancellation of the batch's context stops starting new calls, drains the started ones
//! and commits their results, then logs a `tool/call` and a `CANCELLED` result ("tool
//! call aborted before dispatch") for every call that did not start; the turn ends as
//! `cancelled`. A failure of the scheduler itself (the log refusing an append) stops new
//! starts, drains what runs, closes the turn as best it can (dsh's repair results), and
//! returns the first failure.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, Weak};

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use serde_json::Value;
use tether_protocol::ErrorCode;
use tether_protocol::api::ToolCallRequest;
use tether_protocol::events::{EventBody, ToolError, ToolResult, TurnEndKind};
use tether_provider::CallCtx;
use tether_provider::ProviderError;
use tether_provider::clock::CancelReason;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use super::guards::{ExecNext, Guard, Invocation, PostDecision, PostNext, PreDecision};
use super::tools::{ToolOutput, ToolRegistry};
use crate::error::{DaemonError, Result};
use crate::session_log::{not_started_result, outcome_unknown_result};
use crate::session_manager::Session;
use crate::telemetry::Metrics;

/// The text of a call that never started because the batch was cancelled.
pub const ABORTED_BEFORE_DISPATCH: &str = "tool call aborted before dispatch";
/// The text of a call whose caller cancelled it while it ran and that did not fail.
pub const ABORTED: &str = "tool call aborted";
/// The reason of an `ask` decision without a reason of its own.
const ASK_WITHOUT_APPROVER: &str = "the tool call needs an approval and no approver is configured";
/// The text of a post-execute block without feedback.
const BLOCKED: &str = "tool result blocked by post-execute policy";

/// Refuse empty and repeated call ids (the in-session check runs under the batch lock).
pub(crate) fn check_ids(calls: &[ToolCallRequest]) -> Result<()> {
    let mut seen = HashSet::new();
    for c in calls {
        if c.id.is_empty() {
            return Err(DaemonError::invalid("a tool call has an empty id"));
        }
        if !seen.insert(c.id.as_str()) {
            return Err(DaemonError::invalid(format!(
                "call id {:?} appears twice in the batch",
                c.id
            )));
        }
    }
    Ok(())
}

/// Arguments as the tools see them: `null` is `{}`; a string holding JSON (the raw form
/// some model APIs use) is decoded, an empty one is `{}`, and any other string stays a
/// string (which no built-in tool accepts).
pub fn normalize_arguments(v: &Value) -> Value {
    match v {
        Value::Null => Value::Object(Default::default()),
        Value::String(s) if s.trim().is_empty() => Value::Object(Default::default()),
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| v.clone()),
        other => other.clone(),
    }
}

// === impl CallBooks ===

/// Per session: the call ids already used and the next turn number, read incrementally
/// from the log so a batch never rescans the whole log.
#[derive(Debug, Default)]
pub(crate) struct CallBooks {
    books: RwLock<HashMap<String, Book>>,
}

#[derive(Debug)]
struct Book {
    owner: Weak<Session>,
    scanned: Option<u64>,
    used: HashSet<String>,
    next_turn: u64,
}

impl CallBooks {
    /// Bring the session's book up to date; refuse ids it already used. Returns the next
    /// turn number. Call under the session's batch lock.
    async fn check(&self, session: &Arc<Session>, calls: &[ToolCallRequest]) -> Result<u64> {
        let scanned = {
            let mut books = self.books.write().unwrap_or_else(|p| p.into_inner());
            books.retain(|_, b| b.owner.strong_count() > 0);
            Self::book(&mut books, session).scanned
        };
        // Read outside the lock: events older than the log's held window come from disk.
        let events = session.log.events_after(scanned).await?;
        let mut books = self.books.write().unwrap_or_else(|p| p.into_inner());
        let book = Self::book(&mut books, session);
        for e in events {
            if book.scanned.is_some_and(|s| e.seq <= s) {
                continue;
            }
            match &e.body {
                EventBody::TurnStart { turn, call_ids } => {
                    book.next_turn = book.next_turn.max(turn.saturating_add(1));
                    book.used.extend(call_ids.iter().cloned());
                }
                EventBody::ToolCall { call_id, .. } => {
                    book.used.insert(call_id.clone());
                }
                EventBody::ToolResult { result, .. } => {
                    book.used.insert(result.call_id.clone());
                }
                _ => {}
            }
            book.scanned = Some(e.seq);
        }
        if let Some(c) = calls.iter().find(|c| book.used.contains(&c.id)) {
            return Err(DaemonError::invalid(format!(
                "call id {:?} was already used in this session",
                c.id
            )));
        }
        Ok(book.next_turn)
    }

    /// The book of `session` (a new one for a session it has not seen, or for a new
    /// session object with the same id).
    fn book<'a>(books: &'a mut HashMap<String, Book>, session: &Arc<Session>) -> &'a mut Book {
        let owner = Arc::downgrade(session);
        books
            .entry(session.id.clone())
            .and_modify(|b| {
                if !Weak::ptr_eq(&b.owner, &owner) {
                    *b = Book::new(owner.clone());
                }
            })
            .or_insert_with(|| Book::new(owner.clone()))
    }

    pub(crate) fn forget(&self, session_id: &str) {
        self.books
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session_id);
    }
}

impl Book {
    fn new(owner: Weak<Session>) -> Self {
        Self {
            owner,
            scanned: None,
            used: HashSet::new(),
            next_turn: 0,
        }
    }
}

// === impl Batch ===

/// What a batch needs of the pipeline (cheap clones, so the batch can run in a task).
#[derive(Debug)]
pub(crate) struct Batch {
    pub(crate) tools: Arc<ToolRegistry>,
    pub(crate) guards: Arc<Vec<Arc<dyn Guard>>>,
    pub(crate) max_parallel: usize,
    pub(crate) metrics: Metrics,
    pub(crate) books: Arc<CallBooks>,
}

impl Batch {
    /// Run the batch under the session's batch lock.
    pub(crate) async fn run(
        self,
        session: Arc<Session>,
        ctx: CallCtx,
        calls: Vec<ToolCallRequest>,
    ) -> Result<Vec<ToolResult>> {
        let _turn_lock = tokio::select! {
            biased;
            g = session.batch_lock.lock() => g,
            _ = ctx.cancel.cancelled() => {
                let reason = ctx.cancel.reason().unwrap_or(CancelReason::Caller("cancelled"));
                return Err(ProviderError::from_reason(reason).into());
            }
        };
        let turn = self.books.check(&session, &calls).await?;
        if let Some(open) = session.log.open_turn() {
            return Err(DaemonError::Conflict {
                message: format!("turn {open} of the session is still open"),
            });
        }
        let call_ids = calls.iter().map(|c| c.id.clone()).collect();
        // Staged: written with the first tool/call (or result) in one group commit.
        session
            .log
            .stage(EventBody::TurnStart { turn, call_ids })
            .await;
        Span::current().record("turn", turn);
        session.touch();

        let planned: Vec<Planned> = calls
            .into_iter()
            .map(|req| {
                let tool = self.tools.get(&req.name);
                let span = tracing::info_span!(
                    "tool.call",
                    session.id = %session.id,
                    provider.kind = %session.provider_kind,
                    tool.name = %req.name,
                    tool.call_id = %req.id,
                    outcome = Empty,
                    error.code = Empty,
                    timeout.clock = Empty,
                );
                let inv = Invocation {
                    session: Arc::clone(&session),
                    call_id: req.id.clone(),
                    name: req.name.clone(),
                    arguments: normalize_arguments(&req.arguments),
                    ctx: ctx.clone(),
                    tool,
                };
                Planned {
                    raw_arguments: req.arguments,
                    inv: Arc::new(inv),
                    span,
                    started: None,
                    call_seq: None,
                }
            })
            .collect();
        let n = planned.len();
        let mut runner = Runner {
            batch: self,
            session: Arc::clone(&session),
            ctx,
            calls: planned,
            slots: (0..n).map(|_| None).collect(),
            results: (0..n).map(|_| None).collect(),
            committed: 0,
        };
        match runner.run().await {
            Ok(aborted) => {
                let kind = if aborted {
                    TurnEndKind::Cancelled
                } else {
                    TurnEndKind::Completed
                };
                session
                    .log
                    .append(EventBody::TurnEnd { turn, kind })
                    .await?;
                Span::current().record(
                    "outcome",
                    if aborted {
                        ErrorCode::Cancelled.as_str()
                    } else {
                        "ok"
                    },
                );
                session.touch();
                Ok(runner.results.into_iter().flatten().collect())
            }
            Err(e) => {
                tracing::error!(session.id = %session.id, turn, error = %e, "A tool batch failed; closing its turn");
                Span::current().record("outcome", e.code().as_str());
                runner.close_after_failure(turn).await;
                Err(e)
            }
        }
    }
}

/// One call of the batch.
#[derive(Debug)]
struct Planned {
    /// The arguments as given (logged so).
    raw_arguments: Value,
    inv: Arc<Invocation>,
    span: Span,
    started: Option<Instant>,
    call_seq: Option<u64>,
}

/// A settled call awaiting its model-order commit.
#[derive(Debug)]
struct Slot {
    output: ToolOutput,
    post: bool,
    finished: Instant,
}

type InFlight = FuturesUnordered<BoxFuture<'static, (usize, ToolOutput, Instant)>>;

/// The scheduler's state for one batch.
struct Runner {
    batch: Batch,
    session: Arc<Session>,
    ctx: CallCtx,
    calls: Vec<Planned>,
    slots: Vec<Option<Slot>>,
    results: Vec<Option<ToolResult>>,
    /// Every call before this index has its result logged.
    committed: usize,
}

// === impl Runner ===

impl Runner {
    /// Run every group; `Ok(true)` when the batch was cancelled.
    async fn run(&mut self) -> Result<bool> {
        let n = self.calls.len();
        let mut next = 0;
        while next < n {
            let parallel = !self.exclusive(next);
            let end = if parallel { n } else { next + 1 };
            let (started, aborted) = self.run_group(next, end, parallel).await?;
            next += started;
            if aborted {
                self.skip_from(next).await?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Whether call `i` must run alone, asked right before it would start. Fails closed:
    /// an unknown tool is exclusive.
    fn exclusive(&self, i: usize) -> bool {
        let inv = &self.calls[i].inv;
        inv.tool
            .as_ref()
            .is_none_or(|t| t.exclusive(&inv.arguments))
    }

    /// Run one barrier (`end == start + 1`) or pool. Returns how many calls started and
    /// whether the batch was cancelled.
    async fn run_group(
        &mut self,
        start: usize,
        end: usize,
        parallel: bool,
    ) -> Result<(usize, bool)> {
        let mut in_flight: InFlight = FuturesUnordered::new();
        let mut next = start;
        let mut aborted = self.ctx.cancel.is_cancelled();
        let mut failure: Option<DaemonError> = None;
        loop {
            while failure.is_none()
                && !aborted
                && next < end
                && in_flight.len() < self.batch.max_parallel
            {
                // Re-classify right before the start: a call that became exclusive waits
                // for the pool to drain and opens the next group.
                if next > start && parallel && self.exclusive(next) {
                    break;
                }
                match self.start_call(next).await {
                    Ok(Some(dispatch)) => in_flight.push(dispatch),
                    Ok(None) => {}
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
                next += 1;
                if let Err(e) = self.commit_ready().await {
                    failure = Some(e);
                    break;
                }
                // Cancellation may arrive while pre-execute or a commit awaits.
                aborted |= self.ctx.cancel.is_cancelled();
            }
            let Some((i, output, finished)) = in_flight.next().await else {
                break;
            };
            self.slots[i] = Some(Slot {
                output,
                post: true,
                finished,
            });
            if failure.is_none()
                && let Err(e) = self.commit_ready().await
            {
                failure = Some(e);
            }
            aborted |= self.ctx.cancel.is_cancelled();
        }
        // Every started call has settled: `in_flight` is empty.
        if let Some(e) = failure {
            return Err(e);
        }
        self.commit_ready().await?;
        Ok((next - start, aborted))
    }

    /// Start call `i`: pre-execute, argument check, `tool/call`, then dispatch (returned
    /// as a future to await) or an immediate result (put in its slot).
    async fn start_call(
        &mut self,
        i: usize,
    ) -> Result<Option<BoxFuture<'static, (usize, ToolOutput, Instant)>>> {
        let started = Instant::now();
        self.calls[i].started = Some(started);
        let inv = Arc::clone(&self.calls[i].inv);
        let span = self.calls[i].span.clone();
        let refusal = self.prepare(&inv).instrument(span.clone()).await;
        let logged = self
            .session
            .log
            .append(EventBody::ToolCall {
                call_id: inv.call_id.clone(),
                name: inv.name.clone(),
                arguments: self.calls[i].raw_arguments.clone(),
            })
            .await?;
        self.calls[i].call_seq = Some(logged.seq);
        let tool = match (refusal, &inv.tool) {
            (Some((output, post)), _) => {
                self.slots[i] = Some(Slot {
                    output,
                    post,
                    finished: Instant::now(),
                });
                return Ok(None);
            }
            (None, None) => {
                // `prepare` refuses unknown tools; unreachable, but never a panic.
                let output = unknown_tool(&inv.name);
                self.slots[i] = Some(Slot {
                    output,
                    post: true,
                    finished: Instant::now(),
                });
                return Ok(None);
            }
            (None, Some(tool)) => Arc::clone(tool),
        };
        let guards = Arc::clone(&self.batch.guards);
        let task = self.session.tasks().spawn(
            async move {
                let output = ExecNext::new(&guards, &tool).run(&inv, &inv.ctx).await;
                (settle_abort(output, &inv.ctx), Instant::now())
            }
            .instrument(span),
        );
        Ok(Some(Box::pin(async move {
            match task.await {
                Ok((output, finished)) => (i, output, finished),
                Err(e) => {
                    tracing::error!(error = %e, "A tool task failed");
                    (
                        i,
                        ToolOutput::error(ErrorCode::Internal, "the tool failed unexpectedly"),
                        Instant::now(),
                    )
                }
            }
        })))
    }

    /// The ordered, sequential part of a start. `Some((result, run post-execute))` refuses
    /// the dispatch.
    async fn prepare(&self, inv: &Invocation) -> Option<(ToolOutput, bool)> {
        for g in self.batch.guards.iter() {
            match g.pre_execute(inv).await {
                PreDecision::Allow => {}
                PreDecision::Deny { reason } => {
                    return Some((ToolOutput::error(ErrorCode::ToolDenied, reason), true));
                }
                PreDecision::Ask { reason } => {
                    let reason = reason.unwrap_or_else(|| ASK_WITHOUT_APPROVER.to_owned());
                    return Some((ToolOutput::error(ErrorCode::ToolDenied, reason), true));
                }
            }
        }
        let Some(tool) = &inv.tool else {
            return Some((unknown_tool(&inv.name), true));
        };
        if let Err(why) = tool.check_args(&inv.arguments) {
            return Some((ToolOutput::error(ErrorCode::InvalidRequest, why), true));
        }
        if self.ctx.cancel.is_cancelled() {
            return Some((
                ToolOutput::error(ErrorCode::Cancelled, ABORTED_BEFORE_DISPATCH),
                false,
            ));
        }
        None
    }

    /// Commit every settled call whose predecessors are committed, in model order.
    async fn commit_ready(&mut self) -> Result<()> {
        while self.committed < self.calls.len() {
            let i = self.committed;
            let Some(slot) = self.slots[i].take() else {
                break;
            };
            let call = &self.calls[i];
            let inv = Arc::clone(&call.inv);
            let span = call.span.clone();
            let decision = if slot.post {
                PostNext::new(&self.batch.guards)
                    .run(&inv, &slot.output)
                    .instrument(span.clone())
                    .await
            } else {
                PostDecision::accept()
            };
            let result = apply(slot.output, decision, &inv.call_id);
            let body = EventBody::ToolResult {
                result: result.clone(),
                call_seq: call.call_seq,
            };
            if i + 1 == self.calls.len() {
                // The last result is written with `turn/end`, in one group commit: the
                // batch is acknowledged only after both are durable.
                self.session.log.stage(body).await;
            } else {
                self.session.log.append(body).await?;
            }
            let outcome = result.error.as_ref().map_or("ok", |e| e.code.as_str());
            span.record("outcome", outcome);
            if let Some(e) = &result.error {
                span.record("error.code", e.code.as_str());
                if let Some(clock) = &e.clock {
                    span.record("timeout.clock", clock.name());
                }
            }
            let label = if inv.tool.is_some() {
                inv.name.as_str()
            } else {
                "unknown"
            };
            let took = call
                .started
                .map(|s| slot.finished.saturating_duration_since(s))
                .unwrap_or_default();
            self.batch
                .metrics
                .tool_call(label, &self.session.provider_kind, outcome, took);
            self.results[i] = Some(result);
            self.committed += 1;
        }
        Ok(())
    }

    /// After a cancellation: a `tool/call` and an aborted-before-dispatch result for every
    /// call from `from` on, in model order.
    async fn skip_from(&mut self, from: usize) -> Result<()> {
        for i in from..self.calls.len() {
            let call = &self.calls[i];
            let logged = self
                .session
                .log
                .append(EventBody::ToolCall {
                    call_id: call.inv.call_id.clone(),
                    name: call.inv.name.clone(),
                    arguments: call.raw_arguments.clone(),
                })
                .await?;
            let result = ToolOutput::error(ErrorCode::Cancelled, ABORTED_BEFORE_DISPATCH)
                .into_result(&call.inv.call_id);
            self.session
                .log
                .append(EventBody::ToolResult {
                    result: result.clone(),
                    call_seq: Some(logged.seq),
                })
                .await?;
            call.span.record("outcome", ErrorCode::Cancelled.as_str());
            call.span
                .record("error.code", ErrorCode::Cancelled.as_str());
            self.results[i] = Some(result);
            self.committed = i + 1;
        }
        Ok(())
    }

    /// Best effort after a scheduler failure: the repair results for the calls without a
    /// logged result, then `turn/end {interrupted}`, so the session stays usable when the
    /// log itself still is.
    async fn close_after_failure(&mut self, turn: u64) {
        let mut bodies = Vec::new();
        for (i, call) in self.calls.iter().enumerate().skip(self.committed) {
            if self.results[i].is_some() {
                continue;
            }
            let result = match call.call_seq {
                Some(_) => outcome_unknown_result(&call.inv.call_id),
                None => not_started_result(&call.inv.call_id),
            };
            bodies.push(EventBody::ToolResult {
                result,
                call_seq: call.call_seq,
            });
        }
        bodies.push(EventBody::TurnEnd {
            turn,
            kind: TurnEndKind::Interrupted,
        });
        if let Err(e) = self.session.log.append_all(bodies).await {
            tracing::error!(session.id = %self.session.id, error = %e, "Could not close a failed turn; it is repaired when the log is re-opened");
        }
    }
}

fn unknown_tool(name: &str) -> ToolOutput {
    ToolOutput::error(ErrorCode::UnknownTool, format!("unknown tool \"{name}\""))
}

/// A call whose caller cancelled it while it ran: a successful output becomes `CANCELLED`
/// ("tool call aborted"); an error keeps its own code (a `TOOL_TIMEOUT` that fired first
/// stays one).
fn settle_abort(output: ToolOutput, caller: &CallCtx) -> ToolOutput {
    if output.is_error || !caller.cancel.is_cancelled() {
        return output;
    }
    ToolOutput::error(ErrorCode::Cancelled, ABORTED)
}

/// The result of a call after the `post_execute` waterfall decided.
fn apply(output: ToolOutput, decision: PostDecision, call_id: &str) -> ToolResult {
    let mut result = output.into_result(call_id);
    match decision {
        PostDecision::Accept {
            additional_contexts,
        } => result.additional_contexts = additional_contexts,
        PostDecision::Replace {
            content,
            additional_contexts,
        } => {
            result.content = content;
            result.additional_contexts = additional_contexts;
        }
        PostDecision::Block {
            feedback,
            additional_contexts,
        } => {
            let (content, message) = if feedback.is_empty() {
                (format!("Error: {BLOCKED}"), BLOCKED.to_owned())
            } else {
                (feedback.clone(), feedback)
            };
            result.is_error = true;
            result.content = content;
            result.error = Some(ToolError {
                code: ErrorCode::ToolDenied,
                message,
                clock: None,
                timeout_ms: None,
            });
            result.additional_contexts = additional_contexts;
        }
    }
    result
}
