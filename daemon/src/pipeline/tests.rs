//! Tests of the pipeline: dsh's timeout-policy, repeat-tool-reminder and scheduler cases,
//! ported, plus the built-in tools against a real local sandbox.
//!
//! Every test runs real sessions (local provider in a temp dir, real session log). Tests
//! that only need a controllable tool register one on the pipeline ([`TestTool`]); waits
//! are on events (watch channels), never on sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tether_protocol::ErrorCode;
use tether_protocol::api::ToolCallRequest;
use tether_protocol::events::{
    AdditionalContext, EventBody, Message, Source, ToolResult, TurnEndKind,
};
use tether_protocol::fs::WriteGuard;
use tether_provider::CallCtx;
use tether_provider::clock::CancelReason;
use tokio::sync::{Mutex, watch};

use super::batch::{ABORTED, ABORTED_BEFORE_DISPATCH};
use super::guards::repeat_reminder::GENTLE_REMINDER;
use super::*;
use crate::config::{Config, LimitsConfig};
use crate::session_manager::Session;
use crate::testutil::test_session;
use tether_provider::Clock;

// === helpers ===

/// How a test tool behaves once called.
#[derive(Debug, Clone)]
enum Behavior {
    /// Return `ok` at once.
    Ok,
    /// Wait for the call's cancellation, then return `ok` ("stopped cooperatively").
    UntilCancelled,
    /// Wait for the call's cancellation, then fail with a code of its own.
    AbortError,
    /// Wait for cancellation, report it, wait for `release`, then return `ok`.
    SlowCleanup,
    /// Wait until `n` calls have started: none ends before `n` ran at once.
    Together(usize),
    /// Wait until `release` is set (or the call is cancelled), then return `ok`.
    UntilReleased,
}

/// Shared observations of the test tools.
#[derive(Debug)]
struct Probe {
    /// Calls in flight now, and calls entered so far.
    flight: watch::Sender<(usize, usize)>,
    /// Most calls in flight at once.
    max: AtomicUsize,
    /// Dispatches.
    dispatched: AtomicUsize,
    /// `start:<id>` / `end:<id>` in order.
    events: Mutex<Vec<String>>,
    /// Budgets (`ctx.budget`) the tools saw.
    budgets: Mutex<Vec<Option<Duration>>>,
    /// Set by the test to release waiting tools.
    release: watch::Sender<bool>,
    /// Set by a slow-cleanup tool once it saw its cancellation.
    saw_abort: watch::Sender<bool>,
    /// Tools whose calls are exclusive right now.
    exclusive_now: std::sync::RwLock<Vec<String>>,
}

impl Probe {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            flight: watch::Sender::new((0, 0)),
            max: AtomicUsize::new(0),
            dispatched: AtomicUsize::new(0),
            events: Mutex::new(Vec::new()),
            budgets: Mutex::new(Vec::new()),
            release: watch::Sender::new(false),
            saw_abort: watch::Sender::new(false),
            exclusive_now: std::sync::RwLock::new(Vec::new()),
        })
    }

    fn make_exclusive(&self, tool: &str) {
        self.exclusive_now.write().unwrap().push(tool.to_owned());
    }

    async fn events(&self) -> Vec<String> {
        self.events.lock().await.clone()
    }

    async fn wait_entered(&self, n: usize) {
        let mut rx = self.flight.subscribe();
        tokio::time::timeout(
            Duration::from_secs(20),
            rx.wait_for(|(_, entered)| *entered >= n),
        )
        .await
        .expect("calls entered in time")
        .expect("probe alive");
    }
}

/// A tool whose behaviour the test picks.
#[derive(Debug)]
struct TestTool {
    name: &'static str,
    exclusive: bool,
    timeout_ms: Option<u64>,
    behavior: Behavior,
    probe: Arc<Probe>,
}

impl TestTool {
    fn new(name: &'static str, behavior: Behavior, probe: &Arc<Probe>) -> Self {
        Self {
            name,
            exclusive: false,
            timeout_ms: None,
            behavior,
            probe: Arc::clone(probe),
        }
    }

    fn exclusive(mut self) -> Self {
        self.exclusive = true;
        self
    }

    fn budget(mut self, ms: u64) -> Self {
        self.timeout_ms = Some(ms);
        self
    }
}

#[async_trait]
impl Tool for TestTool {
    fn name(&self) -> &str {
        self.name
    }

    fn exclusive(&self, _args: &Value) -> bool {
        self.exclusive
            || self
                .probe
                .exclusive_now
                .read()
                .unwrap()
                .iter()
                .any(|t| t == self.name)
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }

    fn check_args(&self, args: &Value) -> Result<(), String> {
        if args.get("invalid").is_some() {
            Err("invalid arguments for the test tool".into())
        } else {
            Ok(())
        }
    }

    async fn call(&self, ctx: &CallCtx, _session: &Arc<Session>, args: &Value) -> ToolOutput {
        let p = &self.probe;
        let id = args
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned();
        p.dispatched.fetch_add(1, Ordering::SeqCst);
        p.budgets.lock().await.push(ctx.budget);
        p.events.lock().await.push(format!("start:{id}"));
        p.flight.send_modify(|(cur, entered)| {
            *cur += 1;
            *entered += 1;
            p.max.fetch_max(*cur, Ordering::SeqCst);
        });
        let out = match &self.behavior {
            Behavior::Ok => ToolOutput::ok("ok"),
            Behavior::UntilCancelled => {
                ctx.cancel.cancelled().await;
                ToolOutput::ok("stopped cooperatively")
            }
            Behavior::AbortError => {
                ctx.cancel.cancelled().await;
                ToolOutput::error(ErrorCode::FsAborted, "web fetch aborted")
            }
            Behavior::SlowCleanup => {
                ctx.cancel.cancelled().await;
                p.saw_abort.send_replace(true);
                let mut rx = p.release.subscribe();
                let _ = rx.wait_for(|r| *r).await;
                ToolOutput::ok("cleanup complete")
            }
            Behavior::Together(n) => {
                let mut rx = p.flight.subscribe();
                let met = tokio::time::timeout(
                    Duration::from_secs(20),
                    rx.wait_for(|(_, entered)| *entered >= *n),
                )
                .await;
                if met.is_err() {
                    return ToolOutput::error(ErrorCode::Internal, "the calls never ran together");
                }
                ToolOutput::ok("together")
            }
            Behavior::UntilReleased => {
                let mut rx = p.release.subscribe();
                tokio::select! {
                    _ = rx.wait_for(|r| *r) => {}
                    _ = ctx.cancel.cancelled() => {}
                }
                ToolOutput::ok("released")
            }
        };
        p.events.lock().await.push(format!("end:{id}"));
        p.flight.send_modify(|(cur, _)| *cur -= 1);
        out
    }
}

/// A guard the test scripts.
#[derive(Debug, Default)]
struct Scripted {
    pre: Mutex<Vec<String>>,
    post: Mutex<Vec<String>>,
    post_budgets: Mutex<Vec<Option<Duration>>>,
    deny: Option<&'static str>,
    block: Option<&'static str>,
    replace: Option<&'static str>,
    context: bool,
    cancel_at: Option<(&'static str, CallCtx)>,
    exclusive_after: Option<(&'static str, &'static str, Arc<Probe>)>,
}

#[async_trait]
impl Guard for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }

    async fn pre_execute(&self, inv: &Invocation) -> PreDecision {
        self.pre.lock().await.push(inv.call_id.clone());
        if let Some((id, ctx)) = &self.cancel_at
            && inv.call_id == *id
        {
            ctx.cancel.cancel(CancelReason::Caller("test"));
        }
        match self.deny {
            Some(tool) if inv.name == tool => PreDecision::Deny {
                reason: format!("{tool} is not welcome"),
            },
            _ => PreDecision::Allow,
        }
    }

    async fn post_execute(
        &self,
        inv: &Invocation,
        output: &ToolOutput,
        next: PostNext<'_>,
    ) -> PostDecision {
        self.post.lock().await.push(inv.call_id.clone());
        self.post_budgets.lock().await.push(inv.ctx.budget);
        if let Some((id, tool, probe)) = &self.exclusive_after
            && inv.call_id == *id
        {
            probe.make_exclusive(tool);
        }
        let _ = next.run(inv, output).await;
        let additional_contexts = if self.context {
            vec![AdditionalContext {
                source: Source::System,
                content: format!("ctx-{}", inv.call_id),
            }]
        } else {
            Vec::new()
        };
        if let Some(feedback) = self.block {
            return PostDecision::Block {
                feedback: feedback.to_owned(),
                additional_contexts,
            };
        }
        if let Some(content) = self.replace {
            return PostDecision::Replace {
                content: content.to_owned(),
                additional_contexts,
            };
        }
        PostDecision::Accept {
            additional_contexts,
        }
    }
}

fn pipeline(cfg: PipelineConfig) -> Pipeline {
    Pipeline::new(
        &cfg,
        &LimitsConfig::default(),
        crate::telemetry::Metrics::new(),
    )
    .expect("valid pipeline")
}

fn call(id: &str, name: &str, args: Value) -> ToolCallRequest {
    ToolCallRequest {
        id: id.into(),
        name: name.into(),
        arguments: args,
    }
}

/// One call of a test tool; `id` also goes into the arguments so the tool can name it.
fn tcall(id: &str, name: &str) -> ToolCallRequest {
    call(id, name, json!({ "id": id }))
}

async fn run(p: &Pipeline, s: &Arc<Session>, calls: Vec<ToolCallRequest>) -> Vec<ToolResult> {
    let ctx = CallCtx::new("test");
    tokio::time::timeout(Duration::from_secs(60), p.run_batch(s, &ctx, calls))
        .await
        .expect("the batch finished in time")
        .expect("the batch ran")
}

async fn run_one(p: &Pipeline, s: &Arc<Session>, c: ToolCallRequest) -> ToolResult {
    run(p, s, vec![c]).await.remove(0)
}

fn code(r: &ToolResult) -> Option<ErrorCode> {
    r.error.as_ref().map(|e| e.code)
}

fn reminders(r: &ToolResult) -> Vec<&AdditionalContext> {
    r.additional_contexts
        .iter()
        .filter(|c| matches!(&c.source, Source::Plugin { plugin, .. } if plugin == "repeat-tool-reminder"))
        .collect()
}

fn summary(c: &AdditionalContext) -> Option<&str> {
    match &c.source {
        Source::Plugin { summary, .. } => summary.as_deref(),
        _ => None,
    }
}

/// The pipeline's log events of the session after its `sandbox/leased`.
async fn batch_events(s: &Session) -> Vec<EventBody> {
    s.log
        .events_after(None)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.body)
        .filter(|b| {
            matches!(
                b,
                EventBody::TurnStart { .. }
                    | EventBody::ToolCall { .. }
                    | EventBody::ToolResult { .. }
                    | EventBody::TurnEnd { .. }
            )
        })
        .collect()
}

async fn result_order(s: &Session) -> Vec<String> {
    batch_events(s)
        .await
        .into_iter()
        .filter_map(|b| match b {
            EventBody::ToolResult { result, .. } => Some(result.call_id),
            _ => None,
        })
        .collect()
}

/// Wait until the log holds a `tool/call` (`result: false`) or `tool/result` for `id`;
/// `false` if none arrives within `within`.
async fn logged_within(s: &Session, id: &str, result: bool, within: Duration) -> bool {
    use futures_util::StreamExt;
    let mut follow = s.log.follow(None);
    tokio::time::timeout(within, async {
        while let Some(e) = follow.next().await {
            match &e.unwrap().body {
                EventBody::ToolCall { call_id, .. } if !result && call_id == id => return,
                EventBody::ToolResult { result: r, .. } if result && r.call_id == id => return,
                _ => {}
            }
        }
        std::future::pending::<()>().await
    })
    .await
    .is_ok()
}

/// How long a scheduler that wrongly starts a call is given to do it.
const NEGATIVE_WAIT: Duration = Duration::from_millis(300);

// === timeout policy (dsh 3.2) ===

#[tokio::test]
async fn timeout_policy_delegates_a_tool_without_budget_untouched() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    let r = run_one(&p, &s, tcall("c1", "probe")).await;
    assert!(!r.is_error);
    assert_eq!(
        *probe.budgets.lock().await,
        vec![None],
        "the tool saw the caller's own (unbounded) context"
    );
}

#[tokio::test]
async fn timeout_policy_keeps_a_fast_budgeted_result() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("fast", Behavior::Ok, &probe).budget(10_000),
    ));
    let r = run_one(&p, &s, tcall("c1", "fast")).await;
    assert_eq!(
        r,
        ToolResult {
            call_id: "c1".into(),
            is_error: false,
            content: "ok".into(),
            error: None,
            additional_contexts: vec![]
        }
    );
}

#[tokio::test]
async fn timeout_policy_hands_the_derived_context_to_the_tool_and_the_caller_context_to_post_execute()
 {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("probe", Behavior::Ok, &probe).budget(10_000),
    ));
    let observer = Arc::new(Scripted::default());
    p.register_guard(observer.clone());
    run_one(&p, &s, tcall("c1", "probe")).await;
    assert_eq!(
        *probe.budgets.lock().await,
        vec![Some(Duration::from_millis(10_000))],
        "derived deadline"
    );
    assert_eq!(
        *observer.post_budgets.lock().await,
        vec![None],
        "post-execute sees the caller's context"
    );
}

#[tokio::test]
async fn timeout_policy_replaces_a_cooperative_result_when_its_own_deadline_fires() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("slow", Behavior::UntilCancelled, &probe).budget(100),
    ));
    let r = run_one(&p, &s, tcall("c1", "slow")).await;
    assert_eq!(
        r,
        ToolResult {
            call_id: "c1".into(),
            is_error: true,
            content: "Error: tool call timed out after 100ms".into(),
            error: Some(tether_protocol::events::ToolError {
                code: ErrorCode::ToolTimeout,
                message: "tool call timed out after 100ms".into(),
                clock: Some(Clock::Tool),
                timeout_ms: Some(100),
            }),
            additional_contexts: vec![],
        }
    );
}

#[tokio::test]
async fn timeout_policy_replaces_a_tool_owned_abort_error_when_the_timer_was_its_own() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("aborter", Behavior::AbortError, &probe).budget(100),
    ));
    let r = run_one(&p, &s, tcall("c1", "aborter")).await;
    assert!(r.is_error);
    assert_eq!(code(&r), Some(ErrorCode::ToolTimeout));
    assert_eq!(r.content, "Error: tool call timed out after 100ms");
}

#[tokio::test]
async fn timeout_policy_keeps_the_callers_abort_when_the_caller_cancels_first() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("slow", Behavior::UntilCancelled, &probe).budget(60_000),
    ));
    let ctx = CallCtx::new("test");
    let (results, ()) = tokio::join!(p.run_batch(&s, &ctx, vec![tcall("c1", "slow")]), async {
        probe.wait_entered(1).await;
        ctx.cancel.cancel(CancelReason::Caller("user cancelled"));
    });
    let r = &results.unwrap()[0];
    assert!(r.is_error);
    assert_eq!(code(r), Some(ErrorCode::Cancelled));
    assert_eq!(r.error.as_ref().unwrap().message, ABORTED);
    assert_eq!(r.content, format!("Error: {ABORTED}"));
}

#[tokio::test]
async fn timeout_policy_keeps_the_timeout_when_it_fired_before_a_later_caller_abort() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("slow-cleanup", Behavior::SlowCleanup, &probe).budget(100),
    ));
    let ctx = CallCtx::new("test");
    let (results, ()) = tokio::join!(
        p.run_batch(&s, &ctx, vec![tcall("c1", "slow-cleanup")]),
        async {
            let mut saw = probe.saw_abort.subscribe();
            saw.wait_for(|v| *v).await.unwrap();
            ctx.cancel
                .cancel(CancelReason::Caller("too late to replace the timeout"));
            probe.release.send_replace(true);
        }
    );
    let r = &results.unwrap()[0];
    assert_eq!(code(r), Some(ErrorCode::ToolTimeout));
    assert_eq!(
        r.error.as_ref().unwrap().message,
        "tool call timed out after 100ms"
    );
}

#[tokio::test]
async fn timeout_policy_does_not_take_an_outer_deadline_for_its_own() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(
        TestTool::new("slow", Behavior::UntilCancelled, &probe).budget(60_000),
    ));
    // The caller's own (request) deadline fires first: an ordinary cancellation to the tool.
    let ctx = CallCtx::new("test").with_timeout(Duration::from_millis(100), Clock::Total);
    let rs = p
        .run_batch(&s, &ctx, vec![tcall("c1", "slow")])
        .await
        .unwrap();
    assert_eq!(
        rs[0].error.as_ref().map(|e| (e.code, e.message.as_str())),
        Some((ErrorCode::Cancelled, ABORTED))
    );
}

#[test]
fn timeout_policy_exposes_its_code() {
    assert_eq!(Clock::Tool.code(), ErrorCode::ToolTimeout);
}

#[tokio::test]
async fn timeout_policy_config_overrides_and_removes_budgets() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let cfg: Config =
        Config::from_toml_str("[pipeline.tool_timeouts]\nslow = 50\nprobe = 0\n").expect("config");
    let mut p = pipeline(cfg.pipeline);
    assert!(p.guard_names().contains(&"timeout-policy"));
    p.register_tool(Arc::new(
        TestTool::new("slow", Behavior::UntilCancelled, &probe).budget(60_000),
    ));
    p.register_tool(Arc::new(
        TestTool::new("probe", Behavior::Ok, &probe).budget(60_000),
    ));
    let r = run_one(&p, &s, tcall("c1", "slow")).await;
    assert_eq!(
        r.error.as_ref().map(|e| (e.code, e.timeout_ms)),
        Some((ErrorCode::ToolTimeout, Some(50)))
    );
    let r = run_one(&p, &s, tcall("c2", "probe")).await;
    assert!(!r.is_error);
    assert_eq!(
        probe.budgets.lock().await.last(),
        Some(&None),
        "0 removes the tool's own budget"
    );
}

// === repeat-tool-reminder (dsh 3.3) ===

fn reminder_cfg(thresholds: &[f64]) -> PipelineConfig {
    let mut cfg = PipelineConfig::default();
    cfg.repeat_tool_reminder.thresholds = thresholds.to_vec();
    cfg
}

async fn reminder_pipeline(cfg: PipelineConfig, probe: &Arc<Probe>) -> Pipeline {
    let mut p = pipeline(cfg);
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, probe)));
    p.register_tool(Arc::new(TestTool::new("other", Behavior::Ok, probe)));
    p
}

/// Each call in a batch of its own (one model reply each), as an agent loop would.
async fn sequence(p: &Pipeline, s: &Arc<Session>, calls: &[(&str, Value)]) -> Vec<ToolResult> {
    let mut out = Vec::new();
    for (name, args) in calls {
        let id = format!("c{}", uuid::Uuid::new_v4().simple());
        out.push(run_one(p, s, call(&id, name, args.clone())).await);
    }
    out
}

#[tokio::test]
async fn reminder_is_gentle_at_the_first_threshold_and_detailed_at_the_second() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(PipelineConfig::default(), &probe).await;
    let same = json!({"q": "same"});
    let rs = sequence(&p, &s, &vec![("probe", same); 5]).await;
    let found: Vec<(usize, &AdditionalContext)> = rs
        .iter()
        .enumerate()
        .flat_map(|(i, r)| reminders(r).into_iter().map(move |c| (i + 1, c)))
        .collect();
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].0, 3);
    assert_eq!(found[0].1.content, GENTLE_REMINDER);
    assert_eq!(summary(found[0].1), Some("probe × 3"));
    assert_eq!(found[1].0, 5);
    assert!(found[1].1.content.contains("consecutive_calls: 5"));
    assert!(found[1].1.content.contains("- tool: probe"));
    assert!(found[1].1.content.contains(r#"{"q":"same"}"#));
    assert_eq!(summary(found[1].1), Some("probe × 5"));
}

#[tokio::test]
async fn reminder_keys_the_gentle_text_to_the_smallest_threshold() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(reminder_cfg(&[4.0, 2.0]), &probe).await;
    let rs = sequence(&p, &s, &vec![("probe", json!({})); 4]).await;
    assert_eq!(reminders(&rs[1]).len(), 1);
    assert_eq!(reminders(&rs[1])[0].content, GENTLE_REMINDER);
    assert!(
        reminders(&rs[3])[0]
            .content
            .contains("consecutive_calls: 4")
    );
    assert!(reminders(&rs[0]).is_empty() && reminders(&rs[2]).is_empty());
}

#[tokio::test]
async fn reminder_caps_the_quoted_arguments() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = reminder_cfg(&[2.0, 3.0]);
    cfg.repeat_tool_reminder.arguments_preview_chars = 24.0;
    let p = reminder_pipeline(cfg, &probe).await;
    let payload = "x".repeat(400);
    let rs = sequence(&p, &s, &vec![("probe", json!({ "body": payload })); 3]).await;
    let all: Vec<_> = rs.iter().flat_map(reminders).collect();
    assert_eq!(all.len(), 2);
    let canonical = format!(r#"{{"body":"{payload}"}}"#);
    let head: String = canonical.chars().take(24).collect();
    let expected = format!("{head}… (+{} more chars)", canonical.chars().count() - 24);
    assert_eq!(canonical.chars().count() - 24, 387);
    assert!(
        all[1]
            .content
            .contains(&format!("- arguments: {expected}\n")),
        "{}",
        all[1].content
    );
    assert!(!all[1].content.contains(&payload));
}

#[tokio::test]
async fn reminder_chain_is_reset_by_a_different_tracked_call() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(PipelineConfig::default(), &probe).await;
    let a = ("probe", json!({}));
    let b = ("other", json!({}));
    let rs = sequence(&p, &s, &[a.clone(), a.clone(), b, a.clone(), a.clone(), a]).await;
    let counts: Vec<usize> = rs.iter().map(|r| reminders(r).len()).collect();
    assert_eq!(counts, vec![0, 0, 0, 0, 0, 1]);
}

#[tokio::test]
async fn reminder_excluded_calls_are_transparent() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = PipelineConfig::default();
    cfg.repeat_tool_reminder.exclude = vec!["other".into()];
    let p = reminder_pipeline(cfg, &probe).await;
    let a = ("probe", json!({}));
    let b = ("other", json!({}));
    let rs = sequence(&p, &s, &[a.clone(), b.clone(), a.clone(), b, a]).await;
    let counts: Vec<usize> = rs.iter().map(|r| reminders(r).len()).collect();
    assert_eq!(counts, vec![0, 0, 0, 0, 1]);
    assert_eq!(reminders(&rs[4])[0].content, GENTLE_REMINDER);
}

#[tokio::test]
async fn reminder_include_patterns_track_only_matching_tools() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = PipelineConfig::default();
    cfg.repeat_tool_reminder.include = vec!["pro*".into()];
    let p = reminder_pipeline(cfg, &probe).await;
    let rs = sequence(
        &p,
        &s,
        &[
            ("other", json!({})),
            ("other", json!({})),
            ("other", json!({})),
            ("probe", json!({})),
            ("probe", json!({})),
            ("probe", json!({})),
        ],
    )
    .await;
    let counts: Vec<usize> = rs.iter().map(|r| reminders(r).len()).collect();
    assert_eq!(counts, vec![0, 0, 0, 0, 0, 1]);
}

#[tokio::test]
async fn reminder_patterns_treat_regex_metacharacters_literally() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = PipelineConfig::default();
    cfg.repeat_tool_reminder.exclude = vec!["pr.be".into()];
    let p = reminder_pipeline(cfg, &probe).await;
    let rs = sequence(&p, &s, &vec![("probe", json!({})); 3]).await;
    assert_eq!(reminders(&rs[2]).len(), 1, "pr.be must not exclude probe");
}

#[tokio::test]
async fn reminder_canonicalization_ignores_property_order_deeply() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(PipelineConfig::default(), &probe).await;
    let rs = sequence(
        &p,
        &s,
        &[
            (
                "probe",
                json!({"a": 1, "b": {"c": 2, "d": [ {"e": 3, "f": 4} ]}}),
            ),
            (
                "probe",
                json!({"b": {"d": [ {"f": 4, "e": 3} ], "c": 2}, "a": 1}),
            ),
            (
                "probe",
                json!({"b": {"c": 2, "d": [ {"f": 4, "e": 3} ]}, "a": 1}),
            ),
        ],
    )
    .await;
    let counts: Vec<usize> = rs.iter().map(|r| reminders(r).len()).collect();
    assert_eq!(counts, vec![0, 0, 1]);
}

#[tokio::test]
async fn reminder_chains_are_per_session() {
    let (a, manager, _d) = test_session().await;
    let b = manager
        .create(
            &CallCtx::new("test"),
            crate::session_manager::NewSession::default(),
        )
        .await
        .unwrap();
    let probe = Probe::new();
    let p = reminder_pipeline(PipelineConfig::default(), &probe).await;
    let on_a = sequence(&p, &a, &vec![("probe", json!({})); 2]).await;
    let on_b = sequence(&p, &b, &vec![("probe", json!({})); 3]).await;
    assert_eq!(on_a.iter().map(|r| reminders(r).len()).sum::<usize>(), 0);
    assert_eq!(on_b.iter().map(|r| reminders(r).len()).sum::<usize>(), 1);
}

#[tokio::test]
async fn reminder_chain_is_reset_by_a_user_message() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(PipelineConfig::default(), &probe).await;
    let mut rs = sequence(&p, &s, &vec![("probe", json!({})); 2]).await;
    p.on_user_message(&s.id);
    rs.extend(sequence(&p, &s, &[("probe", json!({}))]).await);
    assert_eq!(rs.iter().map(|r| reminders(r).len()).sum::<usize>(), 0);
}

#[tokio::test]
async fn reminder_chain_is_dropped_with_its_session() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let p = reminder_pipeline(reminder_cfg(&[2.0]), &probe).await;
    let mut rs = sequence(&p, &s, &[("probe", json!({}))]).await;
    p.on_session_closed(&s.id);
    rs.extend(sequence(&p, &s, &[("probe", json!({}))]).await);
    assert_eq!(rs.iter().map(|r| reminders(r).len()).sum::<usize>(), 0);
}

#[tokio::test]
async fn reminder_counts_denied_calls() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = reminder_cfg(&[2.0]);
    cfg.permission.deny_tools = vec!["probe".into()];
    let p = reminder_pipeline(cfg, &probe).await;
    let rs = sequence(&p, &s, &vec![("probe", json!({})); 2]).await;
    assert!(rs.iter().all(|r| code(r) == Some(ErrorCode::ToolDenied)));
    assert_eq!(reminders(&rs[1]).len(), 1);
    assert_eq!(
        probe.dispatched.load(Ordering::SeqCst),
        0,
        "denied calls never dispatch"
    );
}

#[tokio::test]
async fn reminder_folds_onto_a_downstream_block_and_keeps_its_feedback() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = reminder_pipeline(reminder_cfg(&[2.0]), &probe).await;
    p.register_guard(Arc::new(Scripted {
        block: Some("nope"),
        context: true,
        ..Default::default()
    }));
    let rs = sequence(&p, &s, &vec![("probe", json!({})); 2]).await;
    assert!(
        rs.iter()
            .all(|r| r.is_error && r.content == "nope" && code(r) == Some(ErrorCode::ToolDenied))
    );
    let first: Vec<&str> = rs[0]
        .additional_contexts
        .iter()
        .map(|c| c.content.as_str())
        .collect();
    assert_eq!(first, vec![format!("ctx-{}", rs[0].call_id)]);
    let second = &rs[1].additional_contexts;
    assert_eq!(second.len(), 2);
    assert_eq!(
        second[0].content, GENTLE_REMINDER,
        "the reminder is prepended"
    );
    assert_eq!(second[1].content, format!("ctx-{}", rs[1].call_id));
}

#[tokio::test]
async fn reminder_keeps_a_downstream_replacement_while_folding() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = reminder_pipeline(reminder_cfg(&[2.0]), &probe).await;
    p.register_guard(Arc::new(Scripted {
        replace: Some("replaced"),
        ..Default::default()
    }));
    let rs = sequence(&p, &s, &vec![("probe", json!({})); 2]).await;
    assert_eq!(rs[1].content, "replaced");
    assert!(!rs[1].is_error);
    assert_eq!(reminders(&rs[1]).len(), 1);
}

#[test]
fn reminder_config_is_validated_loudly() {
    let bad = |t: Vec<f64>, preview: f64| {
        let mut cfg = PipelineConfig::default();
        cfg.repeat_tool_reminder.thresholds = t;
        cfg.repeat_tool_reminder.arguments_preview_chars = preview;
        cfg.validate().unwrap_err()
    };
    assert_eq!(bad(vec![], 500.0), PipelineConfigError::EmptyThresholds);
    assert_eq!(
        bad(vec![3.0, 1.0], 500.0),
        PipelineConfigError::InvalidThreshold { value: 1.0 }
    );
    assert_eq!(
        bad(vec![2.5], 500.0),
        PipelineConfigError::InvalidThreshold { value: 2.5 }
    );
    assert_eq!(
        bad(vec![3.0, 5.0, 3.0], 500.0),
        PipelineConfigError::DuplicateThresholds
    );
    assert_eq!(
        bad(vec![3.0], 0.0),
        PipelineConfigError::InvalidPreviewChars { value: 0.0 }
    );
    assert_eq!(
        bad(vec![3.0], 1.5),
        PipelineConfigError::InvalidPreviewChars { value: 1.5 }
    );
    // At load, through the daemon's config, and when building the pipeline.
    let e =
        Config::from_toml_str("[pipeline.repeat_tool_reminder]\nthresholds = []\n").unwrap_err();
    assert!(matches!(e, crate::config::ConfigError::Invalid(_)));
    let mut cfg = PipelineConfig::default();
    cfg.repeat_tool_reminder.enabled = false;
    cfg.repeat_tool_reminder.thresholds = vec![1.0];
    let built = Pipeline::new(
        &cfg,
        &LimitsConfig::default(),
        crate::telemetry::Metrics::new(),
    );
    assert_eq!(
        built.unwrap_err(),
        PipelineConfigError::InvalidThreshold { value: 1.0 },
        "checked even when disabled"
    );
    // The defaults.
    let d = RepeatReminderConfig::default();
    assert_eq!(d.validate().unwrap(), (vec![3, 5, 8], 500));
    let parsed: Config =
        Config::from_toml_str("[pipeline.repeat_tool_reminder]\nthresholds = [8, 3]\n").unwrap();
    assert_eq!(
        parsed.pipeline.repeat_tool_reminder.validate().unwrap().0,
        vec![3, 8]
    );
}

// === the scheduler (dsh 5.4) ===

fn cap(n: i64) -> PipelineConfig {
    PipelineConfig {
        max_parallel_tool_calls: n,
        ..PipelineConfig::default()
    }
}

#[tokio::test]
async fn parallel_siblings_start_before_any_completes() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(TestTool::new(
        "gate",
        Behavior::Together(3),
        &probe,
    )));
    let rs = run(
        &p,
        &s,
        vec![tcall("a", "gate"), tcall("b", "gate"), tcall("c", "gate")],
    )
    .await;
    assert!(rs.iter().all(|r| r.content == "together"), "{rs:?}");
    assert_eq!(probe.max.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn an_exclusive_call_between_parallel_ones_is_a_barrier() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    p.register_tool(Arc::new(
        TestTool::new("excl", Behavior::Ok, &probe).exclusive(),
    ));
    p.register_tool(Arc::new(TestTool::new("par", Behavior::Ok, &probe)));
    let ctx = CallCtx::new("test");
    let calls = vec![tcall("p1", "held"), tcall("x", "excl"), tcall("p2", "par")];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        probe.wait_entered(1).await;
        assert!(
            !logged_within(&s, "x", false, NEGATIVE_WAIT).await,
            "the barrier waits for the running call"
        );
        probe.release.send_replace(true);
    });
    assert!(rs.unwrap().iter().all(|r| !r.is_error));
    assert_eq!(
        probe.events().await,
        vec![
            "start:p1", "end:p1", "start:x", "end:x", "start:p2", "end:p2"
        ]
    );
    assert_eq!(probe.max.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn calls_are_reclassified_right_before_they_start() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(
        TestTool::new("excl", Behavior::Ok, &probe).exclusive(),
    ));
    p.register_tool(Arc::new(TestTool::new(
        "par",
        Behavior::UntilReleased,
        &probe,
    )));
    // The barrier's result makes `par` exclusive: the later `par` calls must run alone.
    p.register_guard(Arc::new(Scripted {
        exclusive_after: Some(("x", "par", Arc::clone(&probe))),
        ..Default::default()
    }));
    let ctx = CallCtx::new("test");
    let calls = vec![tcall("x", "excl"), tcall("p1", "par"), tcall("p2", "par")];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        probe.wait_entered(2).await;
        assert!(
            !logged_within(&s, "p2", false, NEGATIVE_WAIT).await,
            "p2 became exclusive"
        );
        probe.release.send_replace(true);
    });
    assert!(rs.unwrap().iter().all(|r| !r.is_error));
    assert_eq!(probe.max.load(Ordering::SeqCst), 1);
    assert_eq!(
        probe.events().await,
        vec![
            "start:x", "end:x", "start:p1", "end:p1", "start:p2", "end:p2"
        ]
    );
}

#[tokio::test]
async fn a_result_that_makes_the_next_call_exclusive_stops_replenishing_the_pool() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(2));
    p.register_tool(Arc::new(TestTool::new("fast", Behavior::Ok, &probe)));
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    p.register_tool(Arc::new(TestTool::new("later", Behavior::Ok, &probe)));
    p.register_guard(Arc::new(Scripted {
        exclusive_after: Some(("a", "later", Arc::clone(&probe))),
        ..Default::default()
    }));
    let ctx = CallCtx::new("test");
    let calls = vec![tcall("a", "fast"), tcall("b", "held"), tcall("c", "later")];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        // `a` is committed (and `later` turned exclusive) while `b` is still held: the
        // freed pool slot must not be refilled with `c`.
        assert!(logged_within(&s, "a", true, Duration::from_secs(20)).await);
        assert!(
            !logged_within(&s, "c", false, NEGATIVE_WAIT).await,
            "c waits for the pool to drain"
        );
        probe.release.send_replace(true);
    });
    assert!(rs.unwrap().iter().all(|r| !r.is_error));
    let ev = probe.events().await;
    let pos = |e: &str| ev.iter().position(|x| x == e).unwrap();
    assert!(pos("start:c") > pos("end:b"), "{ev:?}");
}

#[tokio::test]
async fn results_are_committed_in_model_order_despite_out_of_order_settlement() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    p.register_tool(Arc::new(TestTool::new("fast", Behavior::Ok, &probe)));
    let observer = Arc::new(Scripted {
        context: true,
        ..Default::default()
    });
    p.register_guard(observer.clone());
    let ctx = CallCtx::new("test");
    let calls = vec![tcall("a", "held"), tcall("b", "fast"), tcall("c", "fast")];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        let mut ev = probe.flight.subscribe();
        ev.wait_for(|(cur, entered)| *entered == 3 && *cur == 1)
            .await
            .unwrap();
        probe.release.send_replace(true);
    });
    let rs = rs.unwrap();
    let ids: Vec<&str> = rs.iter().map(|r| r.call_id.as_str()).collect();
    assert_eq!(ids, vec!["a", "b", "c"]);
    let ev = probe.events().await;
    assert!(
        ev.iter().position(|e| e == "end:b") < ev.iter().position(|e| e == "end:a"),
        "b settled first: {ev:?}"
    );
    assert_eq!(
        result_order(&s).await,
        vec!["a", "b", "c"],
        "logged in model order"
    );
    assert_eq!(
        *observer.pre.lock().await,
        vec!["a", "b", "c"],
        "pre-execute in model order"
    );
    assert_eq!(
        *observer.post.lock().await,
        vec!["a", "b", "c"],
        "post-execute in model order"
    );
    for r in &rs {
        assert_eq!(
            r.additional_contexts[0].content,
            format!("ctx-{}", r.call_id),
            "contexts stay with their call"
        );
    }
    // The derived history pairs the results in model order.
    let history: Vec<String> = s
        .log
        .derive_messages()
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            Message::Tool { result } => Some(result.call_id),
            _ => None,
        })
        .collect();
    assert_eq!(history, vec!["a", "b", "c"]);
}

#[test]
fn the_pool_cap_is_validated_and_defaults_to_four() {
    assert_eq!(PipelineConfig::default().max_parallel_tool_calls, 4);
    assert_eq!(
        Config::from_toml_str("")
            .unwrap()
            .pipeline
            .max_parallel()
            .unwrap(),
        4
    );
    assert_eq!(
        cap(0).validate().unwrap_err(),
        PipelineConfigError::MaxParallel { value: 0 }
    );
    assert_eq!(
        cap(-3).validate().unwrap_err(),
        PipelineConfigError::MaxParallel { value: -3 }
    );
    let e = Pipeline::new(
        &cap(0),
        &LimitsConfig::default(),
        crate::telemetry::Metrics::new(),
    )
    .unwrap_err();
    assert_eq!(e, PipelineConfigError::MaxParallel { value: 0 });
    assert!(matches!(
        Config::from_toml_str("[pipeline]\nmax_parallel_tool_calls = 0\n"),
        Err(crate::config::ConfigError::Invalid(_))
    ));
    assert!(
        Config::from_toml_str("[pipeline]\nmax_parallel = 2\n").is_err(),
        "unknown fields are refused"
    );
}

#[tokio::test]
async fn at_most_the_cap_runs_at_once() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(2));
    p.register_tool(Arc::new(TestTool::new(
        "gate",
        Behavior::Together(2),
        &probe,
    )));
    let calls = (0..5).map(|i| tcall(&format!("g{i}"), "gate")).collect();
    let rs = run(&p, &s, calls).await;
    assert!(rs.iter().all(|r| !r.is_error), "{rs:?}");
    assert_eq!(probe.max.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_cap_of_one_runs_the_batch_serially() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(1));
    p.register_tool(Arc::new(TestTool::new(
        "par",
        Behavior::UntilReleased,
        &probe,
    )));
    let ctx = CallCtx::new("test");
    let calls = vec![tcall("a", "par"), tcall("b", "par"), tcall("c", "par")];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        probe.wait_entered(1).await;
        assert!(
            !logged_within(&s, "b", false, NEGATIVE_WAIT).await,
            "b waits for a"
        );
        probe.release.send_replace(true);
    });
    assert!(rs.unwrap().iter().all(|r| !r.is_error));
    assert_eq!(probe.max.load(Ordering::SeqCst), 1);
    assert_eq!(
        probe.events().await,
        vec!["start:a", "end:a", "start:b", "end:b", "start:c", "end:c"]
    );
}

#[tokio::test]
async fn refusals_are_ordered_results_without_dispatch() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut cfg = PipelineConfig::default();
    cfg.permission.deny_tools = vec!["forbidden".into()];
    let mut p = pipeline(cfg);
    p.register_tool(Arc::new(TestTool::new("forbidden", Behavior::Ok, &probe)));
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    let rs = run(
        &p,
        &s,
        vec![
            tcall("a", "forbidden"),
            tcall("b", "nope"),
            call("c", "probe", json!({"invalid": true})),
            tcall("d", "probe"),
        ],
    )
    .await;
    let codes: Vec<Option<ErrorCode>> = rs.iter().map(code).collect();
    assert_eq!(
        codes,
        vec![
            Some(ErrorCode::ToolDenied),
            Some(ErrorCode::UnknownTool),
            Some(ErrorCode::InvalidRequest),
            None
        ]
    );
    assert_eq!(rs[1].content, "Error: unknown tool \"nope\"");
    assert_eq!(
        probe.dispatched.load(Ordering::SeqCst),
        1,
        "only the valid call ran"
    );
    assert_eq!(result_order(&s).await, vec!["a", "b", "c", "d"]);
}

#[tokio::test]
async fn a_batch_is_logged_as_one_turn_with_its_call_ids() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    run(&p, &s, vec![tcall("a", "probe"), tcall("b", "probe")]).await;
    run(&p, &s, vec![tcall("c", "probe")]).await;
    let ev = batch_events(&s).await;
    assert!(
        matches!(&ev[0], EventBody::TurnStart { turn: 0, call_ids } if call_ids == &["a", "b"])
    );
    assert!(matches!(&ev[1], EventBody::ToolCall { call_id, .. } if call_id == "a"));
    assert!(matches!(
        ev.last(),
        Some(EventBody::TurnEnd {
            turn: 1,
            kind: TurnEndKind::Completed
        })
    ));
    assert!(ev.iter().any(|e| matches!(
        e,
        EventBody::TurnEnd {
            turn: 0,
            kind: TurnEndKind::Completed
        }
    )));
    // Every result cites its call.
    let events = s.log.events_after(None).await.unwrap();
    for e in &events {
        if let EventBody::ToolResult {
            result,
            call_seq: Some(seq),
        } = &e.body
        {
            let cited = events.iter().find(|c| c.seq == *seq).unwrap();
            assert!(
                matches!(&cited.body, EventBody::ToolCall { call_id, .. } if *call_id == result.call_id)
            );
        }
    }
}

#[tokio::test]
async fn repeated_call_ids_refuse_the_batch_before_anything_is_logged() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    let ctx = CallCtx::new("test");
    let before = s.log.next_seq();
    let e = p
        .run_batch(&s, &ctx, vec![tcall("a", "probe"), tcall("a", "probe")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
    let e = p
        .run_batch(&s, &ctx, vec![tcall("", "probe")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
    assert_eq!(s.log.next_seq(), before);
    run(&p, &s, vec![tcall("a", "probe")]).await;
    let after = s.log.next_seq();
    let e = p
        .run_batch(&s, &ctx, vec![tcall("b", "probe"), tcall("a", "probe")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidRequest);
    assert_eq!(
        s.log.next_seq(),
        after,
        "nothing logged for the refused batch"
    );
    assert_eq!(probe.dispatched.load(Ordering::SeqCst), 1);
    // A fresh pipeline (a restarted daemon) reads the used ids from the log.
    let mut fresh = pipeline(PipelineConfig::default());
    fresh.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    assert_eq!(
        fresh
            .run_batch(&s, &ctx, vec![tcall("a", "probe")])
            .await
            .unwrap_err()
            .code(),
        ErrorCode::InvalidRequest
    );
    assert_eq!(run(&fresh, &s, vec![tcall("z", "probe")]).await.len(), 1);
    assert!(matches!(
        batch_events(&s).await.last(),
        Some(EventBody::TurnEnd { turn: 1, .. })
    ));
}

#[tokio::test]
async fn a_cancelled_caller_starts_nothing() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(TestTool::new("probe", Behavior::Ok, &probe)));
    let ctx = CallCtx::new("test");
    ctx.cancel.cancel(CancelReason::Caller("gone"));
    let rs = p
        .run_batch(&s, &ctx, vec![tcall("a", "probe"), tcall("b", "probe")])
        .await
        .unwrap();
    assert!(rs.iter().all(|r| code(r) == Some(ErrorCode::Cancelled)
        && r.content == format!("Error: {ABORTED_BEFORE_DISPATCH}")));
    assert_eq!(probe.dispatched.load(Ordering::SeqCst), 0);
    let ev = batch_events(&s).await;
    let calls = ev
        .iter()
        .filter(|e| matches!(e, EventBody::ToolCall { .. }))
        .count();
    assert_eq!(calls, 2, "every call has its tool/call and tool/result");
    assert!(matches!(
        ev.last(),
        Some(EventBody::TurnEnd {
            kind: TurnEndKind::Cancelled,
            ..
        })
    ));
}

#[tokio::test]
async fn a_cancellation_during_pre_execute_skips_the_dispatch() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let ctx = CallCtx::new("test");
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(TestTool::new(
        "probe",
        Behavior::UntilCancelled,
        &probe,
    )));
    p.register_guard(Arc::new(Scripted {
        cancel_at: Some(("b", ctx.clone())),
        ..Default::default()
    }));
    let rs = p
        .run_batch(
            &s,
            &ctx,
            vec![
                tcall("a", "probe"),
                tcall("b", "probe"),
                tcall("c", "probe"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        probe.dispatched.load(Ordering::SeqCst),
        1,
        "only the call started before the cancellation ran"
    );
    assert_eq!(
        rs[0].error.as_ref().map(|e| (e.code, e.message.as_str())),
        Some((ErrorCode::Cancelled, ABORTED))
    );
    for r in &rs[1..] {
        assert_eq!(
            r.error.as_ref().map(|e| (e.code, e.message.as_str())),
            Some((ErrorCode::Cancelled, ABORTED_BEFORE_DISPATCH))
        );
    }
    assert_eq!(result_order(&s).await, vec!["a", "b", "c"]);
}

#[tokio::test]
async fn a_cancellation_stops_replenishing_and_commits_started_calls() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(2));
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    p.register_tool(Arc::new(TestTool::new(
        "fails",
        Behavior::AbortError,
        &probe,
    )));
    p.register_tool(Arc::new(
        TestTool::new("excl", Behavior::Ok, &probe).exclusive(),
    ));
    let ctx = CallCtx::new("test");
    let calls = vec![
        tcall("a", "held"),
        tcall("b", "fails"),
        tcall("c", "held"),
        tcall("x", "excl"),
    ];
    let (rs, ()) = tokio::join!(p.run_batch(&s, &ctx, calls), async {
        probe.wait_entered(2).await;
        ctx.cancel.cancel(CancelReason::Caller("user"));
    });
    let rs = rs.unwrap();
    assert_eq!(
        probe.dispatched.load(Ordering::SeqCst),
        2,
        "no call starts after the cancellation, no barrier runs"
    );
    let got: Vec<(Option<ErrorCode>, &str)> = rs
        .iter()
        .map(|r| (code(r), r.error.as_ref().map_or("", |e| e.message.as_str())))
        .collect();
    assert_eq!(
        got,
        vec![
            (Some(ErrorCode::Cancelled), ABORTED),
            (Some(ErrorCode::FsAborted), "web fetch aborted"),
            (Some(ErrorCode::Cancelled), ABORTED_BEFORE_DISPATCH),
            (Some(ErrorCode::Cancelled), ABORTED_BEFORE_DISPATCH),
        ],
        "a successful call becomes aborted, a failed one keeps its error"
    );
    assert_eq!(result_order(&s).await, vec!["a", "b", "c", "x"]);
    assert!(matches!(
        batch_events(&s).await.last(),
        Some(EventBody::TurnEnd {
            kind: TurnEndKind::Cancelled,
            ..
        })
    ));
}

#[tokio::test]
async fn dropping_the_callers_future_cancels_and_still_logs_the_batch() {
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(PipelineConfig::default());
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    let p = Arc::new(p);
    let (p2, s2) = (Arc::clone(&p), Arc::clone(&s));
    let caller = tokio::spawn(async move {
        let ctx = CallCtx::new("test");
        p2.run_batch(&s2, &ctx, vec![tcall("a", "held")]).await
    });
    probe.wait_entered(1).await;
    caller.abort();
    let mut follow = s.log.follow(None);
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        use futures_util::StreamExt;
        while let Some(e) = follow.next().await {
            if let EventBody::TurnEnd { kind, .. } = e.unwrap().body {
                return kind;
            }
        }
        panic!("the log ended without a turn/end");
    })
    .await
    .expect("the batch ended");
    assert_eq!(ended, TurnEndKind::Cancelled);
    assert_eq!(
        probe.events().await,
        vec!["start:a", "end:a"],
        "the tool reached quiescence"
    );
}

#[tokio::test]
async fn a_scheduler_failure_drains_started_calls_before_failing() {
    /// Once the other call runs, closes the session log: every later append fails.
    #[derive(Debug)]
    struct Closer(Arc<Probe>);
    #[async_trait]
    impl Tool for Closer {
        fn name(&self) -> &str {
            "closer"
        }
        fn exclusive(&self, _: &Value) -> bool {
            false
        }
        async fn call(&self, _: &CallCtx, session: &Arc<Session>, _: &Value) -> ToolOutput {
            self.0.wait_entered(1).await;
            session.log.close().await;
            self.0.saw_abort.send_replace(true);
            ToolOutput::ok("closed")
        }
    }
    let (s, _m, _d) = test_session().await;
    let probe = Probe::new();
    let mut p = pipeline(cap(4));
    p.register_tool(Arc::new(TestTool::new(
        "held",
        Behavior::UntilReleased,
        &probe,
    )));
    p.register_tool(Arc::new(Closer(Arc::clone(&probe))));
    let ctx = CallCtx::new("test");
    let finished = AtomicBool::new(false);
    let (r, ()) = tokio::join!(
        async {
            let r = p
                .run_batch(&s, &ctx, vec![tcall("b", "closer"), tcall("a", "held")])
                .await;
            finished.store(true, Ordering::SeqCst);
            r
        },
        async {
            let mut closed = probe.saw_abort.subscribe();
            closed.wait_for(|c| *c).await.unwrap();
            // The commit of `b` fails now; the batch must still wait for `a`.
            for _ in 0..200 {
                tokio::task::yield_now().await;
            }
            assert!(
                !finished.load(Ordering::SeqCst),
                "the batch waits for its started calls"
            );
            probe.release.send_replace(true);
        }
    );
    assert!(r.is_err());
    assert_eq!(probe.events().await, vec!["start:a", "end:a"]);
}

#[test]
fn arguments_are_normalized_like_dsh() {
    use super::batch::normalize_arguments;
    assert_eq!(normalize_arguments(&Value::Null), json!({}));
    assert_eq!(normalize_arguments(&json!("")), json!({}));
    assert_eq!(normalize_arguments(&json!(r#"{"a":1}"#)), json!({"a": 1}));
    assert_eq!(normalize_arguments(&json!("not json")), json!("not json"));
    assert_eq!(normalize_arguments(&json!({"b": 2})), json!({"b": 2}));
}

// === the built-in tools, on a real local sandbox ===

fn builtin(limits: LimitsConfig, cfg: PipelineConfig) -> Pipeline {
    Pipeline::new(&cfg, &limits, crate::telemetry::Metrics::new()).expect("pipeline")
}

fn text_of(r: &ToolResult) -> &str {
    &r.content
}

#[tokio::test]
async fn file_tools_write_read_edit_and_list() {
    let (s, _m, _d) = test_session().await;
    let p = builtin(LimitsConfig::default(), PipelineConfig::default());
    let w = run_one(
        &p,
        &s,
        call(
            "w1",
            "write_file",
            json!({"path": "src/a.txt", "content": "one\ntwo\nthree\n"}),
        ),
    )
    .await;
    assert!(!w.is_error, "{w:?}");
    let r = run_one(
        &p,
        &s,
        call("r1", "read_file", json!({"path": "src/a.txt"})),
    )
    .await;
    assert_eq!(text_of(&r), "one\ntwo\nthree\n");
    let r = run_one(
        &p,
        &s,
        call(
            "r2",
            "read_file",
            json!({"path": "/home/user/src/a.txt", "offset": 2, "limit": 1}),
        ),
    )
    .await;
    assert_eq!(text_of(&r), "two\n[lines 2-2 of 3]");
    let r = run_one(
        &p,
        &s,
        call("r3", "read_file", json!({"path": "src/a.txt", "offset": 9})),
    )
    .await;
    assert_eq!(code(&r), Some(ErrorCode::InvalidRequest));

    let e = run_one(
        &p,
        &s,
        call(
            "e1",
            "edit_file",
            json!({"path": "src/a.txt", "old_string": "two", "new_string": "2"}),
        ),
    )
    .await;
    assert!(!e.is_error, "{e:?}");
    let r = run_one(
        &p,
        &s,
        call("r4", "read_file", json!({"path": "src/a.txt"})),
    )
    .await;
    assert_eq!(text_of(&r), "one\n2\nthree\n");
    let e = run_one(
        &p,
        &s,
        call(
            "e2",
            "edit_file",
            json!({"path": "src/a.txt", "old_string": "zzz", "new_string": "y"}),
        ),
    )
    .await;
    assert_eq!(code(&e), Some(ErrorCode::FsEditNotFound));
    let e = run_one(
        &p,
        &s,
        call(
            "e3",
            "edit_file",
            json!({"path": "src/a.txt", "old_string": "e", "new_string": "E"}),
        ),
    )
    .await;
    assert_eq!(code(&e), Some(ErrorCode::FsAmbiguousEdit));

    run_one(
        &p,
        &s,
        call(
            "w2",
            "write_file",
            json!({"path": "src/sub/b.txt", "content": "b"}),
        ),
    )
    .await;
    let l = run_one(&p, &s, call("l1", "list_dir", json!({"path": "src"}))).await;
    assert_eq!(text_of(&l), "a.txt\nsub/\n");
    let l = run_one(
        &p,
        &s,
        call("l2", "list_dir", json!({"path": "src", "depth": 2})),
    )
    .await;
    assert_eq!(text_of(&l), "a.txt\nsub/\nsub/b.txt\n");
    let l = run_one(
        &p,
        &s,
        call("l3", "list_dir", json!({"path": "src", "depth": 0})),
    )
    .await;
    assert_eq!(code(&l), Some(ErrorCode::InvalidRequest));
}

#[tokio::test]
async fn file_tools_refuse_missing_binary_large_and_malformed() {
    let (s, _m, _d) = test_session().await;
    let limits = LimitsConfig {
        read_file_max_bytes: 16,
        ..LimitsConfig::default()
    };
    let p = builtin(limits, PipelineConfig::default());
    let r = run_one(
        &p,
        &s,
        call("r1", "read_file", json!({"path": "missing.txt"})),
    )
    .await;
    assert_eq!(code(&r), Some(ErrorCode::FsNotFound));
    run_one(
        &p,
        &s,
        call(
            "w1",
            "write_file",
            json!({"path": "bin", "content": "a\u{0}b"}),
        ),
    )
    .await;
    let r = run_one(&p, &s, call("r2", "read_file", json!({"path": "bin"}))).await;
    assert_eq!(code(&r), Some(ErrorCode::FsNotText));
    run_one(
        &p,
        &s,
        call(
            "w2",
            "write_file",
            json!({"path": "big", "content": "x".repeat(17)}),
        ),
    )
    .await;
    let r = run_one(&p, &s, call("r3", "read_file", json!({"path": "big"}))).await;
    assert_eq!(code(&r), Some(ErrorCode::FsTooLarge));
    let r = run_one(
        &p,
        &s,
        call("r4", "read_file", json!({"path": "big", "bogus": 1})),
    )
    .await;
    assert_eq!(
        code(&r),
        Some(ErrorCode::InvalidRequest),
        "unknown fields are refused"
    );
    let r = run_one(&p, &s, call("r5", "read_file", json!("not an object"))).await;
    assert_eq!(code(&r), Some(ErrorCode::InvalidRequest));
    let r = run_one(&p, &s, call("r6", "read_file", json!({}))).await;
    assert_eq!(code(&r), Some(ErrorCode::InvalidRequest));
}

#[tokio::test]
async fn edits_are_guarded_by_the_version_they_read() {
    let (s, _m, _d) = test_session().await;
    let limits = LimitsConfig::default();
    let ctx = CallCtx::new("test");
    let v1 =
        super::tools::tests_support::write(&ctx, &s, &limits, "f.txt", "one", WriteGuard::None)
            .await
            .unwrap();
    super::tools::tests_support::write(&ctx, &s, &limits, "f.txt", "two", WriteGuard::None)
        .await
        .unwrap();
    let stale = WriteGuard::ReplaceIfVersion {
        version: v1.version,
    };
    let out = super::tools::tests_support::write(&ctx, &s, &limits, "f.txt", "three", stale)
        .await
        .unwrap_err();
    assert_eq!(out.code(), Some(ErrorCode::FsVersionMismatch));
}

#[tokio::test]
async fn the_path_policy_protects_git_from_write_tools() {
    let (s, _m, _d) = test_session().await;
    let p = builtin(LimitsConfig::default(), PipelineConfig::default());
    let w = run_one(
        &p,
        &s,
        call(
            "w1",
            "write_file",
            json!({"path": "repo/.git/config", "content": "x"}),
        ),
    )
    .await;
    assert_eq!(code(&w), Some(ErrorCode::ToolDenied));
    let r = run_one(
        &p,
        &s,
        call("r1", "read_file", json!({"path": "repo/.git/config"})),
    )
    .await;
    assert_eq!(
        code(&r),
        Some(ErrorCode::FsNotFound),
        "the denied write never happened"
    );
}

#[tokio::test]
async fn bash_reports_exit_code_and_both_streams() {
    let (s, _m, _d) = test_session().await;
    let p = builtin(LimitsConfig::default(), PipelineConfig::default());
    let r = run_one(
        &p,
        &s,
        call(
            "b1",
            "bash",
            json!({"command": "echo out; echo err >&2; exit 3"}),
        ),
    )
    .await;
    assert!(!r.is_error, "a non-zero exit is not an error: {r:?}");
    assert_eq!(
        text_of(&r),
        "exit code: 3\n--- stdout ---\nout\n--- stderr ---\nerr\n"
    );
    run_one(
        &p,
        &s,
        call("b0", "bash", json!({"command": "mkdir -p sub"})),
    )
    .await;
    let r = run_one(
        &p,
        &s,
        call("b2", "bash", json!({"command": "pwd", "cwd": "sub"})),
    )
    .await;
    assert!(text_of(&r).contains("/sub\n"), "{r:?}");
    let r = run_one(
        &p,
        &s,
        call("b3", "bash", json!({"command": "true", "timeout_ms": 0})),
    )
    .await;
    assert_eq!(code(&r), Some(ErrorCode::InvalidRequest));
    let r = run_one(&p, &s, call("b4", "bash", json!({"cmd": "true"}))).await;
    assert_eq!(code(&r), Some(ErrorCode::InvalidRequest));
}

#[tokio::test]
async fn a_bash_call_is_three_durability_points() {
    let (s, _m, _d) = test_session().await;
    let p = builtin(LimitsConfig::default(), PipelineConfig::default());
    run_one(&p, &s, call("w", "bash", json!({"command": "true"}))).await;
    let before = s.log.stats().batches;
    let r = run_one(&p, &s, call("b1", "bash", json!({"command": "echo hi"}))).await;
    assert_eq!(text_of(&r), "exit code: 0\n--- stdout ---\nhi\n");
    // `tool/call` (before the command runs), `process/started` (its id, for a restart),
    // then its end, the result and the turn's end in one group.
    assert_eq!(s.log.stats().batches - before, 3);
    let kinds: Vec<String> = s
        .log
        .events_after(None)
        .await
        .unwrap()
        .iter()
        .rev()
        .take(6)
        .map(|e| {
            serde_json::to_value(&e.body).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "turn/end",
            "tool/result",
            "process/exited",
            "process/started",
            "tool/call",
            "turn/start"
        ]
    );
}

#[tokio::test]
async fn bash_keeps_the_tail_of_long_output() {
    let (s, _m, _d) = test_session().await;
    let limits = LimitsConfig {
        tool_output_bytes: 100,
        ..LimitsConfig::default()
    };
    let p = builtin(limits, PipelineConfig::default());
    let r = run_one(&p, &s, call("b1", "bash", json!({"command": "seq 1 1000"}))).await;
    assert!(!r.is_error);
    assert!(
        text_of(&r).contains("[stdout truncated: the last 100 of 3893 bytes are shown]"),
        "{}",
        text_of(&r)
    );
    assert!(text_of(&r).ends_with("999\n1000\n"));
}

#[tokio::test]
async fn bash_expiries_are_errors_with_their_clock_and_partial_output() {
    let (s, _m, _d) = test_session().await;
    // The command's own total deadline.
    let p = builtin(LimitsConfig::default(), PipelineConfig::default());
    let r = run_one(
        &p,
        &s,
        call(
            "b1",
            "bash",
            json!({"command": "echo started; sleep 30", "timeout_ms": 500}),
        ),
    )
    .await;
    let e = r.error.clone().unwrap();
    assert_eq!(
        (e.code, e.clock, e.timeout_ms),
        (ErrorCode::DeadlineExceeded, Some(Clock::Total), Some(500))
    );
    assert!(text_of(&r).contains("started"), "{r:?}");
    // The output-idle watchdog.
    let limits = LimitsConfig {
        output_idle_ms: 400,
        ..LimitsConfig::default()
    };
    let p = builtin(limits, PipelineConfig::default());
    let r = run_one(
        &p,
        &s,
        call("b2", "bash", json!({"command": "echo started; sleep 30"})),
    )
    .await;
    let e = r.error.clone().unwrap();
    assert_eq!(
        (e.code, e.clock),
        (ErrorCode::IdleTimeout, Some(Clock::OutputIdle))
    );
    assert!(text_of(&r).contains("started"));
    // The tool's own budget (the timeout policy), shorter than the command's deadline.
    let cfg: Config = Config::from_toml_str("[pipeline.tool_timeouts]\nbash = 500\n").unwrap();
    let p = builtin(LimitsConfig::default(), cfg.pipeline);
    let r = run_one(
        &p,
        &s,
        call("b3", "bash", json!({"command": "echo started; sleep 30"})),
    )
    .await;
    let e = r.error.clone().unwrap();
    assert_eq!(
        (e.code, e.clock, e.timeout_ms),
        (ErrorCode::ToolTimeout, Some(Clock::Tool), Some(500))
    );
    assert!(text_of(&r).starts_with("Error: tool call timed out after 500ms"));
    assert!(
        text_of(&r).contains("started"),
        "the partial output is kept: {r:?}"
    );
}
