//! The Connect protocol with the JSON codec, as envd and the E2B SDKs speak it: one copy
//! of its framing, its error shapes and its headers, shared by tetherd's E2B front (the
//! server side) and the E2B provider (the client side). Pure: bytes in, values out; no
//! I/O.
//!
//! - **Unary**: `POST` with `Content-Type: application/json` ([`UNARY_JSON`]) and one
//!   JSON message ([`decode_json`]: an empty body is the empty message). Success is
//!   `200 application/json`; an error is the status of its code
//!   ([`ConnectCode::http_status`]) with a [`ConnectErrorBody`] (`{"code", "message"}`).
//! - **Streaming**: `Content-Type: application/connect+json` ([`STREAM_JSON`]) and
//!   *envelopes*: one flag byte ([`FLAG_COMPRESSED`], [`FLAG_END_STREAM`]), a 4-byte
//!   big-endian length, the payload ([`encode`], [`Decoder`]). A stream answer is `200`;
//!   its last envelope is the end-of-stream frame ([`end_stream`], [`EndOfStream`]):
//!   `{}` on success, `{"error": {...}}` when the call failed, with optional trailing
//!   `metadata`.
//! - `Connect-Timeout-Ms` ([`TIMEOUT_HEADER`]) bounds a call ([`parse_timeout_ms`],
//!   [`format_timeout_ms`]).
//!
//! Written here rather than taken from the `connectrpc` crate: that crate works only with
//! its own generated message types and its own HTTP stack, while tether's envd messages are
//! the serde types of [`crate::e2b`] and its HTTP clients and servers carry tether's own
//! deadlines. What the SDKs use of Connect is the small part above.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The content type of unary Connect JSON.
pub const UNARY_JSON: &str = "application/json";
/// The content type of streaming Connect JSON. A stream answer carries exactly this (the
/// Python client compares it literally).
pub const STREAM_JSON: &str = "application/connect+json";
/// The header that bounds a call, in milliseconds.
pub const TIMEOUT_HEADER: &str = "connect-timeout-ms";
/// The header that names the protocol version (`1`).
pub const PROTOCOL_VERSION_HEADER: &str = "connect-protocol-version";

/// Envelope flag: the payload is compressed.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream frame.
pub const FLAG_END_STREAM: u8 = 0x02;
/// The length of an envelope's prefix: the flag byte and the 4-byte length.
pub const PREFIX_LEN: usize = 5;

// === errors ===

/// A Connect error code (the Connect protocol's closed set, snake_case on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectCode {
    /// The operation was cancelled.
    Canceled,
    /// Unknown error.
    Unknown,
    /// Bad argument.
    InvalidArgument,
    /// A deadline expired.
    DeadlineExceeded,
    /// Not found.
    NotFound,
    /// Already exists.
    AlreadyExists,
    /// Permission denied.
    PermissionDenied,
    /// Out of a resource (rate limit, quota).
    ResourceExhausted,
    /// The system is not in the required state.
    FailedPrecondition,
    /// Aborted (concurrency conflict).
    Aborted,
    /// Out of range.
    OutOfRange,
    /// Not implemented.
    Unimplemented,
    /// Internal error.
    Internal,
    /// Unavailable, retryable.
    Unavailable,
    /// Data loss.
    DataLoss,
    /// No valid credentials.
    Unauthenticated,
}

impl ConnectCode {
    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn http_status(self) -> u16 {
        match self {
            Self::Canceled => 499,
            Self::Unknown | Self::Internal | Self::DataLoss => 500,
            Self::InvalidArgument | Self::FailedPrecondition | Self::OutOfRange => 400,
            Self::DeadlineExceeded => 504,
            Self::NotFound => 404,
            Self::AlreadyExists | Self::Aborted => 409,
            Self::PermissionDenied => 403,
            Self::ResourceExhausted => 429,
            Self::Unimplemented => 501,
            Self::Unavailable => 503,
            Self::Unauthenticated => 401,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Canceled => "canceled",
            Self::Unknown => "unknown",
            Self::InvalidArgument => "invalid_argument",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::PermissionDenied => "permission_denied",
            Self::ResourceExhausted => "resource_exhausted",
            Self::FailedPrecondition => "failed_precondition",
            Self::Aborted => "aborted",
            Self::OutOfRange => "out_of_range",
            Self::Unimplemented => "unimplemented",
            Self::Internal => "internal",
            Self::Unavailable => "unavailable",
            Self::DataLoss => "data_loss",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

/// A Connect error: the body of a unary error, or the `error` of an end-of-stream frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectErrorBody {
    /// The code.
    pub code: ConnectCode,
    /// A human sentence.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// The JSON of a Connect end-of-stream frame: `{}`, or `{"error": ...}`, with the
/// stream's trailing metadata if any.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndOfStream {
    /// The error that ended the stream, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ConnectErrorBody>,
    /// Trailing metadata: each key with its values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, Vec<String>>,
}

impl EndOfStream {
    /// The end frame of a stream that failed with `code`.
    pub fn error(code: ConnectCode, message: impl Into<String>) -> Self {
        Self {
            error: Some(ConnectErrorBody {
                code,
                message: message.into(),
            }),
            metadata: BTreeMap::new(),
        }
    }
}

/// A violation of the envelope framing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Flag bits the protocol does not define.
    UnknownFlags(u8),
    /// A compressed envelope, while only `identity` is spoken.
    Compressed,
    /// A length prefix over the decoder's limit (or a payload over 4 GiB to encode).
    TooLarge {
        /// The announced (or given) length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An end-of-stream frame whose JSON is not an [`EndOfStream`].
    BadEndFrame(String),
    /// The body ended inside an envelope.
    Truncated {
        /// The bytes of the incomplete envelope.
        pending: usize,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownFlags(flags) => write!(f, "invalid envelope flags 0x{flags:02x}"),
            Self::Compressed => f.write_str("a compressed envelope without a negotiated encoding"),
            Self::TooLarge { len, max } => {
                write!(f, "an envelope of {len} bytes is over the limit of {max}")
            }
            Self::BadEndFrame(e) => write!(f, "an undecodable end-of-stream frame: {e}"),
            Self::Truncated { pending } => {
                write!(f, "the stream ended inside an envelope ({pending} bytes)")
            }
        }
    }
}

impl std::error::Error for FrameError {}

// === envelopes ===

/// Frame one envelope: flags, big-endian length, payload. A payload over 4 GiB cannot be
/// framed.
pub fn encode(flags: u8, payload: &[u8]) -> Result<Bytes, FrameError> {
    let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLarge {
        len: payload.len(),
        max: u32::MAX as usize,
    })?;
    let mut out = BytesMut::with_capacity(PREFIX_LEN + payload.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out.freeze())
}

/// The envelope of one message (JSON serialised by the caller).
pub fn message(payload: &[u8]) -> Result<Bytes, FrameError> {
    encode(0, payload)
}

/// The end-of-stream envelope of `end`.
pub fn end_stream(end: &EndOfStream) -> Bytes {
    // An `EndOfStream` always serialises (string keys, plain fields). Should that ever
    // change, the stream must still end as failed, never as a success.
    let json = serde_json::to_vec(end).unwrap_or_else(|_| {
        br#"{"error":{"code":"internal","message":"cannot encode the end of the stream"}}"#.to_vec()
    });
    let mut out = BytesMut::with_capacity(PREFIX_LEN + json.len());
    out.extend_from_slice(&[FLAG_END_STREAM]);
    // An end frame is a few hundred bytes: its length always fits.
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out.freeze()
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A message payload.
    Message(Bytes),
    /// The end of the stream, with its JSON (an error, if the call failed). An empty
    /// payload reads as `{}`.
    End(EndOfStream),
}

/// An incremental envelope decoder: feed it body chunks as they come, split anywhere,
/// and take complete frames.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    max: usize,
}

impl Decoder {
    /// A decoder that refuses envelopes longer than `max` bytes (a longer length prefix
    /// is a corrupted stream or an abusive peer; nothing is buffered for it).
    pub fn new(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Add bytes from the body.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes received but not yet decoded.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, if one is buffered. The prefix is checked as soon as it
    /// is in, before the payload arrives.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & !(FLAG_COMPRESSED | FLAG_END_STREAM) != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < PREFIX_LEN + len {
            return Ok(None);
        }
        self.buf.advance(PREFIX_LEN);
        let payload = self.buf.split_to(len).freeze();
        if flags & FLAG_END_STREAM == 0 {
            return Ok(Some(Frame::Message(payload)));
        }
        let end = if payload.iter().all(u8::is_ascii_whitespace) {
            EndOfStream::default()
        } else {
            serde_json::from_slice(&payload).map_err(|e| FrameError::BadEndFrame(e.to_string()))?
        };
        Ok(Some(Frame::End(end)))
    }

    /// At the end of the body: an error if it stopped inside an envelope.
    pub fn finish(&self) -> Result<(), FrameError> {
        match self.buf.len() {
            0 => Ok(()),
            pending => Err(FrameError::Truncated { pending }),
        }
    }
}

// === unary ===

/// Decode a JSON message: a unary body or an envelope's payload. An empty (or all
/// whitespace) body is the empty message `{}`.
pub fn decode_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
}

/// The Connect error of a unary error body, when the body is one (a plain HTTP error in
/// front of the server, a proxy's page, is not).
pub fn decode_error(body: &[u8]) -> Option<ConnectErrorBody> {
    serde_json::from_slice(body).ok()
}

// === headers ===

/// `Connect-Timeout-Ms`: a positive integer of at most 10 digits. `0` means no deadline
/// (as the SDKs send it for `timeout=0`).
pub fn parse_timeout_ms(value: &str) -> Result<Option<Duration>, String> {
    let s = value.trim();
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("invalid Connect-Timeout-Ms {s:?}"));
    }
    let ms: u64 = s
        .parse()
        .map_err(|_| format!("invalid Connect-Timeout-Ms {s:?}"))?;
    Ok((ms > 0).then(|| Duration::from_millis(ms)))
}

/// The `Connect-Timeout-Ms` value of a time left (at least 1: `0` would mean none).
pub fn format_timeout_ms(left: Duration) -> String {
    left.as_millis().clamp(1, 9_999_999_999).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames_of(wire: &[u8], chunk: usize) -> Result<Vec<Frame>, FrameError> {
        let mut d = Decoder::new(1 << 20);
        let mut out = Vec::new();
        for piece in wire.chunks(chunk) {
            d.push(piece);
            while let Some(f) = d.next_frame()? {
                out.push(f);
            }
        }
        d.finish()?;
        Ok(out)
    }

    #[test]
    fn envelopes_round_trip_whatever_the_chunking() {
        let big = vec![b'x'; 70_000];
        let mut wire = Vec::new();
        wire.extend_from_slice(&message(br#"{"event":{"start":{"pid":7}}}"#).unwrap());
        wire.extend_from_slice(&message(b"").unwrap());
        wire.extend_from_slice(&message(&big).unwrap());
        wire.extend_from_slice(&end_stream(&EndOfStream::default()));
        for chunk in [1, 2, 4, 5, 6, 7, 100, 65_536, wire.len()] {
            let frames = frames_of(&wire, chunk).unwrap();
            assert_eq!(
                frames,
                [
                    Frame::Message(Bytes::from_static(br#"{"event":{"start":{"pid":7}}}"#)),
                    Frame::Message(Bytes::new()),
                    Frame::Message(Bytes::from(big.clone())),
                    Frame::End(EndOfStream::default()),
                ],
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn the_prefix_is_the_flag_then_a_big_endian_length() {
        let e = encode(FLAG_END_STREAM, b"{}").unwrap();
        assert_eq!(&e[..], b"\x02\x00\x00\x00\x02{}");
        let m = message(&[7u8; 258]).unwrap();
        assert_eq!(&m[..PREFIX_LEN], b"\x00\x00\x00\x01\x02");
        assert_eq!(m.len(), PREFIX_LEN + 258);
    }

    #[test]
    fn a_partial_frame_waits_and_a_body_cut_inside_one_is_truncated() {
        let wire = message(b"hello").unwrap();
        let mut d = Decoder::new(64);
        d.push(&wire[..3]);
        assert_eq!(d.next_frame(), Ok(None));
        d.push(&wire[3..8]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.pending(), 8);
        assert_eq!(d.finish(), Err(FrameError::Truncated { pending: 8 }));
        d.push(&wire[8..]);
        assert_eq!(
            d.next_frame(),
            Ok(Some(Frame::Message(Bytes::from_static(b"hello"))))
        );
        assert_eq!(d.finish(), Ok(()));
    }

    #[test]
    fn an_oversized_length_is_refused_from_the_prefix_alone() {
        let mut d = Decoder::new(1024);
        d.push(&[0, 0, 0, 4, 1]);
        assert_eq!(
            d.next_frame(),
            Err(FrameError::TooLarge {
                len: 1025,
                max: 1024
            })
        );
        let mut d = Decoder::new(1024);
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_frame(), Err(FrameError::TooLarge { .. })));
        // Exactly the limit is fine.
        let mut d = Decoder::new(3);
        d.push(&message(b"abc").unwrap());
        assert!(matches!(d.next_frame(), Ok(Some(Frame::Message(_)))));
    }

    #[test]
    fn flags_other_than_end_are_refused() {
        let mut d = Decoder::new(64);
        d.push(&encode(FLAG_COMPRESSED, b"x").unwrap());
        assert_eq!(d.next_frame(), Err(FrameError::Compressed));
        let mut d = Decoder::new(64);
        d.push(&encode(0x80, b"x").unwrap());
        assert_eq!(d.next_frame(), Err(FrameError::UnknownFlags(0x80)));
    }

    #[test]
    fn the_end_frame_carries_the_error_and_the_metadata() {
        let mut end = EndOfStream::error(ConnectCode::DeadlineExceeded, "too slow");
        end.metadata
            .insert("x-trace".into(), vec!["a".into(), "b".into()]);
        let wire = end_stream(&end);
        assert_eq!(wire[0], FLAG_END_STREAM);
        let json: serde_json::Value = serde_json::from_slice(&wire[PREFIX_LEN..]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "error": {"code": "deadline_exceeded", "message": "too slow"},
                "metadata": {"x-trace": ["a", "b"]}
            })
        );
        let mut d = Decoder::new(64 * 1024);
        d.push(&wire);
        assert_eq!(d.next_frame(), Ok(Some(Frame::End(end))));
        // A success is `{}`; an empty payload reads the same.
        assert_eq!(&end_stream(&EndOfStream::default())[PREFIX_LEN..], b"{}");
        let mut d = Decoder::new(64);
        d.push(&encode(FLAG_END_STREAM, b"").unwrap());
        assert_eq!(d.next_frame(), Ok(Some(Frame::End(EndOfStream::default()))));
        // Unknown fields of an error (`details`) are ignored; a bad code is not.
        let mut d = Decoder::new(1024);
        d.push(
            &encode(
                FLAG_END_STREAM,
                br#"{"error":{"code":"not_found","message":"m","details":[]}}"#,
            )
            .unwrap(),
        );
        assert_eq!(
            d.next_frame(),
            Ok(Some(Frame::End(EndOfStream::error(
                ConnectCode::NotFound,
                "m"
            ))))
        );
        let mut d = Decoder::new(1024);
        d.push(&encode(FLAG_END_STREAM, br#"{"error":{"code":"nope"}}"#).unwrap());
        assert!(matches!(d.next_frame(), Err(FrameError::BadEndFrame(_))));
    }

    #[test]
    fn unary_bodies_and_errors() {
        #[derive(Debug, Deserialize, PartialEq)]
        struct M {
            #[serde(default)]
            a: u32,
        }
        assert_eq!(decode_json::<M>(b"").unwrap(), M { a: 0 });
        assert_eq!(decode_json::<M>(b" \n").unwrap(), M { a: 0 });
        assert_eq!(decode_json::<M>(br#"{"a":3}"#).unwrap(), M { a: 3 });
        assert!(decode_json::<M>(b"{").is_err());
        assert_eq!(
            decode_error(br#"{"code":"permission_denied","message":"no"}"#),
            Some(ConnectErrorBody {
                code: ConnectCode::PermissionDenied,
                message: "no".into()
            })
        );
        // A REST error body (`code` is the HTTP status) is not a Connect error.
        assert_eq!(decode_error(br#"{"code":404,"message":"no"}"#), None);
        assert_eq!(decode_error(b"<html>"), None);
        for code in [
            ConnectCode::Canceled,
            ConnectCode::DeadlineExceeded,
            ConnectCode::Unauthenticated,
        ] {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
        assert_eq!(ConnectCode::DeadlineExceeded.http_status(), 504);
    }

    #[test]
    fn timeout_header() {
        assert_eq!(
            parse_timeout_ms("1500"),
            Ok(Some(Duration::from_millis(1500)))
        );
        assert_eq!(parse_timeout_ms("0"), Ok(None));
        assert!(parse_timeout_ms("").is_err());
        assert!(parse_timeout_ms("-1").is_err());
        assert!(parse_timeout_ms("12345678901").is_err());
        assert_eq!(format_timeout_ms(Duration::from_micros(10)), "1");
        assert_eq!(format_timeout_ms(Duration::from_secs(60)), "60000");
    }
}
