//! The derived model history: the projection of the log onto what the model sees.
//!
//! Only `user/message`, `assistant/message` and `tool/result` project; every other event is
//! log-only. An assistant message with empty content projects nothing (as in dsh, such a
//! message exists only to carry accounting). The projection is a pure function of the
//! events, so the history can always be rebuilt from the log alone: nothing model-visible
//! exists outside it.

use tether_protocol::events::{Event, EventBody, Message};

/// The message one event contributes to the history, if any.
pub fn project(body: &EventBody) -> Option<Message> {
    match body {
        EventBody::UserMessage { content, source } => Some(Message::User {
            content: content.clone(),
            source: source.clone(),
        }),
        EventBody::AssistantMessage { content } if content.is_empty() => None,
        EventBody::AssistantMessage { content } => Some(Message::Assistant {
            content: content.clone(),
        }),
        EventBody::ToolResult { result, .. } => Some(Message::Tool {
            result: result.clone(),
        }),
        EventBody::TurnStart { .. }
        | EventBody::ToolCall { .. }
        | EventBody::TurnEnd { .. }
        | EventBody::SandboxLeased { .. }
        | EventBody::SandboxReleased { .. }
        | EventBody::ProcessStarted { .. }
        | EventBody::ProcessExited { .. }
        | EventBody::FsOp { .. }
        | EventBody::EndSeed { .. }
        | EventBody::ExpirySet { .. }
        | EventBody::SandboxPaused { .. }
        | EventBody::SandboxResumed { .. }
        | EventBody::SandboxSnapshot { .. }
        | EventBody::SandboxNetwork { .. }
        | EventBody::SessionClosed { .. } => None,
    }
}

/// The history derived from `events`, in log order.
pub fn derive(events: &[Event]) -> Vec<Message> {
    events.iter().filter_map(|e| project(&e.body)).collect()
}

#[cfg(test)]
mod tests {
    use tether_protocol::events::{Source, ToolResult, TurnEndKind};

    use super::*;

    fn ev(seq: u64, body: EventBody) -> Event {
        Event { seq, time: 0, body }
    }

    #[test]
    fn projects_only_surface_events_in_order() {
        let result = ToolResult {
            call_id: "c1".into(),
            is_error: false,
            content: "ok".into(),
            error: None,
            additional_contexts: vec![],
        };
        let events = vec![
            ev(
                0,
                EventBody::UserMessage {
                    content: "hi".into(),
                    source: Source::User,
                },
            ),
            ev(
                1,
                EventBody::TurnStart {
                    turn: 0,
                    call_ids: vec!["c1".into()],
                },
            ),
            ev(
                2,
                EventBody::AssistantMessage {
                    content: String::new(),
                },
            ),
            ev(
                3,
                EventBody::AssistantMessage {
                    content: "let me look".into(),
                },
            ),
            ev(
                4,
                EventBody::ToolCall {
                    call_id: "c1".into(),
                    name: "bash".into(),
                    arguments: serde_json::json!({}),
                },
            ),
            ev(
                5,
                EventBody::ToolResult {
                    result: result.clone(),
                    call_seq: Some(4),
                },
            ),
            ev(
                6,
                EventBody::TurnEnd {
                    turn: 0,
                    kind: TurnEndKind::Completed,
                },
            ),
            ev(
                7,
                EventBody::SessionClosed {
                    reason: "done".into(),
                },
            ),
        ];
        assert_eq!(
            derive(&events),
            vec![
                Message::User {
                    content: "hi".into(),
                    source: Source::User
                },
                Message::Assistant {
                    content: "let me look".into()
                },
                Message::Tool { result },
            ]
        );
    }
}
