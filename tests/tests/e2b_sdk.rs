//! The official E2B SDKs against tetherd's E2B front.
//!
//! tetherd runs in this process on an ephemeral loopback port with two tenants (two API
//! keys); the unmodified Python and JS SDK suites in `tests/e2b_sdk/` drive it through
//! `run.sh` exactly as user programs would (`E2B_API_URL`, `E2B_SANDBOX_URL`,
//! `E2B_API_KEY`, plus `TETHER_E2B_OTHER_KEY` and `TETHER_E2B_BAD_KEY` for the tenant and
//! auth tests). Their output is streamed; each suite must exit 0. Afterwards the session
//! logs must show what the SDKs did: every sandbox a suite created is a session of its
//! tenant, with a leased sandbox, commands and file operations logged, and closed.
//!
//! Sandboxes are of the local provider's `base` template, as E2B's are of its `base`:
//! Debian, commands as user `user` (with sudo) unless `root` is asked for.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tether_daemon::config::ApiKey;
use tether_protocol::events::EventBody;
use tether_tests::{TestDaemon, base_templates, use_base_template, workspace_root};

const MAIN_TENANT: &str = "main";
const OTHER_TENANT: &str = "other";

/// Longest a whole suite may run.
const SUITE_LIMIT: Duration = Duration::from_secs(1500);

fn sdk_dir() -> PathBuf {
    workspace_root().join("tests").join("e2b_sdk")
}

/// Fail with the fix when the suites' dependencies are not installed.
fn require_setup(which: &str) {
    let (path, what) = match which {
        "python" => (
            workspace_root()
                .join(".venv-e2b")
                .join("bin")
                .join("python"),
            "the Python venv .venv-e2b",
        ),
        _ => (
            sdk_dir().join("js").join("node_modules").join("e2b"),
            "tests/e2b_sdk/js/node_modules",
        ),
    };
    assert!(
        path.exists(),
        "{what} is missing ({}): run tests/e2b_sdk/setup.sh first",
        path.display()
    );
}

fn key(prefix: &str) -> String {
    format!("e2b_{prefix}_{}", uuid::Uuid::new_v4().simple())
}

async fn run_suite(which: &str) {
    require_setup(which);
    let (main_key, other_key) = (key("main"), key("other"));
    let keys = vec![
        ApiKey {
            key: main_key.clone(),
            tenant: Some(MAIN_TENANT.into()),
        },
        ApiKey {
            key: other_key.clone(),
            tenant: Some(OTHER_TENANT.into()),
        },
    ];
    let templates = tokio::task::spawn_blocking(base_templates)
        .await
        .expect("the template build panicked")
        .expect("the base template (built by tests/run-all.sh)");
    let d = TestDaemon::start_with(|cfg| {
        cfg.default_provider = "local".into();
        use_base_template(cfg, templates);
        cfg.e2b_front.api_keys = keys;
    })
    .await;

    let child = tokio::process::Command::new("bash")
        .arg(sdk_dir().join("run.sh"))
        .arg(which)
        .env("E2B_API_URL", &d.base)
        .env("E2B_SANDBOX_URL", &d.base)
        .env("E2B_API_KEY", &main_key)
        .env("TETHER_E2B_OTHER_KEY", &other_key)
        .env("TETHER_E2B_BAD_KEY", key("bad"))
        // The local provider reaches a sandbox's ports (the port proxy's test runs) and
        // takes snapshots (the snapshot and fork tests run).
        .env("TETHER_SUITE_PORTS", "1")
        .env("TETHER_SUITE_SNAPSHOTS", "1")
        // ... and enforces egress rules (nftables in the sandbox's namespace).
        .env("TETHER_SUITE_EGRESS", "1")
        // ... and pauses without memory (its resume boots the sandbox again).
        .env("TETHER_SUITE_PAUSE_FILESYSTEM", "1")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn run.sh");
    let (status, lines) = tether_tests::run_streamed(child, which, SUITE_LIMIT).await;
    let summary = lines
        .iter()
        .rev()
        .find(|l| l.contains("passed,") && l.contains("failed"))
        .cloned();
    assert!(
        status.success(),
        "the {which} SDK suite failed ({status}); summary: {summary:?}"
    );
    assert!(
        summary.as_deref().is_some_and(|s| s.contains(" 0 failed")),
        "no clean summary line: {summary:?}"
    );

    // What the suite did is in the session logs.
    // The suites kill what they create; a kill is synchronous, expiry takes a second.
    // Closed sessions are read back from their logs on disk.
    tether_tests::wait_no_e2b_sandboxes(&d, Duration::from_secs(20)).await;
    let e2b = tether_tests::e2b_sessions(&d).await;
    assert!(
        e2b.len() >= 5,
        "only {} E2B sandboxes were created",
        e2b.len()
    );
    assert!(e2b.iter().any(|s| s.owner.as_deref() == Some(MAIN_TENANT)));
    assert!(
        e2b.iter().any(|s| s.owner.as_deref() == Some(OTHER_TENANT)),
        "the tenant test used the other key"
    );
    let (mut processes, mut writes) = (0, 0);
    for s in &e2b {
        let events = tether_tests::closed_session_events(s).await;
        processes += events
            .iter()
            .filter(|e| matches!(e, EventBody::ProcessStarted { .. }))
            .count();
        writes += events
            .iter()
            .filter(|e| matches!(e, EventBody::FsOp { op, .. } if op == "write"))
            .count();
        // Every started command has its end logged.
        let started = events
            .iter()
            .filter(|e| matches!(e, EventBody::ProcessStarted { .. }))
            .count();
        let exited = events
            .iter()
            .filter(|e| matches!(e, EventBody::ProcessExited { .. }))
            .count();
        assert_eq!(
            started, exited,
            "{}: a command's end is missing from the log",
            s.id
        );
    }
    assert!(processes >= 10, "only {processes} commands logged");
    assert!(writes >= 5, "only {writes} file writes logged");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_suite() {
    run_suite("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk_suite() {
    run_suite("js").await;
}
