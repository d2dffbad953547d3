//! The conformance suite against real E2B (feature `e2b-live`, off by default).
//!
//! Runs when `E2B_API_KEY` is set (and, optionally, `E2B_API_URL` / `E2B_DOMAIN` for a
//! self-hosted backend, `E2B_TEMPLATE` for the template); without a key every test here
//! says so and passes without touching the network:
//!
//! ```text
//! E2B_API_KEY=e2b_... cargo nextest run -p tether-provider-e2b --features e2b-live integration_tests
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tether_provider::testkit::{ConformanceOptions, Outcome, run_conformance};
use tether_provider::{CallCtx, PauseKind, Provider, SandboxSpec};

use crate::{E2bConfig, E2bProvider};

fn live_provider() -> Option<E2bProvider> {
    let lookup = |k: &str| std::env::var(k).ok();
    let mut cfg = E2bConfig::from_env(&lookup)?;
    cfg.api_key.as_ref()?;
    if let Some(t) = lookup("E2B_TEMPLATE") {
        cfg.template = t;
    }
    // Real sandboxes boot in seconds: leave room, and keep leaked ones short-lived.
    cfg.ttl_ms = 600_000;
    cfg.connect_timeout_ms = 30_000;
    Some(E2bProvider::new(cfg).expect("provider from the E2B_* environment"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_passes_against_e2b() {
    let Some(p) = live_provider() else {
        eprintln!("E2B_API_KEY is not set: skipping the live E2B conformance run");
        return;
    };
    let opts = ConformanceOptions {
        spec: SandboxSpec {
            ttl: Some(Duration::from_secs(600)),
            ..SandboxSpec::default()
        },
        fs_confined_to_workspace: false,
        case_timeout: Duration::from_secs(180),
    };
    let report = run_conformance(Arc::new(p), opts).await;
    for c in &report.cases {
        eprintln!(
            "{:<40} {:>8.2}s {:?}",
            c.name,
            c.elapsed.as_secs_f64(),
            c.outcome
        );
    }
    let failed: Vec<_> = report
        .cases
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Failed(_)))
        .map(|c| c.name)
        .collect();
    assert!(failed.is_empty(), "failed against E2B: {failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_leases_against_e2b() {
    let Some(p) = live_provider() else {
        eprintln!("E2B_API_KEY is not set: skipping the live E2B lease test");
        return;
    };
    let ctx = CallCtx::new("e2b-live");
    let mut spec = SandboxSpec::default();
    spec.metadata
        .insert("tether.session".into(), "live-test".into());
    let sb = p.create(&ctx, spec).await.expect("create");
    let id = sb.info().id;
    let listed = p.list(&ctx).await.expect("list");
    let mine = listed
        .iter()
        .find(|s| s.id == id)
        .expect("the new sandbox is listed");
    assert_eq!(
        mine.metadata.get("tether.session").map(String::as_str),
        Some("live-test")
    );
    p.renew(&ctx, &id, Duration::from_secs(300))
        .await
        .expect("renew");
    match p.pause(&ctx, &id, PauseKind::Memory).await {
        Ok(()) => {
            let again = p.resume(&ctx, &id).await.expect("resume");
            assert_eq!(again.info().id, id);
        }
        Err(e) => assert_eq!(e.code(), tether_protocol::ErrorCode::Unsupported, "{e}"),
    }
    p.destroy(&ctx, &id).await.expect("destroy");
    p.destroy(&ctx, &id)
        .await
        .expect("destroying twice succeeds");
}
