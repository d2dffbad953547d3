//! Who is calling: one notion of principal for every surface.
//!
//! A caller presents one credential, in `X-API-Key: <credential>` or
//! `Authorization: Bearer <credential>` (the native API and the E2B control plane take
//! both). It resolves to a [`Principal`]:
//!
//! - a `[server] auth_tokens` token: [`Principal::Admin`], who sees every session;
//! - an `[e2b_front] api_keys` key: [`Principal::Tenant`], who sees only the sessions its
//!   tenant owns (created through `/v1` or the E2B front by any key of that tenant);
//! - nothing configured at all (allowed only on a loopback listener, said at start-up):
//!   [`Principal::Development`], which the native API treats as admin.
//!
//! As soon as any token or key is configured every surface needs one: `/v1/*` (except
//! `/v1/health`) answers 401 `UNAUTHORIZED` without a valid credential, and the E2B front
//! accepts only configured keys. envd requests carry the per-sandbox access token instead,
//! which only the owning tenant can obtain.
//!
//! Comparisons are constant-time ([`constant_time_eq`]: every byte of every configured
//! credential is compared, so neither a prefix nor which entry matched shows in the time
//! taken; `subtle`'s comparison, in the provider seam's helpers, shared with envd's
//! server and the telemetry scrape).

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::session_manager::Scope;

/// The shortest accepted token or API key, characters.
pub const MIN_CREDENTIAL_LEN: usize = 16;

/// Who a request acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A `[server] auth_tokens` bearer: every session.
    Admin,
    /// A tenant, named by an `[e2b_front] api_keys` key: its own sessions only.
    Tenant(String),
    /// No credential is configured (loopback only): every session.
    Development,
}

impl Principal {
    /// The sessions this principal sees.
    pub fn scope(&self) -> Scope<'_> {
        match self {
            Self::Tenant(t) => Scope::Owner(Some(t.as_str())),
            Self::Admin | Self::Development => Scope::Any,
        }
    }

    /// The owner recorded on a session this principal creates.
    pub fn owner(&self) -> Option<String> {
        match self {
            Self::Tenant(t) => Some(t.clone()),
            Self::Admin | Self::Development => None,
        }
    }
}

/// Whether no credential at all is configured (development mode).
pub fn is_development(config: &Config) -> bool {
    config.server.auth_tokens.is_empty() && config.e2b_front.api_keys.is_empty()
}

/// The credential a request presents: `X-API-Key`, else `Authorization: Bearer`.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    let from_header = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let from_bearer = || {
        headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
    };
    from_header
        .filter(|k| !k.is_empty())
        .or_else(from_bearer)
        .filter(|k| !k.is_empty())
}

/// The tenant a configured key without a `tenant` names.
pub fn key_tenant(key: &str, tenant: Option<&str>) -> String {
    tenant.map_or_else(|| format!("key-{}", short_hash(key)), str::to_owned)
}

/// The tenant of `given` among the configured API keys.
pub fn tenant_of_key(config: &Config, given: &str) -> Option<String> {
    let mut found = None;
    for k in &config.e2b_front.api_keys {
        if constant_time_eq(k.key.as_bytes(), given.as_bytes()) && found.is_none() {
            found = Some(key_tenant(&k.key, k.tenant.as_deref()));
        }
    }
    found
}

/// The principal of a request: `Development` when nothing is configured, else the
/// principal of a valid presented credential, else `None` (401).
pub fn resolve(config: &Config, headers: &HeaderMap) -> Option<Principal> {
    if is_development(config) {
        return Some(Principal::Development);
    }
    let given = presented(headers)?;
    let admin = config.server.auth_tokens.iter().fold(false, |acc, t| {
        acc | constant_time_eq(t.as_bytes(), given.as_bytes())
    });
    let tenant = tenant_of_key(config, given);
    match (admin, tenant) {
        (true, _) => Some(Principal::Admin),
        (false, t) => t.map(Principal::Tenant),
    }
}

/// A short stable digest of a secret, for names derived from it.
pub fn short_hash(s: &str) -> String {
    hex::encode(&Sha256::digest(s.as_bytes())[..8])
}

pub use tether_provider::util::constant_time_eq;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ApiKey;

    fn cfg(tokens: &[&str], keys: &[(&str, &str)]) -> Config {
        let mut c = Config::default();
        c.server.auth_tokens = tokens.iter().map(|t| (*t).to_owned()).collect();
        c.e2b_front.api_keys = keys
            .iter()
            .map(|(k, t)| ApiKey {
                key: (*k).to_owned(),
                tenant: Some((*t).to_owned()),
            })
            .collect();
        c
    }

    fn hdr(name: &str, v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
        h
    }

    #[test]
    fn credentials_resolve_to_principals() {
        let c = cfg(
            &["admin-token-0123456789"],
            &[("tenant-a-key-0123456789", "a")],
        );
        assert_eq!(
            resolve(&c, &hdr("authorization", "Bearer admin-token-0123456789")),
            Some(Principal::Admin)
        );
        assert_eq!(
            resolve(&c, &hdr("x-api-key", "tenant-a-key-0123456789")),
            Some(Principal::Tenant("a".into()))
        );
        assert_eq!(
            resolve(&c, &hdr("authorization", "Bearer tenant-a-key-0123456789")),
            Some(Principal::Tenant("a".into()))
        );
        assert_eq!(resolve(&c, &hdr("x-api-key", "nope-nope-nope-nope")), None);
        assert_eq!(resolve(&c, &HeaderMap::new()), None);
        assert_eq!(
            resolve(&cfg(&[], &[]), &HeaderMap::new()),
            Some(Principal::Development)
        );
    }
}
