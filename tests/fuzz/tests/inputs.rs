//! The fuzz targets, bounded: every seed, then a fixed number of mutations of each (bit
//! flips, byte changes, truncations, duplications, splices), from a fixed seed so that a
//! failure reproduces. Coverage-guided runs are cargo-fuzz's (see the crate docs).

use tether_fuzz::{connect_frames, e2b_requests, multipart, native_requests, session_log_tail};

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
fn native_requests_never_panic_and_round_trip() {
    let seeds: Vec<Vec<u8>> = [
        // Bodies.
        r#"{"provider":"local","template":"base","ttl_s":600,"env":{"LANG":"C.UTF-8"},"metadata":{"owner":"ci"},"network":false,"limits":{"memory_bytes":536870912,"pids":256,"cpu_millis":1500,"disk_bytes":1073741824}}"#,
        "{}",
        r#"{"calls":[{"id":"c1","name":"bash","arguments":{"command":"ls -la","timeout_ms":5000}},{"id":"c2","name":"read_file","arguments":{"path":"/home/user/a.txt","n":[1,2.5,-0.0,1e300,18446744073709551615]}}]}"#,
        r#"{"role":"user","content":"list the files \u00e9\ud83d\ude00\n"}"#,
        r#"{"at_seq":42}"#,
        r#"{"cmd":"echo hi","cwd":"/tmp","env":{"A":"1","B":null},"stdin":{"mode":"data","data":"aGkK"},"timeout_ms":30000,"idle_timeout_ms":5000,"pty":{"rows":24,"cols":80},"command_id":"cmd-1"}"#,
        r#"{"argv":["/bin/sh","-c","cat"],"stdin":{"mode":"pipe"}}"#,
        r#"{"data":"aGVsbG8K","eof":true}"#,
        r#"{"signal":"terminate"}"#,
        // Queries.
        "after=12&follow=true",
        "offset=1024&stderr_offset=7&follow=false",
        "path=%2Fhome%2Fuser%2Fa%20b.txt&offset=0&length=4096",
        "path=/home/user&depth=3&recursive=true",
        "path=a+b%26c%3D&path=twice",
        // Malformed.
        r#"{"calls":[{"id":"c1","name":"bash","arguments":{"a":1},"extra":true}]}"#,
        r#"{"data":"not base64!"}"#,
        r#"{"at_seq":-1}"#,
        "after=%FF%FE&follow=yes",
        "",
        "null",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    run(native_requests, &seeds, MUTATIONS);
}

/// A multipart target input: the boundary's index, the chunk sizes (less one), the body.
fn upload(boundary: u8, sizes: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut v = vec![boundary];
    v.extend_from_slice(&sizes);
    v.extend_from_slice(body);
    v
}

#[test]
fn multipart_bodies_decode_alike_however_split() {
    let one = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/dir/a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ--\r\n";
    let two = b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n\x00\x01\r\n--X\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b \\\"q\\\".txt\"\r\n\r\nsecond\r\n--XyZ--\r\nepilogue";
    let webkit = b"------WebKitFormBoundary7MA4YWxkTrZu0gW\r\nContent-Disposition: form-data; name=\"path\"\r\n\r\n/tmp/x\r\n------WebKitFormBoundary7MA4YWxkTrZu0gW\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x%22y%0A.txt\"\r\n\r\ndata\r\n------WebKitFormBoundary7MA4YWxkTrZu0gW--";
    // Line ends as a sloppy client writes them: LF only, padding after a delimiter.
    let lf = b"--a\nContent-Disposition: form-data; name=\"file\"\n\nx\n--a--\n";
    let padded = b"--a  \t\r\ncontent-disposition: form-data; name=file; filename=plain.txt\r\n\r\nx\r\n--a--";
    let unterminated = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cut\"\r\n\r\nthe body stops here\r\n--Xy";
    let no_close = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc\r\n--XyZ";
    // Found by this target: a 20 KiB header block, refused in small chunks, was taken
    // in one.
    let mut huge =
        b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"h\"\r\nX-Pad: "
            .to_vec();
    huge.extend(std::iter::repeat_n(b'p', 20 * 1024));
    huge.extend_from_slice(b"\r\n\r\ndata\r\n--XyZ--\r\n");
    // Header blocks of exactly the limit and one byte over.
    let headers_of = |len: usize| {
        let mut v = b"--XyZ\r\nX-Pad: ".to_vec();
        v.resize(5 + len, b'p');
        v.extend_from_slice(b"\r\n\r\ndata\r\n--XyZ--\r\n");
        v
    };
    let limit = tether_protocol::multipart::MAX_HEADER_BYTES;
    let seeds = vec![
        upload(0, [255, 255, 255, 255], one),
        upload(0, [0, 3, 17, 200], one),
        upload(0, [6, 0, 1, 90], two),
        upload(1, [40, 41, 0, 2], webkit),
        upload(2, [0, 0, 0, 0], lf),
        upload(2, [1, 2, 3, 4], padded),
        upload(0, [9, 9, 9, 9], unterminated),
        upload(0, [4, 4, 4, 4], no_close),
        upload(3, [0, 1, 2, 3], b"no delimiter at all"),
        upload(0, [127, 255, 63, 200], &huge),
        upload(0, [255, 255, 255, 255], &headers_of(limit)),
        upload(0, [200, 255, 31, 255], &headers_of(limit + 1)),
        vec![0],
        vec![],
    ];
    run(multipart, &seeds, MUTATIONS);
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
