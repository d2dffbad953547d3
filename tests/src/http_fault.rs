//! An HTTP-level fault proxy on 127.0.0.1, for the faults a backend produces above TCP.
//!
//! It forwards every request to an upstream base URL (bodies streamed both ways) unless a
//! rule matches the request's path prefix:
//!
//! - [`HttpFaultProxy::refuse`]: the next `n` matching requests are answered with a status
//!   (429 or a 5xx), an optional `Retry-After` and an E2B-shaped JSON error body, without
//!   reaching the upstream (a rate limit, a storm of 503s);
//! - [`HttpFaultProxy::drop_end_frame`]: the next `n` matching responses that are Connect
//!   streams lose their end-of-stream envelope: the body ends cleanly right before it (a
//!   stream whose server went away between its last message and its end);
//! - [`HttpFaultProxy::delay`]: the next `n` matching responses come `d` late, whole (a
//!   backend slow to do what it was asked).
//!
//! Matching requests are counted, refused or not.

// Test support: a proxy that cannot bind means a broken test machine, and says so.
#![allow(clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
enum Action {
    Refuse {
        status: u16,
        retry_after_s: Option<u64>,
    },
    DropEndFrame,
    Delay(std::time::Duration),
}

#[derive(Debug, Clone)]
struct Rule {
    prefix: String,
    action: Action,
    remaining: u32,
}

#[derive(Debug, Default)]
struct State {
    rules: RwLock<Vec<Rule>>,
    /// (path, what happened) of every request, in order.
    /// Every request: its method, its path, what happened to it.
    seen: RwLock<Vec<(http::Method, String, &'static str)>>,
}

/// A running HTTP fault proxy; dropping it stops it.
#[derive(Debug)]
pub struct HttpFaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

impl Drop for HttpFaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

type Body = BoxBody<Bytes, std::io::Error>;

impl HttpFaultProxy {
    /// Start a proxy to `upstream` (`http://host:port`) on an ephemeral port.
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the HTTP fault proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(State::default());
        let stop = CancellationToken::new();
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("proxy client");
        let upstream = upstream.trim_end_matches('/').to_owned();
        let (st, token) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = token.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((tcp, _)) = accepted else { continue };
                let (st, client, upstream, token) =
                    (st.clone(), client.clone(), upstream.clone(), token.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        handle(req, st.clone(), client.clone(), upstream.clone())
                    });
                    let conn = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .into_owned();
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        Self { addr, state, stop }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answer the next `n` requests whose path starts with `prefix` with `status` (and
    /// `Retry-After: retry_after_s` when given), without forwarding them.
    pub fn refuse(&self, prefix: &str, n: u32, status: u16, retry_after_s: Option<u64>) {
        self.push(Rule {
            prefix: prefix.to_owned(),
            action: Action::Refuse {
                status,
                retry_after_s,
            },
            remaining: n,
        });
    }

    /// Strip the end-of-stream envelope of the next `n` Connect stream responses to
    /// requests whose path starts with `prefix`.
    pub fn drop_end_frame(&self, prefix: &str, n: u32) {
        self.push(Rule {
            prefix: prefix.to_owned(),
            action: Action::DropEndFrame,
            remaining: n,
        });
    }

    /// Answer the next `n` requests whose path starts with `prefix` `d` late: the request
    /// is forwarded at once, its answer held back that long.
    pub fn delay(&self, prefix: &str, n: u32, d: std::time::Duration) {
        self.push(Rule {
            prefix: prefix.to_owned(),
            action: Action::Delay(d),
            remaining: n,
        });
    }

    fn push(&self, rule: Rule) {
        if let Ok(mut r) = self.state.rules.write() {
            r.push(rule);
        }
    }

    /// Every request so far: its method and path, and what happened to it, in order.
    pub fn seen(&self) -> Vec<(String, &'static str)> {
        self.state
            .seen
            .read()
            .map(|s| s.iter().map(|(m, p, w)| (format!("{m} {p}"), *w)).collect())
            .unwrap_or_default()
    }

    /// How many requests with a path starting with `prefix` were `what` (`forwarded`,
    /// `refused`, `truncated`, `delayed`).
    pub fn count(&self, prefix: &str, what: &str) -> usize {
        self.count_where(|_, p| p.starts_with(prefix), what)
    }

    /// [`HttpFaultProxy::count`] of the requests with `method` only (a list and a create
    /// share a path).
    pub fn count_method(&self, method: http::Method, prefix: &str, what: &str) -> usize {
        self.count_where(|m, p| *m == method && p.starts_with(prefix), what)
    }

    fn count_where(&self, pick: impl Fn(&http::Method, &str) -> bool, what: &str) -> usize {
        self.state
            .seen
            .read()
            .map(|s| {
                s.iter()
                    .filter(|(m, p, w)| pick(m, p) && *w == what)
                    .count()
            })
            .unwrap_or(0)
    }
}

/// The rule the request falls under, its budget taken.
fn take_rule(st: &State, path: &str) -> Option<Action> {
    let mut rules = st.rules.write().ok()?;
    let rule = rules
        .iter_mut()
        .find(|r| r.remaining > 0 && path.starts_with(&r.prefix))?;
    rule.remaining -= 1;
    Some(rule.action.clone())
}

fn note(st: &State, method: &http::Method, path: &str, what: &'static str) {
    if let Ok(mut s) = st.seen.write() {
        s.push((method.clone(), path.to_owned(), what));
    }
}

fn full(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

async fn handle(
    req: Request<Incoming>,
    st: Arc<State>,
    client: reqwest::Client,
    upstream: String,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let action = take_rule(&st, &path);
    if let Some(Action::Refuse {
        status,
        retry_after_s,
    }) = action
    {
        note(&st, req.method(), &path, "refused");
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut r = full(
            code,
            format!(r#"{{"code":{status},"message":"injected by the fault proxy"}}"#),
        );
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        if let Some(s) = retry_after_s
            && let Ok(v) = http::HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(http::header::RETRY_AFTER, v);
        }
        return Ok(r);
    }
    let truncate = matches!(action, Some(Action::DropEndFrame));
    let delay = match action {
        Some(Action::Delay(d)) => Some(d),
        _ => None,
    };
    note(
        &st,
        req.method(),
        &path,
        match (truncate, delay) {
            (true, _) => "truncated",
            (_, Some(_)) => "delayed",
            _ => "forwarded",
        },
    );
    let pq = req
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), ToString::to_string);
    let (parts, body) = req.into_parts();
    let mut rb = client.request(parts.method, format!("{upstream}{pq}"));
    for (k, v) in &parts.headers {
        if k != http::header::HOST && k != http::header::CONTENT_LENGTH {
            rb = rb.header(k, v);
        }
    }
    let body = http_body_util::BodyStream::new(body).filter_map(|f| async move {
        match f {
            Ok(frame) => frame.into_data().ok().map(Ok::<Bytes, hyper::Error>),
            Err(e) => Some(Err(e)),
        }
    });
    let resp = match rb.body(reqwest::Body::wrap_stream(body)).send().await {
        Ok(r) => r,
        Err(e) => return Ok(full(StatusCode::BAD_GATEWAY, e.to_string())),
    };
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    let mut out = Response::builder().status(resp.status().as_u16());
    for (k, v) in resp.headers() {
        if k != http::header::CONTENT_LENGTH && k != http::header::TRANSFER_ENCODING {
            out = out.header(k, v);
        }
    }
    let mut upstream_body = resp.bytes_stream();
    let stream = async_stream_body(move |tx| async move {
        let mut cut = EnvelopeCut::default();
        while let Some(chunk) = upstream_body.next().await {
            let Ok(chunk) = chunk else { return };
            let chunk = if truncate {
                match cut.pass(&chunk) {
                    (part, false) => part,
                    (part, true) => {
                        if !part.is_empty() {
                            let _ = tx.send(Ok(Frame::data(part))).await;
                        }
                        return;
                    }
                }
            } else {
                chunk
            };
            if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                return;
            }
        }
    });
    Ok(out
        .body(stream)
        .unwrap_or_else(|_| full(StatusCode::BAD_GATEWAY, "bad response".into())))
}

/// A response body fed by a task through a channel.
fn async_stream_body<F, Fut>(f: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(f(tx));
    BodyExt::boxed(StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ))
}

/// Passes Connect envelopes through until the end-of-stream one (flag 0x02), which it
/// swallows with everything after it.
#[derive(Debug, Default)]
struct EnvelopeCut {
    /// Bytes of the current envelope's 5-byte prefix seen so far.
    head: BytesMut,
    /// Payload bytes of the current envelope still to pass.
    left: usize,
}

impl EnvelopeCut {
    /// The part of `chunk` to forward, and whether the end envelope began in it.
    fn pass(&mut self, chunk: &[u8]) -> (Bytes, bool) {
        let mut out = BytesMut::new();
        let mut i = 0;
        while i < chunk.len() {
            if self.left > 0 {
                let n = self.left.min(chunk.len() - i);
                out.extend_from_slice(&chunk[i..i + n]);
                self.left -= n;
                i += n;
                continue;
            }
            let need = 5 - self.head.len();
            let n = need.min(chunk.len() - i);
            self.head.extend_from_slice(&chunk[i..i + n]);
            i += n;
            if self.head.len() == 5 {
                if self.head[0] & 0x02 != 0 {
                    return (out.freeze(), true);
                }
                let len =
                    u32::from_be_bytes([self.head[1], self.head[2], self.head[3], self.head[4]]);
                out.extend_from_slice(&self.head);
                self.head.clear();
                self.left = len as usize;
            }
        }
        (out.freeze(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::EnvelopeCut;

    #[test]
    fn the_end_envelope_and_what_follows_are_cut_wherever_chunks_split() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&[0, 0, 0, 0, 3, b'a', b'b', b'c']);
        stream.extend_from_slice(&[0, 0, 0, 0, 1, b'd']);
        stream.extend_from_slice(&[2, 0, 0, 0, 2, b'{', b'}']);
        for split in 1..stream.len() {
            let mut cut = EnvelopeCut::default();
            let (a, end_a) = cut.pass(&stream[..split]);
            let mut got = a.to_vec();
            if !end_a {
                let (b, end_b) = cut.pass(&stream[split..]);
                assert!(end_b, "split at {split}");
                got.extend_from_slice(&b);
            }
            assert_eq!(got, stream[..14], "split at {split}");
        }
    }
}
