//! The fuzz targets, bounded: every seed, then a fixed number of mutations of each (bit
//! flips, byte changes, truncations, duplications, splices), from a fixed seed so that a
//! failure reproduces. Coverage-guided runs are cargo-fuzz's (see the crate docs).

use tether_fuzz::{connect_frames, e2b_requests, session_log_tail};

/// Mutations per seed.
const MUTATIONS: usize = 400;

/// xorshift64*: a small deterministic generator (no dependency for a test's dice).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..=rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            3 if !v.is_empty() => {
                let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                let (a, b) = (a.min(b), a.max(b));
                let part = v[a..b].to_vec();
                v.splice(b..b, part);
            }
            4 => {
                let o = &others[rng.below(others.len())];
                let at = rng.below(v.len() + 1);
                v.splice(at..at, o.iter().copied());
            }
            _ => {
                let at = rng.below(v.len() + 1);
                v.insert(at, [0u8, 0xff, b'{', b'"', b'\n', 0x02][rng.below(6)]);
            }
        }
    }
    v
}

fn run(target: fn(&[u8]), seeds: &[Vec<u8>], mutations: usize) {
    let mut rng = Rng(0x7e7e_0001_dead_beef);
    for s in seeds {
        target(s);
        for _ in 0..mutations {
            target(&mutate(&mut rng, s, seeds));
        }
    }
}

fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

#[test]
fn connect_frames_never_panic() {
    let mut stream = vec![3, 9, 1, 40];
    stream.extend(envelope(0, br#"{"event":{"start":{"pid":7}}}"#));
    stream.extend(envelope(0, br#"{"event":{"data":{"stdout":"aGkK"}}}"#));
    stream.extend(envelope(
        2,
        br#"{"error":{"code":"deadline_exceeded","message":"x"}}"#,
    ));
    let seeds = vec![
        stream,
        envelope(2, b""),
        envelope(1, b"compressed"),
        vec![0, 0xff, 0xff, 0xff, 0xff],
        envelope(0x80, b"{}"),
    ];
    run(connect_frames, &seeds, MUTATIONS);
}

#[test]
fn e2b_requests_never_panic() {
    let seeds: Vec<Vec<u8>> = [
        r#"{"templateID":"base","timeout":300,"metadata":{"a":"b"},"envVars":{"X":"1"},"autoPause":false}"#,
        r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"b"},"cwd":"/tmp"},"pty":{"size":{"rows":24,"cols":80}},"tag":"t"}"#,
        r#"{"process":{"pid":12},"input":{"stdin":"aGkK"}}"#,
        r#"{"process":{"tag":"t"},"signal":"SIGNAL_SIGKILL"}"#,
        r#"{"accessToken":"tok","envVars":{"A":"1"},"timestamp":"2026-12-01T00:00:00Z","tetherEntropy":"AAAA"}"#,
        r#"{"source":"/a","destination":"/b"}"#,
        r#"{"path":"~/x"}"#,
        "",
        "null",
        "[]",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    run(e2b_requests, &seeds, MUTATIONS);
}

#[test]
fn a_session_log_with_any_tail_is_refused_or_repaired_never_a_panic() {
    let seeds: Vec<Vec<u8>> = [
        "{\"seq\":1,\"ts_ms\":1,\"type\":\"user/message\",\"data\":{\"content\":\"hi\",\"source\":\"user\"}}\n",
        "{\"seq\":1,\"ts_ms\":1,\"type\":\"turn/start\",\"data\":{\"turn\":1,\"call_ids\":[\"c1\"]}}\n{\"seq\":2,\"ts_ms\":2,\"type\":\"tool/call\",\"data\":{\"call_id\":\"c1\",\"name\":\"bash\",\"arguments\":{}}}\n",
        "{\"seq\":1,\"ts_ms\":1,\"type\":\"user/mess",
        "\n\n",
        "garbage",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    // Each input opens a real log on disk: fewer mutations.
    run(session_log_tail, &seeds, MUTATIONS / 8);
}
