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

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
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

/// Whether the request carries `expected` in `X-Access-Token`. `None`: no token sent.
pub(super) fn access_token_matches(headers: &HeaderMap, expected: &str) -> Option<bool> {
    let given = headers.get("x-access-token")?.to_str().unwrap_or("");
    Some(constant_time_eq(given.as_bytes(), expected.as_bytes()))
}

/// The user of an envd RPC from `Authorization: Basic base64("<user>:")`. `Ok(None)`: no
/// such header (the default user).
pub(super) fn basic_user(headers: &HeaderMap) -> Result<Option<String>, String> {
    let Some(v) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let v = v
        .to_str()
        .map_err(|_| "invalid Authorization header".to_owned())?;
    let Some(b64) = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))
    else {
        return Ok(None);
    };
    let raw = STANDARD
        .decode(b64.trim())
        .map_err(|_| "invalid Basic credentials".to_owned())?;
    let raw = String::from_utf8(raw).map_err(|_| "invalid Basic credentials".to_owned())?;
    let user = raw.split_once(':').map_or(raw.as_str(), |(u, _)| u);
    Ok((!user.is_empty()).then(|| user.to_owned()))
}

/// The users a sandbox has. The local provider runs everything as one confined user; the
/// requested user is still recorded in the session log.
pub(super) fn check_user(user: &str) -> Result<(), String> {
    match user {
        "user" | "root" => Ok(()),
        other => Err(format!("invalid username: '{other}'")),
    }
}

/// The signature of a `/files` URL: `v1_` + unpadded base64 of
/// `sha256("<path>:<op>:<username>:<token>[:<expiration>]")`, as the SDKs compute it.
pub(super) fn file_signature(
    path: &str,
    op: &str,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut raw = format!("{path}:{op}:{username}:{token}");
    if let Some(exp) = expiration {
        raw.push_str(&format!(":{exp}"));
    }
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}
