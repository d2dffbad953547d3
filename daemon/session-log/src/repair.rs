//! Crash repair: the closers appended when a log is re-opened after the daemon stopped
//! mid-turn.
//!
//! The contract is dsh's (`core/session` repair): every call without a durable result gets
//! an error result, so the model never sees a dangling call, and the open turn is closed
//! with `turn/end {kind: interrupted}`. The result's code tells the model what it may do:
//! `TOOL_NOT_STARTED` when the call was only announced (the batch's `turn/start` lists it, no
//! `tool/call` was logged, and tether logs `tool/call` right before dispatch, so it never ran:
//! retrying is safe); `TOOL_OUTCOME_UNKNOWN` when a `tool/call` was logged (it was dispatched
//! and may have had effects in the sandbox: the model must not retry blindly). The sentences
//! are dsh's, verbatim.

use tether_protocol::ErrorCode;
use tether_protocol::events::{EventBody, ToolError, ToolResult, TurnEndKind};

use super::index::Index;

/// The message of a `TOOL_NOT_STARTED` repair result.
pub const NOT_STARTED_MESSAGE: &str = "The tool call was interrupted before the Harness recorded it as started. Retry it if it is still needed.";

/// The message of a `TOOL_OUTCOME_UNKNOWN` repair result.
pub const OUTCOME_UNKNOWN_MESSAGE: &str = "The tool call was interrupted after it was recorded, but no result was \
     durably recorded. Its outcome is unknown. Decide whether to retry from the tool semantics: retry only if the \
     operation is read-only or idempotent; if it may have side effects, first verify external state or ask the user. \
     Do not retry blindly.";

/// The error result of a call that was announced but never dispatched.
pub fn not_started_result(call_id: &str) -> ToolResult {
    error_result(call_id, ErrorCode::ToolNotStarted, NOT_STARTED_MESSAGE)
}

/// The error result of a call that was dispatched but whose result was not logged.
pub fn outcome_unknown_result(call_id: &str) -> ToolResult {
    error_result(
        call_id,
        ErrorCode::ToolOutcomeUnknown,
        OUTCOME_UNKNOWN_MESSAGE,
    )
}

fn error_result(call_id: &str, code: ErrorCode, message: &str) -> ToolResult {
    ToolResult {
        call_id: call_id.to_owned(),
        is_error: true,
        content: format!("Error: {message}"),
        error: Some(ToolError {
            code,
            message: message.to_owned(),
            clock: None,
            timeout_ms: None,
        }),
        additional_contexts: Vec::new(),
    }
}

/// The events that close a crashed log, and what they close.
#[derive(Debug, Default)]
pub(crate) struct Closers {
    pub bodies: Vec<EventBody>,
    pub not_started: Vec<String>,
    pub outcome_unknown: Vec<String>,
    pub turn_closed: bool,
}

/// Compute the closers for the state in `index` (empty for a balanced log). Results come
/// first, in the order the calls appeared, then the open turn's `turn/end`.
pub(crate) fn closers(index: &Index) -> Closers {
    let mut out = Closers::default();
    for call in index.unanswered() {
        let result = match call.call_seq {
            Some(_) => {
                out.outcome_unknown.push(call.call_id.clone());
                outcome_unknown_result(&call.call_id)
            }
            None => {
                out.not_started.push(call.call_id.clone());
                not_started_result(&call.call_id)
            }
        };
        out.bodies.push(EventBody::ToolResult {
            result,
            call_seq: call.call_seq,
        });
    }
    if let Some(open) = index.open_turn() {
        out.bodies.push(EventBody::TurnEnd {
            turn: open.turn,
            kind: TurnEndKind::Interrupted,
        });
        out.turn_closed = true;
    }
    out
}
