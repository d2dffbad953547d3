//! Unit tests of the pieces that need no host (the end-to-end suite against a real
//! OpenSSH server is in `tests/tests/ssh_provider.rs`).

use crate::client::{bash_line, sh_quote};
use crate::config::{AuthConfig, HostConfig, SshConfig};
use tether_protocol::ErrorCode;

fn host() -> HostConfig {
    HostConfig {
        name: None,
        address: "10.0.0.2".into(),
        port: 22,
        user: "u".into(),
        auth: AuthConfig::Agent,
        workspace_root: "/srv/tether".into(),
    }
}

#[test]
fn quoting_survives_every_byte() {
    assert_eq!(sh_quote("abc"), "abc");
    assert_eq!(sh_quote(""), "''");
    assert_eq!(sh_quote("a b"), "'a b'");
    assert_eq!(sh_quote("it's"), r"'it'\''s'");
    let line = bash_line("echo \"$1\"", &["x y"]);
    assert_eq!(line, "exec /bin/bash -c 'echo \"$1\"' tether 'x y'");
}

#[test]
fn config_parses_with_defaults_and_validates() {
    let cfg: SshConfig = toml::from_str(
        r#"
        [[hosts]]
        address = "10.0.0.2"
        user = "sandbox"
        auth = { method = "key_file", path = "/k" }
        "#,
    )
    .unwrap();
    assert_eq!(cfg.hosts[0].port, 22);
    assert_eq!(
        cfg.connect_timeout_ms,
        crate::config::DEFAULT_CONNECT_TIMEOUT_MS
    );
    assert_eq!(cfg.host_key_policy, crate::config::HostKeyPolicy::Strict);
    cfg.validate().unwrap();
    assert!(toml::from_str::<SshConfig>("bogus = 1").is_err());

    let empty = SshConfig::default();
    assert_eq!(
        empty.validate().unwrap_err().code(),
        ErrorCode::InvalidRequest
    );
    let mut bad = SshConfig {
        hosts: vec![host()],
        ..Default::default()
    };
    bad.hosts[0].workspace_root = "/".into();
    assert_eq!(
        bad.validate().unwrap_err().code(),
        ErrorCode::InvalidRequest
    );
    let mut bad = SshConfig {
        hosts: vec![host(), host()],
        ..Default::default()
    };
    bad.hosts[1].name = Some("h0".into());
    assert!(bad.validate().is_err(), "duplicate host names");
    let bad = SshConfig {
        hosts: vec![host()],
        keepalive_interval_ms: 60_000,
        transport_idle_timeout_ms: 30_000,
        ..Default::default()
    };
    assert!(bad.validate().is_err());
}

#[test]
fn host_key_refusal_is_forbidden_and_not_retried() {
    let e = tether_provider::ProviderError::HostKeyRejected {
        host: "10.0.0.2:22".into(),
        fingerprint: "SHA256:abc".into(),
        changed: true,
    };
    assert_eq!(e.code(), ErrorCode::Forbidden);
    assert!(!e.retryable());
    assert!(e.to_string().contains("SHA256:abc"));
    assert!(e.to_string().contains("10.0.0.2:22"));
}
