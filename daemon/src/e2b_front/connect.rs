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
//! Compression is refused (the SDKs never compress), and so is the binary codec.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_protocol::e2b::{ConnectCode, ConnectErrorBody, EndOfStream};
use tokio::time::Instant;

use crate::error::DaemonError;

/// The content type of unary Connect JSON.
pub(super) const UNARY_JSON: &str = "application/json";
/// The content type of streaming Connect JSON.
pub(super) const STREAM_JSON: &str = "application/connect+json";

/// Envelope flag: the payload is compressed.
const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream.
const FLAG_END_STREAM: u8 = 0x02;

/// envd's keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// The largest request message accepted (RPC requests are small; file data goes over
/// `/files`).
pub(super) const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

// === impl RpcError ===

/// A Connect error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RpcError {
    pub(super) code: ConnectCode,
    pub(super) message: String,
}

impl RpcError {
    pub(super) fn new(code: ConnectCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ConnectCode::InvalidArgument, message)
    }

    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Self::new(ConnectCode::NotFound, message)
    }

    fn body(&self) -> ConnectErrorBody {
        ConnectErrorBody {
            code: self.code,
            message: self.message.clone(),
        }
    }
}

impl From<DaemonError> for RpcError {
    fn from(e: DaemonError) -> Self {
        super::log_error(&e);
        Self::new(super::connect_code(e.code()), e.public_message())
    }
}

impl From<tether_provider::ProviderError> for RpcError {
    fn from(e: tether_provider::ProviderError) -> Self {
        DaemonError::from(e).into()
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
pub(super) struct CallOpts {
    /// `Connect-Timeout-Ms`.
    pub(super) timeout: Option<Duration>,
    /// `Keepalive-Ping-Interval`.
    pub(super) keepalive: Duration,
}

impl CallOpts {
    /// Parse and validate the headers of a call of the given kind.
    pub(super) fn parse(headers: &HeaderMap, streaming: bool) -> Result<Self, RpcError> {
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
    pub(super) fn deadline(&self) -> Option<Instant> {
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

/// `Connect-Timeout-Ms`: a positive integer of at most 10 digits; absent = no deadline.
fn timeout_of(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("").trim();
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RpcError::invalid(format!(
            "invalid Connect-Timeout-Ms {s:?}"
        )));
    }
    let ms: u64 = s
        .parse()
        .map_err(|_| RpcError::invalid("invalid Connect-Timeout-Ms"))?;
    Ok((ms > 0).then(|| Duration::from_millis(ms)))
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
pub(super) fn decode_unary<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| RpcError::invalid(format!("cannot decode the request message: {e}")))
}

/// A unary success.
pub(super) fn unary_ok<T: Serialize>(msg: &T) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON))],
        json_bytes(msg),
    )
        .into_response()
}

/// Read a whole (small) request body, refusing more than `max` bytes.
pub(super) async fn read_body(body: Body, max: usize) -> Result<Bytes, RpcError> {
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

/// Frame one envelope.
pub(super) fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(payload);
    out.freeze()
}

/// One decoded request envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Frame {
    /// A message payload.
    Message(Bytes),
    /// The client's end-of-stream frame.
    End,
}

/// Incremental envelope decoder: feed chunks, take frames.
#[derive(Debug, Default)]
pub(super) struct EnvelopeDecoder {
    buf: BytesMut,
}

impl EnvelopeDecoder {
    pub(super) fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete frame, if one is buffered.
    pub(super) fn next_frame(&mut self) -> Result<Option<Frame>, RpcError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & !(FLAG_COMPRESSED | FLAG_END_STREAM) != 0 {
            return Err(RpcError::invalid(format!(
                "invalid envelope flags 0x{flags:02x}"
            )));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::invalid(
                "compressed envelope without a negotiated encoding",
            ));
        }
        if len > MAX_MESSAGE_BYTES {
            return Err(RpcError::new(
                ConnectCode::ResourceExhausted,
                format!("message of {len} bytes is over the limit"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(if flags & FLAG_END_STREAM != 0 {
            Frame::End
        } else {
            Frame::Message(payload)
        }))
    }

    /// Bytes buffered that do not form a complete frame (at the end of the body: a
    /// truncated envelope).
    pub(super) fn leftover(&self) -> usize {
        self.buf.len()
    }
}

/// The one request message of a server-streaming call.
pub(super) async fn read_single_message<T: DeserializeOwned>(body: Body) -> Result<T, RpcError> {
    let bytes = read_body(body, MAX_MESSAGE_BYTES + 5).await?;
    let mut dec = EnvelopeDecoder::default();
    dec.push(&bytes);
    let msg = match dec.next_frame()? {
        Some(Frame::Message(m)) => m,
        Some(Frame::End) => return Err(RpcError::invalid("the request stream holds no message")),
        None if bytes.is_empty() => {
            return Err(RpcError::invalid("the request stream holds no message"));
        }
        None => return Err(RpcError::invalid("truncated request envelope")),
    };
    // Anything after the message may only be the client's end-of-stream frame.
    match dec.next_frame()? {
        None if dec.leftover() == 0 => {}
        Some(Frame::End) if dec.leftover() == 0 => {}
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
pub(super) fn message_stream<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> BoxStream<'static, Result<T, RpcError>> {
    struct St {
        body: BoxStream<'static, Result<Bytes, axum::Error>>,
        dec: EnvelopeDecoder,
        done: bool,
    }
    let st = St {
        body: body.into_data_stream().boxed(),
        dec: EnvelopeDecoder::default(),
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
                    return Some((Err(e), st));
                }
                Ok(Some(Frame::Message(m))) => return Some((decode_unary::<T>(&m), st)),
                Ok(Some(Frame::End)) => return None,
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
                    if st.dec.leftover() > 0 {
                        return Some((Err(RpcError::invalid("truncated request envelope")), st));
                    }
                    return None;
                }
            }
        }
    })
    .boxed()
}

// === streaming responses ===

/// Options of a streaming response.
pub(super) struct StreamOpts {
    /// Keepalive interval.
    pub(super) keepalive: Duration,
    /// The keepalive message of this service, JSON.
    pub(super) keepalive_msg: Bytes,
    /// When the call's deadline passes, the stream ends with `deadline_exceeded`.
    pub(super) deadline: Option<Instant>,
    /// The span the stream is produced in.
    pub(super) span: tracing::Span,
}

/// Serialise a message for a stream.
pub(super) fn msg<T: Serialize>(m: &T) -> Bytes {
    json_bytes(m)
}

/// The end-of-stream frame.
pub(super) fn end_frame(error: Option<&RpcError>) -> Bytes {
    envelope(
        FLAG_END_STREAM,
        &json_bytes(&EndOfStream {
            error: error.map(RpcError::body),
        }),
    )
}

/// A streaming response over `messages` (JSON payloads): message envelopes, keepalives,
/// then the end-of-stream frame (`{}`, or the error that ended the stream).
pub(super) fn stream_response(
    messages: BoxStream<'static, Result<Bytes, RpcError>>,
    opts: StreamOpts,
) -> Response {
    struct St {
        inner: BoxStream<'static, Result<Bytes, RpcError>>,
        done: bool,
        keepalive: Duration,
        keepalive_msg: Bytes,
        deadline: Option<Instant>,
    }
    let st = St {
        inner: messages,
        done: false,
        keepalive: opts.keepalive,
        keepalive_msg: opts.keepalive_msg,
        deadline: opts.deadline,
    };
    let frames = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let deadline = st.deadline;
        let out = tokio::select! {
            biased;
            item = st.inner.next() => match item {
                Some(Ok(payload)) => envelope(0, &payload),
                Some(Err(e)) => {
                    st.done = true;
                    end_frame(Some(&e))
                }
                None => {
                    st.done = true;
                    end_frame(None)
                }
            },
            _ = sleep_until_opt(deadline) => {
                st.done = true;
                end_frame(Some(&RpcError::new(ConnectCode::DeadlineExceeded, "the call's Connect-Timeout-Ms expired")))
            }
            _ = tokio::time::sleep(st.keepalive) => envelope(0, &st.keepalive_msg),
        };
        Some((Ok::<_, std::convert::Infallible>(out), st))
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
pub(super) fn stream_error(e: &RpcError) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON))],
        end_frame(Some(e)),
    )
        .into_response()
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
