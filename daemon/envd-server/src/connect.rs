//! The Connect protocol as envd speaks it to the E2B SDKs: JSON codec only, unary and
//! streaming.
//!
//! - **Unary**: `POST` with `Content-Type: application/json` and one JSON message; the
//!   answer is `200 application/json`, or an error status with
//!   `{"code": "<connect code>", "message"}`.
//! - **Streaming** (server- and client-streaming): `Content-Type: application/connect+json`
//!   and *envelopes*: one flag byte (`0x01` compressed, `0x02` end of stream), a 4-byte
//!   big-endian length, the JSON payload. A streaming answer is always `200` with exactly
//!   `application/connect+json` (the Python client compares it literally), message
//!   envelopes, then one end-of-stream envelope `{}` or `{"error": {...}}`: errors of a
//!   stream travel in that last frame.
//! - `Connect-Timeout-Ms` bounds the call: a stream that outlives it ends with
//!   `deadline_exceeded`. `Keepalive-Ping-Interval` (seconds; envd's default 90) asks for
//!   a keepalive message whenever nothing else was sent for that long.
//!
//! Compression is refused (the SDKs never compress), and so is the binary codec. The
//! framing itself is [`tether_protocol::connect`]'s, shared with the E2B provider; this
//! module puts it on axum bodies and responses.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_protocol::connect::{self as codec, Decoder, Frame, FrameError};
use tether_protocol::e2b::{ConnectCode, ConnectErrorBody, EndOfStream};
use tether_provider::clock::CancelToken;
use tokio::time::Instant;

use crate::error::Failure;

/// The content type of unary Connect JSON.
pub(crate) const UNARY_JSON: &str = codec::UNARY_JSON;
/// The content type of streaming Connect JSON.
pub(crate) const STREAM_JSON: &str = codec::STREAM_JSON;

/// envd's keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// The largest request message accepted (RPC requests are small; file data goes over
/// `/files`).
pub(crate) const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

// === impl RpcError ===

/// A Connect error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RpcError {
    pub(crate) code: ConnectCode,
    pub(crate) message: String,
}

impl RpcError {
    pub(crate) fn new(code: ConnectCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ConnectCode::InvalidArgument, message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(ConnectCode::NotFound, message)
    }

    fn body(&self) -> ConnectErrorBody {
        ConnectErrorBody {
            code: self.code,
            message: self.message.clone(),
        }
    }
}

impl From<FrameError> for RpcError {
    fn from(e: FrameError) -> Self {
        let code = match e {
            FrameError::TooLarge { .. } => ConnectCode::ResourceExhausted,
            FrameError::UnknownFlags(_)
            | FrameError::Compressed
            | FrameError::BadEndFrame(_)
            | FrameError::Truncated { .. } => ConnectCode::InvalidArgument,
        };
        Self::new(code, e.to_string())
    }
}

impl From<Failure> for RpcError {
    fn from(e: Failure) -> Self {
        Self::new(crate::connect_code(e.code), e.public_message())
    }
}

impl From<tether_provider::ProviderError> for RpcError {
    fn from(e: tether_provider::ProviderError) -> Self {
        Failure::from(e).into()
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON))],
            json_bytes(&self.body()),
        )
            .into_response()
    }
}

fn json_bytes<T: Serialize>(v: &T) -> Bytes {
    // Serialising the front's own wire types cannot fail (string keys, no custom errors).
    serde_json::to_vec(v)
        .map(Bytes::from)
        .unwrap_or_else(|_| Bytes::from_static(b"{}"))
}

// === request headers ===

/// What a Connect request's headers ask for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallOpts {
    /// `Connect-Timeout-Ms`.
    pub(crate) timeout: Option<Duration>,
    /// `Keepalive-Ping-Interval`.
    pub(crate) keepalive: Duration,
}

impl CallOpts {
    /// Parse and validate the headers of a call of the given kind.
    pub(crate) fn parse(headers: &HeaderMap, streaming: bool) -> Result<Self, RpcError> {
        check_content_type(headers, streaming)?;
        for name in ["content-encoding", "connect-content-encoding"] {
            if let Some(enc) = headers.get(name) {
                let enc = enc.to_str().unwrap_or("?").trim();
                if !enc.is_empty() && !enc.eq_ignore_ascii_case("identity") {
                    return Err(RpcError::new(
                        ConnectCode::Unimplemented,
                        format!("unsupported compression {enc:?}: only identity is served"),
                    ));
                }
            }
        }
        Ok(Self {
            timeout: timeout_of(headers)?,
            keepalive: keepalive_of(headers),
        })
    }

    /// The call's deadline, from now.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| Instant::now() + t)
    }
}

fn check_content_type(headers: &HeaderMap, streaming: bool) -> Result<(), RpcError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let base = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let want = if streaming { STREAM_JSON } else { UNARY_JSON };
    if base == want {
        return Ok(());
    }
    let hint = match base.as_str() {
        "application/proto" | "application/connect+proto" => {
            "the protobuf codec is not served; use JSON"
        }
        "application/json" | "application/connect+json" => {
            "wrong content type for this method's kind"
        }
        _ => "unsupported content type",
    };
    Err(RpcError::new(
        ConnectCode::Unimplemented,
        format!("{hint}: got {ct:?}, want {want:?}"),
    ))
}

/// `Connect-Timeout-Ms`; absent = no deadline.
fn timeout_of(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    let Some(v) = headers.get(codec::TIMEOUT_HEADER) else {
        return Ok(None);
    };
    codec::parse_timeout_ms(v.to_str().unwrap_or("")).map_err(RpcError::invalid)
}

/// `Keepalive-Ping-Interval` in seconds; envd's default when missing or not a number.
fn keepalive_of(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_KEEPALIVE, Duration::from_secs)
}

// === unary ===

/// Decode a unary request body. An empty body is the empty message.
pub(crate) fn decode_unary<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    codec::decode_json(body)
        .map_err(|e| RpcError::invalid(format!("cannot decode the request message: {e}")))
}

/// A unary success.
pub(crate) fn unary_ok<T: Serialize>(msg: &T) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON))],
        json_bytes(msg),
    )
        .into_response()
}

/// Read a whole (small) request body, refusing more than `max` bytes.
pub(crate) async fn read_body(body: Body, max: usize) -> Result<Bytes, RpcError> {
    let mut stream = body.into_data_stream();
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            RpcError::new(
                ConnectCode::Canceled,
                format!("cannot read the request: {e}"),
            )
        })?;
        if buf.len() + chunk.len() > max {
            return Err(RpcError::new(
                ConnectCode::ResourceExhausted,
                format!("request message larger than {max} bytes"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

// === envelopes ===

/// Frame one message envelope. Messages are bounded far below 4 GiB (request messages by
/// [`MAX_MESSAGE_BYTES`], answers by what the front reads per message), so framing fails
/// only on a broken invariant, reported as an internal error.
pub(crate) fn envelope(payload: &[u8]) -> Result<Bytes, RpcError> {
    codec::message(payload).map_err(|e| RpcError::new(ConnectCode::Internal, e.to_string()))
}

/// A decoder of request envelopes, bounded by [`MAX_MESSAGE_BYTES`].
fn request_decoder() -> Decoder {
    Decoder::new(MAX_MESSAGE_BYTES)
}

/// The one request message of a server-streaming call.
pub(crate) async fn read_single_message<T: DeserializeOwned>(body: Body) -> Result<T, RpcError> {
    let bytes = read_body(body, MAX_MESSAGE_BYTES + codec::PREFIX_LEN).await?;
    let mut dec = request_decoder();
    dec.push(&bytes);
    let msg = match dec.next_frame()? {
        Some(Frame::Message(m)) => m,
        Some(Frame::End(_)) => {
            return Err(RpcError::invalid("the request stream holds no message"));
        }
        None if bytes.is_empty() => {
            return Err(RpcError::invalid("the request stream holds no message"));
        }
        None => return Err(RpcError::invalid("truncated request envelope")),
    };
    // Anything after the message may only be the client's end-of-stream frame.
    match dec.next_frame()? {
        None | Some(Frame::End(_)) if dec.pending() == 0 => {}
        None => return Err(RpcError::invalid("truncated request envelope")),
        Some(_) => {
            return Err(RpcError::invalid(
                "a server-streaming call takes exactly one request message",
            ));
        }
    }
    decode_unary(&msg)
}

/// The request messages of a client-streaming call, decoded as they arrive.
pub(crate) fn message_stream<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> BoxStream<'static, Result<T, RpcError>> {
    struct St {
        body: BoxStream<'static, Result<Bytes, axum::Error>>,
        dec: Decoder,
        done: bool,
    }
    let st = St {
        body: body.into_data_stream().boxed(),
        dec: request_decoder(),
        done: false,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            match st.dec.next_frame() {
                Err(e) => {
                    st.done = true;
                    return Some((Err(e.into()), st));
                }
                Ok(Some(Frame::Message(m))) => return Some((decode_unary::<T>(&m), st)),
                Ok(Some(Frame::End(_))) => return None,
                Ok(None) => {}
            }
            match st.body.next().await {
                Some(Ok(chunk)) => st.dec.push(&chunk),
                Some(Err(e)) => {
                    st.done = true;
                    return Some((
                        Err(RpcError::new(
                            ConnectCode::Canceled,
                            format!("request stream broke: {e}"),
                        )),
                        st,
                    ));
                }
                None => {
                    st.done = true;
                    return match st.dec.finish() {
                        Ok(()) => None,
                        Err(e) => Some((Err(e.into()), st)),
                    };
                }
            }
        }
    })
    .boxed()
}

// === streaming responses ===

/// Options of a streaming response.
pub(crate) struct StreamOpts {
    /// Keepalive interval.
    pub(crate) keepalive: Duration,
    /// The keepalive message of this service, JSON.
    pub(crate) keepalive_msg: Bytes,
    /// When the call's deadline passes, the stream ends with `deadline_exceeded`, even
    /// when a message (the end of a process its deadline killed) is ready at that moment:
    /// envd's handler returns its context's error first.
    pub(crate) deadline: Option<Instant>,
    /// When this fires (the sandbox is gone), the connection is cut without an end frame,
    /// as a killed sandbox's envd cuts it: the SDKs then probe `/health` and report the
    /// sandbox killed, never a normal end.
    pub(crate) sever: Option<CancelToken>,
    /// The span the stream is produced in.
    pub(crate) span: tracing::Span,
}

/// Serialise a message for a stream.
pub(crate) fn msg<T: Serialize>(m: &T) -> Bytes {
    json_bytes(m)
}

/// The end-of-stream frame.
pub(crate) fn end_frame(error: Option<&RpcError>) -> Bytes {
    codec::end_stream(&EndOfStream {
        error: error.map(RpcError::body),
        ..EndOfStream::default()
    })
}

/// A streaming response over `messages` (JSON payloads): message envelopes, keepalives,
/// then the end-of-stream frame (`{}`, or the error that ended the stream).
pub(crate) fn stream_response(
    messages: BoxStream<'static, Result<Bytes, RpcError>>,
    opts: StreamOpts,
) -> Response {
    struct St {
        inner: BoxStream<'static, Result<Bytes, RpcError>>,
        done: bool,
        keepalive: Duration,
        keepalive_msg: Bytes,
        deadline: Option<Instant>,
        sever: Option<CancelToken>,
    }
    let st = St {
        inner: messages,
        done: false,
        keepalive: opts.keepalive,
        keepalive_msg: opts.keepalive_msg,
        deadline: opts.deadline,
        sever: opts.sever,
    };
    let expired = || {
        RpcError::new(
            ConnectCode::DeadlineExceeded,
            "the call's Connect-Timeout-Ms expired",
        )
    };
    let frames = futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        let deadline = st.deadline;
        let sever = st.sever.clone();
        let out = tokio::select! {
            biased;
            _ = cancelled_opt(sever.as_ref()) => {
                st.done = true;
                return Some((Err(std::io::Error::other("the sandbox is gone")), st));
            }
            _ = sleep_until_opt(deadline) => {
                st.done = true;
                end_frame(Some(&expired()))
            }
            item = st.inner.next() => {
                if sever.as_ref().is_some_and(CancelToken::is_cancelled) {
                    st.done = true;
                    return Some((Err(std::io::Error::other("the sandbox is gone")), st));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    st.done = true;
                    end_frame(Some(&expired()))
                } else {
                    match item {
                        Some(Ok(payload)) => match envelope(&payload) {
                            Ok(frame) => frame,
                            Err(e) => {
                                st.done = true;
                                end_frame(Some(&e))
                            }
                        },
                        Some(Err(e)) => {
                            st.done = true;
                            end_frame(Some(&e))
                        }
                        None => {
                            st.done = true;
                            end_frame(None)
                        }
                    }
                }
            },
            _ = tokio::time::sleep(st.keepalive) => match envelope(&st.keepalive_msg) {
                Ok(frame) => frame,
                Err(e) => {
                    st.done = true;
                    end_frame(Some(&e))
                }
            },
        };
        Some((Ok::<_, std::io::Error>(out), st))
    });
    let body = Body::from_stream(InSpan {
        inner: frames.boxed(),
        span: opts.span,
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON))],
        body,
    )
        .into_response()
}

/// A streaming answer that is only an error (the stream failed before its first message).
pub(crate) fn stream_error(e: &RpcError) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON))],
        end_frame(Some(e)),
    )
        .into_response()
}

async fn cancelled_opt(token: Option<&CancelToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Polls a stream inside a span (the response body is produced after the handler returned).
struct InSpan<S> {
    inner: S,
    span: tracing::Span,
}

impl<S: Stream + Unpin> Stream for InSpan<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let span = self.span.clone();
        let _entered = span.enter();
        self.inner.poll_next_unpin(cx)
    }
}
