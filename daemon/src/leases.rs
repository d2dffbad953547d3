//! Leases: how the daemon knows which sandboxes are its own.
//!
//! The session log is the one record of a lease. Its header (written and synced before a
//! provider is asked for a sandbox) is the intent; `sandbox/leased` records the sandbox id
//! once known; `sandbox/released` its end. Every sandbox is also stamped at the provider
//! with `tether.session` and `tether.daemon` metadata, so the reconciler finds this
//! daemon's sandboxes that no live session owns (a crash between create and
//! `sandbox/leased` included) and destroys them. A session whose log cannot be read keeps
//! its sandbox: an unreadable record never reads as "owns nothing".

/// Metadata key holding the owning session id.
pub const META_SESSION: &str = "tether.session";
/// Metadata key holding the owning daemon's id.
pub const META_DAEMON: &str = "tether.daemon";

/// Milliseconds since the Unix epoch (0 for a clock before it).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
