//! Fuzz targets: each takes arbitrary bytes, must never panic, and checks what must hold
//! for any input. The test suite runs them bounded over seeds and their mutations
//! (`tests/inputs.rs`); `harness/` runs them coverage-guided under cargo-fuzz:
//!
//! ```sh
//! cd tests/fuzz/harness && cargo +nightly fuzz run connect_frames -- -max_total_time=60
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
