//! The provider conformance suite, run against the local provider on both templates.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use tether_provider::Provider;
use tether_provider::testkit::{ConformanceOptions, Fixture};
use tether_provider_local::{LocalConfig, LocalProvider};

/// The file view of a local sandbox is its whole root (as on an E2B microVM), so the
/// workspace-escape cases do not apply; `tests/isolation.rs` checks that nothing of
/// the host is reachable instead.
fn options() -> ConformanceOptions {
    ConformanceOptions {
        fs_confined_to_workspace: false,
        ..ConformanceOptions::default()
    }
}

async fn fixture() -> Fixture {
    let dir = tempfile::Builder::new()
        .prefix("tether-conformance-")
        .tempdir()
        .expect("tempdir");
    let mut cfg = LocalConfig::with_root(dir.path().join("sandboxes"));
    cfg.confine_helper = Some(env!("CARGO_BIN_EXE_tether-confine").into());
    let provider: Arc<dyn Provider> = Arc::new(LocalProvider::new(cfg).expect("provider"));
    Fixture::new(provider).with_options(options()).keep(dir)
}

tether_provider::conformance_tests!(fixture);
