//! Test helpers: a real session on a real local provider in a temporary directory.

use std::sync::Arc;

use tempfile::TempDir;
use tether_provider::CallCtx;
use tether_provider::clock::CancelToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ProviderConfig};
use crate::invariants::Invariants;
use crate::providers::ProviderRegistry;
use crate::session_manager::{NewSession, Session, SessionManager};
use crate::telemetry::Metrics;

/// A session leased from a local provider rooted in a fresh temp dir. Keep the
/// `TempDir` (and the manager) alive for the test's duration.
pub async fn test_session() -> (Arc<Session>, Arc<SessionManager>, TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config::default();
    cfg.server.state_dir = dir.path().to_owned();
    let local = tether_provider_local::LocalConfig {
        root: dir.path().join("sandboxes"),
        ..Default::default()
    };
    cfg.providers
        .insert("local".into(), ProviderConfig::Local(local));
    let providers = Arc::new(ProviderRegistry::from_config(&cfg).expect("providers"));
    let mgr = Arc::new(
        SessionManager::new(
            dir.path().to_owned(),
            providers,
            CancelToken::new(),
            TaskTracker::new(),
            Metrics::new(),
            Invariants::new(&cfg.invariants).expect("invariants"),
            cfg.limits.deadlines(),
        )
        .await
        .expect("manager"),
    );
    let s = mgr
        .create(&CallCtx::new("test"), NewSession::default())
        .await
        .expect("session");
    (s, mgr, dir)
}
