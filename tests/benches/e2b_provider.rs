//! The E2B provider against the official Python SDK, on the same backend (tetherd's E2B
//! front, in-process, serving the local provider), with the local provider called
//! directly as the floor, in one run, side by side:
//!
//! - `exec true` latency (`bash -lc true`, start to exit status), p50 / p95 / mean;
//! - 64 MiB file write and read throughput, median of a few rounds.
//!
//! `cargo bench -p tether-tests --bench e2b_provider` (the Python SDK comes from
//! `.venv-e2b`, made by `tests/e2b_sdk/setup.sh`; without it that column reads n/a).

// A benchmark stops at the first broken measurement, loudly.
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::{ByteStream, CallCtx, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_e2b::{E2bConfig, E2bProvider};
use tether_tests::TestDaemon;
use tokio::time::Instant;

const EXEC_N: usize = 100;
const FILE_BYTES: usize = 64 * 1024 * 1024;
const FILE_ROUNDS: usize = 3;

const PY_BENCH: &str = r#"
import json, os, sys, time
os.environ["E2B_DEBUG"] = "false"
from e2b import Sandbox
n, size, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sb = Sandbox.create(timeout=600)
try:
    sb.commands.run("true")
    lat = []
    for _ in range(n):
        t = time.perf_counter(); sb.commands.run("true"); lat.append(time.perf_counter() - t)
    data = bytes((i * 2654435761 >> 24) & 0xff for i in range(4096)) * (size // 4096)
    w, r = [], []
    for _ in range(rounds):
        t = time.perf_counter(); sb.files.write("/home/user/bench-py.bin", data); w.append(time.perf_counter() - t)
        t = time.perf_counter(); back = sb.files.read("/home/user/bench-py.bin", format="bytes"); r.append(time.perf_counter() - t)
        assert bytes(back) == data, "read-back differs"
    print(json.dumps({"exec_s": lat, "write_s": w, "read_s": r}))
finally:
    sb.kill()
"#;

#[derive(Debug, Default, Clone)]
struct Row {
    exec: Option<(f64, f64, f64)>,
    write_mib_s: Option<f64>,
    read_mib_s: Option<f64>,
}

fn secs(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn throughput(v: Vec<Duration>) -> f64 {
    FILE_BYTES as f64 / (1024.0 * 1024.0) / secs(v.iter().map(Duration::as_secs_f64).collect())
}

fn payload() -> Bytes {
    let block: Vec<u8> = (0..4096u64)
        .map(|i| ((i * 2_654_435_761) >> 24) as u8)
        .collect();
    Bytes::from(block.repeat(FILE_BYTES / 4096))
}

fn chunks(data: &Bytes) -> ByteStream {
    let parts: Vec<_> = (0..data.len())
        .step_by(1 << 20)
        .map(|i| Ok(data.slice(i..(i + (1 << 20)).min(data.len()))))
        .collect();
    futures_util::stream::iter(parts).boxed()
}

/// The Rust side: the same three measurements on any provider's sandbox.
async fn measure(sb: &dyn Sandbox) -> Row {
    let ctx = CallCtx::new("bench");
    let run_true = || async {
        let h = sb
            .process()
            .spawn(&ctx, ProcessSpec::shell("true"))
            .await
            .expect("spawn");
        let mut ev = h.events(StreamOffsets::default());
        while let Some(e) = ev.next().await {
            if matches!(e.expect("event"), ProcessEvent::Exited { .. }) {
                break;
            }
        }
    };
    run_true().await;
    let mut lat = Vec::with_capacity(EXEC_N);
    for _ in 0..EXEC_N {
        let t = Instant::now();
        run_true().await;
        lat.push(t.elapsed());
    }
    let data = payload();
    let (mut w, mut r) = (Vec::new(), Vec::new());
    for _ in 0..FILE_ROUNDS {
        let t = Instant::now();
        sb.fs()
            .write(&ctx, "bench-rs.bin", chunks(&data), WriteGuard::None)
            .await
            .expect("write");
        w.push(t.elapsed());
        let t = Instant::now();
        let mut s = sb
            .fs()
            .read(&ctx, "bench-rs.bin", ByteRange::default())
            .await
            .expect("read");
        let mut back = Vec::with_capacity(FILE_BYTES);
        while let Some(c) = s.next().await {
            back.extend_from_slice(&c.expect("chunk"));
        }
        r.push(t.elapsed());
        assert!(back == data, "read-back differs");
    }
    Row {
        exec: Some(tether_tests::latency_ms(lat)),
        write_mib_s: Some(throughput(w)),
        read_mib_s: Some(throughput(r)),
    }
}

fn python() -> Option<PathBuf> {
    let root = tether_tests::workspace_root();
    let py = root.join(".venv-e2b/bin/python");
    let has_sdk = |py: &PathBuf| {
        std::process::Command::new(py)
            .args(["-c", "import e2b"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !has_sdk(&py) {
        let _ = std::process::Command::new("bash")
            .arg(root.join("tests/e2b_sdk/setup.sh"))
            .status();
    }
    has_sdk(&py).then_some(py)
}

async fn measure_python(base: &str) -> Row {
    let Some(py) = python() else {
        eprintln!("the E2B Python SDK is not installed (.venv-e2b): its column reads n/a");
        return Row::default();
    };
    let out = tokio::process::Command::new(py)
        .args([
            "-c",
            PY_BENCH,
            &EXEC_N.to_string(),
            &FILE_BYTES.to_string(),
            &FILE_ROUNDS.to_string(),
        ])
        .env("E2B_API_URL", base)
        .env("E2B_SANDBOX_URL", base)
        .env("E2B_API_KEY", "e2b_tether_bench")
        .output()
        .await
        .expect("run python");
    if !out.status.success() {
        eprintln!(
            "the Python SDK run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return Row::default();
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("the Python SDK's results");
    let list = |k: &str| {
        v[k].as_array()
            .map(|a| {
                a.iter()
                    .filter_map(serde_json::Value::as_f64)
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let lat: Vec<Duration> = list("exec_s")
        .into_iter()
        .map(Duration::from_secs_f64)
        .collect();
    let mib = |s: f64| FILE_BYTES as f64 / (1024.0 * 1024.0) / s;
    Row {
        exec: Some(tether_tests::latency_ms(lat)),
        write_mib_s: Some(mib(secs(list("write_s")))),
        read_mib_s: Some(mib(secs(list("read_s")))),
    }
}

fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "n/a".to_owned(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // The floor: the local provider, called directly.
    let dir = tempfile::tempdir().expect("tempdir");
    let helper = tether_tests::workspace_bin("tetherd");
    let mut lc = tether_provider_local::LocalConfig::with_root(dir.path().join("direct"));
    lc.confine_helper = Some(helper.clone());
    let local = Arc::new(tether_provider_local::LocalProvider::new(lc).expect("local provider"));
    let ctx = CallCtx::new("bench");
    let lsb = local
        .create(&ctx, SandboxSpec::default())
        .await
        .expect("local sandbox");
    let floor = measure(lsb.as_ref()).await;
    local.destroy(&ctx, &lsb.info().id).await.expect("destroy");

    // tether's E2B provider and the Python SDK, against the same in-process E2B front.
    // The daemon's own local provider confines through the same helper (a bench binary
    // is not one).
    let d = TestDaemon::start_with(|c| {
        let local = tether_provider_local::LocalConfig {
            confine_helper: Some(helper.clone()),
            ..Default::default()
        };
        c.providers.insert(
            "local".into(),
            tether_daemon::config::ProviderConfig::Local(local),
        );
    })
    .await;
    let cfg = E2bConfig {
        api_url: Some(d.base.clone()),
        sandbox_url: Some(d.base.clone()),
        api_key: Some("e2b_tether_bench".into()),
        inherit_env: false,
        ..E2bConfig::default()
    };
    let e2b = E2bProvider::new(cfg).expect("e2b provider");
    let esb = e2b
        .create(&ctx, SandboxSpec::default())
        .await
        .expect("e2b sandbox");
    let ours = measure(esb.as_ref()).await;
    e2b.destroy(&ctx, &esb.info().id).await.expect("destroy");
    let sdk = measure_python(&d.base).await;

    println!(
        "E2B provider vs the official Python SDK, one run, same in-process tetherd E2B front (local provider behind it)"
    );
    println!(
        "exec true: {EXEC_N} runs, ms (p50 / p95 / mean); files: {} MiB, median of {FILE_ROUNDS} rounds, MiB/s",
        FILE_BYTES >> 20
    );
    println!(
        "{:<22} {:>28} {:>28} {:>28} {:>14} {:>14}",
        "operation",
        "local provider (floor)",
        "tether E2B provider",
        "E2B Python SDK",
        "tether/floor",
        "SDK/tether"
    );
    let lat = |r: &Row| {
        r.exec.map_or_else(
            || "n/a".to_owned(),
            |(a, b, c)| format!("{a:.2} / {b:.2} / {c:.2}"),
        )
    };
    let p50 = |r: &Row| r.exec.map(|e| e.0);
    println!(
        "{:<22} {:>28} {:>28} {:>28} {:>14} {:>14}",
        "exec true (latency)",
        lat(&floor),
        lat(&ours),
        lat(&sdk),
        ratio(p50(&ours), p50(&floor)),
        ratio(p50(&sdk), p50(&ours))
    );
    for (name, get) in [
        (
            "write 64 MiB (MiB/s)",
            (|r: &Row| r.write_mib_s) as fn(&Row) -> Option<f64>,
        ),
        ("read 64 MiB (MiB/s)", |r: &Row| r.read_mib_s),
    ] {
        println!(
            "{:<22} {:>28} {:>28} {:>28} {:>14} {:>14}",
            name,
            cell(get(&floor)),
            cell(get(&ours)),
            cell(get(&sdk)),
            // Throughput: how much of the floor's speed tether keeps, and how the SDK compares.
            ratio(get(&ours), get(&floor)),
            ratio(get(&sdk), get(&ours))
        );
    }
    d.stop().await;
}
