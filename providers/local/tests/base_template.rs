//! The `base` template (a Debian root from Debian's packages): built once per cache dir
//! (`TETHER_TEMPLATE_DIR`, default `target/tether-templates`), then the conformance
//! suite and what E2B programs expect of it (user `user`, passwordless sudo, python3,
//! git, curl) run on it. Building takes minutes the first time; the tests skip, saying
//! so, only when debootstrap cannot fetch Debian's packages.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;

use futures_util::StreamExt;
use tether_protocol::ErrorCode;
use tether_protocol::process::{ProcessEvent, ProcessSpec};
use tether_provider::testkit::{ConformanceOptions, Outcome, run_conformance};
use tether_provider::{CallCtx, Provider, Sandbox, SandboxSpec, StreamOffsets};
use tether_provider_local::{
    BuildProgress, DEFAULT_UID_BASE, LocalConfig, LocalProvider, build_base,
};

fn cache_dir() -> PathBuf {
    std::env::var_os("TETHER_TEMPLATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/tether-templates")
        })
}

/// Build the template once per process (the tests of this file share it); `None`,
/// with the reason printed, when Debian's packages cannot be fetched.
fn built() -> Option<PathBuf> {
    static BUILT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = cache_dir();
            let mut last = String::new();
            let mut progress = |p: BuildProgress| {
                if let BuildProgress::Line(l) = &p {
                    last = l.clone();
                }
                eprintln!("base template: {p:?}");
            };
            match build_base(&dir, None, DEFAULT_UID_BASE, &mut progress) {
                Ok(_) => Some(dir),
                Err(e) if e.code() == ErrorCode::ProviderUnavailable => {
                    eprintln!("SKIPPED: debootstrap cannot fetch Debian's packages ({e}; last line: {last})");
                    None
                }
                Err(e) => panic!("building the base template failed: {e}"),
            }
        })
        .clone()
}

fn provider(templates: PathBuf) -> (tempfile::TempDir, Arc<LocalProvider>) {
    let dir = tempfile::Builder::new()
        .prefix("tether-base-")
        .tempdir()
        .unwrap();
    let mut cfg = LocalConfig::with_root(dir.path().join("sandboxes"));
    cfg.confine_helper = Some(env!("CARGO_BIN_EXE_tether-confine").into());
    cfg.templates_dir = Some(templates);
    cfg.default_template = "base".into();
    (dir, Arc::new(LocalProvider::new(cfg).unwrap()))
}

/// A provider on the built template and a sandbox of it (`None`: the template could not
/// be built here).
async fn base_sandbox() -> Option<(tempfile::TempDir, Arc<LocalProvider>, Arc<dyn Sandbox>)> {
    let templates = tokio::task::spawn_blocking(built).await.unwrap()?;
    let (dir, p) = provider(templates);
    let sb = p
        .create(&CallCtx::new("base"), SandboxSpec::default())
        .await
        .unwrap();
    Some((dir, p, sb))
}

async fn sh(sb: &dyn Sandbox, cmd: &str, user: Option<&str>) -> (String, String, Option<i32>) {
    let mut spec = ProcessSpec::shell(cmd);
    spec.user = user.map(str::to_owned);
    run(sb, spec).await
}

async fn run(sb: &dyn Sandbox, spec: ProcessSpec) -> (String, String, Option<i32>) {
    let h = sb
        .process()
        .spawn(&CallCtx::new("base"), spec)
        .await
        .unwrap();
    let (mut out, mut err, mut code) = (String::new(), String::new(), None);
    let mut ev = h.events(StreamOffsets::default());
    while let Some(e) = ev.next().await {
        match e.unwrap() {
            ProcessEvent::Output {
                stream: tether_protocol::process::StreamKind::Stderr,
                data,
                ..
            } => err.push_str(&String::from_utf8_lossy(&data)),
            ProcessEvent::Output { data, .. } => out.push_str(&String::from_utf8_lossy(&data)),
            ProcessEvent::Exited { status, .. } => code = status.code,
            ProcessEvent::Started { .. } => {}
        }
    }
    (out, err, code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_passes_on_the_base_template() {
    let Some(templates) = tokio::task::spawn_blocking(built).await.unwrap() else {
        return;
    };
    let (_dir, p) = provider(templates);
    let opts = ConformanceOptions {
        spec: SandboxSpec {
            template: Some("base".into()),
            ..SandboxSpec::default()
        },
        fs_confined_to_workspace: false,
        ..ConformanceOptions::default()
    };
    let report = run_conformance(p, opts).await;
    for c in &report.cases {
        eprintln!("{:<45} {:?} ({:?})", c.name, c.outcome, c.elapsed);
    }
    assert!(
        report.passed(),
        "failures: {:?}",
        report.failures().collect::<Vec<_>>()
    );
    // Skipped only where the suite says so for a whole-machine file view (path escapes)
    // and a provider with every optional capability (nothing to check as unsupported).
    let skipped: Vec<&str> = report
        .cases
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Skipped(_)))
        .map(|c| c.name)
        .collect();
    assert_eq!(
        skipped,
        ["unsupported_ops_fail_fast", "fs_path_escapes_are_refused"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_is_debian_with_user_sudo_python_git_curl_attr() {
    let Some((_dir, p, sb)) = base_sandbox().await else {
        return;
    };
    let ctx = CallCtx::new("base");
    let (out, err, code) = sh(
        sb.as_ref(),
        "id -un; echo $HOME; cat /etc/debian_version >/dev/null && echo debian; python3 -c 'print(6*7)'; python -c 'print(7*7)'; git --version | cut -d' ' -f1; curl --version | head -1 | cut -d' ' -f1; sudo -n id -u; cat /etc/shadow >/dev/null 2>&1 || echo no-shadow; sudo -n cat /etc/shadow >/dev/null && echo sudo-shadow",
        None,
    )
    .await;
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(!err.contains("unable to resolve host"), "{err}");
    assert_eq!(
        out, "user\n/home/user\ndebian\n42\n49\ngit\ncurl\n0\nno-shadow\nsudo-shadow\n",
        "{err}"
    );
    // As root too, and root inside owns the system.
    let (out, _, _) = sh(
        sb.as_ref(),
        "id -u; touch /usr/local/bin/mine && echo wrote",
        Some("root"),
    )
    .await;
    assert_eq!(out, "0\nwrote\n");
    // Files written through the file API belong to `user`.
    sb.fs()
        .write(
            &ctx,
            "note.txt",
            tether_provider::util::once_bytes(bytes::Bytes::from_static(b"x")),
            tether_protocol::fs::WriteGuard::None,
        )
        .await
        .unwrap();
    let (out, _, _) = sh(sb.as_ref(), "stat -c %U /home/user/note.txt", None).await;
    assert_eq!(out, "user\n");
    // An attribute set inside with `setfattr` is what the files API reports as metadata.
    let (_, err, code) = sh(
        sb.as_ref(),
        "setfattr -n user.e2b.owner -v alice note.txt",
        None,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    let attrs = sb.fs().xattrs(&ctx, "note.txt", "user.e2b.").await.unwrap();
    assert_eq!(
        attrs.get("owner").map(Vec::as_slice),
        Some(&b"alice"[..]),
        "{attrs:?}"
    );
    // As `user`, the command's stdio can be reopened by name.
    let (out, err, code) = sh(
        sb.as_ref(),
        "echo via-fd > /dev/stdout; echo e > /dev/fd/2",
        None,
    )
    .await;
    assert_eq!(
        (out.as_str(), err.as_str(), code),
        ("via-fd\n", "e\n", Some(0))
    );
    p.destroy(&ctx, &sb.info().id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_shell_runs_no_program_to_learn_its_uid() {
    let Some((_dir, p, sb)) = base_sandbox().await else {
        return;
    };
    let ctx = CallCtx::new("base");
    // An `id` first on the PATH notes every call, then does the real one's work.
    let (_, err, code) = sh(
        sb.as_ref(),
        "mkdir -p /tmp/spy && printf '#!/bin/sh\\necho \"$@\" >> /tmp/spy/calls\\nexec /usr/bin/id \"$@\"\\n' > /tmp/spy/id && chmod 755 /tmp/spy/id && /tmp/spy/id -u",
        None,
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    // The login shell still sets the PATH each user gets, as root and as `user`.
    for (user, path) in [
        (
            None,
            "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games",
        ),
        (
            Some("root"),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
    ] {
        let mut spec = ProcessSpec::shell("echo $PATH");
        spec.user = user.map(str::to_owned);
        spec.env
            .insert("PATH".into(), Some("/tmp/spy:/usr/bin:/bin".into()));
        let (out, err, code) = run(sb.as_ref(), spec).await;
        assert_eq!((out.trim(), code), (path, Some(0)), "{user:?}: {err}");
    }
    // Only the check above called it; `sh -l` (no `$EUID`) still does, and works.
    let mut spec = ProcessSpec::argv(["/bin/sh", "-lc", "echo $PATH"]);
    spec.env
        .insert("PATH".into(), Some("/tmp/spy:/usr/bin:/bin".into()));
    let (out, _, _) = run(sb.as_ref(), spec).await;
    assert_eq!(
        out.trim(),
        "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    );
    let (calls, _, _) = sh(sb.as_ref(), "cat /tmp/spy/calls", None).await;
    assert_eq!(calls, "-u\n-u\n", "a login shell ran `id`");
    p.destroy(&ctx, &sb.info().id).await.unwrap();
}

/// Read a whole file through `fs`.
async fn read_all(fs: &dyn tether_provider::Fs, path: &str) -> Result<Vec<u8>, ErrorCode> {
    let ctx = CallCtx::new("base");
    let mut s = fs
        .read(&ctx, path, tether_protocol::fs::ByteRange::default())
        .await
        .map_err(|e| e.code())?;
    let mut out = Vec::new();
    while let Some(c) = s.next().await {
        out.extend_from_slice(&c.map_err(|e| e.code())?);
    }
    Ok(out)
}

async fn write(
    fs: &dyn tether_provider::Fs,
    path: &str,
    data: &'static [u8],
) -> Result<(), ErrorCode> {
    fs.write(
        &CallCtx::new("base"),
        path,
        tether_provider::util::once_bytes(bytes::Bytes::from_static(data)),
        tether_protocol::fs::WriteGuard::None,
    )
    .await
    .map(|_| ())
    .map_err(|e| e.code())
}

/// E2B's file API (envd) acts with root's rights and gives what it creates to the user
/// asked for: `Sandbox::fs_for`. The kernel grants those rights: the operations run in
/// a helper that joined the sandbox's user namespace as its root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_file_rights_are_the_sandbox_roots_and_what_they_create_is_the_users() {
    let Some((_dir, p, sb)) = base_sandbox().await else {
        return;
    };
    let ctx = CallCtx::new("base");
    let as_user = sb.fs_for("user").unwrap().expect("a view for user");
    let as_root = sb.fs_for("root").unwrap().expect("a view for root");
    assert_eq!(
        sb.fs_for("mallory").err().map(|e| e.code()),
        Some(ErrorCode::InvalidRequest)
    );

    // As `user`: a file in root's /etc, and a new tree at the top, both the user's.
    write(as_user.as_ref(), "/etc/app.conf", b"conf")
        .await
        .unwrap();
    write(as_user.as_ref(), "/0/a/b.txt", b"deep")
        .await
        .unwrap();
    let (out, err, _) = sh(
        sb.as_ref(),
        "stat -c '%U:%G %a' /etc/app.conf /0 /0/a /0/a/b.txt; cat /0/a/b.txt",
        None,
    )
    .await;
    assert_eq!(
        out, "user:user 644\nuser:user 755\nuser:user 755\nuser:user 644\ndeep",
        "{err}"
    );
    // The default view keeps the user's own rights.
    assert_eq!(
        write(sb.fs(), "/etc/other.conf", b"x").await,
        Err(ErrorCode::FsPermissionDenied)
    );

    // As root: /root, private to root, and relative paths start there.
    write(as_root.as_ref(), "/root/secret.txt", b"s3cret")
        .await
        .unwrap();
    write(as_root.as_ref(), "rel.txt", b"r").await.unwrap();
    assert_eq!(
        read_all(as_root.as_ref(), "/root/secret.txt")
            .await
            .unwrap(),
        b"s3cret"
    );
    assert_eq!(
        read_all(sb.fs(), "/root/secret.txt").await,
        Err(ErrorCode::FsPermissionDenied)
    );
    let (out, _, _) = sh(
        sb.as_ref(),
        "stat -c '%U:%G' /root/secret.txt /root/rel.txt; cat /root/secret.txt 2>&1 >/dev/null | grep -c denied",
        Some("root"),
    )
    .await;
    assert_eq!(out, "root:root\nroot:root\n0\n");
    let (out, _, _) = sh(
        sb.as_ref(),
        "cat /root/secret.txt 2>&1 | grep -c denied",
        None,
    )
    .await;
    assert_eq!(out, "1\n", "the user still cannot read root's file");
    // Every operation of the seam.
    let st = as_root.mkdir(&ctx, "/root/d/e", true).await.unwrap();
    assert_eq!(st.path, "/root/d/e");
    let names: Vec<String> = as_root
        .list(&ctx, "/root", 1)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.stat.name)
        .collect();
    assert!(names.contains(&"secret.txt".to_owned()), "{names:?}");
    as_root
        .rename(&ctx, "/root/secret.txt", "/root/d/moved.txt")
        .await
        .unwrap();
    assert_eq!(
        as_root
            .stat(&ctx, "/root/secret.txt")
            .await
            .map_err(|e| e.code())
            .err(),
        Some(ErrorCode::FsNotFound)
    );
    let mut attrs = std::collections::BTreeMap::new();
    attrs.insert("owner".to_owned(), b"root".to_vec());
    as_root
        .set_xattrs(&ctx, "/root/d/moved.txt", "user.e2b.", attrs.clone())
        .await
        .unwrap();
    assert_eq!(
        as_root
            .xattrs(&ctx, "/root/d/moved.txt", "user.e2b.")
            .await
            .unwrap(),
        attrs
    );
    as_root.remove(&ctx, "/root/d", true).await.unwrap();
    assert_eq!(
        as_root
            .stat(&ctx, "/root/d")
            .await
            .map_err(|e| e.code())
            .err(),
        Some(ErrorCode::FsNotFound)
    );

    // A body that breaks publishes nothing and leaves no temporary file.
    let broken = futures_util::stream::iter(vec![
        Ok(bytes::Bytes::from_static(b"half")),
        Err(tether_provider::ProviderError::Internal {
            message: "the body broke".into(),
            source: None,
        }),
    ])
    .boxed();
    let r = as_root
        .write(
            &ctx,
            "/root/rel.txt",
            broken,
            tether_protocol::fs::WriteGuard::None,
        )
        .await;
    assert_eq!(r.map_err(|e| e.code()).err(), Some(ErrorCode::Internal));
    assert_eq!(
        read_all(as_root.as_ref(), "/root/rel.txt").await.unwrap(),
        b"r"
    );
    let (out, _, _) = sh(
        sb.as_ref(),
        "ls -A /root | grep -c tether-write",
        Some("root"),
    )
    .await;
    assert_eq!(out, "0\n", "no temporary file is left");

    // Root's rights end at the sandbox: the host's kernel settings stay the host's, and
    // no link leads out.
    let panic_before = std::fs::read_to_string("/proc/sys/kernel/panic").unwrap();
    assert!(
        write(as_root.as_ref(), "/proc/sys/kernel/panic", b"7")
            .await
            .is_err()
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/panic").unwrap(),
        panic_before
    );
    let (_, err, code) = sh(
        sb.as_ref(),
        "ln -s /proc/1/root/etc/shadow /tmp/out",
        Some("root"),
    )
    .await;
    assert_eq!(code, Some(0), "{err}");
    // What root inside may read, root's view reads: the sandbox's own shadow file,
    // which the user's view may not.
    let own_shadow = read_all(as_root.as_ref(), "/etc/shadow").await.unwrap();
    assert_eq!(
        read_all(sb.fs(), "/etc/shadow").await,
        Err(ErrorCode::FsPermissionDenied)
    );
    // A link through /proc to "another" root lands in the sandbox's own, or nowhere:
    // never on the host's file.
    let host_shadow = std::fs::read("/etc/shadow").unwrap();
    assert_ne!(own_shadow, host_shadow);
    match read_all(as_root.as_ref(), "/tmp/out").await {
        Ok(b) => assert_eq!(b, own_shadow),
        Err(code) => assert_eq!(code, ErrorCode::FsPermissionDenied),
    }
    p.destroy(&ctx, &sb.info().id).await.unwrap();
}
