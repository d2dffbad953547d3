//! Unit tests of the envd client's pieces (the Connect codec's are in
//! `tether_protocol::connect`): envd versions, error mapping, exit statuses, the output
//! window, paths and versions, and the bash wrapper itself. The whole client against
//! small in-test backends is in `tether-provider-e2b`'s `tests/fake_backend.rs`; against
//! tetherd's E2B front in the workspace's end-to-end tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderValue};
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{ConnectCode, EndEvent, EntryInfo, FileType};
use tether_protocol::fs::FileKind;

use crate::client::{EnvdVersion, basic_user};
use crate::error::{Op, from_connect, from_status};
use crate::fs::{resolve, to_stat, version_of};
use crate::process::{Window, exit_status};

// --- configuration ---

#[test]
fn the_client_configuration_defaults_to_its_named_constants_and_is_checked() {
    use crate::config::{self, EnvdClientConfig};
    let empty: EnvdClientConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(empty, EnvdClientConfig::default());
    assert_eq!(empty.connect_timeout_ms, config::DEFAULT_CONNECT_TIMEOUT_MS);
    assert_eq!(empty.health_timeout_ms, config::DEFAULT_HEALTH_TIMEOUT_MS);
    assert_eq!(empty.retry.max_times, config::DEFAULT_RETRY_MAX_TIMES);
    assert_eq!(empty.state_dir(), "/home/user/.cache/tether");
    assert!(empty.validate("microvm").is_ok());
    let some: EnvdClientConfig =
        serde_json::from_str(r#"{"workspace": "/root", "health_timeout_ms": 500}"#).unwrap();
    assert_eq!(some.health_timeout(), Duration::from_millis(500));
    assert_eq!(some.state_dir(), "/root/.cache/tether");
    assert_eq!(some.request_timeout_ms, config::DEFAULT_REQUEST_TIMEOUT_MS);
    assert!(serde_json::from_str::<EnvdClientConfig>(r#"{"bogus": 1}"#).is_err());
    for bad in [
        EnvdClientConfig {
            workspace: "rel".into(),
            ..EnvdClientConfig::default()
        },
        EnvdClientConfig {
            health_timeout_ms: 0,
            ..EnvdClientConfig::default()
        },
        EnvdClientConfig {
            keepalive_interval_s: 60,
            ..EnvdClientConfig::default()
        },
        EnvdClientConfig {
            retry: crate::RetryConfig {
                min_delay_ms: 10,
                max_delay_ms: 5,
                max_times: 1,
            },
            ..EnvdClientConfig::default()
        },
    ] {
        assert_eq!(
            bad.validate("microvm").unwrap_err().code(),
            ErrorCode::InvalidRequest,
            "{bad:?}"
        );
    }
}

// --- versions ---

#[test]
fn envd_versions_gate_features() {
    let v = EnvdVersion::parse("0.6.13").unwrap();
    assert_eq!(v, EnvdVersion(0, 6, 13));
    assert!(v.close_stdin() && v.octet_stream_upload() && v.default_user() && v.file_metadata());
    let old = EnvdVersion::parse("v0.5.1-rc.2").unwrap();
    assert_eq!(old, EnvdVersion(0, 5, 1));
    assert!(!old.close_stdin() && !old.octet_stream_upload() && old.default_user());
    assert!(!EnvdVersion::parse("0.3").unwrap().default_user());
    assert_eq!(EnvdVersion::parse("garbage"), None);
    assert_eq!(basic_user("root"), "Basic cm9vdDo=");
}

// --- errors ---

fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_static(v));
    }
    h
}

#[test]
fn http_errors_map_onto_stable_codes() {
    let sb = Op::Sandbox {
        op: "get",
        id: "i1",
    };
    let none = HeaderMap::new();
    let e = from_status(
        sb,
        StatusCode::NOT_FOUND,
        &none,
        br#"{"code":404,"message":"sandbox not found"}"#,
    );
    assert_eq!(e.code(), ErrorCode::SandboxNotFound);
    // The edge proxy's answer for a sandbox that is gone.
    let fs = Op::Fs {
        op: "read",
        path: "/home/user/a",
    };
    let e = from_status(
        fs,
        StatusCode::BAD_GATEWAY,
        &none,
        br#"{"sandboxId":"i1","message":"The sandbox was not found","code":502}"#,
    );
    assert_eq!(e.code(), ErrorCode::SandboxNotFound);
    // Rate limits and overload: retryable, with the advised delay.
    let e = from_status(
        sb,
        StatusCode::TOO_MANY_REQUESTS,
        &headers(&[("retry-after", "2")]),
        br#"{"code":429,"message":"slow down"}"#,
    );
    assert!(e.retryable());
    assert_eq!(e.code(), ErrorCode::RateLimited);
    assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
    // `Should-Retry` overrides the status either way.
    assert!(
        !from_status(
            sb,
            StatusCode::SERVICE_UNAVAILABLE,
            &headers(&[("should-retry", "false")]),
            b"{}"
        )
        .retryable()
    );
    assert!(
        from_status(
            sb,
            StatusCode::INTERNAL_SERVER_ERROR,
            &headers(&[("should-retry", "true")]),
            b"{}"
        )
        .retryable()
    );
    assert!(!from_status(sb, StatusCode::INTERNAL_SERVER_ERROR, &none, b"<html>").retryable());
    assert_eq!(
        from_status(sb, StatusCode::NOT_IMPLEMENTED, &none, b"").code(),
        ErrorCode::Unsupported
    );
    assert_eq!(
        from_status(fs, StatusCode::NOT_FOUND, &none, b"").code(),
        ErrorCode::FsNotFound
    );
    assert_eq!(
        from_status(fs, StatusCode::FORBIDDEN, &none, b"").code(),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        from_status(fs, StatusCode::INSUFFICIENT_STORAGE, &none, b"").code(),
        ErrorCode::FsIoError
    );
    // A Connect error body in front of an RPC wins over the status.
    let p = Op::Process {
        op: "start",
        id: "c1",
    };
    assert_eq!(
        from_status(
            p,
            StatusCode::BAD_REQUEST,
            &none,
            br#"{"code":"not_found","message":"x"}"#
        )
        .code(),
        ErrorCode::CommandNotFound
    );
}

#[test]
fn connect_errors_map_by_operation() {
    let fs = Op::Fs {
        op: "mkdir",
        path: "/d",
    };
    let p = Op::Process {
        op: "start",
        id: "c",
    };
    assert_eq!(
        from_connect(fs, ConnectCode::AlreadyExists, "").code(),
        ErrorCode::FsAlreadyExists
    );
    assert_eq!(
        from_connect(fs, ConnectCode::NotFound, "").code(),
        ErrorCode::FsNotFound
    );
    assert_eq!(
        from_connect(fs, ConnectCode::PermissionDenied, "").code(),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        from_connect(p, ConnectCode::InvalidArgument, "cwd does not exist").code(),
        ErrorCode::SpawnFailed
    );
    assert_eq!(
        from_connect(p, ConnectCode::NotFound, "").code(),
        ErrorCode::CommandNotFound
    );
    assert_eq!(
        from_connect(p, ConnectCode::Unimplemented, "").code(),
        ErrorCode::Unsupported
    );
    assert!(from_connect(p, ConnectCode::Unavailable, "").retryable());
    assert_eq!(
        from_connect(p, ConnectCode::DeadlineExceeded, "").code(),
        ErrorCode::DeadlineExceeded
    );
    assert_eq!(
        from_connect(p, ConnectCode::Canceled, "").code(),
        ErrorCode::Cancelled
    );
}

// --- processes ---

fn end(exit_code: i32, exited: bool, status: &str) -> EndEvent {
    EndEvent {
        exit_code,
        exited,
        status: status.into(),
        error: None,
    }
}

#[test]
fn exit_statuses_read_like_go_process_state() {
    assert_eq!(
        exit_status(&end(0, true, "exit status 0")),
        tether_protocol::process::ExitStatus {
            code: Some(0),
            signal: None
        }
    );
    assert_eq!(exit_status(&end(3, true, "exit status 3")).code, Some(3));
    for (status, n) in [
        ("signal: killed", 9),
        ("signal: terminated", 15),
        ("signal: interrupt", 2),
        ("signal: user defined signal 1", 10),
        ("signal: segmentation fault (core dumped)", 11),
        ("signal: signal 40", 40),
    ] {
        let s = exit_status(&end(-1, false, status));
        assert_eq!((s.code, s.signal), (None, Some(n)), "{status}");
    }
    // proto3 JSON omits `exited: false` and `exitCode: 0`: the status text decides.
    assert_eq!(exit_status(&end(0, false, "exit status 4")).code, Some(4));
}

#[test]
fn the_output_window_keeps_the_recent_bytes_at_their_offsets() {
    let mut w = Window::with_limit(10);
    for c in [&b"abcd"[..], b"efgh", b"ijkl", b"mnop"] {
        w.push(Bytes::copy_from_slice(c));
    }
    // At least `limit` bytes are kept, whole chunks dropped from the front.
    assert_eq!(w.start(), 4);
    assert_eq!(w.read(3, 100), None, "dropped bytes are not served");
    assert_eq!(w.read(4, 100).unwrap(), Bytes::from_static(b"efgh"));
    assert_eq!(w.read(6, 1).unwrap(), Bytes::from_static(b"g"));
    assert_eq!(w.read(13, 100).unwrap(), Bytes::from_static(b"nop"));
    assert_eq!(w.read(16, 100), None, "nothing past the end");
    w.shrink(4);
    assert_eq!(w.start(), 12);
    assert_eq!(w.read(12, 100).unwrap(), Bytes::from_static(b"mnop"));
}

// --- paths and versions ---

#[test]
fn paths_resolve_against_the_workspace() {
    assert_eq!(resolve("/home/user", "a/b.txt"), "/home/user/a/b.txt");
    assert_eq!(
        resolve("/home/user", "./rel/../rel/x.txt"),
        "/home/user/rel/x.txt"
    );
    assert_eq!(resolve("/home/user", "~/x"), "/home/user/x");
    assert_eq!(resolve("/home/user", "/etc/../tmp//f"), "/tmp/f");
    assert_eq!(resolve("/home/user", "../../../.."), "/");
    assert_eq!(resolve("/home/user", ""), "/home/user");
}

fn entry(size: i64, mtime: &str, meta: Option<&str>) -> EntryInfo {
    let mut metadata = BTreeMap::new();
    if let Some(m) = meta {
        metadata.insert(crate::fs::VERSION_META.to_owned(), m.to_owned());
    }
    EntryInfo {
        name: "a.txt".into(),
        kind: FileType::File,
        path: "/home/user/a.txt".into(),
        size,
        mode: 0o644,
        permissions: "-rw-r--r--".into(),
        owner: "user".into(),
        group: "user".into(),
        modified_time: Some(mtime.into()),
        symlink_target: None,
        metadata,
        is_symlink: false,
    }
}

#[test]
fn versions_change_with_every_write_even_within_one_millisecond() {
    let t = "2026-11-30T08:16:00.123Z";
    assert_eq!(
        version_of(&entry(3, t, Some("v1"))),
        version_of(&entry(3, t, Some("v1"))),
        "same facts, same version"
    );
    assert_ne!(
        version_of(&entry(3, t, Some("v1"))),
        version_of(&entry(3, t, Some("v2"))),
        "a new write id"
    );
    assert_ne!(
        version_of(&entry(3, t, None)),
        version_of(&entry(4, t, None)),
        "a new size"
    );
    assert_ne!(
        version_of(&entry(3, t, None)),
        version_of(&entry(3, "2026-11-30T08:16:00.124Z", None)),
        "a new time"
    );
    let st = to_stat(&entry(3, t, None));
    assert_eq!((st.kind, st.size, st.mode), (FileKind::File, 3, 0o644));
    assert_eq!(st.modified_ms, 1_796_026_560_123);
    let mut link = entry(0, t, None);
    link.symlink_target = Some("/etc/passwd".into());
    assert_eq!(to_stat(&link).kind, FileKind::Symlink);
}

// --- the wrapper ---

/// Run the wrapper locally, as envd would, and return (status, stdout, stderr, dir).
async fn run_wrapper(
    argv: &[&str],
    caps: [&str; 2],
    unset: &[&str],
) -> (
    std::process::ExitStatus,
    Vec<u8>,
    Vec<u8>,
    std::path::PathBuf,
) {
    let dir = std::env::temp_dir().join(format!(
        "tether-e2b-wrapper-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let mut cmd = tokio::process::Command::new("/bin/bash");
    cmd.arg("-c")
        .arg(crate::process::WRAPPER)
        .arg("tether")
        .arg(crate::process::RELAY)
        .arg(&dir)
        .arg("id.test");
    cmd.arg("1")
        .args(caps)
        .arg(unset.len().to_string())
        .args(unset)
        .args(argv);
    cmd.env("TETHER_WRAPPER_TEST", "set");
    let out = cmd.output().await.expect("run the wrapper");
    (out.status, out.stdout, out.stderr, dir)
}

async fn wait_for(path: &std::path::Path) {
    for _ in 0..200 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", path.display());
}

#[tokio::test]
async fn the_wrapper_copies_both_streams_and_keeps_the_commands_status() {
    if !std::path::Path::new("/bin/bash").exists() {
        return;
    }
    let script = "printf 'out-1\\n'; printf 'err-1\\n' >&2; head -c 100000 /dev/zero | tr '\\0' a; printf \"%s|%s\" \"${TETHER_WRAPPER_TEST-unset}\" \"$(ps -o pgid= -p $$ | tr -d ' ')-$$\"; exit 7";
    let (status, out, err, dir) = run_wrapper(
        &["/bin/bash", "-c", script],
        ["1000000", "1000000"],
        &["TETHER_WRAPPER_TEST"],
    )
    .await;
    assert_eq!(status.code(), Some(7), "the exec'd command's own status");
    wait_for(&dir.join("out.done")).await;
    wait_for(&dir.join("err.done")).await;
    assert!(dir.join("id.test").is_file(), "the file naming the command");
    // The copies hold exactly what went to envd.
    assert_eq!(std::fs::read(dir.join("out")).unwrap(), out);
    assert_eq!(std::fs::read(dir.join("err")).unwrap(), err);
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("out-1\n"));
    assert_eq!(err, b"err-1\n");
    let tail = text.rsplit('a').next().unwrap();
    let (var, group) = tail.split_once('|').unwrap();
    assert_eq!(var, "unset", "a removed variable is removed");
    let (pgid, pid) = group.split_once('-').unwrap();
    assert_eq!(pgid, pid, "the command leads its own process group");
    let _ = std::fs::remove_dir_all(&dir);
    // The copies stop at the capture caps; envd still gets everything.
    let (status, out, err, dir) =
        run_wrapper(&["/bin/bash", "-c", script], ["1000", "3"], &[]).await;
    assert_eq!(status.code(), Some(7));
    wait_for(&dir.join("out.done")).await;
    wait_for(&dir.join("err.done")).await;
    assert!(out.len() > 100_000);
    assert_eq!(std::fs::read(dir.join("out")).unwrap(), out[..1000]);
    assert_eq!(std::fs::read(dir.join("err")).unwrap(), err[..3]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With its directory made ahead, the wrapper starts no `mkdir`: on a `PATH` without
/// one, the copies are still made there, next to the file naming the command; without the
/// directory, on that `PATH`, the command still runs and envd still gets its output.
#[tokio::test]
async fn a_directory_made_ahead_needs_no_mkdir() {
    let (Ok(tee), Ok(setsid)) = (which("tee"), which("setsid")) else {
        panic!("tee and setsid are needed");
    };
    let base = std::env::temp_dir().join(format!(
        "tether-e2b-ahead-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let bin = base.join("bin");
    let made = base.join("made");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&made).unwrap();
    std::os::unix::fs::symlink(tee, bin.join("tee")).unwrap();
    std::os::unix::fs::symlink(setsid, bin.join("setsid")).unwrap();
    let run = |dir: std::path::PathBuf| {
        let mut cmd = tokio::process::Command::new("/bin/bash");
        cmd.arg("-c")
            .arg(crate::process::WRAPPER)
            .arg("tether")
            .arg("")
            .arg(dir)
            .args(["id.cmd-7", "1", "1024", "1024", "0"])
            .args([
                "/bin/bash",
                "-c",
                "printf 'hello\\n'; printf 'oops' >&2; exit 4",
            ])
            .env_clear()
            .env("PATH", &bin);
        cmd
    };
    let out = run(made.clone()).output().await.unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.stderr, b"oops");
    wait_for(&made.join("out.done")).await;
    wait_for(&made.join("err.done")).await;
    assert!(made.join("id.cmd-7").is_file());
    assert_eq!(std::fs::read(made.join("out")).unwrap(), b"hello\n");
    assert_eq!(std::fs::read(made.join("err")).unwrap(), b"oops");
    // No directory and no `mkdir`: no copies, the command and its output unchanged.
    let missing = base.join("missing");
    let out = run(missing.clone()).output().await.unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.stderr, b"oops");
    assert!(!missing.exists());
    let _ = std::fs::remove_dir_all(&base);
}

/// The absolute path of a program on `PATH`.
fn which(name: &str) -> std::io::Result<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, name.to_owned()))
}

#[tokio::test]
async fn caps_of_whole_kib_are_held_exactly_by_the_file_size_limit() {
    if !std::path::Path::new("/bin/bash").exists() {
        return;
    }
    // 2 KiB and 1 KiB take the file size limit branch (`ulimit -f`): the copies still hold
    // exactly the first cap bytes, envd gets everything, and the cut copy says nothing.
    let script = "printf 'err-1\\n' >&2; head -c 100000 /dev/zero | tr '\\0' b; head -c 3000 /dev/zero | tr '\\0' c >&2; exit 3";
    let (status, out, err, dir) =
        run_wrapper(&["/bin/bash", "-c", script], ["2048", "1024"], &[]).await;
    assert_eq!(status.code(), Some(3));
    wait_for(&dir.join("out.done")).await;
    wait_for(&dir.join("err.done")).await;
    assert_eq!(out.len(), 100_000, "envd got all of stdout");
    assert_eq!(
        err.len(),
        3006,
        "envd got all of stderr, and no diagnostics of the copies"
    );
    assert_eq!(std::fs::read(dir.join("out")).unwrap(), out[..2048]);
    assert_eq!(std::fs::read(dir.join("err")).unwrap(), err[..1024]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_signal_sent_while_the_relay_is_starting_waits_for_it() {
    if !std::path::Path::new("/bin/bash").exists() {
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "tether-e2b-early-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let mut cmd = tokio::process::Command::new("/bin/bash");
    cmd.arg("-c")
        .arg(crate::process::WRAPPER)
        .arg("tether")
        .arg(crate::process::RELAY)
        .arg(&dir)
        .args(["id.test", "1", "64", "64", "0"]);
    cmd.args(["/bin/sleep", "30"])
        .stdout(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let fifo = dir.join("ctl");
    // As soon as the wrapper announced a relay (its FIFO may not exist yet), signal. The
    // group id given is no group at all, so only the relay can deliver it.
    wait_for(&dir.join("ctl.wait")).await;
    let script = format!(
        "{}{}",
        crate::process::AWAIT_RELAY,
        crate::process::SIGNAL_SCRIPT
    );
    let send = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .arg("tether")
        .arg(&fifo)
        .arg("999999999")
        .arg("TERM")
        .status()
        .await
        .unwrap();
    assert!(send.success(), "handed to the relay");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the signal arrived")
        .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(15)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_relay_signals_the_whole_group() {
    if !std::path::Path::new("/bin/bash").exists() {
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "tether-e2b-relay-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let script = "trap 'echo got-usr1; exit 5' USR1; (trap '' USR1; sleep 30) & echo ready; while :; do sleep 0.02; done";
    let mut cmd = tokio::process::Command::new("/bin/bash");
    cmd.arg("-c")
        .arg(crate::process::WRAPPER)
        .arg("tether")
        .arg(crate::process::RELAY)
        .arg(&dir)
        .args(["id.test", "1", "64", "64", "0"]);
    cmd.args(["/bin/bash", "-c", script])
        .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let pgid = child.id().expect("pid");
    let fifo = dir.join("ctl");
    wait_for(&fifo).await;
    // Signal once the command has set its trap.
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line)
        .await
        .unwrap();
    assert_eq!(line, "ready\n");
    // Signal the group the way a control command does: one line into the FIFO.
    let send = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("printf 'SIG %s\\n' \"$2\" 1<>\"$1\"")
        .arg("tether")
        .arg(&fifo)
        .arg("USR1")
        .status()
        .await
        .unwrap();
    assert!(send.success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("the signal arrived")
        .unwrap();
    assert_eq!(status.code(), Some(5));
    let mut next = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut next)
        .await
        .unwrap();
    assert_eq!(next, "got-usr1\n");
    // The relay leaves with the group's last process (the background sleep ignores USR1).
    let _ = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("kill -KILL -{pgid}"))
        .status()
        .await;
    for _ in 0..300 {
        if !fifo.exists() {
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the relay outlived its group");
}
