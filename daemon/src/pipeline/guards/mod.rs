//! Guards: the plugins of the tool pipeline, and the three waterfalls they hook.
//!
//! Every call flows through, in order:
//!
//! 1. `pre_execute` (allow / deny / ask), run in model order before the call is logged
//!    and dispatched. The first guard that does not allow decides; `ask` is a denial here
//!    because tetherd has no approver. Denied calls get a `TOOL_DENIED` result and still
//!    go through `post_execute`.
//! 2. `execute`, an around-dispatch chain: each guard receives the call context and a
//!    [`ExecNext`] continuation, may hand a *derived* context down (a tighter deadline),
//!    must await the continuation (a tool future is never dropped), and may replace the
//!    output afterwards.
//! 3. `post_execute` (accept / replace / block, each with additional contexts), run at
//!    commit time, in model order, with the caller's own context. A guard calls
//!    [`PostNext::run`] to get the downstream decision and may fold its own contexts onto it.
//!
//! Guards are registered on the [`super::Pipeline`] in order; the built-in ones
//! ([`permission`], [`timeout_policy`], [`repeat_reminder`]) each have their own config
//! section. Hooks a guard does not implement pass through.

pub mod permission;
pub mod repeat_reminder;
pub mod timeout_policy;

use std::sync::Arc;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use serde_json::Value;
use tether_protocol::events::AdditionalContext;
use tether_provider::CallCtx;

use crate::session_manager::Session;

use super::tools::{Tool, ToolOutput};

/// One tool call as the guards see it. The arguments are the parsed ones (a JSON string
/// holding JSON is decoded; `null` reads as `{}`).
#[derive(Debug, Clone)]
pub struct Invocation {
    /// The session the call runs in.
    pub session: Arc<Session>,
    /// The model's call id.
    pub call_id: String,
    /// The tool's name as the model wrote it.
    pub name: String,
    /// The arguments.
    pub arguments: Value,
    /// The caller's context (the batch's). `post_execute` always sees this one, whatever
    /// an `execute` wrapper handed down.
    pub ctx: CallCtx,
    /// The tool, when one of that name is registered.
    pub tool: Option<Arc<dyn Tool>>,
}

/// What a `pre_execute` guard decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreDecision {
    /// Let the call run (or let the next guard decide).
    Allow,
    /// Refuse the call; `reason` becomes the result's text.
    Deny {
        /// Why, for the model.
        reason: String,
    },
    /// The call needs an approval. There is no approver, so the call is denied.
    Ask {
        /// Why, for the model.
        reason: Option<String>,
    },
}

/// What a `post_execute` guard decides about a finished call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostDecision {
    /// Keep the result.
    Accept {
        /// Contexts to attach, in order.
        additional_contexts: Vec<AdditionalContext>,
    },
    /// Keep the result's status but replace its text.
    Replace {
        /// The new text.
        content: String,
        /// Contexts to attach, in order.
        additional_contexts: Vec<AdditionalContext>,
    },
    /// Turn the result into an error whose text is `feedback` (code `TOOL_DENIED`).
    Block {
        /// What the model reads instead of the result.
        feedback: String,
        /// Contexts to attach, in order.
        additional_contexts: Vec<AdditionalContext>,
    },
}

impl PostDecision {
    /// Accept with no context: the end of the waterfall.
    pub fn accept() -> Self {
        Self::Accept {
            additional_contexts: Vec::new(),
        }
    }

    /// The contexts of any variant.
    pub fn additional_contexts_mut(&mut self) -> &mut Vec<AdditionalContext> {
        match self {
            Self::Accept {
                additional_contexts,
            }
            | Self::Replace {
                additional_contexts,
                ..
            }
            | Self::Block {
                additional_contexts,
                ..
            } => additional_contexts,
        }
    }
}

/// A pipeline plugin. Every hook passes through unless implemented.
#[async_trait]
pub trait Guard: Send + Sync + std::fmt::Debug {
    /// The guard's name (`permission`, `timeout-policy`, `repeat-tool-reminder`, ...).
    fn name(&self) -> &'static str;

    /// Decide whether the call may run.
    async fn pre_execute(&self, inv: &Invocation) -> PreDecision {
        let _ = inv;
        PreDecision::Allow
    }

    /// Wrap the dispatch. Hand `next` either `ctx` or a context derived from it, and
    /// await it: the tool reaches quiescence before the wrapper returns.
    async fn execute(&self, inv: &Invocation, ctx: &CallCtx, next: ExecNext<'_>) -> ToolOutput {
        next.run(inv, ctx).await
    }

    /// Decide about the finished call; `output` is the dispatch's (or the denial's).
    async fn post_execute(
        &self,
        inv: &Invocation,
        output: &ToolOutput,
        next: PostNext<'_>,
    ) -> PostDecision {
        next.run(inv, output).await
    }

    /// A user message arrived in the session.
    fn on_user_message(&self, session_id: &str) {
        let _ = session_id;
    }

    /// The session was closed: drop whatever the guard keeps for it.
    fn on_session_closed(&self, session_id: &str) {
        let _ = session_id;
    }
}

/// The rest of the `execute` chain: the guards after the current one, then the tool.
#[derive(Debug, Clone, Copy)]
pub struct ExecNext<'a> {
    rest: &'a [Arc<dyn Guard>],
    tool: &'a Arc<dyn Tool>,
}

impl<'a> ExecNext<'a> {
    pub(crate) fn new(rest: &'a [Arc<dyn Guard>], tool: &'a Arc<dyn Tool>) -> Self {
        Self { rest, tool }
    }

    /// Run the rest of the chain under `ctx`.
    pub fn run(self, inv: &'a Invocation, ctx: &'a CallCtx) -> BoxFuture<'a, ToolOutput> {
        match self.rest.split_first() {
            Some((first, rest)) => first.execute(
                inv,
                ctx,
                ExecNext {
                    rest,
                    tool: self.tool,
                },
            ),
            None => self.tool.call(ctx, &inv.session, &inv.arguments),
        }
    }
}

/// The rest of the `post_execute` waterfall.
#[derive(Debug, Clone, Copy)]
pub struct PostNext<'a> {
    rest: &'a [Arc<dyn Guard>],
}

impl<'a> PostNext<'a> {
    pub(crate) fn new(rest: &'a [Arc<dyn Guard>]) -> Self {
        Self { rest }
    }

    /// The downstream decision.
    pub fn run(self, inv: &'a Invocation, output: &'a ToolOutput) -> BoxFuture<'a, PostDecision> {
        match self.rest.split_first() {
            Some((first, rest)) => first.post_execute(inv, output, PostNext { rest }),
            None => Box::pin(async { PostDecision::accept() }),
        }
    }
}

/// A tool-name pattern: `*` matches any run of characters, every other character
/// (regex metacharacters included) matches itself, and the whole name must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    pattern: Vec<char>,
    source: String,
}

impl Wildcard {
    /// Compile a pattern.
    pub fn new(pattern: &str) -> Self {
        Self {
            pattern: pattern.chars().collect(),
            source: pattern.to_owned(),
        }
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether `name` matches, anchored at both ends.
    pub fn matches(&self, name: &str) -> bool {
        let text: Vec<char> = name.chars().collect();
        let p = &self.pattern;
        // Greedy match with backtracking to the last star: linear in practice.
        let (mut ti, mut pi) = (0usize, 0usize);
        let mut star: Option<(usize, usize)> = None;
        while ti < text.len() {
            if pi < p.len() && p[pi] == '*' {
                star = Some((pi, ti));
                pi += 1;
            } else if pi < p.len() && p[pi] == text[ti] {
                pi += 1;
                ti += 1;
            } else if let Some((sp, st)) = star {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            } else {
                return false;
            }
        }
        p[pi..].iter().all(|c| *c == '*')
    }

    /// Compile a list.
    pub fn compile(patterns: &[String]) -> Vec<Self> {
        patterns.iter().map(|p| Self::new(p)).collect()
    }

    /// The first pattern of `list` matching `name`.
    pub fn first_match<'a>(list: &'a [Self], name: &str) -> Option<&'a Self> {
        list.iter().find(|w| w.matches(name))
    }
}
