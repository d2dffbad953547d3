//! Fuzz targets: each takes arbitrary bytes, must never panic, and checks what must hold
//! for any input. The test suite runs them bounded over seeds and their mutations
//! (`tests/inputs.rs`); `harness/` runs them coverage-guided under cargo-fuzz:
//!
//! ```sh
//! cd tests/fuzz && cargo +nightly fuzz run --fuzz-dir harness connect_frames -- -max_total_time=60
//! ```

// A fuzz target reports a violated property by panicking: that is what the fuzzer catches.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use tether_protocol::connect::{Decoder, FLAG_END_STREAM, Frame, encode, end_stream};

/// Largest envelope the targets accept (as the daemon's bound, smaller).
const MAX_ENVELOPE: usize = 1 << 16;

/// A Connect stream body, split at the places the input's first bytes say: the decoder
/// yields exactly the envelopes a plain walk over the bytes finds (the same payloads, in
/// order, however the body is split), stops at the first it must refuse, and never panics.
pub fn connect_frames(data: &[u8]) {
    let (splits, body) = data.split_at(data.len().min(4));
    let mut decoder = Decoder::new(MAX_ENVELOPE);
    let mut chunks = Vec::new();
    let mut rest = body;
    for s in splits {
        let at = (*s as usize).min(rest.len());
        let (a, b) = rest.split_at(at);
        chunks.push(a);
        rest = b;
    }
    chunks.push(rest);
    let mut got: Vec<(u8, Vec<u8>)> = Vec::new();
    let mut refused = false;
    'feed: for c in chunks {
        decoder.push(c);
        loop {
            match decoder.next_frame() {
                Ok(Some(Frame::Message(m))) => {
                    let e = encode(0, &m).expect("a decoded message re-encodes");
                    assert_eq!(&e[5..], &m[..]);
                    got.push((0, m.to_vec()));
                }
                Ok(Some(Frame::End(end))) => {
                    let _ = end_stream(&end);
                    got.push((FLAG_END_STREAM, Vec::new()));
                }
                Ok(None) => break,
                Err(_) => {
                    refused = true;
                    break 'feed;
                }
            }
        }
    }
    // The reference: walk the envelopes by their length prefixes.
    let mut want: Vec<(u8, Vec<u8>)> = Vec::new();
    let mut i = 0;
    let mut reference_refuses = false;
    while i + 5 <= body.len() {
        let flags = body[i];
        let len = u32::from_be_bytes([body[i + 1], body[i + 2], body[i + 3], body[i + 4]]) as usize;
        if flags & !FLAG_END_STREAM != 0 || len > MAX_ENVELOPE {
            reference_refuses = true;
            break;
        }
        if i + 5 + len > body.len() {
            break;
        }
        let payload = &body[i + 5..i + 5 + len];
        if flags == FLAG_END_STREAM {
            // An end frame must carry JSON (or nothing): else the decoder refuses it.
            let blank = payload.iter().all(u8::is_ascii_whitespace);
            if !blank
                && serde_json::from_slice::<tether_protocol::connect::EndOfStream>(payload).is_err()
            {
                reference_refuses = true;
                break;
            }
            want.push((FLAG_END_STREAM, Vec::new()));
        } else {
            want.push((0, payload.to_vec()));
        }
        i += 5 + len;
    }
    assert_eq!(
        refused, reference_refuses,
        "refusal differs from the plain walk"
    );
    assert_eq!(
        got, want,
        "the decoded envelopes differ from the plain walk"
    );
    if !refused {
        assert_eq!(decoder.finish().is_ok(), i == body.len());
    }
}

/// E2B request bodies as the front decodes them: any bytes decode or fail cleanly, and
/// what decodes serializes again.
pub fn e2b_requests(data: &[u8]) {
    use tether_protocol::e2b::{
        InitRequest, MoveRequest, NewSandboxRequest, PathRequest, SendInputRequest,
        SendSignalRequest, StartRequest, UpdateRequest,
    };
    fn one<T: serde::de::DeserializeOwned + serde::Serialize>(data: &[u8]) {
        if let Ok(v) = tether_protocol::connect::decode_json::<T>(data) {
            serde_json::to_vec(&v).expect("a decoded request serializes");
        }
    }
    one::<NewSandboxRequest>(data);
    one::<InitRequest>(data);
    one::<StartRequest>(data);
    one::<UpdateRequest>(data);
    one::<SendInputRequest>(data);
    one::<SendSignalRequest>(data);
    one::<PathRequest>(data);
    one::<MoveRequest>(data);
}

/// Native API requests as the daemon decodes them: the JSON bodies (`serde_json`, as its
/// `ApiJson` extractor does) and the query strings (`serde_urlencoded`, as axum's `Query`
/// does). Any bytes decode or fail cleanly, and what decodes encodes again into what
/// decodes to an equal value.
pub fn native_requests(data: &[u8]) {
    use std::fmt::Debug;

    use serde::Serialize;
    use serde::de::DeserializeOwned;
    use tether_protocol::api::{
        CreateSessionRequest, EventsQuery, ForkRequest, OutputQuery, PathQuery, PostMessageRequest,
        SignalRequest, StartProcessRequest, StdinRequest, ToolCallsRequest,
    };

    fn body<T: DeserializeOwned + Serialize + PartialEq + Debug>(data: &[u8]) {
        let Ok(v) = serde_json::from_slice::<T>(data) else {
            return;
        };
        let json = serde_json::to_vec(&v).expect("a decoded request encodes");
        let again: T = serde_json::from_slice(&json).unwrap_or_else(|e| {
            panic!(
                "a re-encoded request does not decode ({e}): {}",
                String::from_utf8_lossy(&json)
            )
        });
        assert_eq!(again, v, "a request changes through a round trip");
    }
    fn query<T: DeserializeOwned + Serialize + PartialEq + Debug>(data: &[u8]) {
        let Ok(v) = serde_urlencoded::from_bytes::<T>(data) else {
            return;
        };
        let text = serde_urlencoded::to_string(&v).expect("a decoded query encodes");
        let again: T = serde_urlencoded::from_str(&text)
            .unwrap_or_else(|e| panic!("a re-encoded query does not decode ({e}): {text}"));
        assert_eq!(again, v, "a query changes through a round trip");
    }
    body::<CreateSessionRequest>(data);
    body::<ToolCallsRequest>(data);
    body::<PostMessageRequest>(data);
    body::<ForkRequest>(data);
    body::<StartProcessRequest>(data);
    body::<StdinRequest>(data);
    body::<SignalRequest>(data);
    query::<EventsQuery>(data);
    query::<OutputQuery>(data);
    query::<PathQuery>(data);
}

/// Boundaries of the multipart target, chosen by the input's first byte: a short one, a
/// browser's, one letter, and the longest a content type may give (70 bytes).
const BOUNDARIES: [&str; 4] = [
    "XyZ",
    "----WebKitFormBoundary7MA4YWxkTrZu0gW",
    "a",
    "0123456789012345678901234567890123456789012345678901234567890123456789",
];

/// What a multipart body decodes into: each part's headers and data (the last one cut
/// short if the body fails inside it), then the end or the error.
type Transcript = (
    Vec<(tether_protocol::multipart::PartHeaders, Vec<u8>)>,
    Result<(), tether_protocol::multipart::MultipartError>,
);

/// Decode `chunks` as the E2B front feeds a request body, checking the memory bound at
/// each request for more input.
fn multipart_transcript<'a>(
    boundary: &str,
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> Transcript {
    use tether_protocol::multipart::{Decoder, MAX_HEADER_BYTES, Step};
    let bound = (MAX_HEADER_BYTES + 3).max(boundary.len() + 4);
    let mut chunks = chunks.into_iter();
    let mut dec = Decoder::new(boundary);
    let mut feed = |dec: &mut Decoder| {
        assert!(
            dec.buffered() <= bound,
            "the decoder holds {} bytes while asking for more (bound {bound})",
            dec.buffered()
        );
        match chunks.next() {
            Some(c) => dec.push(c),
            None => dec.finish(),
        }
    };
    let mut parts = Vec::new();
    loop {
        let headers = match dec.next_part() {
            Ok(Step::Ready(Some(h))) => h,
            Ok(Step::Ready(None)) => return (parts, Ok(())),
            Ok(Step::NeedInput) => {
                feed(&mut dec);
                continue;
            }
            Err(e) => return (parts, Err(e)),
        };
        let mut data = Vec::new();
        loop {
            match dec.next_chunk() {
                Ok(Step::Ready(Some(c))) => {
                    assert!(!c.is_empty(), "an empty piece of data");
                    data.extend_from_slice(&c);
                }
                Ok(Step::Ready(None)) => break,
                Ok(Step::NeedInput) => feed(&mut dec),
                Err(e) => {
                    parts.push((headers, data));
                    return (parts, Err(e));
                }
            }
        }
        parts.push((headers, data));
    }
}

/// A `multipart/form-data` upload body: byte 0 picks the boundary, bytes 1 to 4 the sizes
/// of the chunks it arrives in (each plus one, cycled), the rest is the body. The decoder never panics,
/// holds no more than its bound while waiting for input (refusing with its error instead),
/// yields data that is the body's own (never more than the body holds), and yields the
/// same parts, the same data and the same end however the body is split: as one chunk and
/// as the chosen chunks.
pub fn multipart(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let boundary = BOUNDARIES[pick as usize % BOUNDARIES.len()];
    let (sizes, body) = rest.split_at(rest.len().min(4));
    let mut chunks = Vec::new();
    let mut left = body;
    for s in sizes.iter().cycle() {
        if left.is_empty() {
            break;
        }
        let (a, b) = left.split_at((*s as usize + 1).min(left.len()));
        chunks.push(a);
        left = b;
    }
    let whole = multipart_transcript(boundary, [body]);
    let split = multipart_transcript(boundary, chunks);
    assert_eq!(split, whole, "the parts differ with the body split");
    let total: usize = whole.0.iter().map(|(_, d)| d.len()).sum();
    assert!(total <= body.len(), "more data than the body holds");
    for (_, d) in &whole.0 {
        assert!(
            d.is_empty() || body.windows(d.len()).any(|w| w == &d[..]),
            "part data that is not in the body"
        );
    }
}

/// A session log whose tail is arbitrary bytes (a crash, a disk error, an attacker with
/// write access to the state dir): opening it either refuses with an error or repairs it
/// into a file whose every line is a JSON event, ending with a newline. Never a panic.
pub fn session_log_tail(data: &[u8]) {
    use tether_session_log::{LogConfig, SessionLog};
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    rt.block_on(async {
        let cfg = || LogConfig {
            fsync: false,
            ..LogConfig::default()
        };
        let params = tether_protocol::events::SessionParams {
            provider: "local".into(),
            template: None,
            env: Default::default(),
            network: false,
            metadata: Default::default(),
            owner: None,
            expiry: Default::default(),
            limits: Default::default(),
            ports: Default::default(),
            snapshot: None,
            lifecycle: Default::default(),
            egress: Default::default(),
        };
        let header = SessionLog::new_header("fuzz", params);
        let Ok(log) = SessionLog::create(dir.path(), header, cfg()).await else {
            return;
        };
        log.close().await;
        drop(log);
        let path = dir.path().join("events.jsonl");
        let Ok(mut bytes) = std::fs::read(&path) else {
            return;
        };
        bytes.extend_from_slice(data);
        if std::fs::write(&path, &bytes).is_err() {
            return;
        }
        if let Ok((log, _report)) = SessionLog::open(dir.path(), cfg()).await {
            log.close().await;
            let text = std::fs::read(&path).expect("the repaired log is readable");
            assert!(text.ends_with(b"\n"), "a repaired log ends with a newline");
            for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                serde_json::from_slice::<serde_json::Value>(line)
                    .expect("every line of a repaired log is JSON");
            }
        }
    });
}
