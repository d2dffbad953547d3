//! A sandbox's root file system: a quota-bounded store and an overlay over a template.
//!
//! ```text
//! <root>/<id>/store.img     sparse ext4 image, as large as the disk limit
//! <root>/<id>/store/        its mount (loop device): upper/ and work/ of the overlay
//! <root>/<id>/rootfs/       the overlay: lower = the template, upper = store/upper
//! ```
//!
//! Every write of the sandbox lands in its own ext4 file system, so a full disk is
//! `ENOSPC` inside the sandbox and nowhere else. Both mounts are made by the sandbox's
//! holder in its own mount namespace ([`crate::init`]): the host's mount table never
//! shows them, and they go away with the sandbox's last process.
//!
//! Templates, under the templates directory:
//! - `host`: a skeleton (empty system directories, `/tmp`, `/home`); the sandbox's init
//!   binds the host's system directories over it read-only. Built on first use in
//!   milliseconds.
//! - `base`: a Debian root file system from `debootstrap` with a user `user` that has
//!   passwordless `sudo`, built by [`build_base`] (minutes) and reused. Its files are
//!   owned by the sandbox uid range, so root inside owns them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tokio::time::Instant;

use tether_provider::{ProviderError, Result};

use crate::error::internal;

/// Packages of the `base` template besides `minbase`.
pub const BASE_PACKAGES: &[&str] = &[
    "sudo",
    "bash",
    "coreutils",
    "python3",
    "git",
    "curl",
    "ca-certificates",
    "procps",
    "iproute2",
    // As in E2B's base template: `python` is python3, and `setfattr`/`getfattr` set the
    // `user.e2b.*` attributes that the files API reports as metadata.
    "python-is-python3",
    "attr",
];

/// The Debian suite of the `base` template.
pub const BASE_SUITE: &str = "bookworm";

/// The name of the sandbox's user in a `base` sandbox.
pub const BASE_USER: &str = "user";

/// The uid of `user` inside a `base` sandbox.
pub const BASE_USER_UID: u32 = 1000;

/// Marker of a complete template build.
const COMPLETE: &str = ".tether-template-complete";

/// A template's lower layer and what the init binds over it.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    pub name: String,
    pub lower: PathBuf,
    pub binds: Vec<PathBuf>,
    /// Files tether supplies in place of binds of the host's: path inside -> content.
    pub bind_texts: BTreeMap<PathBuf, String>,
}

/// Run a program to completion, mapping failure to `INTERNAL` with its stderr.
fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| internal(format!("cannot run {program}"), e))?;
    if out.status.success() {
        return Ok(());
    }
    Err(internal(
        format!("{program} {} failed ({})", args.join(" "), out.status),
        std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
    ))
}

/// Whether `path` is a mount point (in the provider's mount namespace).
pub(crate) fn is_mounted(path: &Path) -> bool {
    mount_source(path).is_some()
}

/// The source of the topmost mount at `path` (in this process's mount namespace): a
/// loop device for a store.
pub(crate) fn mount_source(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    info.lines()
        .rev()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m == want))
        .find_map(|l| l.split_once(" - ")?.1.split(' ').nth(1).map(str::to_owned))
}

/// Create the store image of `size` bytes and its file system (root owned by `owner`).
pub(crate) fn create_store(dir: &Path, size: u64, owner: u32) -> Result<()> {
    let img = dir.join("store.img");
    let f = std::fs::File::create(&img).map_err(|e| internal("cannot create store.img", e))?;
    f.set_len(size)
        .map_err(|e| internal("cannot size store.img", e))?;
    drop(f);
    let img_s = img.to_string_lossy().into_owned();
    let mkfs = crate::client::find_program("mkfs.ext4")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|| "mkfs.ext4".into());
    run(
        &mkfs,
        &[
            "-q",
            "-F",
            "-m",
            "0",
            "-E",
            &format!("lazy_itable_init=1,lazy_journal_init=1,root_owner={owner}:{owner}"),
            &img_s,
        ],
    )
}

/// Mount the store (if it is not) and make sure the overlay's directories exist.
pub(crate) fn mount_store(dir: &Path, owner: u32) -> Result<()> {
    let store = dir.join("store");
    std::fs::create_dir_all(&store).map_err(|e| internal("cannot create store/", e))?;
    if !is_mounted(&store) {
        let img = dir.join("store.img").to_string_lossy().into_owned();
        run(
            "mount",
            &["-o", "loop,nosuid,nodev", &img, &store.to_string_lossy()],
        )?;
    }
    for d in ["upper", "work"] {
        let p = store.join(d);
        if !p.exists() {
            std::fs::create_dir(&p).map_err(|e| internal(format!("cannot create {d}"), e))?;
            std::os::unix::fs::chown(&p, Some(owner), Some(owner))
                .map_err(|e| internal(format!("cannot chown {d}"), e))?;
        }
    }
    Ok(())
}

/// Unmount whatever of a sandbox is mounted in the provider's namespace (the store,
/// while a snapshot is copied into it; an older layout's mounts). Lazily: a process
/// that still holds them keeps them until it lets go.
pub(crate) fn unmount(dir: &Path) {
    for m in ["rootfs", "store"] {
        let p = dir.join(m);
        if is_mounted(&p) {
            let _ = rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Bytes used and total on a sandbox's store, through its root (an overlay reports
/// its upper layer's file system).
pub(crate) fn disk_usage(root: &Path) -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(root).ok()?;
    let total = st.f_blocks * st.f_frsize;
    let free = st.f_bfree * st.f_frsize;
    Some((total.saturating_sub(free), total))
}

/// Bytes free on a sandbox's store, through its root.
pub(crate) fn disk_free(root: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(root).ok()?;
    Some(st.f_bavail * st.f_frsize)
}

/// The `host` template: build its skeleton if needed.
pub(crate) fn host_template(
    templates: &Path,
    binds: &[PathBuf],
    home: &Path,
    owner: u32,
) -> Result<Template> {
    let dir = templates.join("host");
    let lower = dir.join("rootfs");
    if !dir.join(COMPLETE).exists() {
        let tmp = templates.join(format!(".host-{}", uuid::Uuid::new_v4().simple()));
        let skel = tmp.join("rootfs");
        build_skeleton(&skel, binds, home, owner)
            .map_err(|e| internal("cannot build the host template", e))?;
        std::fs::write(tmp.join(COMPLETE), b"")
            .map_err(|e| internal("cannot build the host template", e))?;
        // Another provider may have won the race: theirs is as good as ours.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    // The host's `/etc/profile`, made cheap as the base template's is, shown in its place
    // (read at every start: a changed host file is what the next sandbox sees).
    let mut bind_texts = BTreeMap::new();
    let profile = Path::new("/etc/profile");
    if binds.iter().any(|b| b == profile)
        && let Some(tuned) = std::fs::read_to_string(profile)
            .ok()
            .and_then(|t| tune_profile(&t))
    {
        bind_texts.insert(profile.to_owned(), tuned);
    }
    Ok(Template {
        name: "host".into(),
        lower,
        binds: binds.to_vec(),
        bind_texts,
    })
}

/// `profile` with its `"$(id -u)"` (a subshell and a program on every login shell, about
/// a millisecond) asked of bash's `$EUID` first; other shells, which have no `$EUID`,
/// still run `id`. `None` when there is nothing to change.
pub(crate) fn tune_profile(profile: &str) -> Option<String> {
    let tuned = profile.replace("\"$(id -u)\"", "\"${EUID:-$(id -u)}\"");
    (tuned != profile).then_some(tuned)
}

fn build_skeleton(skel: &Path, binds: &[PathBuf], home: &Path, owner: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{PermissionsExt, symlink};
    std::fs::create_dir_all(skel)?;
    let mut dirs: Vec<PathBuf> = [
        "etc",
        "dev",
        "proc",
        "sys",
        "run",
        "tmp",
        "root",
        "home",
        "mnt",
        "srv",
        "var/tmp",
        "var/lib",
        "var/cache",
        "var/log",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    if let Some(rel) = home.strip_prefix("/").ok().and_then(|h| h.parent()) {
        dirs.push(rel.to_owned());
    }
    for d in &dirs {
        std::fs::create_dir_all(skel.join(d))?;
    }
    for p in binds {
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            continue;
        };
        let rel = skel.join(p.strip_prefix("/").unwrap_or(p));
        if let Some(parent) = rel.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(p)?;
            let _ = symlink(target, &rel);
        } else if meta.is_dir() {
            std::fs::create_dir_all(&rel)?;
        } else {
            std::fs::write(&rel, b"")?;
        }
    }
    for d in ["tmp", "var/tmp"] {
        std::fs::set_permissions(skel.join(d), std::fs::Permissions::from_mode(0o1777))?;
    }
    std::fs::set_permissions(skel.join("root"), std::fs::Permissions::from_mode(0o700))?;
    // Root inside owns the skeleton's directories.
    chown_tree(skel, owner)?;
    Ok(())
}

fn chown_tree(dir: &Path, owner: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(dir, Some(owner), Some(owner))?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            chown_tree(&e.path(), owner)?;
        } else {
            std::os::unix::fs::lchown(e.path(), Some(owner), Some(owner))?;
        }
    }
    Ok(())
}

/// The `base` template, if it has been built.
pub(crate) fn base_template(templates: &Path) -> Option<Template> {
    let dir = templates.join("base");
    dir.join(COMPLETE).exists().then(|| Template {
        name: "base".into(),
        lower: dir.join("rootfs"),
        binds: Vec::new(),
        bind_texts: BTreeMap::new(),
    })
}

/// What [`build_base`] reports while it works.
#[derive(Debug, Clone, PartialEq)]
pub enum BuildProgress {
    /// A step started.
    Step(String),
    /// A line of the builder's output.
    Line(String),
    /// Done: the template's size and the time it took.
    Done {
        /// Bytes on disk.
        bytes: u64,
        /// Seconds.
        seconds: f64,
    },
}

/// Build the `base` template under `templates` (Debian from `mirror`, debootstrap's
/// `minbase` plus [`BASE_PACKAGES`]) unless it exists; `progress` is told each step.
/// The files are shifted into the uid range starting at `uid_base`.
pub fn build_base(
    templates: &Path,
    mirror: Option<&str>,
    uid_base: u32,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<PathBuf> {
    let dir = templates.join("base");
    if dir.join(COMPLETE).exists() {
        // A template built with fewer packages keeps what it has (sandboxes may run on
        // it): removing it and building again adds them.
        let had = std::fs::read_to_string(dir.join(COMPLETE)).unwrap_or_default();
        let missing: Vec<&str> = BASE_PACKAGES
            .iter()
            .copied()
            .filter(|p| !had.split_whitespace().any(|h| h == *p))
            .collect();
        if !missing.is_empty() {
            progress(BuildProgress::Step(format!(
                "this template was built without {}: remove {} and build it again to add them",
                missing.join(", "),
                dir.display()
            )));
        }
        // A template built before the current tuning gets it now (this runs before
        // sandboxes are made from it, by `tether template build`).
        if !dir.join(BASE_TUNING).exists() {
            progress(BuildProgress::Step("tune the login shell".into()));
            tune_base(&dir.join("rootfs"))?;
            std::fs::write(dir.join(BASE_TUNING), b"")
                .map_err(|e| internal("cannot mark the tuning", e))?;
        }
        return Ok(dir.join("rootfs"));
    }
    let started = Instant::now();
    std::fs::create_dir_all(templates)
        .map_err(|e| internal("cannot create the templates dir", e))?;
    let tmp = templates.join(format!(".base-{}", uuid::Uuid::new_v4().simple()));
    let rootfs = tmp.join("rootfs");
    std::fs::create_dir_all(&rootfs).map_err(|e| internal("cannot create the build dir", e))?;
    let result = (|| {
        progress(BuildProgress::Step(format!(
            "debootstrap {BASE_SUITE} (minbase + {})",
            BASE_PACKAGES.join(",")
        )));
        let mut args = vec![
            "--variant=minbase".to_owned(),
            format!("--include={}", BASE_PACKAGES.join(",")),
            BASE_SUITE.to_owned(),
            rootfs.to_string_lossy().into_owned(),
        ];
        if let Some(m) = mirror {
            args.push(m.to_owned());
        }
        stream("debootstrap", &args, progress)?;
        progress(BuildProgress::Step(
            "user `user` with passwordless sudo".into(),
        ));
        configure_base(&rootfs)?;
        tune_base(&rootfs)?;
        progress(BuildProgress::Step(format!(
            "shift ownership to {uid_base}+"
        )));
        shift_tree(&rootfs, uid_base)
            .map_err(|e| internal("cannot shift the template's ownership", e))?;
        std::fs::write(tmp.join(BASE_TUNING), b"").map_err(|e| internal("cannot finish", e))?;
        // The marker names the packages the template was built with.
        std::fs::write(tmp.join(COMPLETE), BASE_PACKAGES.join("\n"))
            .map_err(|e| internal("cannot finish", e))?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let bytes = du(&dir.join("rootfs"));
    progress(BuildProgress::Done {
        bytes,
        seconds: started.elapsed().as_secs_f64(),
    });
    Ok(dir.join("rootfs"))
}

fn stream(program: &str, args: &[String], progress: &mut dyn FnMut(BuildProgress)) -> Result<()> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| internal(format!("cannot run {program}"), e))?;
    if let Some(out) = child.stdout.take() {
        for line in std::io::BufReader::new(out)
            .lines()
            .map_while(std::result::Result::ok)
        {
            progress(BuildProgress::Line(line));
        }
    }
    let status = child
        .wait()
        .map_err(|e| internal(format!("cannot wait for {program}"), e))?;
    if status.success() {
        Ok(())
    } else {
        Err(ProviderError::Unavailable {
            message: format!("{program} failed ({status})"),
            retry_after: None,
            source: None,
        })
    }
}

fn configure_base(rootfs: &Path) -> Result<()> {
    let chroot = |args: &[&str]| {
        let mut a = vec![rootfs.to_str().unwrap_or("/nonexistent")];
        a.extend_from_slice(args);
        run("chroot", &a)
    };
    chroot(&[
        "/usr/sbin/useradd",
        "-m",
        "-u",
        &BASE_USER_UID.to_string(),
        "-s",
        "/bin/bash",
        "user",
    ])?;
    let sudoers = rootfs.join("etc/sudoers.d/user");
    std::fs::write(&sudoers, "user ALL=(ALL:ALL) NOPASSWD: ALL\n")
        .map_err(|e| internal("cannot write sudoers", e))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sudoers, std::fs::Permissions::from_mode(0o440))
            .map_err(|e| internal("cannot chmod sudoers", e))?;
    }
    // Nothing of the build host's identity stays in the template.
    let _ = std::fs::write(rootfs.join("etc/hostname"), "sandbox\n");
    let _ = std::fs::remove_dir_all(rootfs.join("var/cache/apt/archives"));
    let _ = std::fs::create_dir_all(rootfs.join("var/cache/apt/archives/partial"));
    Ok(())
}

/// Marks a base template that has [`tune_base`]'s changes (bump it when they change).
const BASE_TUNING: &str = ".tuned-1";

/// Make a login shell cheap ([`tune_profile`] on `/etc/profile`: every shell command is
/// a `bash -l`). Idempotent; the file keeps its owner and mode.
fn tune_base(rootfs: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let profile = rootfs.join("etc/profile");
    let Some(tuned) = std::fs::read_to_string(&profile)
        .ok()
        .and_then(|t| tune_profile(&t))
    else {
        return Ok(());
    };
    let meta = std::fs::metadata(&profile).map_err(|e| internal("cannot stat /etc/profile", e))?;
    let tmp = rootfs.join("etc/.profile.tether");
    let write = || -> std::io::Result<()> {
        std::fs::write(&tmp, &tuned)?;
        std::os::unix::fs::chown(&tmp, Some(meta.uid()), Some(meta.gid()))?;
        std::fs::set_permissions(&tmp, meta.permissions())?;
        std::fs::rename(&tmp, &profile)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        internal("cannot tune /etc/profile", e)
    })
}

/// Add `base` to the owner and group of every file below `dir`, keeping set-id bits
/// (chown clears them).
fn shift_tree(dir: &Path, base: u32) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    shift_one(dir, &meta, base)?;
    if meta.is_dir() {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let p = e.path();
            let m = std::fs::symlink_metadata(&p)?;
            if m.is_dir() {
                shift_tree(&p, base)?;
            } else {
                shift_one(&p, &m, base)?;
            }
        }
    }
    Ok(())
}

fn shift_one(p: &Path, m: &std::fs::Metadata, base: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if m.uid() >= base {
        return Ok(());
    }
    std::os::unix::fs::lchown(p, Some(m.uid() + base), Some(m.gid() + base))?;
    let special = m.mode() & 0o7000;
    if special != 0 && !m.file_type().is_symlink() {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m.mode() & 0o7777))?;
    }
    Ok(())
}

fn du(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if let Ok(m) = std::fs::symlink_metadata(e.path()) {
                total += m.blocks() * 512;
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    total
}
