//! The OpenAI Agents SDK's E2B sandbox (`openai-agents[e2b]`) against tetherd's E2B front.
//!
//! tetherd runs in this process on an ephemeral loopback port with two tenants (two API
//! keys); `tests/agents_sdk/run.sh` drives it with whole agent turns of the unmodified
//! Agents SDK (a scripted model, so no network and no OpenAI key), with the SDK's default
//! sandbox options: on-timeout pause with auto-resume, workspace root `/workspace`, the
//! manifest materialized at start, workspace persistence by tar and by E2B snapshot, resume
//! into a new sandbox and into a paused one. Its output is streamed; it must exit 0 with a
//! clean `agents-sdk: N passed, 0 failed` line. Afterwards the session logs must show what
//! the SDK did: every sandbox is a closed session of the main tenant, leased first and closed
//! last, with commands and file writes logged, some paused and resumed.
//!
//! Skipped (with the fix) when the venv `.venv-agents` is missing: `tests/agents_sdk/setup.sh`.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tether_daemon::config::ApiKey;
use tether_protocol::events::EventBody;
use tether_tests::{TestDaemon, workspace_root};

const MAIN_TENANT: &str = "main";
const OTHER_TENANT: &str = "other";

/// Longest the whole suite may run (run.sh bounds itself at 900 s).
const SUITE_LIMIT: Duration = Duration::from_secs(1000);

fn suite_dir() -> PathBuf {
    workspace_root().join("tests").join("agents_sdk")
}

/// Fail with the fix when the venv setup.sh makes is missing (as the E2B SDK suites do:
/// a suite that is not installed must not pass unseen).
fn require_setup() {
    let py = workspace_root()
        .join(".venv-agents")
        .join("bin")
        .join("python");
    assert!(
        py.exists(),
        "the Agents SDK venv is missing ({}): run tests/agents_sdk/setup.sh first",
        py.display()
    );
}

/// An E2B key as the SDK pinned by openai-agents[e2b] (e2b 2.31) accepts: `e2b_` + hex.
fn key() -> String {
    format!("e2b_{}", uuid::Uuid::new_v4().simple())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sdk_suite() {
    require_setup();
    let (main_key, other_key) = (key(), key());
    let keys = vec![
        ApiKey {
            key: main_key.clone(),
            tenant: Some(MAIN_TENANT.into()),
        },
        ApiKey {
            key: other_key,
            tenant: Some(OTHER_TENANT.into()),
        },
    ];
    let d = TestDaemon::start_with(|cfg| {
        cfg.default_provider = "local".into();
        cfg.e2b_front.api_keys = keys;
    })
    .await;

    let child = tokio::process::Command::new("bash")
        .arg(suite_dir().join("run.sh"))
        .env("E2B_API_URL", &d.base)
        .env("E2B_SANDBOX_URL", &d.base)
        .env("E2B_API_KEY", &main_key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .env_remove("OPENAI_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn run.sh");
    let (status, lines) = tether_tests::run_streamed(child, "agents", SUITE_LIMIT).await;
    let summary = lines
        .iter()
        .rev()
        .find(|l| l.starts_with("agents-sdk: "))
        .cloned();
    assert!(
        status.success(),
        "the Agents SDK suite failed ({status}); summary: {summary:?}"
    );
    assert!(
        summary.as_deref().is_some_and(|s| s.contains(" 0 failed")),
        "no clean summary line: {summary:?}"
    );

    // What the suite did is in the session logs.
    // The SDK kills what it runs in at the end of each run; a kill is synchronous.
    tether_tests::wait_no_e2b_sandboxes(&d, Duration::from_secs(20)).await;
    let e2b = tether_tests::e2b_sessions(&d).await;
    // tar: 2 turns; snapshot: turn 1, turn 2's fresh sandbox and the one made from the
    // snapshot; the pause, paused-resume and shell scenarios: one each.
    assert!(
        e2b.len() >= 8,
        "only {} E2B sandboxes were created",
        e2b.len()
    );
    let (mut processes, mut writes, mut pauses, mut resumes) = (0, 0, 0, 0);
    for s in &e2b {
        assert_eq!(s.owner.as_deref(), Some(MAIN_TENANT), "{}", s.id);
        let events = tether_tests::closed_session_events(s).await;
        processes += events
            .iter()
            .filter(|e| matches!(e, EventBody::ProcessStarted { .. }))
            .count();
        writes += events
            .iter()
            .filter(|e| matches!(e, EventBody::FsOp { op, .. } if op == "write"))
            .count();
        pauses += events
            .iter()
            .filter(|e| matches!(e, EventBody::SandboxPaused { .. }))
            .count();
        resumes += events
            .iter()
            .filter(|e| matches!(e, EventBody::SandboxResumed { .. }))
            .count();
    }
    assert!(processes >= 30, "only {processes} commands logged");
    assert!(writes >= 10, "only {writes} file writes logged");
    assert!(
        pauses >= 2,
        "only {pauses} pauses logged (two scenarios time out)"
    );
    assert!(resumes >= 2, "only {resumes} resumes logged");
    d.stop().await;
}
