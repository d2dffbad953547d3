//! Escapes from inside each provider's sandbox, one suite for every provider that runs
//! here: the local provider, the microVM provider (where qemu, the guest agent and the base
//! template are present) and the SSH provider (a real OpenSSH server on a test host of our
//! own). Each sandbox runs what an attacker would try, and the host checks the outcome:
//!
//! - `host secret`: a root-only file the test writes on the host (and the same path through
//!   `/proc/1/root`) is not readable from inside;
//! - `other sandbox`: a second sandbox's running command and its files are invisible;
//! - `tetherd's port`: a listener on the host's loopback (where tetherd serves without a
//!   token) is not reached from a sandbox with network, at any address it might try;
//! - `leftovers`: a process started with `setsid nohup ... &` does not outlive `destroy`.
//!
//! A provider that reports `enforcement: none` (SSH: a plain host the user owns, whose
//! workspaces share one account) promises no confinement: for it the suite checks that it
//! says so and runs only the `leftovers` check. The test prints one row per check.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::{CallCtx, Enforcement, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_ssh::SshProvider;
use tether_tests::ssh_host::SshHost;

fn ctx() -> CallCtx {
    CallCtx::new(format!("escape-{}", uuid::Uuid::new_v4().simple()))
        .with_timeout(Duration::from_secs(120), tether_provider::Clock::Total)
}

/// Run `cmd` under `sh` to its end: stdout and stderr together.
async fn sh(sb: &dyn Sandbox, cmd: &str) -> String {
    let h = sb
        .process()
        .spawn(&ctx(), ProcessSpec::shell(cmd))
        .await
        .expect("spawn");
    let mut out = String::new();
    let mut events = h.events(StreamOffsets::default());
    while let Some(ev) = events.next().await {
        if let ProcessEvent::Output { data, .. } = ev.expect("event") {
            out.push_str(&String::from_utf8_lossy(&data));
        }
    }
    out
}

/// Host processes whose command line contains `marker`.
fn host_processes_with(marker: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}

/// One check's outcome: `Ok(detail)` when the sandbox held, `Err(detail)` when it did not.
type Check = Result<String, String>;

struct Report {
    rows: Vec<(String, &'static str, Check)>,
}

impl Report {
    fn add(&mut self, provider: &str, check: &'static str, r: Check) {
        self.rows.push((provider.to_owned(), check, r));
    }
}

/// The suite on the provider `p`, reported under `name`.
async fn escape_suite(name: &str, p: Arc<dyn Provider>, report: &mut Report) {
    let marker = format!("tether-escape-{}", uuid::Uuid::new_v4().simple());
    let a = p
        .create(
            &ctx(),
            SandboxSpec {
                network: true,
                ..SandboxSpec::default()
            },
        )
        .await
        .expect("create the sandbox with network");
    let enforcement = a.info().enforcement;
    if enforcement == Enforcement::None {
        report.add(
            name,
            "enforcement",
            Ok("reports none: no confinement promised, only leftovers checked".into()),
        );
    } else {
        report.add(
            name,
            "enforcement",
            Ok(format!("reports {}", enforcement.as_str())),
        );
        confinement(name, &p, a.as_ref(), &marker, report).await;
    }
    // Leftovers: a detached process must not outlive destroy.
    let _ = sh(
        a.as_ref(),
        &format!("setsid nohup sh -c 'sleep 997; : {marker}-left' >/dev/null 2>&1 < /dev/null & echo started"),
    )
    .await;
    let before = host_processes_with(&format!("{marker}-left"));
    p.destroy(&ctx(), &a.info().id).await.expect("destroy");
    let mut left = host_processes_with(&format!("{marker}-left"));
    for _ in 0..20 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        left = host_processes_with(&format!("{marker}-left"));
    }
    report.add(
        name,
        "leftovers",
        if left.is_empty() {
            Ok(if before.is_empty() {
                "none on the host before or after destroy (a VM's processes are not host processes)"
                    .into()
            } else {
                format!(
                    "{} detached host process(es) before destroy, none after",
                    before.len()
                )
            })
        } else {
            Err(format!("host pids {left:?} outlived destroy"))
        },
    );
}

/// The checks only a confining provider promises.
async fn confinement(
    name: &str,
    p: &Arc<dyn Provider>,
    a: &dyn Sandbox,
    marker: &str,
    report: &mut Report,
) {
    // A root-only secret on the host.
    let dir = tempfile::Builder::new()
        .prefix("tether-escape-host-")
        .tempdir_in("/tmp")
        .unwrap();
    let secret_path = dir.path().join("secret");
    std::fs::write(&secret_path, format!("{marker}-secret")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let sp = secret_path.display();
    let out = sh(
        a,
        &format!("cat {sp} /proc/1/root{sp} 2>&1; ls /proc/1/root/tmp 2>&1 | head -50; echo done"),
    )
    .await;
    report.add(
        name,
        "host secret",
        if out.contains(&format!("{marker}-secret")) {
            Err(format!("read the host's secret: {out}"))
        } else if !out.contains("done") {
            Err(format!("the probe did not run: {out}"))
        } else {
            Ok(format!("{sp} and /proc/1/root{sp} unreadable"))
        },
    );

    // Another sandbox's command and files.
    let b = p
        .create(&ctx(), SandboxSpec::default())
        .await
        .expect("create the second sandbox");
    let _ = sh(
        b.as_ref(),
        &format!(
            "echo {marker}-other > $HOME/other.txt; echo {marker}-other > /tmp/other.txt; \
             setsid nohup sh -c 'sleep 998; : {marker}-other' >/dev/null 2>&1 < /dev/null &"
        ),
    )
    .await;
    // The marker is put together inside, so the probe's own command line does not hold it.
    let out = sh(
        a,
        &format!(
            "m={marker}; m=\"$m-other\"; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; \
             grep -rs \"$m\" /home /tmp /root /var/tmp 2>/dev/null | head; echo done"
        ),
    )
    .await;
    let seen = out.matches(&format!("{marker}-other")).count();
    report.add(
        name,
        "other sandbox",
        if seen > 0 {
            Err(format!("saw the other sandbox {seen} time(s): {out}"))
        } else if !out.contains("done") {
            Err(format!("the probe did not run: {out}"))
        } else {
            Ok("its processes and files invisible".into())
        },
    );
    p.destroy(&ctx(), &b.info().id).await.expect("destroy");

    // tetherd's port: a listener on the host's loopback.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = tokio::spawn(async move { listener.accept().await.is_ok() });
    let out = sh(
        a,
        &format!(
            "for addr in 127.0.0.1 localhost 10.0.2.2 $(ip -4 route show default 2>/dev/null | awk '{{print $3}}') \
               $(awk '$2==\"00000000\" {{printf \"%d.%d.%d.%d\\n\", \"0x\" substr($3,7,2), \"0x\" substr($3,5,2), \"0x\" substr($3,3,2), \"0x\" substr($3,1,2)}}' /proc/net/route 2>/dev/null); do \
               timeout 3 bash -c \"echo x > /dev/tcp/$addr/{port}\" 2>/dev/null && echo reached=$addr; done; echo done"
        ),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reached = accepted.is_finished();
    accepted.abort();
    report.add(
        name,
        "tetherd's port",
        if reached || out.contains("reached=") {
            Err(format!("a host loopback listener was reached: {out}"))
        } else if !out.contains("done") {
            Err(format!("the probe did not run: {out}"))
        } else {
            Ok(format!("127.0.0.1:{port} on the host not reached"))
        },
    );
}

fn local_provider(root: &std::path::Path) -> Arc<dyn Provider> {
    let cfg = tether_provider_local::LocalConfig::with_root(root.join("sandboxes"));
    Arc::new(tether_provider_local::LocalProvider::new(cfg).expect("local provider"))
}

fn ssh_provider(host: &SshHost) -> Arc<dyn Provider> {
    Arc::new(SshProvider::new(host.provider_config("t")).expect("ssh provider"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sandbox_reaches_the_host_another_sandbox_or_outlives_destroy() {
    let mut report = Report { rows: Vec::new() };
    let tmp = tempfile::Builder::new()
        .prefix("tether-escapes-")
        .tempdir()
        .unwrap();
    escape_suite("local", local_provider(tmp.path()), &mut report).await;
    match tether_tests::microvm_config() {
        Some(cfg) => {
            let p = tether_provider_microvm::MicrovmProvider::new(cfg).expect("microvm");
            p.prepare(&CallCtx::new("escapes")).await.expect("template");
            escape_suite("microvm", Arc::new(p), &mut report).await;
        }
        None => println!("microvm: skipped (see the reason above)"),
    }
    let host = SshHost::start().await;
    escape_suite("ssh", ssh_provider(&host), &mut report).await;

    println!("\n{:<8} | {:<14} | outcome", "provider", "check");
    let mut failed = Vec::new();
    for (p, check, r) in &report.rows {
        match r {
            Ok(d) => println!("{p:<8} | {check:<14} | held: {d}"),
            Err(d) => {
                println!("{p:<8} | {check:<14} | ESCAPED: {d}");
                failed.push(format!("{p} {check}: {d}"));
            }
        }
    }
    println!("{} checks, {} escaped", report.rows.len(), failed.len());
    assert!(failed.is_empty(), "{failed:#?}");
}
