//! The control-plane REST client, over the bounded and retried HTTP calls of
//! [`tether_envd_client::Http`] (the envd half of the wire is in `tether-envd-client`).
//!
//! One `reqwest::Client` is shared by everything a provider does: the control plane and
//! the envd client of every sandbox.

use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use tether_envd_client::Http;
use tether_envd_client::error::{Op, from_status};
use tether_provider::{CallCtx, ProviderError, Result};

use crate::config::{E2bConfig, Endpoints};

const USER_AGENT: &str = concat!("tether-provider-e2b/", env!("CARGO_PKG_VERSION"));

/// The one client a provider uses (plain HTTP/1.1, or HTTP/2 over TLS by ALPN); an idle
/// connection is kept for `pool_idle` (below the backend's own keep-alive: see
/// [`tether_envd_client::config::DEFAULT_POOL_IDLE_MS`]).
pub(crate) fn build_client(pool_idle: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .user_agent(USER_AGENT)
        .tcp_nodelay(true)
        .pool_idle_timeout(pool_idle)
        .build()
        .map_err(|e| ProviderError::Internal {
            message: "cannot build the HTTP client".into(),
            source: Some(Box::new(e)),
        })
}

// === impl ApiClient ===

/// The control-plane REST client.
#[derive(Debug, Clone)]
pub(crate) struct ApiClient {
    pub(crate) http: Http,
    pub(crate) endpoints: Endpoints,
    headers: HeaderMap,
}

impl ApiClient {
    pub(crate) fn new(cfg: &E2bConfig, endpoints: Endpoints, http: Http) -> Result<Self> {
        let mut headers = HeaderMap::new();
        let header = |v: &str, what: &str| {
            HeaderValue::from_str(v).map_err(|_| ProviderError::InvalidRequest {
                message: format!("e2b {what} is not a valid header value"),
            })
        };
        if let Some(k) = &cfg.api_key {
            let mut v = header(k, "api_key")?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static("x-api-key"), v);
        }
        if let Some(t) = &cfg.access_token {
            let mut v = header(&format!("Bearer {t}"), "access_token")?;
            v.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, v);
        }
        Ok(Self {
            http,
            endpoints,
            headers,
        })
    }

    /// A request to `path` of the control plane.
    pub(crate) fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.request_url(method, self.endpoints.api_path(path))
    }

    pub(crate) fn request_url(&self, method: Method, url: Url) -> reqwest::RequestBuilder {
        self.http
            .client
            .request(method, url)
            .headers(self.headers.clone())
    }

    /// One JSON call: `Ok` with the status, headers and body of a success (2xx), the
    /// mapped error otherwise.
    pub(crate) async fn json_call<B: Serialize + ?Sized>(
        &self,
        ctx: &CallCtx,
        method: Method,
        path: &str,
        body: Option<&B>,
        extra: &[(&'static str, String)],
        op: Op<'_>,
    ) -> Result<(StatusCode, HeaderMap, Bytes)> {
        let mut req = self.request(method, path);
        if let Some(b) = body {
            req = req.json(b);
        }
        for (k, v) in extra {
            req = req.header(*k, v.as_str());
        }
        let (status, headers, body) = self.http.call(ctx, req, op).await?;
        if status.is_success() {
            Ok((status, headers, body))
        } else {
            Err(from_status(op, status, &headers, &body))
        }
    }
}
