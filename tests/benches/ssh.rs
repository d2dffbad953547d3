//! The SSH provider against OpenSSH's own command-line clients on the same server (a
//! throwaway sshd in a network namespace, `tether_tests::ssh_host`), interleaved in one
//! run so that both see the same machine:
//!
//! - `exec true` latency, start to exit status: the provider (a pooled connection, one
//!   channel per command, the journaling wrapper) vs `ssh host true` (a new connection per
//!   command, as a script calling the CLI gets), medians and p99;
//! - 64 MiB write and read throughput: the provider's SFTP (pipelined requests, atomic
//!   publication) vs `sftp -b` `put` / `get`, medians and p99.
//!
//! `cargo bench -p tether-tests --bench ssh` (as root: it makes a network namespace and
//! a user). Prints one table and the ratios (provider / CLI; above 1 is faster for
//! throughput, below 1 is faster for latency).

// A benchmark stops at the first broken measurement, loudly.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::process::Command;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::fs::{ByteRange, WriteGuard};
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::{CallCtx, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_ssh::SshProvider;
use tether_tests::ssh_host::SshHost;
use tokio::time::Instant;

const EXEC_N: usize = 60;
const FILE_BYTES: usize = 64 * 1024 * 1024;
const FILE_ROUNDS: usize = 5;

fn ctx() -> CallCtx {
    CallCtx::new("bench")
}

/// Median and p99 of samples (seconds).
fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (p(0.5), p(0.99))
}

fn ssh_base(host: &SshHost) -> Vec<String> {
    vec![
        "-i".into(),
        host.key.display().to_string(),
        "-o".into(),
        format!("UserKnownHostsFile={}", host.known_hosts.display()),
        "-o".into(),
        "StrictHostKeyChecking=yes".into(),
        "-o".into(),
        "BatchMode=yes".into(),
        "-o".into(),
        "LogLevel=ERROR".into(),
    ]
}

fn cli_exec(host: &SshHost) -> f64 {
    let t = Instant::now();
    let st = Command::new("ssh")
        .args(ssh_base(host))
        .args(["-p", &host.addr.port().to_string()])
        .arg(format!("{}@{}", host.user, host.addr.ip()))
        .arg("true")
        .status()
        .expect("ssh");
    assert!(st.success(), "ssh true failed");
    t.elapsed().as_secs_f64()
}

/// `ssh host true` over an already open master connection (`ControlMaster`): the CLI's
/// best case, with the handshake paid once.
fn cli_exec_mux(host: &SshHost, sock: &std::path::Path) -> f64 {
    let t = Instant::now();
    let st = Command::new("ssh")
        .args(ssh_base(host))
        .arg("-S")
        .arg(sock)
        .args(["-p", &host.addr.port().to_string()])
        .arg(format!("{}@{}", host.user, host.addr.ip()))
        .arg("true")
        .status()
        .expect("ssh");
    assert!(st.success(), "ssh -S true failed");
    t.elapsed().as_secs_f64()
}

fn cli_sftp(host: &SshHost, batch: &str) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = dir.path().join("batch");
    std::fs::write(&b, batch).expect("batch");
    let t = Instant::now();
    let out = Command::new("sftp")
        .args(ssh_base(host))
        .args(["-P", &host.addr.port().to_string(), "-b"])
        .arg(&b)
        .arg(format!("{}@{}", host.user, host.addr.ip()))
        .output()
        .expect("sftp");
    assert!(
        out.status.success(),
        "sftp failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed().as_secs_f64()
}

async fn provider_exec(sb: &dyn Sandbox) -> f64 {
    let t = Instant::now();
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::argv(["true"]))
        .await
        .expect("spawn");
    let mut ev = h.events(StreamOffsets::default());
    let mut code = None;
    while let Some(e) = ev.next().await {
        if let ProcessEvent::Exited { status, .. } = e.expect("event") {
            code = status.code;
        }
    }
    assert_eq!(code, Some(0));
    t.elapsed().as_secs_f64()
}

#[allow(clippy::print_stdout)]
fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let host = SshHost::start().await;
        let cfg = host.provider_config("b");
        let p = Arc::new(SshProvider::new(cfg).expect("provider"));
        let sb = p.create(&ctx(), SandboxSpec::default()).await.expect("create");
        let ws = sb.info().workspace;
        // A master connection for the multiplexed CLI row.
        let mux_dir = tempfile::tempdir().expect("tempdir");
        let sock = mux_dir.path().join("mux");
        let st = Command::new("ssh")
            .args(ssh_base(&host))
            .args(["-M", "-f", "-N", "-S"])
            .arg(&sock)
            .args(["-p", &host.addr.port().to_string()])
            .arg(format!("{}@{}", host.user, host.addr.ip()))
            .status()
            .expect("ssh -M");
        assert!(st.success(), "ssh master failed");
        // Warm every path once.
        provider_exec(sb.as_ref()).await;
        cli_exec(&host);
        cli_exec_mux(&host, &sock);

        let (mut pe, mut ce, mut me) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..EXEC_N {
            pe.push(provider_exec(sb.as_ref()).await);
            ce.push(cli_exec(&host));
            me.push(cli_exec_mux(&host, &sock));
        }
        let _ = Command::new("ssh")
            .args(ssh_base(&host))
            .arg("-S")
            .arg(&sock)
            .args(["-O", "exit"])
            .arg(format!("{}@{}", host.user, host.addr.ip()))
            .output();

        let data: Bytes = (0..FILE_BYTES)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect::<Vec<u8>>()
            .into();
        let local = tempfile::tempdir().expect("tempdir");
        let src = local.path().join("src.bin");
        let dst = local.path().join("dst.bin");
        std::fs::write(&src, &data).expect("src");
        let (mut pw, mut pr, mut cw, mut cr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..FILE_ROUNDS {
            let t = Instant::now();
            let chunks: Vec<tether_provider::Result<Bytes>> = (0..FILE_BYTES)
                .step_by(1 << 20)
                .map(|o| Ok(data.slice(o..(o + (1 << 20)).min(FILE_BYTES))))
                .collect();
            let w = sb
                .fs()
                .write(
                    &ctx(),
                    "bench.bin",
                    futures_util::stream::iter(chunks).boxed(),
                    WriteGuard::None,
                )
                .await
                .expect("write");
            pw.push(t.elapsed().as_secs_f64());
            assert_eq!(w.size, FILE_BYTES as u64);
            let t = Instant::now();
            let mut s = sb
                .fs()
                .read(&ctx(), "bench.bin", ByteRange::default())
                .await
                .expect("read");
            let mut n = 0usize;
            let mut same = true;
            while let Some(c) = s.next().await {
                let c = c.expect("chunk");
                same &= c[..] == data[n..n + c.len()];
                n += c.len();
            }
            pr.push(t.elapsed().as_secs_f64());
            assert!(same && n == FILE_BYTES, "read-back differs");

            cw.push(cli_sftp(
                &host,
                &format!("put {} {ws}/cli.bin\n", src.display()),
            ));
            cr.push(cli_sftp(
                &host,
                &format!("get {ws}/cli.bin {}\n", dst.display()),
            ));
            assert_eq!(std::fs::metadata(&dst).expect("dst").len(), FILE_BYTES as u64);
        }
        p.destroy(&ctx(), &sb.info().id).await.expect("destroy");
        p.shutdown().await;

        let mib = FILE_BYTES as f64 / (1024.0 * 1024.0);
        let (pe50, pe99) = stats(pe);
        let (ce50, ce99) = stats(ce);
        let (me50, me99) = stats(me);
        let tp = |v: Vec<f64>| {
            let (m, p99) = stats(v);
            (mib / m, mib / p99)
        };
        let (pw50, pw99) = tp(pw);
        let (cw50, cw99) = tp(cw);
        let (pr50, pr99) = tp(pr);
        let (cr50, cr99) = tp(cr);
        println!("ssh provider vs OpenSSH CLI, same sshd in a netns ({EXEC_N} execs, {FILE_ROUNDS} x 64 MiB, interleaved)");
        println!("{:<28} {:>12} {:>12}", "", "median", "p99");
        println!("{:<28} {:>10.2}ms {:>10.2}ms", "exec true: provider", pe50 * 1e3, pe99 * 1e3);
        println!("{:<28} {:>10.2}ms {:>10.2}ms", "exec true: ssh CLI", ce50 * 1e3, ce99 * 1e3);
        println!("{:<28} {:>10.2}ms {:>10.2}ms", "exec true: ssh -S (mux)", me50 * 1e3, me99 * 1e3);
        println!("{:<28} {:>8.1}MiB/s {:>8.1}MiB/s", "write 64 MiB: provider", pw50, pw99);
        println!("{:<28} {:>8.1}MiB/s {:>8.1}MiB/s", "write 64 MiB: sftp put", cw50, cw99);
        println!("{:<28} {:>8.1}MiB/s {:>8.1}MiB/s", "read 64 MiB: provider", pr50, pr99);
        println!("{:<28} {:>8.1}MiB/s {:>8.1}MiB/s", "read 64 MiB: sftp get", cr50, cr99);
        println!(
            "ratios (median): exec latency provider/CLI = {:.2}, provider/mux CLI = {:.2} (below 1 is faster); write provider/CLI = {:.2}; read provider/CLI = {:.2} (above 1 is faster)",
            pe50 / ce50,
            pe50 / me50,
            pw50 / cw50,
            pr50 / cr50
        );
        drop(host);
    });
}
