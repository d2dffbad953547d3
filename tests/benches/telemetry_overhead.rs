//! Tool-call latency with trace and metric export on versus off, from one run: two
//! tetherd processes side by side, one exporting over OTLP/HTTP to the real receiver, one
//! with telemetry off; calls alternate between them so machine noise hits both alike.
//!
//! `cargo bench -p tether-tests --bench telemetry_overhead`

// A benchmark: a panic is how it reports a failed setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tether_tests::otlp::OtlpReceiver;
use tether_tests::{free_port, wait_until, workspace_bin};
use tokio::time::Instant;

const N: usize = 300;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(bin: &std::path::Path, state: &std::path::Path, port: u16, otlp: Option<&str>) -> Child {
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--state-dir",
    ])
    .arg(state)
    .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    if let Some(ep) = otlp {
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", ep)
            .env("OTEL_SERVICE_NAME", "tetherd-bench");
    }
    Child(cmd.spawn().expect("spawn tetherd"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let bin = workspace_bin("tetherd");
    let rx = OtlpReceiver::start();
    let (sa, sb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (pa, pb) = (free_port(), free_port());
    let _on = spawn(&bin, sa.path(), pa, Some(&rx.http_endpoint()));
    let _off = spawn(&bin, sb.path(), pb, None);
    let http = reqwest::Client::new();
    let mut sessions = Vec::new();
    for port in [pa, pb] {
        let base = format!("http://127.0.0.1:{port}");
        wait_until("tetherd health", Duration::from_secs(30), || {
            let http = http.clone();
            let url = format!("{base}/v1/health");
            async move {
                http.get(url)
                    .send()
                    .await
                    .map(|r| r.status().is_success())
                    .unwrap_or(false)
            }
        })
        .await;
        let s: Value = http
            .post(format!("{base}/v1/sessions"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let sid = s["id"].as_str().unwrap().to_owned();
        let url = format!("{base}/v1/sessions/{sid}/tool-calls");
        http.post(&url)
            .json(&json!({"calls": [{"id": "seed", "name": "write_file", "arguments": {"path": "f.txt", "content": "x".repeat(4096)}}]}))
            .send()
            .await
            .unwrap();
        sessions.push(url);
    }
    let mut rows = Vec::new();
    for (label, tool, args) in [
        ("bash true", "bash", json!({"command": "true"})),
        ("read_file 4 KiB", "read_file", json!({"path": "f.txt"})),
    ] {
        let mut on = Vec::new();
        let mut off = Vec::new();
        for i in 0..N {
            for (k, url) in sessions.iter().enumerate() {
                let body = json!({"calls": [{"id": format!("{tool}-{i}"), "name": tool, "arguments": args}]});
                let t = Instant::now();
                let r = http.post(url).json(&body).send().await.unwrap();
                assert!(r.status().is_success());
                let _ = r.bytes().await.unwrap();
                if k == 0 {
                    on.push(t.elapsed())
                } else {
                    off.push(t.elapsed())
                }
            }
        }
        rows.push((
            label,
            tether_tests::latency_ms(on),
            tether_tests::latency_ms(off),
        ));
    }
    let spans = rx
        .wait_for_spans(
            |s| s.iter().any(|x| x["name"] == "tool.call"),
            Duration::from_secs(20),
        )
        .await;
    println!(
        "tool-call latency with OTLP export on vs off, {N} calls each, alternating (ms; p50 / p95 / mean)"
    );
    println!(
        "{:<16} {:>26} {:>26} {:>10}",
        "tool", "export on", "export off", "overhead"
    );
    for (label, a, b) in rows {
        println!(
            "{:<16} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>+9.1}%",
            label,
            a.0,
            a.1,
            a.2,
            b.0,
            b.1,
            b.2,
            (a.0 / b.0 - 1.0) * 100.0
        );
    }
    println!(
        "spans received by the OTLP receiver during the run: {}",
        spans.len()
    );
}
