//! The SSH provider against a real OpenSSH server on a test host of our own (a network
//! namespace behind a veth pair; see `tether_tests::ssh_host`): the conformance suite, and
//! the faults of a real network path (a cut connection, a blackholed link, delay, a server
//! that never answers), host-key checking and group kills.
//!
//! Needs root, iproute2 and openssh-server; without them every test fails with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::testkit::Fixture;
use tether_provider::{CallCtx, ProcessSelector, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_ssh::{AuthConfig, HostConfig, HostKeyPolicy, SshConfig, SshProvider};
use tether_tests::ssh_host::{DelayRelay, SilentServer, SshHost};

/// The test host's config with test-sized clocks.
fn config(host: &SshHost) -> SshConfig {
    SshConfig {
        hosts: vec![HostConfig {
            name: Some("t".into()),
            address: host.addr.ip().to_string(),
            port: host.addr.port(),
            user: host.user.clone(),
            auth: AuthConfig::KeyFile {
                path: host.key.clone(),
                passphrase: None,
            },
            workspace_root: ".tether/sandboxes".into(),
        }],
        known_hosts: Some(host.known_hosts.clone()),
        connect_timeout_ms: 5_000,
        transport_idle_timeout_ms: 3_000,
        keepalive_interval_ms: 1_000,
        request_timeout_ms: 30_000,
        ..SshConfig::default()
    }
}

fn provider(cfg: SshConfig) -> Arc<SshProvider> {
    Arc::new(SshProvider::new(cfg).expect("provider"))
}

fn ctx() -> CallCtx {
    CallCtx::new(format!("ssh-test-{}", uuid::Uuid::new_v4().simple()))
}

tether_provider::conformance_tests!(|| async {
    let host = SshHost::start().await;
    let p: Arc<dyn Provider> = provider(config(&host));
    Fixture::new(p).keep(host)
});
