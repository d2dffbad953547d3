//! The binaries as a user runs them: `tether` against an in-process tetherd (sessions,
//! exec with the command's exit code, call, logs, fork, cp both ways byte-exact and landing
//! where `cp` lands: in directories, through symlinks, into FIFOs), `tether
//! run` on its embedded daemon, and `tetherd validate-config` / `serve` refusing bad config
//! with exit code 64.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;

use serde_json::Value;
use tether_tests::{TestDaemon, workspace_bin};

async fn tether(d: &TestDaemon, args: &[&str]) -> Output {
    let bin = workspace_bin("tether");
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    let base = d.base.clone();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .args(&args)
            .env("TETHER_URL", base)
            .env_remove("TETHER_TOKEN")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_drives_a_session_end_to_end() {
    let d = TestDaemon::start().await;
    let o = tether(&d, &["sessions", "new"]).await;
    assert!(o.status.success(), "{o:?}");
    let sid = text(&o).trim().to_owned();
    assert!(sid.starts_with('i'), "{sid}");
    let o = tether(&d, &["sessions", "ls"]).await;
    assert!(text(&o).contains(&sid));

    // exec streams output and exits with the command's code.
    let o = tether(
        &d,
        &[
            "exec",
            &sid,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert_eq!(text(&o), "out\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");

    // cp up and down, byte-exact, 20 MiB (large enough for the progress bar path).
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("big.bin");
    let data: Vec<u8> = (0..20 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    let remote = format!("{sid}:/home/user/big.bin");
    let o = tether(&d, &["cp", src.to_str().unwrap(), &remote]).await;
    assert!(o.status.success(), "{o:?}");
    let back = dir.path().join("back.bin");
    let o = tether(&d, &["cp", &remote, back.to_str().unwrap()]).await;
    assert!(o.status.success(), "{o:?}");
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the round trip must be byte-exact"
    );
    // Into a directory: under the file's own name, with --sync.
    let into = dir.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let o = tether(&d, &["cp", "--sync", &remote, into.to_str().unwrap()]).await;
    assert!(o.status.success(), "{o:?}");
    assert!(std::fs::read(into.join("big.bin")).unwrap() == data);
    // Through a symlink: its target is replaced, the link stays a link.
    let target = dir.path().join("target.bin");
    std::fs::write(&target, b"old").unwrap();
    let link = dir.path().join("link.bin");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = tether(&d, &["cp", &remote, link.to_str().unwrap()]).await;
    assert!(o.status.success(), "{o:?}");
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(std::fs::read(&target).unwrap() == data);
    // Into something that is not a regular file (a FIFO here, `/dev/null` for a user):
    // written in place, never replaced by a file.
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let o = tether(&d, &["cp", &remote, fifo.to_str().unwrap()]).await;
    assert!(o.status.success(), "{o:?}");
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert!(
        reader.join().unwrap() == data,
        "the FIFO's reader gets every byte"
    );
    // A failed download leaves nothing behind.
    let missing = dir.path().join("missing.bin");
    let o = tether(
        &d,
        &[
            "cp",
            &format!("{sid}:/home/user/nope"),
            missing.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("FS_NOT_FOUND"),
        "{o:?}"
    );
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.contains("missing") || n.ends_with(".tether-part")),
        "{names:?}"
    );

    // Uploads land as `cp` lands them: in `SESSION:DIR/`, and in `SESSION:DIR` when DIR is
    // a directory; a local directory is refused as a usage error.
    let small = dir.path().join("small.txt");
    std::fs::write(&small, b"small\n").unwrap();
    let o = tether(&d, &["exec", &sid, "--", "mkdir", "/home/user/sub"]).await;
    assert!(o.status.success(), "{o:?}");
    for to in ["/home/user/sub/", "/home/user/sub"] {
        let o = tether(
            &d,
            &["exec", &sid, "--", "rm", "-f", "/home/user/sub/small.txt"],
        )
        .await;
        assert!(o.status.success(), "{o:?}");
        let o = tether(&d, &["cp", small.to_str().unwrap(), &format!("{sid}:{to}")]).await;
        assert!(o.status.success(), "{to}: {o:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("uploaded 6 bytes to ")
                && String::from_utf8_lossy(&o.stderr).contains(":/home/user/sub/small.txt"),
            "{o:?}"
        );
        let o = tether(&d, &["exec", &sid, "--", "cat", "/home/user/sub/small.txt"]).await;
        assert_eq!(text(&o), "small\n", "{to}");
    }
    let o = tether(
        &d,
        &[
            "cp",
            dir.path().to_str().unwrap(),
            &format!("{sid}:/home/user/x"),
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is a directory"),
        "{o:?}"
    );

    let o = tether(&d, &["cp", "a", "b"]).await;
    assert_eq!(
        o.status.code(),
        Some(2),
        "two local paths are a usage error"
    );

    // call a tool; its result is printed and a failing result exits 1.
    let o = tether(
        &d,
        &["call", &sid, "bash", r#"{"command":"wc -c < big.bin"}"#],
    )
    .await;
    assert!(o.status.success(), "{o:?}");
    assert!(text(&o).contains("20971520"), "{}", text(&o));
    let o = tether(
        &d,
        &["call", &sid, "read_file", r#"{"path":"missing.txt"}"#],
    )
    .await;
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("FS_NOT_FOUND"));

    // logs: one JSON event per line, contiguous seq.
    let o = tether(&d, &["logs", &sid]).await;
    let events: Vec<Value> = text(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(events.iter().enumerate().all(|(i, e)| e["seq"] == i as u64));
    assert!(events.iter().any(|e| e["type"] == "tool/result"));

    // fork, rm; an unknown session is a clear error.
    let o = tether(&d, &["fork", &sid]).await;
    assert!(o.status.success(), "{o:?}");
    let child = text(&o).trim().to_owned();
    assert_ne!(child, sid);
    for s in [&sid, &child] {
        assert!(tether(&d, &["sessions", "rm", s]).await.status.success());
    }
    let o = tether(&d, &["exec", "inope", "--", "true"]).await;
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("SESSION_NOT_FOUND"));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_run_embeds_a_daemon_and_reports_timings() {
    let bin = workspace_bin("tether");
    let o = tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .args(["run", "--", "sh", "-c", "echo hi from $(pwd); exit 7"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "hi from /home/user\n");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("isolation: full"), "{err}");
    assert!(
        err.contains("exit code: 7") && err.contains("sandbox create") && err.contains("total"),
        "{err}"
    );
}

#[tokio::test]
async fn tetherd_refuses_bad_config_with_exit_64() {
    let bin = workspace_bin("tetherd");
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "[server]\nlisten = \"127.0.0.1:7420\"\n").unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten_address = \"x\"\n").unwrap();
    let open = dir.path().join("open.toml");
    std::fs::write(&open, "[server]\nlisten = \"0.0.0.0:7420\"\n").unwrap();
    let run = |args: Vec<String>| {
        let bin = bin.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(bin).args(args).output().unwrap()
        })
    };
    let arg = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let o = run(vec![
        "validate-config".into(),
        "--config".into(),
        arg(&good),
    ])
    .await
    .unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = run(vec!["validate-config".into(), "--config".into(), arg(&bad)])
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(64), "unknown field: {o:?}");
    let o = run(vec![
        "validate-config".into(),
        "--config".into(),
        arg(&open),
    ])
    .await
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(64),
        "non-loopback without a token: {o:?}"
    );
    // serve refuses too, before listening.
    let o = run(vec![
        "serve".into(),
        "--config".into(),
        arg(&open),
        "--state-dir".into(),
        arg(dir.path()),
    ])
    .await
    .unwrap();
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("auth_tokens"));
}

#[tokio::test]
async fn release_on_shutdown_destroys_sandboxes_and_records_it() {
    let d = TestDaemon::start_with(|c| {
        c.server.on_shutdown = tether_daemon::config::ShutdownPolicy::Release
    })
    .await;
    let sid = d.new_session().await;
    let sandboxes = d.dir.path().join("sandboxes").join("local");
    let before = std::fs::read_dir(&sandboxes).unwrap().count();
    assert!(before >= 1);
    let dir = d.stop().await;
    let after = std::fs::read_dir(dir.path().join("sandboxes").join("local"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .count();
    assert_eq!(after, 0, "release must destroy every sandbox");
    assert!(
        !dir.path().join("leases.jsonl").exists(),
        "the session log is the only lease record"
    );
    let log = std::fs::read_to_string(dir.path().join("sessions").join(&sid).join("events.jsonl"))
        .unwrap();
    assert!(log.contains("sandbox/released") && log.contains("session/closed"));
}
