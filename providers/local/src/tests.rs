//! Unit tests of the local provider: configuration, path resolution, the write path and
//! watches, on a real directory but without starting confined processes (the
//! integration tests under `tests/` do that).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{ByteRange, FsEventKind, WriteGuard};
use tether_provider::clock::CancelReason;
use tether_provider::{CallCtx, Fs, ProviderError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{LocalConfig, workspace_components};
use crate::fs::{LocalFs, TEMP_PREFIX, Workspace};

struct Ws {
    _dir: tempfile::TempDir,
    host: std::path::PathBuf,
    outside: std::path::PathBuf,
    ws: Arc<Workspace>,
}

fn workspace() -> Ws {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("workspace");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&host).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.txt"), "secret").unwrap();
    let prefix = vec!["home".to_owned(), "user".to_owned()];
    let ws = Arc::new(Workspace::open(&host, "/home/user", &prefix).unwrap());
    Ws {
        _dir: dir,
        host,
        outside,
        ws,
    }
}

fn fs_of(w: &Ws) -> LocalFs {
    LocalFs::new(w.ws.clone(), TaskTracker::new(), CancellationToken::new())
}

fn ctx() -> CallCtx {
    CallCtx::new("unit")
}

fn once(data: &'static [u8]) -> tether_provider::ByteStream {
    tether_provider::util::once_bytes(Bytes::from_static(data))
}

fn code<T: std::fmt::Debug>(r: Result<T, ProviderError>) -> ErrorCode {
    r.expect_err("expected an error").code()
}

async fn read_all(fs: &LocalFs, path: &str) -> Result<Vec<u8>, ProviderError> {
    let mut s = fs.read(&ctx(), path, ByteRange::default()).await?;
    let mut out = Vec::new();
    while let Some(c) = s.next().await {
        out.extend_from_slice(&c?);
    }
    Ok(out)
}

// === config ===

#[test]
fn config_defaults_and_unknown_fields() {
    let cfg: LocalConfig =
        serde_json::from_str(r#"{"root": "/var/lib/tether/sandboxes"}"#).unwrap();
    assert_eq!(cfg.workspace_path, std::path::PathBuf::from("/home/user"));
    assert!(!cfg.allow_weaker_isolation && !cfg.default_network && cfg.cgroups);
    assert_eq!(cfg.default_template, "host");
    assert_eq!(cfg.limits.memory_bytes, Some(2 << 30));
    assert_eq!(cfg.limits.pids, Some(1024));
    assert_eq!(cfg.limits.disk_bytes, Some(4 << 30));
    assert_eq!(cfg.limits.cpu_millis, None);
    assert!(cfg.uid_base > 0, "root inside is never root outside");
    assert!(
        cfg.read_only_paths
            .iter()
            .any(|p| p == std::path::Path::new("/usr"))
    );
    assert!(
        !cfg.device_paths.iter().any(|p| p.starts_with("/dev/pts")),
        "no blanket access to terminals"
    );
    assert!(
        !cfg.read_only_paths
            .iter()
            .any(|p| p == std::path::Path::new("/etc")),
        "/etc is narrowed, not whole"
    );
    cfg.validate().unwrap();
    assert!(serde_json::from_str::<LocalConfig>(r#"{"root": "/x", "bogus": 1}"#).is_err());
}

#[test]
fn config_validation_refuses_unsafe_layouts() {
    let bad = |f: fn(&mut LocalConfig)| {
        let mut c = LocalConfig::with_root("/var/lib/tether/sandboxes");
        f(&mut c);
        c.validate().expect_err("must be refused").code()
    };
    assert_eq!(
        bad(|c| c.root = "relative/root".into()),
        ErrorCode::InvalidRequest
    );
    // Sandboxes under a path every confined command may read would see each other.
    assert_eq!(
        bad(|c| c.root = "/usr/local/tether".into()),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(|c| c.workspace_path = "/home".into()),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(|c| c.workspace_path = "/home/../etc/x".into()),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(|c| c.workspace_path = "/usr/work".into()),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        bad(|c| c.default_template = "ubuntu".into()),
        ErrorCode::InvalidRequest
    );
    assert_eq!(bad(|c| c.uid_base = 0), ErrorCode::InvalidRequest);
    assert_eq!(
        workspace_components(std::path::Path::new("/srv/work/a")).unwrap(),
        ["srv", "work", "a"]
    );
}

// === path resolution ===

#[test]
fn lexical_paths_map_into_the_workspace() {
    let w = workspace();
    let l = |p: &str| {
        w.ws.lexical(p).map(|c| {
            c.iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(l("a/b").unwrap(), ["a", "b"]);
    assert_eq!(l("/home/user/a/./b/../c").unwrap(), ["a", "c"]);
    assert_eq!(l("/home/user").unwrap(), Vec::<String>::new());
    assert_eq!(l("").unwrap(), Vec::<String>::new());
    assert_eq!(l("/home/user/../user/x").unwrap(), ["x"]);
    for escape in [
        "../x",
        "/etc/passwd",
        "/home/user/../../etc",
        "/home/username/x",
        "/",
        "a/../../..",
    ] {
        assert_eq!(
            l(escape).unwrap_err().code(),
            ErrorCode::FsPermissionDenied,
            "{escape}"
        );
    }
    assert_eq!(l("a\0b").unwrap_err().code(), ErrorCode::InvalidRequest);
}

#[test]
fn symlinks_resolve_as_the_sandbox_sees_them() {
    let w = workspace();
    std::fs::create_dir_all(w.host.join("real/dir")).unwrap();
    std::fs::write(w.host.join("real/dir/f.txt"), "in").unwrap();
    let link =
        |target: &str, name: &str| std::os::unix::fs::symlink(target, w.host.join(name)).unwrap();
    link("/home/user/real", "abs_in"); // absolute, but a sandbox path inside the workspace
    link("real/dir", "rel_in");
    link("rel_in/..", "via_up");
    link(w.outside.to_str().unwrap(), "host_abs"); // a host path: outside in the sandbox's view
    link("../outside", "rel_out");
    link("loop_b", "loop_a");
    link("loop_a", "loop_b");
    let r = |p: &str, follow: bool| {
        w.ws.resolve(p, follow).map(|c| {
            c.iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(
        r("abs_in/dir/f.txt", true).unwrap(),
        ["real", "dir", "f.txt"]
    );
    assert_eq!(r("rel_in/f.txt", true).unwrap(), ["real", "dir", "f.txt"]);
    assert_eq!(
        r("rel_in/../dir", true).unwrap(),
        ["dir"],
        "`..` of the request is lexical"
    );
    assert_eq!(
        r("via_up/dir", true).unwrap(),
        ["real", "dir"],
        "`..` inside a link target is physical"
    );
    assert_eq!(
        r("abs_in", false).unwrap(),
        ["abs_in"],
        "the last link is kept when not following"
    );
    assert_eq!(
        r("new/deeper/file", true).unwrap(),
        ["new", "deeper", "file"]
    );
    for p in [
        "host_abs/secret.txt",
        "rel_out/secret.txt",
        "host_abs",
        "rel_out",
    ] {
        assert_eq!(
            r(p, true).unwrap_err().code(),
            ErrorCode::FsPermissionDenied,
            "{p}"
        );
    }
    assert_eq!(
        r("loop_a", true).unwrap_err().code(),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        r("real/dir/f.txt/x", true).unwrap_err().code(),
        ErrorCode::FsNotDirectory
    );
}

#[tokio::test]
async fn fs_never_reads_or_writes_the_host_outside() {
    let w = workspace();
    let fs = fs_of(&w);
    std::os::unix::fs::symlink(w.outside.join("secret.txt"), w.host.join("leak")).unwrap();
    std::os::unix::fs::symlink(&w.outside, w.host.join("leakdir")).unwrap();
    for p in ["leak", "leakdir/secret.txt", "../outside/secret.txt"] {
        assert_eq!(
            code(read_all(&fs, p).await),
            ErrorCode::FsPermissionDenied,
            "{p}"
        );
        assert_eq!(
            code(fs.write(&ctx(), p, once(b"pwned"), WriteGuard::None).await),
            ErrorCode::FsPermissionDenied,
            "{p}"
        );
    }
    assert_eq!(
        code(fs.list(&ctx(), "leakdir", 1).await),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        code(fs.remove(&ctx(), "leakdir/secret.txt", false).await),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        code(fs.rename(&ctx(), "leakdir/secret.txt", "stolen").await),
        ErrorCode::FsPermissionDenied
    );
    assert_eq!(
        code(fs.remove(&ctx(), "/home/user", true).await),
        ErrorCode::FsPermissionDenied
    );
    // Removing the link removes the link, not its target.
    fs.remove(&ctx(), "leakdir", true).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(w.outside.join("secret.txt")).unwrap(),
        "secret"
    );
    assert!(!w.outside.join("pwned").exists());
}

#[tokio::test]
async fn a_directory_swapped_for_a_symlink_is_refused_by_the_kernel() {
    let w = workspace();
    std::fs::create_dir(w.host.join("d")).unwrap();
    let comps = w.ws.resolve("d/secret.txt", true).unwrap();
    // What a sandboxed process racing the daemon would do between resolution and open.
    std::fs::remove_dir(w.host.join("d")).unwrap();
    std::os::unix::fs::symlink(&w.outside, w.host.join("d")).unwrap();
    let err =
        w.ws.open_beneath(&comps, rustix::fs::OFlags::RDONLY)
            .unwrap_err();
    assert_eq!(
        crate::error::fs_errno("d/secret.txt", err).code(),
        ErrorCode::FsPermissionDenied
    );
}

// === writes ===

#[tokio::test]
async fn versions_change_on_every_write_even_with_equal_size() {
    let w = workspace();
    let fs = fs_of(&w);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..50 {
        let out = fs
            .write(&ctx(), "v.txt", once(b"same"), WriteGuard::None)
            .await
            .unwrap();
        assert!(
            seen.insert(out.version.clone()),
            "version {} repeated",
            out.version
        );
        assert_eq!(fs.stat(&ctx(), "v.txt").await.unwrap().version, out.version);
    }
}

#[tokio::test]
async fn overwrites_keep_the_file_mode() {
    use std::os::unix::fs::PermissionsExt;
    let w = workspace();
    let fs = fs_of(&w);
    fs.write(&ctx(), "run.sh", once(b"#!/bin/sh\n"), WriteGuard::None)
        .await
        .unwrap();
    std::fs::set_permissions(
        w.host.join("run.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    fs.write(
        &ctx(),
        "run.sh",
        once(b"#!/bin/sh\necho\n"),
        WriteGuard::None,
    )
    .await
    .unwrap();
    assert_eq!(fs.stat(&ctx(), "run.sh").await.unwrap().mode, 0o755);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_create_if_absent_has_one_winner() {
    let w = workspace();
    let fs = Arc::new(fs_of(&w));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let fs = fs.clone();
            tokio::spawn(async move {
                let data = tether_provider::util::once_bytes(Bytes::from(format!("writer {i}")));
                fs.write(&ctx(), "race.txt", data, WriteGuard::CreateIfAbsent)
                    .await
            })
        })
        .collect();
    let mut wins = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => wins += 1,
            Err(e) => assert_eq!(e.code(), ErrorCode::FsAlreadyExists),
        }
    }
    assert_eq!(wins, 1);
    assert!(
        String::from_utf8(read_all(&fs, "race.txt").await.unwrap())
            .unwrap()
            .starts_with("writer ")
    );
}

#[tokio::test]
async fn a_cancelled_write_publishes_nothing_and_leaves_no_temp_file() {
    let w = workspace();
    let fs = fs_of(&w);
    let call = ctx();
    let (tx, rx) = tokio::sync::mpsc::channel::<tether_provider::Result<Bytes>>(1);
    tx.send(Ok(Bytes::from_static(b"partial"))).await.unwrap();
    let data = futures_util::stream::poll_fn({
        let mut rx = rx;
        move |cx| rx.poll_recv(cx)
    })
    .boxed();
    let cancel = call.cancel.clone();
    let canceller = tokio::spawn(async move {
        tokio::task::yield_now().await;
        cancel.cancel(CancelReason::Caller("test"));
    });
    let err = fs
        .write(&call, "c.txt", data, WriteGuard::None)
        .await
        .unwrap_err();
    canceller.await.unwrap();
    drop(tx);
    assert_eq!(err.code(), ErrorCode::Cancelled);
    let names: Vec<String> = std::fs::read_dir(&w.host)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.is_empty(), "left behind: {names:?}");
}

#[tokio::test]
async fn a_failing_data_stream_publishes_nothing() {
    let w = workspace();
    let fs = fs_of(&w);
    fs.write(&ctx(), "keep.txt", once(b"original"), WriteGuard::None)
        .await
        .unwrap();
    let data = futures_util::stream::iter(vec![
        Ok(Bytes::from_static(b"new")),
        Err(ProviderError::fs(
            ErrorCode::FsAborted,
            "keep.txt",
            "upload broke",
        )),
    ])
    .boxed();
    assert_eq!(
        code(fs.write(&ctx(), "keep.txt", data, WriteGuard::None).await),
        ErrorCode::FsAborted
    );
    assert_eq!(read_all(&fs, "keep.txt").await.unwrap(), b"original");
    assert_eq!(
        std::fs::read_dir(&w.host).unwrap().count(),
        1,
        "no temp file left"
    );
}

#[tokio::test]
async fn reads_stream_in_bounded_chunks() {
    let w = workspace();
    let fs = fs_of(&w);
    std::fs::write(w.host.join("big"), vec![7u8; 1_000_000]).unwrap();
    let mut s = fs
        .read(
            &ctx(),
            "big",
            ByteRange {
                offset: 10,
                length: Some(300_000),
            },
        )
        .await
        .unwrap();
    let mut total = 0;
    while let Some(c) = s.next().await {
        let c = c.unwrap();
        assert!(c.len() <= crate::fs::READ_CHUNK);
        total += c.len();
    }
    assert_eq!(total, 300_000);
}

// === watch ===

#[tokio::test]
async fn watch_reports_tether_writes_as_create_and_write_without_temp_names() {
    let w = workspace();
    let fs = fs_of(&w);
    fs.mkdir(&ctx(), "w", false).await.unwrap();
    let mut events = fs.watch(&ctx(), "w", true).await.unwrap();
    fs.write(&ctx(), "w/a.txt", once(b"1"), WriteGuard::None)
        .await
        .unwrap();
    fs.write(&ctx(), "w/a.txt", once(b"2"), WriteGuard::None)
        .await
        .unwrap();
    fs.mkdir(&ctx(), "w/sub", false).await.unwrap();
    let mut got = Vec::new();
    while got.len() < 4 {
        got.push(next_event(&mut events).await);
    }
    std::fs::write(w.host.join("w/sub/deep.txt"), "d").unwrap();
    loop {
        let ev = next_event(&mut events).await;
        let done = ev.name == "sub/deep.txt";
        got.push(ev);
        if done {
            break;
        }
    }
    assert!(got.iter().all(|e| !e.name.contains(TEMP_PREFIX)), "{got:?}");
    let kinds: Vec<(FsEventKind, &str)> = got.iter().map(|e| (e.kind, e.name.as_str())).collect();
    // Publications and inotify events arrive through different channels: order them per name.
    let of = |name: &str| {
        kinds
            .iter()
            .filter(|(_, n)| *n == name)
            .map(|(k, _)| *k)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of("a.txt"),
        [FsEventKind::Create, FsEventKind::Write, FsEventKind::Write],
        "{kinds:?}"
    );
    assert_eq!(of("sub"), [FsEventKind::Create], "{kinds:?}");
    assert!(
        kinds.contains(&(FsEventKind::Create, "sub/deep.txt")),
        "{kinds:?}"
    );
}

async fn next_event(
    events: &mut futures_util::stream::BoxStream<
        'static,
        tether_provider::Result<tether_protocol::fs::FsEvent>,
    >,
) -> tether_protocol::fs::FsEvent {
    tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("watch event")
        .unwrap()
        .unwrap()
}

// === process scans ===

#[tokio::test]
async fn group_scan_finds_members_and_ignores_others() {
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", "sleep 30 & sleep 30"])
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap() as i32;
    let mut members = Vec::new();
    for _ in 0..200 {
        members = crate::client::group_members(pid);
        if members.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(members.len(), 3, "sh and its two sleeps: {members:?}");
    assert!(!members.contains(&(std::process::id() as i32)));
    crate::client::signal_group(pid, nix::sys::signal::Signal::SIGKILL);
    child.wait().await.unwrap();
    for _ in 0..200 {
        if crate::client::group_members(pid).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "group members survived SIGKILL: {:?}",
        crate::client::group_members(pid)
    );
}
