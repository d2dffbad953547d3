//! The cases of dsh's `tests/timeout.spec.ts`, one test each, on paused Tokio time, plus
//! tether's own: first reason wins, nested classification, no leftover timer tasks.

use super::*;
use std::time::Duration;
use tokio::time::advance;

fn alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

async fn settle() {
    // Let spawned timer tasks observe the advanced clock.
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
}

async fn step(ms: u64) {
    advance(Duration::from_millis(ms)).await;
    settle().await;
}

// --- TimeoutReason ---

#[test]
fn timeout_reason_is_an_error_carrying_the_code_and_elapsed_ms() {
    let r = TimeoutReason {
        clock: Clock::Tool,
        timeout_ms: 100,
    };
    let e: &dyn std::error::Error = &r;
    assert_eq!(e.to_string(), "TOOL_TIMEOUT after 100ms");
    assert_eq!(r.clock, Clock::Tool);
    assert_eq!(r.timeout_ms, 100);
}

// --- clampTimeout ---

#[test]
fn clamp_fills_the_default_when_the_hint_is_absent() {
    assert_eq!(
        clamp_timeout(None, 120_000.0, 600_000.0, "timeoutMs").unwrap(),
        120_000.0
    );
}

#[test]
fn clamp_caps_the_hint_at_max() {
    assert_eq!(
        clamp_timeout(Some(999_999.0), 120_000.0, 600_000.0, "timeoutMs").unwrap(),
        600_000.0
    );
}

#[test]
fn clamp_keeps_a_valid_hint_under_the_cap() {
    assert_eq!(
        clamp_timeout(Some(5_000.0), 120_000.0, 600_000.0, "timeoutMs").unwrap(),
        5_000.0
    );
}

#[test]
fn clamp_caps_the_default_itself_when_the_default_exceeds_max() {
    assert_eq!(
        clamp_timeout(None, 900_000.0, 600_000.0, "timeoutMs").unwrap(),
        600_000.0
    );
}

#[test]
fn clamp_rejects_a_non_finite_hint_with_the_caller_provided_name() {
    let e = clamp_timeout(Some(f64::NAN), 1.0, 2.0, "bash-local: request.timeoutMs").unwrap_err();
    assert_eq!(
        e,
        ClockError::InvalidHint {
            name: "bash-local: request.timeoutMs".into()
        }
    );
    assert_eq!(
        e.to_string(),
        "bash-local: request.timeoutMs must be a positive finite number"
    );
    let e = clamp_timeout(Some(f64::INFINITY), 1.0, 2.0, "timeoutMs").unwrap_err();
    assert_eq!(e.to_string(), "timeoutMs must be a positive finite number");
}

#[test]
fn clamp_rejects_a_non_positive_hint() {
    assert!(matches!(
        clamp_timeout(Some(0.0), 1.0, 2.0, "t"),
        Err(ClockError::InvalidHint { .. })
    ));
    assert!(matches!(
        clamp_timeout(Some(-1.0), 1.0, 2.0, "t"),
        Err(ClockError::InvalidHint { .. })
    ));
}

// --- deadline: timeout arm ---

#[tokio::test(start_paused = true)]
async fn deadline_aborts_on_timeout_with_a_timeout_reason_after_the_elapsed_ms() {
    let d = deadline(None, 100.0, Clock::Tool).unwrap();
    step(99).await;
    assert!(!d.token().is_cancelled());
    step(1).await;
    assert!(d.token().is_cancelled());
    let t = timeout_of(d.token(), Some(Clock::Tool)).unwrap();
    assert_eq!(
        t,
        TimeoutReason {
            clock: Clock::Tool,
            timeout_ms: 100
        }
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_dispose_clears_the_timer_so_no_abort_fires_afterward() {
    let d = deadline(None, 100.0, Clock::Tool).unwrap();
    let token = d.token().clone();
    d.dispose();
    step(1_000).await;
    assert!(!token.is_cancelled());
    assert_eq!(timeout_of(&token, None), None);
}

#[tokio::test(start_paused = true)]
async fn deadline_rejects_delays_that_node_would_clamp_to_one_millisecond() {
    let e = deadline(None, MAX_TIMER_DELAY_MS + 1.0, Clock::Total).unwrap_err();
    assert!(e.to_string().contains("no greater than 2147483647"), "{e}");
    let e = deadline(None, f64::INFINITY, Clock::Total).unwrap_err();
    assert!(e.to_string().contains("no greater than 2147483647"), "{e}");
    assert!(matches!(
        deadline(None, f64::NAN, Clock::Total),
        Err(ClockError::InvalidDelay {
            name: "deadline timeoutMs"
        })
    ));
}

// --- deadline: fuse with upstream ---

#[tokio::test(start_paused = true)]
async fn deadline_aborts_on_upstream_cancellation_classified_as_not_a_timeout() {
    let up = CancelToken::new();
    let d = deadline(Some(&up), 100.0, Clock::Tool).unwrap();
    up.cancel(CancelReason::Caller("test"));
    settle().await;
    assert!(d.token().is_cancelled());
    assert_eq!(timeout_of(d.token(), Some(Clock::Tool)), None);
}

#[tokio::test(start_paused = true)]
async fn deadline_cancel_wins_when_it_fires_before_the_timeout() {
    let up = CancelToken::new();
    let d = deadline(Some(&up), 100.0, Clock::Tool).unwrap();
    up.cancel(CancelReason::Caller("test"));
    step(200).await;
    assert_eq!(timeout_of(d.token(), None), None);
    assert_eq!(d.token().reason(), Some(CancelReason::Caller("test")));
}

#[tokio::test(start_paused = true)]
async fn deadline_timeout_wins_when_it_fires_before_upstream_cancellation() {
    let up = CancelToken::new();
    let d = deadline(Some(&up), 100.0, Clock::Connect).unwrap();
    step(150).await;
    assert_eq!(
        timeout_of(d.token(), None).map(|t| t.clock),
        Some(Clock::Connect)
    );
    up.cancel(CancelReason::Caller("late"));
    settle().await;
    assert_eq!(
        timeout_of(d.token(), None).map(|t| t.clock),
        Some(Clock::Connect)
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_forwards_a_pre_aborted_upstream_signal_immediately() {
    let up = CancelToken::new();
    up.cancel(CancelReason::Shutdown);
    let d = deadline(Some(&up), 100.0, Clock::Tool).unwrap();
    assert!(d.token().is_cancelled());
    assert_eq!(timeout_of(d.token(), None), None);
    assert_eq!(d.token().reason(), Some(CancelReason::Shutdown));
}

// --- deadline: timeout_ms <= 0 ---

#[tokio::test(start_paused = true)]
async fn deadline_zero_arms_no_timer_and_forwards_only_the_upstream_signal() {
    let up = CancelToken::new();
    let d = deadline(Some(&up), 0.0, Clock::Tool).unwrap();
    step(1_000_000).await;
    assert!(!d.token().is_cancelled());
    up.cancel(CancelReason::Caller("x"));
    assert!(d.token().is_cancelled());
    assert_eq!(timeout_of(d.token(), None), None);
}

#[tokio::test(start_paused = true)]
async fn deadline_zero_without_upstream_never_aborts_and_disposes_cleanly() {
    let d = deadline(None, 0.0, Clock::Tool).unwrap();
    let t = d.token().clone();
    d.dispose();
    step(1_000_000).await;
    assert!(!t.is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn deadline_treats_a_negative_timeout_the_same_as_zero() {
    let d = deadline(None, -5.0, Clock::Tool).unwrap();
    step(1_000).await;
    assert!(!d.token().is_cancelled());
    let d = deadline(None, f64::NEG_INFINITY, Clock::Tool).unwrap();
    assert!(d.expires_at().is_none());
}

// --- timeoutOf ---

#[test]
fn timeout_of_classifies_a_bare_reason_carrier_that_holds_a_timeout_reason() {
    let r = TimeoutReason {
        clock: Clock::Tool,
        timeout_ms: 5,
    };
    assert_eq!(timeout_of(&CancelReason::Timeout(r), None), Some(r));
    assert_eq!(timeout_of(&Some(CancelReason::Timeout(r)), None), Some(r));
}

#[test]
fn timeout_of_returns_none_for_a_non_timeout_reason() {
    assert_eq!(timeout_of(&CancelReason::Caller("x"), None), None);
    assert_eq!(timeout_of(&CancelReason::Shutdown, None), None);
    assert_eq!(timeout_of(&None::<CancelReason>, None), None);
    assert_eq!(timeout_of(&CancelToken::new(), None), None);
}

#[test]
fn timeout_of_matches_only_the_requested_code_when_one_is_given() {
    let r = CancelReason::Timeout(TimeoutReason {
        clock: Clock::Connect,
        timeout_ms: 1,
    });
    assert!(timeout_of(&r, Some(Clock::Connect)).is_some());
    assert!(timeout_of(&r, Some(Clock::TransportIdle)).is_none());
}

// --- nested deadlines ---

#[tokio::test(start_paused = true)]
async fn nested_does_not_misclassify_an_outer_deadlines_timeout_as_the_inner_code() {
    let outer = CancelToken::new();
    outer.cancel(CancelReason::Timeout(TimeoutReason {
        clock: Clock::Total,
        timeout_ms: 30,
    }));
    let inner = deadline(Some(&outer), 60_000.0, Clock::Tool).unwrap();
    assert!(inner.token().is_cancelled());
    assert_eq!(timeout_of(inner.token(), Some(Clock::Tool)), None);
    assert_eq!(
        timeout_of(inner.token(), None).map(|t| t.clock),
        Some(Clock::Total)
    );
}

// --- idleWatchdog ---

#[tokio::test(start_paused = true)]
async fn idle_arms_only_while_next_is_outstanding_and_rearms_the_same_signal_for_later_demand() {
    let w = IdleWatchdog::new(None, 100.0, Clock::OutputIdle).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
    let first = {
        let w = &w;
        async move { w.next(rx).await }
    };
    let driver = async {
        step(99).await;
        assert!(!w.token().is_cancelled());
        tx.send(7).unwrap();
    };
    let (got, ()) = tokio::join!(first, driver);
    assert_eq!(got.unwrap().unwrap(), 7);
    // No demand: think-time does not count.
    step(10_000).await;
    assert!(!w.token().is_cancelled());
    let token_before = w.token().clone();
    // Second demand never resolves on its own; it observes the token.
    let demand = {
        let t = w.token().clone();
        async move {
            t.cancelled().await;
            Err::<(), _>(t.reason().unwrap())
        }
    };
    let out = tokio::join!(w.next(demand), step(100)).0.unwrap();
    let reason = out.unwrap_err();
    assert_eq!(
        timeout_of(&reason, None),
        Some(TimeoutReason {
            clock: Clock::OutputIdle,
            timeout_ms: 100
        })
    );
    // The signal is the same stable token.
    assert!(token_before.is_cancelled());
    assert_eq!(token_before.reason(), Some(reason));
}

#[tokio::test(start_paused = true)]
async fn idle_rearms_outstanding_demand_on_an_out_of_band_activity_pulse() {
    let w = IdleWatchdog::new(None, 100.0, Clock::OutputIdle).unwrap();
    w.pulse(); // no demand: no-op
    step(1_000).await;
    assert!(!w.token().is_cancelled());
    let t = w.token().clone();
    let demand = async move { t.cancelled().await };
    let driver = async {
        step(99).await;
        w.pulse();
        step(99).await;
        assert!(!w.token().is_cancelled());
        step(1).await;
        assert!(w.token().is_cancelled());
    };
    let (r, ()) = tokio::join!(w.next(demand), driver);
    r.unwrap();
    assert_eq!(
        timeout_of(w.token(), Some(Clock::OutputIdle))
            .unwrap()
            .timeout_ms,
        100
    );
    w.dispose();
    w.pulse(); // harmless after dispose
}

#[tokio::test(start_paused = true)]
async fn idle_keeps_an_earlier_upstream_abort_distinct_from_its_own_timeout() {
    let up = CancelToken::new();
    let w = IdleWatchdog::new(Some(&up), 100.0, Clock::OutputIdle).unwrap();
    up.cancel(CancelReason::Caller("caller cancelled"));
    assert!(w.token().is_cancelled());
    assert_eq!(timeout_of(w.token(), None), None);
    let t = w.token().clone();
    let _ = tokio::join!(w.next(async move { t.cancelled().await }), step(1_000));
    assert_eq!(
        w.token().reason(),
        Some(CancelReason::Caller("caller cancelled"))
    );
}

#[tokio::test(start_paused = true)]
async fn idle_clears_an_outstanding_arm_on_disposal() {
    let w = IdleWatchdog::new(None, 100.0, Clock::OutputIdle).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let driver = async {
        step(50).await;
        w.dispose();
        step(1_000).await;
        assert!(!w.token().is_cancelled());
        tx.send(()).unwrap();
    };
    let (r, ()) = tokio::join!(w.next(rx), driver);
    r.unwrap().unwrap();
    assert_eq!(w.next(async {}).await.unwrap_err(), ClockError::Disposed);
    w.dispose();
}

#[tokio::test(start_paused = true)]
async fn idle_rejects_invalid_bounds_and_concurrent_iterator_demand() {
    for bad in [0.0, f64::NAN, -1.0] {
        let e = IdleWatchdog::new(None, bad, Clock::OutputIdle).unwrap_err();
        assert!(e.to_string().contains("positive finite"), "{e}");
    }
    let e = IdleWatchdog::new(None, MAX_TIMER_DELAY_MS + 1.0, Clock::OutputIdle).unwrap_err();
    assert!(e.to_string().contains("no greater than 2147483647"));
    let w = IdleWatchdog::new(None, 100.0, Clock::OutputIdle).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let second = async {
        settle().await;
        let e = w.next(async {}).await.unwrap_err();
        tx.send(()).unwrap();
        e
    };
    let (first, e) = tokio::join!(w.next(rx), second);
    first.unwrap().unwrap();
    assert_eq!(e, ClockError::AlreadyOutstanding);
    assert!(e.to_string().contains("already outstanding"));
}

// --- tether-specific ---

#[tokio::test(start_paused = true)]
async fn first_reason_wins_and_never_changes() {
    let t = CancelToken::new();
    assert!(t.cancel(CancelReason::Shutdown));
    assert!(!t.cancel(CancelReason::Caller("later")));
    assert_eq!(t.reason(), Some(CancelReason::Shutdown));
    // A child cancelled by its parent keeps the parent's reason even if it is cancelled later.
    let p = CancelToken::new();
    let c = p.child();
    p.cancel(CancelReason::SessionClosed);
    assert!(!c.cancel(CancelReason::Shutdown));
    assert_eq!(c.reason(), Some(CancelReason::SessionClosed));
    // Cancelling the child does not touch the parent.
    let p = CancelToken::new();
    let c = p.child();
    c.cancel(CancelReason::Caller("child"));
    assert!(!p.is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn nested_deadlines_each_classify_their_own_expiry() {
    let outer = deadline(None, 1_000.0, Clock::Total).unwrap();
    let inner = deadline(Some(outer.token()), 100.0, Clock::Tool).unwrap();
    step(100).await;
    assert_eq!(
        timeout_of(inner.token(), Some(Clock::Tool))
            .unwrap()
            .timeout_ms,
        100
    );
    assert!(
        !outer.token().is_cancelled(),
        "the inner timer must not cancel the outer token"
    );
    // And the other way round: the outer expiring first is not the inner's timeout.
    let outer = deadline(None, 100.0, Clock::Total).unwrap();
    let inner = deadline(Some(outer.token()), 1_000.0, Clock::Tool).unwrap();
    step(100).await;
    assert!(inner.token().is_cancelled());
    assert_eq!(timeout_of(inner.token(), Some(Clock::Tool)), None);
    assert_eq!(
        timeout_of(inner.token(), Some(Clock::Total))
            .unwrap()
            .timeout_ms,
        100
    );
}

#[tokio::test(start_paused = true)]
async fn dropped_deadlines_and_watchdogs_leave_no_timer_task_behind() {
    settle().await;
    let base = alive();
    let up = CancelToken::new();
    let many: Vec<_> = (0..100)
        .map(|_| deadline(Some(&up), 60_000.0, Clock::Total).unwrap())
        .collect();
    settle().await;
    assert_eq!(alive(), base + 100);
    drop(many);
    settle().await;
    assert_eq!(
        alive(),
        base,
        "disposed deadlines must end their timer tasks"
    );
    // A fired deadline's task ends too.
    let d = deadline(None, 10.0, Clock::Total).unwrap();
    step(10).await;
    assert!(d.token().is_cancelled());
    assert_eq!(alive(), base);
    drop(d);
    // A watchdog spawns nothing, even while a demand is outstanding.
    let w = IdleWatchdog::new(None, 100.0, Clock::OutputIdle).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let check = async {
        settle().await;
        assert_eq!(alive(), base);
        tx.send(()).unwrap();
    };
    let _ = tokio::join!(w.next(rx), check);
    drop(w);
    assert_eq!(alive(), base);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_cancel_ends_the_timer_task_early() {
    settle().await;
    let base = alive();
    let up = CancelToken::new();
    let d = deadline(Some(&up), 60_000.0, Clock::Total).unwrap();
    settle().await;
    assert_eq!(alive(), base + 1);
    up.cancel(CancelReason::Shutdown);
    settle().await;
    assert_eq!(alive(), base);
    drop(d);
}
