//! Unit tests of the E2B provider's own pieces: configuration from the environment,
//! endpoint resolution, validation (the envd client's pieces are tested in
//! `tether-envd-client`). The whole provider against small in-test backends is in
//! `tests/fake_backend.rs`; against tetherd's E2B front in the workspace's end-to-end
//! tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tether_protocol::ErrorCode;

use crate::config::{E2bConfig, Endpoints, RetryConfig};

// --- configuration ---

fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| (*v).to_owned())
    }
}

#[test]
fn the_environment_names_a_backend_as_the_sdks_read_it() {
    assert!(
        E2bConfig::from_env(&env_of(&[("E2B_DOMAIN", "example.org")])).is_none(),
        "a domain alone names no backend"
    );
    let c = E2bConfig::from_env(&env_of(&[
        ("E2B_API_KEY", "e2b_k"),
        ("E2B_DOMAIN", "example.org"),
        ("E2B_SANDBOX_URL", "http://127.0.0.1:9"),
        ("E2B_DEBUG", "FALSE"),
    ]))
    .unwrap();
    assert_eq!(c.api_key.as_deref(), Some("e2b_k"));
    assert_eq!(c.domain(), "example.org");
    assert!(!c.is_debug());
    let ep = c.validate().unwrap();
    assert_eq!(ep.api.as_str(), "https://api.example.org/");
    assert_eq!(
        ep.envd_url("iabc", None).unwrap().as_str(),
        "http://127.0.0.1:9/"
    );
    // An explicit value beats the variable; `inherit_env = false` ignores them all.
    let explicit = E2bConfig {
        api_key: Some("mine".into()),
        ..E2bConfig::default()
    }
    .with_env(&env_of(&[("E2B_API_KEY", "theirs")]));
    assert_eq!(explicit.api_key.as_deref(), Some("mine"));
    let sealed = E2bConfig {
        inherit_env: false,
        ..E2bConfig::default()
    }
    .with_env(&env_of(&[("E2B_API_KEY", "theirs")]));
    assert_eq!(sealed.api_key, None);
    // Debug mode: no key needed, the SDKs' local URLs.
    let d = E2bConfig::from_env(&env_of(&[("E2B_DEBUG", "True")])).unwrap();
    let ep = d.validate().unwrap();
    assert!(ep.debug);
    assert_eq!(ep.api.as_str(), "http://localhost:3000/");
    assert_eq!(
        ep.envd_url("x", None).unwrap().as_str(),
        "http://localhost:49983/"
    );
    // Credentials stay out of debug output.
    let shown = format!(
        "{:?}",
        E2bConfig {
            api_key: Some("e2b_secret".into()),
            access_token: Some("sk_secret".into()),
            ..E2bConfig::default()
        }
    );
    assert!(!shown.contains("secret"), "{shown}");
}

#[test]
fn envd_urls_follow_the_sandbox_domain() {
    let ep = Endpoints::resolve(&E2bConfig::default()).unwrap();
    assert_eq!(ep.api.as_str(), "https://api.e2b.app/");
    // E2B's own domains share one host, routed by headers.
    assert_eq!(
        ep.envd_url("iabc", None).unwrap().as_str(),
        "https://sandbox.e2b.app/"
    );
    assert_eq!(
        ep.envd_url("iabc", Some("e2b.dev")).unwrap().as_str(),
        "https://sandbox.e2b.dev/"
    );
    // Other domains: one host per sandbox and port; a domain from create/connect wins.
    assert_eq!(
        ep.envd_url("iabc", Some("sandboxes.example.org"))
            .unwrap()
            .as_str(),
        "https://49983-iabc.sandboxes.example.org/"
    );
    let self_hosted = Endpoints::resolve(&E2bConfig {
        domain: Some("corp.test".into()),
        ..E2bConfig::default()
    })
    .unwrap();
    assert_eq!(
        self_hosted.envd_url("i1", None).unwrap().as_str(),
        "https://49983-i1.corp.test/"
    );
    // A sandbox's other ports are served the same ways.
    assert_eq!(
        self_hosted.port_url("i1", 8080, None).unwrap().as_str(),
        "https://8080-i1.corp.test/"
    );
    assert_eq!(
        ep.port_url("iabc", 3000, None).unwrap().as_str(),
        "https://sandbox.e2b.app/"
    );
    let fixed = Endpoints::resolve(&E2bConfig {
        sandbox_url: Some("http://127.0.0.1:9/".into()),
        ..E2bConfig::default()
    })
    .unwrap();
    assert_eq!(
        fixed
            .port_url("i1", 8080, Some("corp.test"))
            .unwrap()
            .as_str(),
        "http://127.0.0.1:9/"
    );
    // A base path of the API URL is kept.
    let prefixed = Endpoints::resolve(&E2bConfig {
        api_url: Some("http://127.0.0.1:8/e2b/".into()),
        ..E2bConfig::default()
    })
    .unwrap();
    assert_eq!(
        prefixed.api_path("/v2/sandboxes").as_str(),
        "http://127.0.0.1:8/e2b/v2/sandboxes"
    );
}

#[test]
fn invalid_configurations_are_refused() {
    let bad = |c: E2bConfig| c.validate().map(|_| ()).unwrap_err().code();
    assert_eq!(
        bad(E2bConfig {
            api_url: Some("not a url".into()),
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(E2bConfig {
            sandbox_url: Some("ftp://x".into()),
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(E2bConfig {
            workspace: "home/user".into(),
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(E2bConfig {
            connect_timeout_ms: 0,
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    // Keepalives must come more often than the transport is declared dead.
    assert_eq!(
        bad(E2bConfig {
            transport_idle_ms: 10_000,
            keepalive_interval_s: 10,
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(E2bConfig {
            retry: RetryConfig {
                max_times: 1,
                min_delay_ms: 500,
                max_delay_ms: 100
            },
            ..E2bConfig::default()
        }),
        ErrorCode::InvalidRequest
    );
    let toml_like: E2bConfig = serde_json::from_value(
        serde_json::json!({"template": "code-interpreter", "ttl_ms": 60000}),
    )
    .unwrap();
    assert_eq!(toml_like.template, "code-interpreter");
    assert_eq!(toml_like.state_dir(), "/home/user/.cache/tether");
    assert!(
        serde_json::from_value::<E2bConfig>(serde_json::json!({"bogus": 1})).is_err(),
        "unknown fields are refused"
    );
}
