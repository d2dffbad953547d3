//! Who may call envd: the sandbox's access token (`X-Access-Token`), a signed `/files`
//! URL, and the user an operation runs as (`Authorization: Basic base64("<user>:")`, or
//! `?username=`).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http::HeaderMap;
use sha2::{Digest, Sha256};
pub use tether_provider::util::constant_time_eq;

/// Whether the request carries `expected` in `X-Access-Token`. `None`: no token sent.
pub fn access_token_matches(headers: &HeaderMap, expected: &str) -> Option<bool> {
    let given = headers.get("x-access-token")?.to_str().unwrap_or("");
    Some(constant_time_eq(given.as_bytes(), expected.as_bytes()))
}

/// The user of an envd RPC from `Authorization: Basic base64("<user>:")`. `Ok(None)`: no
/// such header (the default user).
pub fn basic_user(headers: &HeaderMap) -> Result<Option<String>, String> {
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
pub fn check_user(user: &str) -> Result<(), String> {
    match user {
        "user" | "root" => Ok(()),
        other => Err(format!("invalid username: '{other}'")),
    }
}

/// The signature of a `/files` URL: `v1_` + unpadded base64 of
/// `sha256("<path>:<op>:<username>:<token>[:<expiration>]")`, as the SDKs compute it.
pub fn file_signature(
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
