//! E2B's port proxy: a request for `<port>-<id>.<domain>` (what the SDKs' `get_host`
//! returns), or one naming a sandbox and a port other than envd's by the
//! `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers, goes to that port on the sandbox's
//! own loopback, as E2B's edge proxy sends it there: the request as it came, the answer
//! as the server gives it, upgrades (WebSocket) carried both ways.
//!
//! Like E2B's, a sandbox's ports are public: whoever reaches the front and knows the
//! sandbox id reaches them (a sandbox cannot: the front is on the host's loopback). The
//! connection is the provider's ([`Provider::connect_port`](tether_provider::Provider::connect_port));
//! it ends when either side ends it or the sandbox closes.

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use hyper_util::rt::TokioIo;
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{ENVD_PORT, GUEST_PORT_TUNNEL_PROTOCOL};
use tether_provider::clock::CancelToken;
use tether_provider::{CallCtx, Clock};
use tracing::Instrument;

use super::auth;
use crate::state::AppState;
use tether_envd_server::{Reject, addressed, proxy_error};

/// Send a request addressed to a sandbox's port there; pass every other one on. A
/// request for a paused sandbox that resumes on traffic (E2B's `autoResume`), to envd or
/// to a port, resumes it first.
pub(crate) async fn layer(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let addressed = addressed(req.headers());
    if let Some((id, _)) = &addressed {
        auto_resume(&state, id).await;
    }
    match addressed {
        Some((id, port)) if port != ENVD_PORT => proxy(&state, id, port, req).await,
        _ => next.run(req).await,
    }
}

/// Resume sandbox `id` if it is an E2B sandbox, paused, whose lifecycle resumes it on
/// traffic; it then lives the create's timeout again. A failed resume is logged and the
/// request is answered as for any paused sandbox.
async fn auto_resume(state: &AppState, id: &str) {
    let Ok(s) = state.sessions.get(id, crate::session_manager::Scope::Any) else {
        return;
    };
    let life = s.params.lifecycle;
    // A sandbox paused without its memory is resumed only when asked (as on E2B: its
    // resume is a boot, not the continuation a request expects).
    if s.owner.is_none()
        || !life.auto_resume
        || s.pause_kind() != Some(tether_protocol::events::PauseKind::Memory)
    {
        return;
    }
    // The new expiry first: resumed past its old one, the expiry sweep would pause it
    // again before it could be set.
    let ttl_ms = life
        .resume_ttl_ms
        .unwrap_or(state.e2b.cfg.default_timeout_s.saturating_mul(1000));
    let at = super::now_ms().saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX));
    if let Err(e) = s.set_expiry(at).await {
        tracing::warn!(session.id = %id, error = %e, "Could not record the expiry of a resumed sandbox");
        return;
    }
    let ctx = CallCtx::new(format!("auto-resume-{id}"));
    match s.resume(&ctx, false).await {
        // Another request resumed it meanwhile.
        Ok(()) | Err(crate::error::DaemonError::Conflict { .. }) => {}
        Err(e) => {
            tracing::warn!(session.id = %id, code = %e.code(), error = %e, "Could not resume a sandbox on traffic");
            return;
        }
    }
    tracing::info!(session.id = %id, "Resumed on traffic");
}

async fn proxy(state: &Arc<AppState>, id: String, port: u16, mut req: Request) -> Response {
    // A browser gets a page where a program gets JSON.
    let browser = tether_envd_server::is_browser(req.headers());
    let Some(target) = super::host::find(state, &id) else {
        return Reject::NotFound(id).for_client(browser);
    };
    let session = target.sandbox;
    let Some(sandbox_id) = session.sandbox_id() else {
        return Reject::NotFound(id).for_client(browser);
    };
    let access = &session.params.ports;
    if !access.public && !auth::traffic_token_matches(req.headers(), &state.e2b.traffic_token(&id))
    {
        return refuse(
            id,
            StatusCode::FORBIDDEN,
            "the sandbox's ports need its traffic access token (e2b-traffic-access-token)",
        );
    }
    // The token is the front's, not the sandbox server's.
    req.headers_mut().remove("e2b-traffic-access-token");
    if let Some(mask) = &access.mask_host {
        match http::HeaderValue::from_str(&mask.replace("${PORT}", &port.to_string())) {
            Ok(v) => {
                req.headers_mut().insert(header::HOST, v);
            }
            Err(_) => {
                return refuse(
                    id,
                    StatusCode::BAD_GATEWAY,
                    "maskRequestHost is not a valid host",
                );
            }
        }
    }
    let ctx = CallCtx::new(format!("port-{port}-{id}")).with_timeout(
        state.config.limits.deadlines().process_start,
        Clock::Connect,
    );
    let stream = match session
        .provider()
        .connect_port(&ctx, &sandbox_id, port)
        .await
    {
        Ok(s) => s,
        Err(e) if e.code() == ErrorCode::Unsupported => {
            let why = format!(
                "ports are not reachable on provider {}",
                session.provider_name
            );
            return refuse(id, StatusCode::NOT_IMPLEMENTED, &why);
        }
        Err(e) if e.code() == ErrorCode::SandboxNotFound => {
            return Reject::NotFound(id).for_client(browser);
        }
        Err(e) => {
            tracing::debug!(sandbox.id = %id, port, error = %e, "Nothing answers on a sandbox port");
            return Reject::PortClosed(id, port).for_client(browser);
        }
    };
    session.touch();
    let stream = if access.https_ports.contains(&port) {
        match tls_to_sandbox(stream, server_name(&req)).await {
            Ok(s) => Box::new(s) as tether_provider::PortStream,
            Err(e) => {
                return refuse(
                    id,
                    StatusCode::BAD_GATEWAY,
                    &format!("TLS to the port's server (httpsPorts): {e}"),
                );
            }
        }
    } else {
        stream
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(x) => x,
        Err(e) => {
            return refuse(
                id,
                StatusCode::BAD_GATEWAY,
                &format!("the port's server: {e}"),
            );
        }
    };
    // The connection runs until both ends are done with it, or the sandbox closes.
    let closed = session.cancel.clone();
    state.tasks.spawn(
        async move {
            tokio::select! {
                r = conn.with_upgrades() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "A sandbox port's connection ended");
                    }
                }
                () = closed.cancelled() => {}
            }
        }
        .in_current_span(),
    );
    // The sandbox's server speaks HTTP/1.1 whatever the client spoke to the front: the
    // request goes in origin form, with the host an HTTP/2 client gave as its authority.
    if !req.headers().contains_key(header::HOST)
        && let Some(v) = req
            .uri()
            .authority()
            .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
    {
        req.headers_mut().insert(header::HOST, v);
    }
    let origin = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse::<http::Uri>();
    match origin {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => {
            return refuse(
                id,
                StatusCode::BAD_REQUEST,
                "the request's path is not valid",
            );
        }
    }
    // Behind a routing proxy (an E2B backend's edge), the request is addressed to it.
    if let Some(route) = session.provider().port_route(&sandbox_id, port) {
        let headers =
            std::iter::once((header::HOST.as_str().to_owned(), route.host)).chain(route.headers);
        for (name, value) in headers {
            match (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(&value),
            ) {
                (Ok(n), Ok(v)) => {
                    req.headers_mut().insert(n, v);
                }
                _ => {
                    return refuse(
                        id,
                        StatusCode::BAD_GATEWAY,
                        "the provider's route to the port is not a valid header",
                    );
                }
            }
        }
    }
    *req.version_mut() = http::Version::HTTP_11;
    let upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let mut resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                id,
                StatusCode::BAD_GATEWAY,
                &format!("the port's server: {e}"),
            );
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client) = upgrade
    {
        let server = hyper::upgrade::on(&mut resp);
        splice(
            state,
            session.cancel.clone(),
            async { client.await.ok().map(TokioIo::new) },
            async { server.await.ok().map(TokioIo::new) },
        );
    }
    resp.map(Body::new)
}

fn refuse(sandbox_id: String, status: StatusCode, message: &str) -> Response {
    proxy_error(status, sandbox_id, message, None)
}

/// Carry bytes both ways between two upgraded connections until either ends or the
/// sandbox closes, on a tracked task.
fn splice<A, B>(
    state: &AppState,
    closed: CancelToken,
    a: impl Future<Output = Option<A>> + Send + 'static,
    b: impl Future<Output = Option<B>> + Send + 'static,
) where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    state.tasks.spawn(
        async move {
            let (Some(mut a), Some(mut b)) = tokio::join!(a, b) else {
                return;
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
                () = closed.cancelled() => {}
            }
        }
        .in_current_span(),
    );
}

/// The guest agent's tunnel to a port of its machine
/// ([`GUEST_PORT_TUNNEL_PATH`](tether_protocol::e2b::GUEST_PORT_TUNNEL_PATH)): the host's
/// microVM provider asks, with the sandbox's envd access token, and the upgraded
/// connection is spliced to that port on the guest's loopback. Served by guest agents
/// only: on a host it would reach the host's own loopback.
pub(crate) async fn guest_tunnel(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(port): axum::extract::Path<u16>,
    mut req: Request,
) -> Response {
    let target = match tether_envd_server::authorize(&*state, req.headers()) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(GUEST_PORT_TUNNEL_PROTOCOL));
    if !wants {
        return refuse(
            target.id,
            StatusCode::BAD_REQUEST,
            "the port tunnel needs an upgrade",
        );
    }
    let limit = state.config.limits.deadlines().process_start;
    let stream = match tokio::time::timeout(
        limit,
        tokio::net::TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port)),
    )
    .await
    {
        Ok(Ok(s)) => s,
        _ => return Reject::PortClosed(target.id, port).into_response(),
    };
    let _ = stream.set_nodelay(true);
    let on_upgrade = hyper::upgrade::on(&mut req);
    splice(
        &state,
        target.sandbox.cancel.clone(),
        async { on_upgrade.await.ok().map(TokioIo::new) },
        async { Some(stream) },
    );
    (
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (header::CONNECTION, "upgrade"),
            (header::UPGRADE, GUEST_PORT_TUNNEL_PROTOCOL),
        ],
    )
        .into_response()
}

// === httpsPorts ===

/// The name a TLS hop to a sandbox's server asks for: the host the request names (after
/// `maskRequestHost`), else `localhost`.
fn server_name(req: &Request) -> rustls::pki_types::ServerName<'static> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(|h| h.rsplit_once(':').map_or(h, |(name, _)| name).to_owned());
    host.and_then(|h| rustls::pki_types::ServerName::try_from(h).ok())
        .unwrap_or_else(|| rustls::pki_types::ServerName::from(std::net::Ipv4Addr::LOCALHOST))
}

/// A TLS client connection over `stream` to a sandbox's server that speaks HTTPS. Its
/// certificate is not verified, as E2B's proxy does not: a sandbox's server is as likely
/// as not self-signed, and the hop runs from tetherd into the sandbox, never over a
/// network. The handshake's signatures are still checked.
async fn tls_to_sandbox(
    stream: tether_provider::PortStream,
    name: rustls::pki_types::ServerName<'static>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tether_provider::PortStream>> {
    static CONFIG: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    let config = CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Arc::new(config))
        })
        .clone()
        .map_err(std::io::Error::other)?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, stream)
        .await
}

/// Accepts any certificate of a sandbox's server; verifies the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
