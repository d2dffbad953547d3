//! Connections to a port of an E2B sandbox, through E2B's edge proxy: TCP to the port's
//! base URL ([`Endpoints::port_url`](crate::config::Endpoints::port_url)), TLS over it for
//! `https` with the platform's certificate verification (as reqwest's own connections).
//! The edge routes each request by its `Host` and the `E2b-Sandbox-Id` /
//! `E2b-Sandbox-Port` headers, which the caller adds
//! ([`Provider::port_route`](tether_provider::Provider::port_route)).

use std::sync::{Arc, OnceLock};

use reqwest::Url;
use tether_provider::{CallCtx, PortStream, ProviderError, Result};

fn unavailable(url: &Url, e: impl std::fmt::Display) -> ProviderError {
    ProviderError::Unavailable {
        message: format!("cannot reach the sandbox's port at {url}: {e}"),
        retry_after: None,
        source: None,
    }
}

/// A byte stream to the edge serving `url`, bounded by `ctx`.
pub(crate) async fn connect(ctx: &CallCtx, url: &Url) -> Result<PortStream> {
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return Err(unavailable(url, "the URL names no host"));
    };
    let tcp = ctx
        .run(async {
            tokio::net::TcpStream::connect((host, port))
                .await
                .map_err(|e| unavailable(url, e))
        })
        .await?;
    let _ = tcp.set_nodelay(true);
    if url.scheme() != "https" {
        return Ok(Box::new(tcp));
    }
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| unavailable(url, e))?;
    let tls = tls_config().map_err(|e| unavailable(url, e))?;
    let stream = ctx
        .run(async {
            tokio_rustls::TlsConnector::from(tls)
                .connect(name, tcp)
                .await
                .map_err(|e| unavailable(url, e))
        })
        .await?;
    Ok(Box::new(stream))
}

/// One client configuration for every port connection: the platform's roots, HTTP/1.1.
fn tls_config() -> std::result::Result<Arc<rustls::ClientConfig>, String> {
    static CONFIG: OnceLock<std::result::Result<Arc<rustls::ClientConfig>, String>> =
        OnceLock::new();
    CONFIG
        .get_or_init(|| {
            use rustls_platform_verifier::BuilderVerifierExt;
            let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_platform_verifier()
                .map_err(|e| e.to_string())?
                .with_no_client_auth();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Arc::new(config))
        })
        .clone()
}
