//! The provider conformance suite, run against the local provider.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use tether_provider::Provider;
use tether_provider::testkit::Fixture;
use tether_provider_local::{LocalConfig, LocalProvider};

async fn fixture() -> Fixture {
    let dir = tempfile::Builder::new()
        .prefix("tether-conformance-")
        .tempdir()
        .expect("tempdir");
    let mut cfg = LocalConfig::with_root(dir.path().join("sandboxes"));
    cfg.confine_helper = Some(env!("CARGO_BIN_EXE_tether-confine").into());
    let provider: Arc<dyn Provider> = Arc::new(LocalProvider::new(cfg).expect("provider"));
    Fixture::new(provider).keep(dir)
}

tether_provider::conformance_tests!(fixture);
