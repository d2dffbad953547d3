//! File operations of a microVM sandbox: envd's, spoken to the guest agent through the
//! slirp host forward (`tether-envd-client`'s `EnvdFs`: atomic guarded writes with
//! versions, streamed transfers, resumable reads, watches), every call on the client's
//! clocks.

use std::sync::Arc;

use tether_envd_client::{EnvdClientConfig, EnvdEndpoint, EnvdSandboxClient, EnvdVersion};
use tether_provider::Result;

use crate::error::internal;
use crate::sandbox::KIND;

pub use tether_envd_client::EnvdFs as VmFs;

/// `Fs::watch` is offered (envd's `WatchDir`).
pub const WATCH: bool = true;

/// The envd client of the VM `id` whose agent is reached at `agent`.
pub(crate) fn envd_client(
    id: &str,
    agent: std::net::SocketAddr,
    token: &str,
    cfg: Arc<EnvdClientConfig>,
    http: reqwest::Client,
) -> Result<EnvdSandboxClient> {
    let base_url = reqwest::Url::parse(&format!("http://{agent}"))
        .map_err(|e| internal("the agent's URL", e))?;
    let endpoint = EnvdEndpoint {
        base_url,
        access_token: Some(token.to_owned()),
        headers: reqwest::header::HeaderMap::new(),
        // The guest agent is tether's own envd server.
        version: EnvdVersion::parse(tether_protocol::e2b::ENVD_VERSION)
            .unwrap_or(EnvdVersion(0, 0, 0)),
    };
    EnvdSandboxClient::with_config(KIND, id, endpoint, cfg, http)
}
