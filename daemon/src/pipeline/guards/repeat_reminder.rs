//! The repeat-tool-reminder guard (dsh's `repeat-tool-reminder`, same semantics and texts).
//!
//! Advisory only: it never denies, blocks or rewrites a call. In `post_execute` (so denied
//! calls count too: a model hammering a denied call is exactly the loop worth breaking) it
//! advances the session's chain: the same tool with the same canonical arguments (JSON
//! with object keys sorted, deeply) extends the run, anything else tracked starts a new one.
//! When the run length is a configured threshold it attaches a reminder: the gentle text at
//! the smallest threshold, the detailed one (tool, run length, arguments cut at
//! `arguments_preview_chars`) at the others, nothing past the largest. The reminder is
//! prepended to the downstream decision's contexts, whatever that decision is, labelled
//! `{kind: plugin, plugin: repeat-tool-reminder, summary: "<tool> × <n>"}`.
//!
//! Untracked tools (not matching `include` when it is set, or matching `exclude`) are
//! transparent: they neither count nor break a run. A user message resets the session's
//! chain. Chains live in memory only and belong to one `Session` object: a session
//! re-opened after a restart starts fresh.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};

use async_trait::async_trait;
use serde_json::{Map, Value};
use tether_protocol::events::{AdditionalContext, Source};

use super::{Guard, Invocation, PostDecision, PostNext, Wildcard};
use crate::pipeline::config::{PipelineConfigError, RepeatReminderConfig};
use crate::pipeline::tools::ToolOutput;

/// The guard's name, also its label on the contexts it adds.
pub const NAME: &str = "repeat-tool-reminder";

/// The reminder at the first threshold.
pub const GENTLE_REMINDER: &str = "You are repeating the exact same tool call with identical arguments. \
     Carefully analyze the previous result before calling again: if the task is not complete, try a different \
     approach or different arguments instead of repeating the call.";

/// The reminder at later thresholds.
pub fn detailed_reminder(tool: &str, count: u32, arguments: &str) -> String {
    format!(
        "Repeated tool call detected:\n- tool: {tool}\n- consecutive_calls: {count}\n- arguments: {arguments}\n\
         The repeated calls are not making progress. Do not call this tool with these exact arguments again. \
         Inspect the latest result and choose a different action, different arguments, or finish the task if \
         enough evidence has been gathered."
    )
}

/// The canonical form of arguments: object keys sorted at every depth, then compact JSON.
pub fn canonicalize(v: &Value) -> String {
    fn sort(v: &Value) -> Value {
        match v {
            Value::Array(a) => Value::Array(a.iter().map(sort).collect()),
            Value::Object(o) => {
                let mut keys: Vec<&String> = o.keys().collect();
                keys.sort();
                let mut m = Map::new();
                for k in keys {
                    m.insert(k.clone(), sort(&o[k]));
                }
                Value::Object(m)
            }
            other => other.clone(),
        }
    }
    serde_json::to_string(&sort(v)).unwrap_or_default()
}

/// The canonical arguments cut at `cap` characters, with how many were left out.
pub fn preview(canonical: &str, cap: usize) -> String {
    let total = canonical.chars().count();
    if total <= cap {
        return canonical.to_owned();
    }
    let head: String = canonical.chars().take(cap).collect();
    format!("{head}… (+{} more chars)", total - cap)
}

#[derive(Debug)]
struct Chain {
    /// The `Session` object the chain belongs to: a new object with the same id (a
    /// session re-opened) does not inherit it.
    owner: Weak<dyn Any + Send + Sync>,
    tool: String,
    canonical: String,
    count: u32,
}

/// See the module documentation.
#[derive(Debug)]
pub struct RepeatReminder {
    thresholds: Vec<u32>,
    include: Vec<Wildcard>,
    exclude: Vec<Wildcard>,
    preview_chars: usize,
    chains: RwLock<HashMap<String, Chain>>,
}

// === impl RepeatReminder ===

impl RepeatReminder {
    /// Build from the config section; invalid thresholds or preview size fail loudly.
    pub fn new(cfg: &RepeatReminderConfig) -> Result<Self, PipelineConfigError> {
        let (thresholds, preview_chars) = cfg.validate()?;
        Ok(Self {
            thresholds,
            include: Wildcard::compile(&cfg.include),
            exclude: Wildcard::compile(&cfg.exclude),
            preview_chars,
            chains: RwLock::new(HashMap::new()),
        })
    }

    /// Whether calls of `tool` take part in chains.
    pub fn tracked(&self, tool: &str) -> bool {
        if !self.include.is_empty() && Wildcard::first_match(&self.include, tool).is_none() {
            return false;
        }
        Wildcard::first_match(&self.exclude, tool).is_none()
    }

    /// Advance the chain of `session_id` (owned by `owner`) by one call and return the
    /// reminder due, if any.
    pub fn observe(
        &self,
        session_id: &str,
        owner: &Arc<dyn Any + Send + Sync>,
        tool: &str,
        arguments: &Value,
    ) -> Option<AdditionalContext> {
        if !self.tracked(tool) {
            return None;
        }
        let canonical = canonicalize(arguments);
        let count = {
            let mut chains = self.chains.write().unwrap_or_else(|p| p.into_inner());
            // Chains of sessions that are gone would otherwise pile up.
            chains.retain(|_, c| c.owner.strong_count() > 0);
            let owner_weak = Arc::downgrade(owner);
            let count = match chains.get(session_id) {
                Some(c)
                    if Weak::ptr_eq(&c.owner, &owner_weak)
                        && c.tool == tool
                        && c.canonical == canonical =>
                {
                    c.count.saturating_add(1)
                }
                _ => 1,
            };
            let chain = Chain {
                owner: owner_weak,
                tool: tool.to_owned(),
                canonical: canonical.clone(),
                count,
            };
            chains.insert(session_id.to_owned(), chain);
            count
        };
        if !self.thresholds.contains(&count) {
            return None;
        }
        let text = if Some(&count) == self.thresholds.first() {
            GENTLE_REMINDER.to_owned()
        } else {
            detailed_reminder(tool, count, &preview(&canonical, self.preview_chars))
        };
        Some(AdditionalContext {
            source: Source::Plugin {
                plugin: NAME.to_owned(),
                summary: Some(format!("{tool} × {count}")),
            },
            content: text,
        })
    }

    /// Drop the chain of a session.
    pub fn reset(&self, session_id: &str) {
        let mut chains = self.chains.write().unwrap_or_else(|p| p.into_inner());
        chains.remove(session_id);
    }
}

#[async_trait]
impl Guard for RepeatReminder {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn post_execute(
        &self,
        inv: &Invocation,
        output: &ToolOutput,
        next: PostNext<'_>,
    ) -> PostDecision {
        // Count first (the chain advances whatever happens downstream), then delegate so a
        // later guard may still block or replace, then fold the reminder onto its decision.
        let owner: Arc<dyn Any + Send + Sync> = inv.session.clone();
        let reminder = self.observe(&inv.session.id, &owner, &inv.name, &inv.arguments);
        let mut downstream = next.run(inv, output).await;
        if let Some(r) = reminder {
            downstream.additional_contexts_mut().insert(0, r);
        }
        downstream
    }

    fn on_user_message(&self, session_id: &str) {
        self.reset(session_id);
    }

    fn on_session_closed(&self, session_id: &str) {
        self.reset(session_id);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn guard(cfg: RepeatReminderConfig) -> RepeatReminder {
        RepeatReminder::new(&cfg).unwrap()
    }

    fn owner() -> Arc<dyn Any + Send + Sync> {
        Arc::new(())
    }

    #[test]
    fn canonical_json_sorts_keys_deeply() {
        let a = json!({"b": 1, "a": {"z": [ {"y": 1, "x": 2} ], "c": null}});
        let b = json!({"a": {"c": null, "z": [ {"x": 2, "y": 1} ]}, "b": 1});
        assert_eq!(canonicalize(&a), canonicalize(&b));
        assert_eq!(
            canonicalize(&a),
            r#"{"a":{"c":null,"z":[{"x":2,"y":1}]},"b":1}"#
        );
    }

    #[test]
    fn preview_cuts_and_counts_what_it_left_out() {
        assert_eq!(preview("abc", 3), "abc");
        assert_eq!(preview("abcdef", 2), "ab… (+4 more chars)");
    }

    #[test]
    fn stale_owner_starts_a_fresh_chain() {
        let g = guard(RepeatReminderConfig {
            thresholds: vec![2.0],
            ..Default::default()
        });
        let first = owner();
        assert!(g.observe("s", &first, "probe", &json!({})).is_none());
        // A different object with the same session id (the session re-opened).
        let second = owner();
        assert!(g.observe("s", &second, "probe", &json!({})).is_none());
        assert!(g.observe("s", &second, "probe", &json!({})).is_some());
        drop(first);
        drop(second);
        g.observe("t", &owner(), "probe", &json!({}));
        assert!(
            g.chains.read().unwrap().len() <= 1,
            "dead sessions' chains are pruned"
        );
    }
}
