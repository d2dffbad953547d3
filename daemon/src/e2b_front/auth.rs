//! Who is calling the E2B front.
//!
//! - Control plane: an API key (`X-API-Key`, or `Authorization: Bearer`) names a tenant;
//!   a tenant sees only its own sandboxes (see [`crate::auth`]). With no credential
//!   configured at all (no key and no `[server] auth_tokens`; allowed only on a loopback
//!   listener, checked at config load) any non-empty key is accepted and each distinct
//!   key is its own tenant: development mode. With tokens but no keys, no key is accepted.
//! - envd: the access token handed out by create/connect, in `X-Access-Token`, or a
//!   signed `/files` URL. Tokens are derived from a per-run secret and the sandbox id, so
//!   the front stores none and a token opens exactly one sandbox.
//! - Users: envd runs a process or a file operation as `user` or `root`
//!   (`Authorization: Basic base64("<user>:")`, or `?username=`).

use http::HeaderMap;
use sha2::{Digest, Sha256};

use super::RestError;
pub(super) use crate::auth::constant_time_eq;
use crate::auth::{key_tenant, presented, short_hash};
use crate::config::ApiKey;

/// A tenant of the E2B front: owner of the sessions its keys create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

/// The configured API keys.
pub(super) struct KeyRing {
    keys: Vec<(String, String)>,
}

impl KeyRing {
    pub(super) fn new(keys: &[ApiKey]) -> Self {
        let keys = keys
            .iter()
            .map(|k| (k.key.clone(), key_tenant(&k.key, k.tenant.as_deref())))
            .collect();
        Self { keys }
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// No key configured.
    pub(super) fn is_dev(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant of a request, or the 401 the SDKs map to `AuthenticationException`.
    /// `dev`: no credential at all is configured (neither keys nor `[server]
    /// auth_tokens`), so any key is accepted as its own tenant. With tokens configured
    /// and no keys, no key is accepted.
    pub(super) fn tenant(&self, headers: &HeaderMap, dev: bool) -> Result<Tenant, RestError> {
        let Some(key) = presented(headers) else {
            return Err(RestError::unauthorized(
                "missing API key: set the X-API-Key header",
            ));
        };
        if dev && self.is_dev() {
            return Ok(Tenant(format!("dev-{}", short_hash(key))));
        }
        // Compare against every key fully so the time taken does not reveal a prefix.
        let mut found = None;
        for (k, tenant) in &self.keys {
            if constant_time_eq(k.as_bytes(), key.as_bytes()) && found.is_none() {
                found = Some(tenant.clone());
            }
        }
        found
            .map(Tenant)
            .ok_or_else(|| RestError::unauthorized("invalid API key"))
    }
}

/// The envd access token of a sandbox.
pub(super) fn derive_token(secret: &[u8; 32], sandbox_id: &str) -> String {
    derive(secret, b"envd-access-token", sandbox_id)
}

/// The traffic access token of a sandbox (its ports, when not public).
pub(super) fn derive_traffic_token(secret: &[u8; 32], sandbox_id: &str) -> String {
    derive(secret, b"traffic-access-token", sandbox_id)
}

fn derive(secret: &[u8; 32], label: &[u8], sandbox_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(secret);
    h.update(b"\0");
    h.update(label);
    h.update(b"\0");
    h.update(sandbox_id.as_bytes());
    hex::encode(&h.finalize()[..20])
}

/// Whether the request carries `expected` in `e2b-traffic-access-token`.
pub(super) fn traffic_token_matches(headers: &HeaderMap, expected: &str) -> bool {
    headers
        .get("e2b-traffic-access-token")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|given| constant_time_eq(given.as_bytes(), expected.as_bytes()))
}
