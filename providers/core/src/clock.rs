//! tether's clock: cooperative deadlines and idle watchdogs.
//!
//! A port of dsh's `util/timeout` with the same edge semantics:
//!
//! - [`deadline`] fuses an upstream [`CancelToken`] with a timer whose reason is a
//!   [`TimeoutReason`]; `timeout_ms <= 0` arms no timer.
//! - [`IdleWatchdog`] arms its timer only while a demand ([`IdleWatchdog::next`]) is
//!   outstanding; [`IdleWatchdog::pulse`] re-arms it. Consumer think-time never counts.
//! - [`clamp_timeout`] validates a caller's hint and caps it.
//! - [`timeout_of`] recognises only the timer of the requested clock, so an outer
//!   deadline reads as an ordinary upstream cancel.
//!
//! Cancellation is cooperative: these types only *notify*. The operation observes the
//! token, reaches quiescence, and the caller classifies the outcome afterwards. The
//! first reason to cancel a token wins and never changes.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The largest timer delay accepted, as in dsh (the largest Node timer without clamping).
pub const MAX_TIMER_DELAY_MS: f64 = 2_147_483_647.0;

pub use tether_protocol::Clock;

/// Why a timer fired: its clock and the limit that expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimeoutReason {
    /// The clock that fired.
    pub clock: Clock,
    /// The limit that expired, in milliseconds.
    pub timeout_ms: u64,
}

impl std::fmt::Display for TimeoutReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} after {}ms", self.clock.code(), self.timeout_ms)
    }
}

impl std::error::Error for TimeoutReason {}

/// Why a [`CancelToken`] was cancelled. Typed, so the outcome of a call can be
/// classified without looking at messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelReason {
    /// A timer of this module fired.
    Timeout(TimeoutReason),
    /// The caller cancelled (request aborted, client disconnected, explicit cancel).
    Caller(&'static str),
    /// The daemon is shutting down.
    Shutdown,
    /// The session that owns the operation was closed.
    SessionClosed,
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout(t) => t.fmt(f),
            Self::Caller(why) => write!(f, "cancelled by the caller ({why})"),
            Self::Shutdown => f.write_str("cancelled by shutdown"),
            Self::SessionClosed => f.write_str("cancelled because the session closed"),
        }
    }
}

/// Errors of the clock's own API (invalid bounds, misuse). Never a timeout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    /// A caller's timeout hint is not a positive finite number.
    #[error("{name} must be a positive finite number")]
    InvalidHint {
        /// The caller-provided name of the value.
        name: String,
    },
    /// A timer delay is out of range.
    #[error("{name} must be a positive finite number no greater than 2147483647")]
    InvalidDelay {
        /// Which value.
        name: &'static str,
    },
    /// `next` was called on a disposed watchdog.
    #[error("idleWatchdog is disposed")]
    Disposed,
    /// `next` was called while another demand was outstanding.
    #[error("idleWatchdog next is already outstanding")]
    AlreadyOutstanding,
    /// A timer was requested outside a Tokio runtime.
    #[error("the clock needs a Tokio runtime")]
    NoRuntime,
}

// === impl CancelToken ===

/// A cancellation token that carries a typed reason; the first reason wins.
///
/// Cloning gives another handle to the same token. [`CancelToken::child`] gives a token
/// that is cancelled, with the parent's reason, when the parent is; cancelling the child
/// does not touch the parent.
#[derive(Debug, Clone)]
pub struct CancelToken {
    token: CancellationToken,
    reason: Arc<OnceLock<CancelReason>>,
    parent: Option<Arc<CancelToken>>,
}

impl Default for CancelToken {
    fn default() -> Self {
        Self::new()
    }
}

impl CancelToken {
    /// A fresh, uncancelled token.
    pub fn new() -> Self {
        Self {
            token: CancellationToken::new(),
            reason: Arc::new(OnceLock::new()),
            parent: None,
        }
    }

    /// A token cancelled whenever this one is (with this one's reason).
    pub fn child(&self) -> Self {
        Self {
            token: self.token.child_token(),
            reason: Arc::new(OnceLock::new()),
            parent: Some(Arc::new(self.clone())),
        }
    }

    /// Cancel with `reason`. Returns `false` (and changes nothing) if already cancelled:
    /// the first reason wins.
    pub fn cancel(&self, reason: CancelReason) -> bool {
        if self.token.is_cancelled() {
            return false;
        }
        if self.reason.set(reason).is_err() {
            return false;
        }
        self.token.cancel();
        true
    }

    /// Whether the token is cancelled (by itself or an ancestor).
    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// The reason, once cancelled.
    pub fn reason(&self) -> Option<CancelReason> {
        if !self.token.is_cancelled() {
            return None;
        }
        if let Some(r) = self.reason.get() {
            return Some(r.clone());
        }
        self.parent.as_ref().and_then(|p| p.reason())
    }

    /// Resolves once the token is cancelled. Cancel-safe.
    pub async fn cancelled(&self) {
        self.token.cancelled().await
    }

    /// The underlying `tokio_util` token, for APIs that take one.
    pub fn as_tokio(&self) -> &CancellationToken {
        &self.token
    }
}

/// Anything that may carry a cancellation reason: a token, or a bare reason.
pub trait ReasonCarrier {
    /// The reason, if any.
    fn carried_reason(&self) -> Option<CancelReason>;
}

impl ReasonCarrier for CancelToken {
    fn carried_reason(&self) -> Option<CancelReason> {
        self.reason()
    }
}

impl ReasonCarrier for CancelReason {
    fn carried_reason(&self) -> Option<CancelReason> {
        Some(self.clone())
    }
}

impl ReasonCarrier for Option<CancelReason> {
    fn carried_reason(&self) -> Option<CancelReason> {
        self.clone()
    }
}

/// The [`TimeoutReason`] behind `x`, iff `x` was cancelled by a timer of this module and
/// (when `clock` is given) that timer is of `clock`.
pub fn timeout_of<R: ReasonCarrier + ?Sized>(x: &R, clock: Option<Clock>) -> Option<TimeoutReason> {
    match x.carried_reason()? {
        CancelReason::Timeout(t) if clock.is_none_or(|c| c == t.clock) => Some(t),
        _ => None,
    }
}

/// Validate a caller's timeout hint and cap it: `min(requested.unwrap_or(default), max)`.
///
/// A hint that is present must be positive and finite (`0` is never a public "disable"
/// value); `default` and `max` are not validated.
pub fn clamp_timeout(
    requested: Option<f64>,
    default_ms: f64,
    max_ms: f64,
    name: &str,
) -> Result<f64, ClockError> {
    if let Some(r) = requested
        && (!r.is_finite() || r <= 0.0)
    {
        return Err(ClockError::InvalidHint {
            name: name.to_owned(),
        });
    }
    Ok(requested.unwrap_or(default_ms).min(max_ms))
}

fn assert_timer_delay(ms: f64, name: &'static str) -> Result<Duration, ClockError> {
    if !ms.is_finite() || ms <= 0.0 || ms > MAX_TIMER_DELAY_MS {
        return Err(ClockError::InvalidDelay { name });
    }
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

static LIVE_TIMERS: AtomicUsize = AtomicUsize::new(0);

/// Number of deadline timer tasks alive in this process (a leak detector and a gauge).
pub fn live_timers() -> usize {
    LIVE_TIMERS.load(Ordering::Relaxed)
}

struct LiveTimer;

impl LiveTimer {
    fn new() -> Self {
        LIVE_TIMERS.fetch_add(1, Ordering::Relaxed);
        Self
    }
}

impl Drop for LiveTimer {
    fn drop(&mut self) {
        LIVE_TIMERS.fetch_sub(1, Ordering::Relaxed);
    }
}

// === impl Deadline ===

/// A token fused from an upstream token and a timer. Dropping (or [`Deadline::dispose`])
/// clears the timer; it never cancels the token.
#[derive(Debug)]
pub struct Deadline {
    token: CancelToken,
    expires_at: Option<Instant>,
    _timer: Option<DropGuard>,
}

impl Deadline {
    /// The fused token to hand to the work.
    pub fn token(&self) -> &CancelToken {
        &self.token
    }

    /// When the timer fires, if one is armed.
    pub fn expires_at(&self) -> Option<Instant> {
        self.expires_at
    }

    /// Clear the timer. Idempotent (same as dropping).
    pub fn dispose(self) {}
}

/// Fuse `upstream` with a timer of `timeout_ms` that cancels with
/// `TimeoutReason { clock, timeout_ms }`.
///
/// `timeout_ms <= 0` (including `-inf`) arms no timer and returns the upstream token (or a
/// never-cancelled one). `NaN`, `+inf` and values above [`MAX_TIMER_DELAY_MS`] are errors.
/// A pre-cancelled upstream yields an already-cancelled token with the upstream reason.
pub fn deadline(
    upstream: Option<&CancelToken>,
    timeout_ms: f64,
    clock: Clock,
) -> Result<Deadline, ClockError> {
    if timeout_ms <= 0.0 {
        let token = upstream.cloned().unwrap_or_default();
        return Ok(Deadline {
            token,
            expires_at: None,
            _timer: None,
        });
    }
    let delay = assert_timer_delay(timeout_ms, "deadline timeoutMs")?;
    let handle = tokio::runtime::Handle::try_current().map_err(|_| ClockError::NoRuntime)?;
    let token = upstream.map(CancelToken::child).unwrap_or_default();
    let expires_at = Instant::now() + delay;
    let reason = TimeoutReason {
        clock,
        timeout_ms: timeout_ms.ceil() as u64,
    };
    let disposed = CancellationToken::new();
    if !token.is_cancelled() {
        let fused = token.clone();
        let stop = disposed.clone();
        let live = LiveTimer::new();
        handle.spawn(async move {
            let _live = live;
            tokio::select! {
                biased;
                _ = stop.cancelled() => {}
                _ = fused.cancelled() => {}
                _ = tokio::time::sleep_until(expires_at) => {
                    fused.cancel(CancelReason::Timeout(reason));
                }
            }
        });
    }
    Ok(Deadline {
        token,
        expires_at: Some(expires_at),
        _timer: Some(disposed.drop_guard()),
    })
}

// === impl IdleWatchdog ===

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    Idle,
    Until(Instant),
}

/// An idle watchdog: a timer that runs only while a demand is outstanding.
///
/// [`IdleWatchdog::next`] arms a full interval and awaits the demand; it does not race the
/// demand: on expiry it only cancels [`IdleWatchdog::token`] with its [`TimeoutReason`]
/// and keeps awaiting, so the demand must observe the token and settle. No timer runs
/// between demands, and no task is ever spawned: dropping the watchdog leaves nothing
/// behind.
#[derive(Debug)]
pub struct IdleWatchdog {
    token: CancelToken,
    interval: Duration,
    reason: TimeoutReason,
    arm: watch::Sender<Arm>,
    outstanding: AtomicBool,
    disposed: AtomicBool,
}

struct Outstanding<'a>(&'a IdleWatchdog);

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.arm.send_replace(Arm::Idle);
        self.0.outstanding.store(false, Ordering::Release);
    }
}

impl IdleWatchdog {
    /// A watchdog of `timeout_ms` whose token is fused with `upstream`.
    pub fn new(
        upstream: Option<&CancelToken>,
        timeout_ms: f64,
        clock: Clock,
    ) -> Result<Self, ClockError> {
        let interval = assert_timer_delay(timeout_ms, "idleWatchdog timeoutMs")?;
        Ok(Self {
            token: upstream.map(CancelToken::child).unwrap_or_default(),
            interval,
            reason: TimeoutReason {
                clock,
                timeout_ms: timeout_ms.ceil() as u64,
            },
            arm: watch::channel(Arm::Idle).0,
            outstanding: AtomicBool::new(false),
            disposed: AtomicBool::new(false),
        })
    }

    /// The one stable token: cancelled by upstream or by this watchdog's timer.
    pub fn token(&self) -> &CancelToken {
        &self.token
    }

    /// The interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Await one demand with the timer armed for a full interval.
    pub async fn next<F: Future>(&self, demand: F) -> Result<F::Output, ClockError> {
        if self.disposed.load(Ordering::Acquire) {
            return Err(ClockError::Disposed);
        }
        if self.outstanding.swap(true, Ordering::AcqRel) {
            return Err(ClockError::AlreadyOutstanding);
        }
        let _outstanding = Outstanding(self);
        let mut rx = self.arm.subscribe();
        self.arm
            .send_replace(Arm::Until(Instant::now() + self.interval));
        tokio::pin!(demand);
        loop {
            let arm = *rx.borrow_and_update();
            let sleep_until = match arm {
                Arm::Until(t) => Some(t),
                Arm::Idle => None,
            };
            tokio::select! {
                out = &mut demand => return Ok(out),
                _ = async { tokio::time::sleep_until(sleep_until.unwrap_or_else(Instant::now)).await }, if sleep_until.is_some() => {
                    // Disarm first: the token stays cancelled, a fired timer does not refire.
                    self.arm.send_replace(Arm::Idle);
                    self.token.cancel(CancelReason::Timeout(self.reason));
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        // The sender lives in `self`; unreachable while borrowed. Stay safe.
                        return Ok(demand.await);
                    }
                }
            }
        }
    }

    /// Out-of-band activity: re-arm a full interval, only while a demand is outstanding.
    /// A no-op when idle or disposed.
    pub fn pulse(&self) {
        if self.disposed.load(Ordering::Acquire) || !self.outstanding.load(Ordering::Acquire) {
            return;
        }
        let until = Instant::now() + self.interval;
        self.arm.send_if_modified(|a| match a {
            Arm::Until(_) => {
                *a = Arm::Until(until);
                true
            }
            Arm::Idle => false,
        });
    }

    /// Clear any armed timer and refuse later demands. Idempotent; never cancels the token.
    pub fn dispose(&self) {
        self.disposed.store(true, Ordering::Release);
        self.arm.send_replace(Arm::Idle);
    }
}

#[cfg(test)]
mod tests;
