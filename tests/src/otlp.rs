//! A real OTLP receiver for end-to-end tests: `tests/otlp/otlp_receiver.py`, built on the
//! official OpenTelemetry protobuf definitions and grpcio, run as a child process on
//! ephemeral ports.
//!
//! It takes OTLP/HTTP (protobuf and JSON) and OTLP/gRPC, for traces and metrics, and writes
//! every span and every metric data point as a JSON line; [`OtlpReceiver`] reads those lines
//! back. Its Python environment (`<repo>/.venv-otlp`) is created on first use by
//! `tests/otlp/setup.sh`; set `TETHER_OTLP_PYTHON` to use another interpreter.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

/// How long the receiver may take to print READY (a cold venv import takes well under this).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A running receiver; killed on drop.
#[derive(Debug)]
pub struct OtlpReceiver {
    child: Child,
    http: SocketAddr,
    grpc: SocketAddr,
    spans_path: PathBuf,
    metrics_path: PathBuf,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

// === impl OtlpReceiver ===

impl OtlpReceiver {
    /// Start a receiver on free ports (it binds port 0 and reports the ports it got, so
    /// there is no window in which another process could take them). Panics if it cannot.
    pub fn start() -> Self {
        let python = python();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let spans_path = dir.path().join("spans.jsonl");
        let metrics_path = dir.path().join("metrics.jsonl");
        let log_path = dir.path().join("receiver.log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", log_path.display()));
        let script = crate::workspace_root().join("tests/otlp/otlp_receiver.py");
        let mut child = Command::new(&python)
            .arg(&script)
            .args([
                "--host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
            ])
            .arg("--out")
            .arg(&spans_path)
            .arg("--metrics-out")
            .arg(&metrics_path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} {}: {e}", python.display(), script.display()));

        // Read the READY line on a thread so that a receiver that hangs cannot hang the test.
        let stdout = child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("receiver stdout not piped"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = tx.send(first);
            // Keep draining so the receiver never blocks on a full pipe.
            for _ in lines {}
        });
        let ready = match rx.recv_timeout(READY_TIMEOUT) {
            Ok(Some(line)) => line,
            other => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "OTLP receiver did not become ready ({other:?}); its log:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
        };
        let (http, grpc) =
            parse_ready(&ready).unwrap_or_else(|| panic!("unexpected receiver banner: {ready:?}"));
        Self {
            child,
            http,
            grpc,
            spans_path,
            metrics_path,
            log_path,
            _dir: dir,
        }
    }

    /// The OTLP/HTTP base URL, `http://127.0.0.1:PORT` (the signal paths `/v1/traces` and
    /// `/v1/metrics` are appended by whoever needs them).
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The OTLP/gRPC endpoint, `http://127.0.0.1:PORT`.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<Value> {
        read_jsonl(&self.spans_path)
    }

    /// Every metric data point received so far, in arrival order.
    pub fn metrics(&self) -> Vec<Value> {
        read_jsonl(&self.metrics_path)
    }

    /// The receiver's stderr so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Wait until `pred` holds for the spans received, and return them. Panics with what
    /// was received if `timeout` passes first.
    pub async fn wait_for_spans(
        &self,
        pred: impl Fn(&[Value]) -> bool,
        timeout: Duration,
    ) -> Vec<Value> {
        self.wait_for("spans", || self.spans(), pred, timeout).await
    }

    /// Wait until `pred` holds for the metric data points received, and return them.
    pub async fn wait_for_metrics(
        &self,
        pred: impl Fn(&[Value]) -> bool,
        timeout: Duration,
    ) -> Vec<Value> {
        self.wait_for("metrics", || self.metrics(), pred, timeout)
            .await
    }

    async fn wait_for(
        &self,
        what: &str,
        read: impl Fn() -> Vec<Value>,
        pred: impl Fn(&[Value]) -> bool,
        timeout: Duration,
    ) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let got = read();
            if pred(&got) {
                return got;
            }
            if tokio::time::Instant::now() >= deadline {
                let shown: Vec<String> = got.iter().map(Value::to_string).collect();
                panic!(
                    "timed out after {timeout:?} waiting for {what}; received {}:\n{}\nreceiver log:\n{}",
                    got.len(),
                    shown.join("\n"),
                    self.log()
                );
            }
            // The receiver appends to a file: polling it is the only signal there is.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Find a span by name.
pub fn span<'a>(spans: &'a [Value], name: &str) -> Option<&'a Value> {
    spans.iter().find(|s| s["name"] == name)
}

/// Find a metric data point by name and attributes (every given attribute must match).
pub fn metric_point<'a>(
    points: &'a [Value],
    name: &str,
    attrs: &[(&str, &str)],
) -> Option<&'a Value> {
    points
        .iter()
        .rev()
        .find(|p| p["name"] == name && attrs.iter().all(|(k, v)| p["attributes"][*k] == *v))
}

/// The interpreter of the receiver's venv, created (once per process, under a file lock
/// across processes) by `tests/otlp/setup.sh`.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("TETHER_OTLP_PYTHON") {
        return PathBuf::from(p);
    }
    static READY: OnceLock<PathBuf> = OnceLock::new();
    READY
        .get_or_init(|| {
            let root = crate::workspace_root();
            let setup = root.join("tests/otlp/setup.sh");
            let out = Command::new("bash")
                .arg(&setup)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("run {}: {e}", setup.display()));
            assert!(
                out.status.success(),
                "{} failed:\n{}{}",
                setup.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            root.join(".venv-otlp/bin/python")
        })
        .clone()
}

/// Parse `READY http=127.0.0.1:P1 grpc=127.0.0.1:P2`.
fn parse_ready(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let mut http = None;
    let mut grpc = None;
    let mut words = line.split_whitespace();
    if words.next()? != "READY" {
        return None;
    }
    for w in words {
        if let Some(a) = w.strip_prefix("http=") {
            http = a.parse().ok();
        } else if let Some(a) = w.strip_prefix("grpc=") {
            grpc = a.parse().ok();
        }
    }
    Some((http?, grpc?))
}

/// Complete lines only: the receiver may be mid-write of the last one.
fn read_jsonl(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad receiver line {l:?}: {e}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line_parses() {
        let (h, g) = parse_ready("READY http=127.0.0.1:4318 grpc=127.0.0.1:4317").unwrap();
        assert_eq!((h.port(), g.port()), (4318, 4317));
        assert!(parse_ready("NOT READY").is_none());
        assert!(parse_ready("READY http=127.0.0.1:1").is_none());
    }
}
