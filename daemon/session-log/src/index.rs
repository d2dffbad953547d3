//! The log's structural index: the open turn and the state of every tool call.
//!
//! The writer applies each staged event to the index before writing it, which is where the
//! session module's pairing invariants run (a call id is used once, a call has at most one
//! result, a result answers a known call, turns do not nest). Applying is undoable so that
//! a group of events refused by a check, or a batch whose write failed, leaves the index as
//! it was. Crash repair reads the unanswered calls from the same index.

use std::collections::HashMap;

use tether_protocol::events::EventBody;

use crate::invariants::{Invariants, Violation};

const MODULE: &str = "session";

/// The turn that has a `turn/start` and no `turn/end` yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpenTurn {
    /// The turn number.
    pub turn: u64,
    /// The seq of its `turn/start`.
    pub start_seq: u64,
}

#[derive(Debug, Clone)]
struct CallEntry {
    /// Where the id first appeared (seq, position in the event), to repair in that order.
    order: (u64, usize),
    /// The seq of the `turn/start` that announced it.
    announced_at: Option<u64>,
    /// The seq of its `tool/call`.
    call_seq: Option<u64>,
    /// The seq of its `tool/result`.
    result_seq: Option<u64>,
}

/// A call id that has no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unanswered {
    pub call_id: String,
    /// `Some` when a `tool/call` was logged (the call was dispatched).
    pub call_seq: Option<u64>,
}

/// What [`Index::rollback`] needs to restore the index.
#[derive(Debug)]
pub(crate) struct Undo {
    open_turn: Option<OpenTurn>,
    calls: Vec<(String, Option<CallEntry>)>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Index {
    open_turn: Option<OpenTurn>,
    calls: HashMap<String, CallEntry>,
}

// === impl Index ===

impl Index {
    pub fn open_turn(&self) -> Option<OpenTurn> {
        self.open_turn
    }

    /// Start recording changes (one undo record may span several [`Index::apply`] calls).
    pub fn begin(&self) -> Undo {
        Undo {
            open_turn: self.open_turn,
            calls: Vec::new(),
        }
    }

    /// Restore the index to the state of `undo`'s [`Index::begin`].
    pub fn rollback(&mut self, undo: Undo) {
        self.open_turn = undo.open_turn;
        for (id, prior) in undo.calls.into_iter().rev() {
            match prior {
                Some(entry) => self.calls.insert(id, entry),
                None => self.calls.remove(&id),
            };
        }
    }

    /// Check `body` (at `seq`) against the enabled invariants, then record it. On a
    /// violation nothing is recorded.
    pub fn apply(
        &mut self,
        seq: u64,
        body: &EventBody,
        inv: &Invariants,
        undo: &mut Undo,
    ) -> Result<(), Violation> {
        match body {
            EventBody::TurnStart { turn, call_ids } => {
                inv.check(MODULE, "turn_enclosure", || match self.open_turn {
                    None => Ok(()),
                    Some(open) => Err(format!(
                        "turn {turn} starts at seq {seq} while turn {} (seq {}) is open",
                        open.turn, open.start_seq
                    )),
                })?;
                inv.check(MODULE, "call_id_unique", || {
                    for (i, id) in call_ids.iter().enumerate() {
                        if self.calls.contains_key(id) || call_ids[..i].contains(id) {
                            return Err(format!(
                                "turn/start at seq {seq} announces call id {id:?} again"
                            ));
                        }
                    }
                    Ok(())
                })?;
                self.open_turn = Some(OpenTurn {
                    turn: *turn,
                    start_seq: seq,
                });
                for (i, id) in call_ids.iter().enumerate() {
                    if !self.calls.contains_key(id) {
                        let entry = CallEntry {
                            order: (seq, i),
                            announced_at: Some(seq),
                            call_seq: None,
                            result_seq: None,
                        };
                        self.put(id, entry, undo);
                    }
                }
            }
            EventBody::TurnEnd { turn, .. } => {
                inv.check(MODULE, "turn_enclosure", || match self.open_turn {
                    Some(open) if open.turn == *turn => Ok(()),
                    Some(open) => Err(format!(
                        "turn/end of turn {turn} at seq {seq} while turn {} is open",
                        open.turn
                    )),
                    None => Err(format!(
                        "turn/end of turn {turn} at seq {seq} with no open turn"
                    )),
                })?;
                self.open_turn = None;
            }
            EventBody::ToolCall { call_id, .. } => {
                inv.check(MODULE, "call_id_unique", || match self.calls.get(call_id) {
                    None => Ok(()),
                    Some(e) if e.call_seq.is_none() && e.result_seq.is_none() => Ok(()),
                    Some(_) => Err(format!("tool/call at seq {seq} reuses call id {call_id:?}")),
                })?;
                match self.calls.get(call_id) {
                    Some(e) if e.call_seq.is_some() => {}
                    Some(e) => {
                        let entry = CallEntry {
                            call_seq: Some(seq),
                            ..e.clone()
                        };
                        self.put(call_id, entry, undo);
                    }
                    None => {
                        let entry = CallEntry {
                            order: (seq, 0),
                            announced_at: None,
                            call_seq: Some(seq),
                            result_seq: None,
                        };
                        self.put(call_id, entry, undo);
                    }
                }
            }
            EventBody::ToolResult { result, call_seq } => {
                let id = &result.call_id;
                let entry = self.calls.get(id);
                inv.check(MODULE, "tool_result_cites_call", || match (entry, call_seq) {
                    (None, _) => Err(format!("tool/result at seq {seq} answers unknown call id {id:?}")),
                    (Some(e), Some(cited)) if e.call_seq != Some(*cited) => Err(format!(
                        "tool/result at seq {seq} for {id:?} cites seq {cited}, but its tool/call is at {:?}",
                        e.call_seq
                    )),
                    (Some(_), _) => Ok(()),
                })?;
                inv.check(MODULE, "tool_call_single_result", || {
                    match entry.and_then(|e| e.result_seq) {
                        None => Ok(()),
                        Some(first) => Err(format!(
                            "call {id:?} has a second tool/result at seq {seq} (first at {first})"
                        )),
                    }
                })?;
                let updated = match entry {
                    Some(e) => CallEntry {
                        result_seq: Some(seq),
                        ..e.clone()
                    },
                    None => CallEntry {
                        order: (seq, 0),
                        announced_at: None,
                        call_seq: None,
                        result_seq: Some(seq),
                    },
                };
                self.put(id, updated, undo);
            }
            EventBody::UserMessage { .. }
            | EventBody::AssistantMessage { .. }
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
            | EventBody::SessionClosed { .. } => {}
        }
        Ok(())
    }

    fn put(&mut self, id: &str, entry: CallEntry, undo: &mut Undo) {
        let prior = self.calls.insert(id.to_owned(), entry);
        undo.calls.push((id.to_owned(), prior));
    }

    /// Calls that need a repair result, in the order they first appeared: every logged
    /// `tool/call` without a result, and every call id announced by the open turn that has
    /// neither a call nor a result.
    pub fn unanswered(&self) -> Vec<Unanswered> {
        let open_at = self.open_turn.map(|t| t.start_seq);
        let mut out: Vec<(&(u64, usize), Unanswered)> = self
            .calls
            .iter()
            .filter(|(_, e)| {
                e.result_seq.is_none()
                    && (e.call_seq.is_some() || (open_at.is_some() && e.announced_at == open_at))
            })
            .map(|(id, e)| {
                (
                    &e.order,
                    Unanswered {
                        call_id: id.clone(),
                        call_seq: e.call_seq,
                    },
                )
            })
            .collect();
        out.sort_by_key(|(order, _)| **order);
        out.into_iter().map(|(_, u)| u).collect()
    }
}

#[cfg(test)]
mod tests {
    use tether_protocol::events::{ToolResult, TurnEndKind};

    use super::*;

    fn call(id: &str) -> EventBody {
        EventBody::ToolCall {
            call_id: id.into(),
            name: "bash".into(),
            arguments: serde_json::json!({}),
        }
    }

    fn result(id: &str, call_seq: Option<u64>) -> EventBody {
        EventBody::ToolResult {
            result: ToolResult {
                call_id: id.into(),
                is_error: false,
                content: String::new(),
                error: None,
                additional_contexts: vec![],
            },
            call_seq,
        }
    }

    fn apply_all(ix: &mut Index, inv: &Invariants, bodies: &[EventBody]) -> Result<(), Violation> {
        let mut undo = ix.begin();
        for (seq, b) in bodies.iter().enumerate() {
            ix.apply(seq as u64, b, inv, &mut undo)?;
        }
        Ok(())
    }

    #[test]
    fn pairing_violations_are_attributed() {
        let inv = Invariants::default();
        let cases: Vec<(Vec<EventBody>, &str)> = vec![
            (
                vec![call("a"), result("a", Some(0)), result("a", Some(0))],
                "tool_call_single_result",
            ),
            (vec![result("x", None)], "tool_result_cites_call"),
            (
                vec![call("a"), result("a", Some(7))],
                "tool_result_cites_call",
            ),
            (vec![call("a"), call("a")], "call_id_unique"),
            (
                vec![
                    EventBody::TurnStart {
                        turn: 0,
                        call_ids: vec![],
                    },
                    EventBody::TurnStart {
                        turn: 1,
                        call_ids: vec![],
                    },
                ],
                "turn_enclosure",
            ),
            (
                vec![EventBody::TurnEnd {
                    turn: 0,
                    kind: TurnEndKind::Completed,
                }],
                "turn_enclosure",
            ),
        ];
        for (bodies, check) in cases {
            let mut ix = Index::default();
            let v = apply_all(&mut ix, &inv, &bodies).unwrap_err();
            assert_eq!((v.module, v.check), ("session", check), "{bodies:?}");
        }
        // With the module disabled the same logs are accepted.
        let off = Invariants::disabled();
        let mut ix = Index::default();
        apply_all(
            &mut ix,
            &off,
            &[call("a"), result("a", Some(0)), result("a", Some(0))],
        )
        .unwrap();
    }

    #[test]
    fn rollback_restores_the_prior_state() {
        let inv = Invariants::default();
        let mut ix = Index::default();
        let mut u = ix.begin();
        ix.apply(
            0,
            &EventBody::TurnStart {
                turn: 0,
                call_ids: vec!["a".into(), "b".into()],
            },
            &inv,
            &mut u,
        )
        .unwrap();
        ix.apply(1, &call("a"), &inv, &mut u).unwrap();
        let before: Vec<_> = ix.unanswered();
        let mut u2 = ix.begin();
        ix.apply(2, &result("a", Some(1)), &inv, &mut u2).unwrap();
        ix.apply(
            3,
            &EventBody::TurnEnd {
                turn: 0,
                kind: TurnEndKind::Completed,
            },
            &inv,
            &mut u2,
        )
        .unwrap();
        assert_eq!(ix.open_turn(), None);
        ix.rollback(u2);
        assert_eq!(
            ix.open_turn(),
            Some(OpenTurn {
                turn: 0,
                start_seq: 0
            })
        );
        assert_eq!(ix.unanswered(), before);
        assert_eq!(
            before,
            vec![
                Unanswered {
                    call_id: "a".into(),
                    call_seq: Some(1)
                },
                Unanswered {
                    call_id: "b".into(),
                    call_seq: None
                },
            ]
        );
    }
}
