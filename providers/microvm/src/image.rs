//! The guest image: Debian's cloud kernel, a busybox initramfs, and an ext4 root file
//! system made from the local provider's `base` template with the guest agent in it.
//!
//! [`build_guest`] makes it (or finds it built) under a directory named by a cache key
//! over everything that goes in: the kernel package and its version, the agent binary's
//! hash, the template's stamp, the disk size and the init script. The kernel is fetched
//! with `apt-get download` of the package `linux-image-cloud-amd64` depends on and
//! unpacked with `dpkg-deb` (nothing is installed on the host); its virtio drivers are
//! modules, loaded by the initramfs in dependency order. The initramfs sets up `lo` and
//! `eth0` (10.0.2.15/24 via 10.0.2.2, slirp's addresses, static: faster than DHCP),
//! mounts `/dev/vda` (ext4) and `switch_root`s into it, running
//! `/usr/local/bin/tether-guest init` as PID 1.
//!
//! Everything here is blocking (it runs programs and copies a file tree): call it from
//! `spawn_blocking`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tether_provider::{ProviderError, Result};

use crate::error::internal;

/// The metapackage whose dependency is the kernel to boot.
pub const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";
/// Kernel modules the initramfs loads, in dependency order (`virtio` needs
/// `virtio_ring`, `virtio_net` needs `net_failover`, ...; the .deb has no `modules.dep`).
/// `loop` and `overlay` make the guest a machine that can mount images and run container
/// tools (and tether's own local provider, whose sandboxes stand on both).
pub const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_blk",
    "loop",
    "overlay",
];
/// Where the agent lives in the guest.
pub const GUEST_AGENT_PATH: &str = "usr/local/bin/tether-guest";
/// The marker of a complete template directory of the local provider.
const TEMPLATE_COMPLETE: &str = ".tether-template-complete";
/// The marker (and manifest) of a complete guest image.
const MANIFEST: &str = "manifest.json";
/// Bumped when the layout of the image changes.
const IMAGE_FORMAT: &str = "tether-microvm-image/1";

/// The initramfs's `/init`. Markers on the console (`TETHER_*`) tell a failed boot's
/// stage in the console log.
pub const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do
  insmod /lib/modules/$m.ko || echo "TETHER_INSMOD_FAILED $m"
done
ip link set lo up
ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
if mount -t ext4 -o rw /dev/vda /newroot; then
  echo "TETHER_ROOT_MOUNTED uptime=$(cut -d' ' -f1 /proc/uptime)"
  umount /proc /sys
  mount --move /dev /newroot/dev
  exec switch_root /newroot /usr/local/bin/tether-guest init
fi
echo "TETHER_ROOT_MOUNT_FAILED"
poweroff -f
"#;

/// What to build the guest from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestSpec {
    /// Directory of built images (one subdirectory per cache key).
    pub out_dir: PathBuf,
    /// The local provider's `base` template directory (holding `rootfs/`).
    pub template: PathBuf,
    /// uid/gid shift of the template's files.
    pub template_uid_base: u32,
    /// The static guest agent.
    pub agent: PathBuf,
    /// Size of the root file system, MiB.
    pub disk_mib: u64,
}

/// A built guest image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestImage {
    /// [`IMAGE_FORMAT`].
    pub format: String,
    /// The cache key (hex).
    pub key: String,
    /// The image's directory.
    pub dir: PathBuf,
    /// The kernel (bzImage).
    pub kernel: PathBuf,
    /// The initramfs (gzip'd cpio).
    pub initrd: PathBuf,
    /// The root file system (raw ext4).
    pub rootfs: PathBuf,
    /// The kernel package and version it came from.
    pub kernel_package: String,
    /// Size of the root file system, bytes.
    pub disk_bytes: u64,
}

/// What [`build_guest`] reports while it works.
#[derive(Debug, Clone, PartialEq)]
pub enum GuestProgress {
    /// A step started.
    Step(String),
    /// Done (or found built: `cached`).
    Done {
        /// The cache key.
        key: String,
        /// Seconds it took.
        seconds: f64,
        /// Nothing was built.
        cached: bool,
    },
}

/// Build the guest image of `spec` unless it is built already; `progress` is told each
/// step. Returns the image.
pub fn build_guest(
    spec: &GuestSpec,
    progress: &mut dyn FnMut(GuestProgress),
) -> Result<GuestImage> {
    let started = tokio::time::Instant::now();
    check_tools()?;
    let (key, kernel) = image_key(spec)?;
    let dir = spec.out_dir.join(&key);
    if let Some(img) = read_manifest(&dir) {
        progress(GuestProgress::Done {
            key,
            seconds: started.elapsed().as_secs_f64(),
            cached: true,
        });
        return Ok(img);
    }
    std::fs::create_dir_all(&spec.out_dir)
        .map_err(|e| internal("cannot create the image dir", e))?;
    let tmp = spec
        .out_dir
        .join(format!(".build-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&tmp).map_err(|e| internal("cannot create the build dir", e))?;
    let result = build_into(spec, &kernel, &key, &tmp, &dir, progress);
    match result {
        Ok(img) => {
            if std::fs::rename(&tmp, &dir).is_err() {
                // Built at the same time by someone else: theirs is as good.
                let _ = std::fs::remove_dir_all(&tmp);
            }
            let img = read_manifest(&dir).unwrap_or(img);
            progress(GuestProgress::Done {
                key,
                seconds: started.elapsed().as_secs_f64(),
                cached: false,
            });
            Ok(img)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

/// The image of `spec` if it is built.
pub fn find_guest(spec: &GuestSpec) -> Option<GuestImage> {
    let (key, _) = image_key(spec).ok()?;
    read_manifest(&spec.out_dir.join(key))
}

/// The cache key of `spec`'s image, over everything that goes into it.
fn image_key(spec: &GuestSpec) -> Result<(String, KernelPackage)> {
    let template_stamp = template_stamp(&spec.template)?;
    let agent_hash = sha256_file(&spec.agent)?;
    let kernel = kernel_package(&spec.out_dir)?;
    let mut h = Sha256::new();
    for part in [
        IMAGE_FORMAT,
        &kernel.id(),
        &agent_hash,
        &template_stamp,
        &spec.disk_mib.to_string(),
        INIT_SCRIPT,
        &MODULES.join(" "),
    ] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    Ok((hex::encode(h.finalize())[..16].to_owned(), kernel))
}

fn build_into(
    spec: &GuestSpec,
    kernel: &KernelPackage,
    key: &str,
    tmp: &Path,
    final_dir: &Path,
    progress: &mut dyn FnMut(GuestProgress),
) -> Result<GuestImage> {
    // 1. The kernel and its modules (cached apart: an agent change does not fetch again).
    let kdir = fetch_kernel(&spec.out_dir, kernel, progress)?;
    std::fs::copy(kdir.join("vmlinuz"), tmp.join("vmlinuz"))
        .map_err(|e| internal("cannot copy the kernel", e))?;

    // 2. The initramfs.
    progress(GuestProgress::Step(format!(
        "initramfs: busybox, modules {}",
        MODULES.join(" ")
    )));
    let ir = tmp.join("initramfs");
    for d in [
        "bin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "newroot",
        "lib/modules",
    ] {
        std::fs::create_dir_all(ir.join(d))
            .map_err(|e| internal("cannot make the initramfs", e))?;
    }
    std::fs::copy(busybox()?, ir.join("bin/busybox"))
        .map_err(|e| internal("cannot copy busybox", e))?;
    let mut order = Vec::new();
    for m in MODULES {
        let src = kdir.join("modules").join(format!("{m}.ko"));
        if src.exists() {
            std::fs::copy(&src, ir.join("lib/modules").join(format!("{m}.ko")))
                .map_err(|e| internal("cannot copy a module", e))?;
            order.push(*m);
        } else {
            progress(GuestProgress::Step(format!(
                "module {m} is not in the package (built in?)"
            )));
        }
    }
    std::fs::write(ir.join("lib/modules/order"), order.join(" ") + "\n")
        .map_err(|e| internal("cannot write the module order", e))?;
    write_exec(&ir.join("init"), INIT_SCRIPT)?;
    let initrd = tmp.join("initrd.gz");
    let out =
        std::fs::File::create(&initrd).map_err(|e| internal("cannot create the initrd", e))?;
    run_to(
        Command::new("sh")
            .arg("-c")
            .arg("find . | cpio -o -H newc --quiet | gzip -1")
            .current_dir(&ir)
            .stdout(out),
        "cpio",
    )?;
    let _ = std::fs::remove_dir_all(&ir);

    // 3. The root file system: the template, its ownership shifted back, the agent in it.
    progress(GuestProgress::Step(format!(
        "root file system from {} ({} MiB ext4)",
        spec.template.display(),
        spec.disk_mib
    )));
    let staging = tmp.join("rootfs");
    run_to(
        Command::new("cp")
            .arg("-a")
            .arg(spec.template.join("rootfs"))
            .arg(&staging),
        "cp",
    )?;
    unshift_tree(&staging, spec.template_uid_base)
        .map_err(|e| internal("cannot shift the template's ownership back", e))?;
    let agent_dst = staging.join(GUEST_AGENT_PATH);
    if let Some(p) = agent_dst.parent() {
        std::fs::create_dir_all(p).map_err(|e| internal("cannot make /usr/local/bin", e))?;
    }
    std::fs::copy(&spec.agent, &agent_dst).map_err(|e| internal("cannot copy the agent", e))?;
    set_mode(&agent_dst, 0o755)?;
    // slirp's DNS; the guest has no DHCP client.
    let _ = std::fs::remove_file(staging.join("etc/resolv.conf"));
    std::fs::write(staging.join("etc/resolv.conf"), "nameserver 10.0.2.3\n")
        .map_err(|e| internal("cannot write resolv.conf", e))?;
    std::fs::write(staging.join("etc/hostname"), "sandbox\n")
        .map_err(|e| internal("cannot write hostname", e))?;
    let rootfs = tmp.join("rootfs.ext4");
    let disk_bytes = spec.disk_mib << 20;
    std::fs::File::create(&rootfs)
        .and_then(|f| f.set_len(disk_bytes))
        .map_err(|e| internal("cannot create the disk image", e))?;
    progress(GuestProgress::Step("mkfs.ext4".into()));
    run_to(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "tetherroot", "-d"])
            .arg(&staging)
            .arg(&rootfs),
        "mkfs.ext4",
    )?;
    std::fs::remove_dir_all(&staging).map_err(|e| internal("cannot remove the staging tree", e))?;

    let img = GuestImage {
        format: IMAGE_FORMAT.into(),
        key: key.to_owned(),
        dir: final_dir.to_owned(),
        kernel: final_dir.join("vmlinuz"),
        initrd: final_dir.join("initrd.gz"),
        rootfs: final_dir.join("rootfs.ext4"),
        kernel_package: kernel.id(),
        disk_bytes,
    };
    let json =
        serde_json::to_vec_pretty(&img).map_err(|e| internal("cannot encode the manifest", e))?;
    std::fs::write(tmp.join(MANIFEST), json)
        .map_err(|e| internal("cannot write the manifest", e))?;
    Ok(img)
}

fn read_manifest(dir: &Path) -> Option<GuestImage> {
    let bytes = std::fs::read(dir.join(MANIFEST)).ok()?;
    let img: GuestImage = serde_json::from_slice(&bytes).ok()?;
    (img.format == IMAGE_FORMAT && img.dir == dir && img.rootfs.exists()).then_some(img)
}

/// The kernel package to boot.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KernelPackage {
    name: String,
    version: String,
}

impl KernelPackage {
    fn id(&self) -> String {
        format!("{}_{}", self.name, self.version)
    }
}

/// The package `linux-image-cloud-amd64` depends on and its candidate version; without
/// apt's lists, the newest kernel fetched before.
fn kernel_package(out_dir: &Path) -> Result<KernelPackage> {
    let from_apt = (|| {
        let deps = output(Command::new("apt-cache").args(["depends", KERNEL_METAPACKAGE]))?;
        let name = deps
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| p.starts_with("linux-image-"))?
            .trim()
            .to_owned();
        let show = output(Command::new("apt-cache").args(["show", "--no-all-versions", &name]))?;
        let version = show
            .lines()
            .find_map(|l| l.strip_prefix("Version: "))?
            .trim()
            .to_owned();
        Some(KernelPackage { name, version })
    })();
    if let Some(k) = from_apt {
        return Ok(k);
    }
    let mut cached: Vec<String> = std::fs::read_dir(out_dir.join("kernel"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("vmlinuz").exists())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    cached.sort();
    match cached.pop().and_then(|id| {
        let (n, v) = id.split_once('_')?;
        Some(KernelPackage {
            name: n.to_owned(),
            version: v.to_owned(),
        })
    }) {
        Some(k) => Ok(k),
        None => Err(ProviderError::Unavailable {
            message: format!(
                "microvm: apt knows no {KERNEL_METAPACKAGE} (run `apt-get update`) and no kernel was fetched before"
            ),
            retry_after: None,
            source: None,
        }),
    }
}

/// `<out>/kernel/<pkg>_<ver>-<modules>/{vmlinuz, modules/*.ko}`, fetched unless there
/// (the directory is named by the module list too: a list that grows fetches again).
fn fetch_kernel(
    out_dir: &Path,
    k: &KernelPackage,
    progress: &mut dyn FnMut(GuestProgress),
) -> Result<PathBuf> {
    let modules = hex::encode(Sha256::digest(MODULES.join(" ")));
    let dir = out_dir
        .join("kernel")
        .join(format!("{}-{}", k.id(), &modules[..8]));
    if dir.join("vmlinuz").exists() {
        return Ok(dir);
    }
    progress(GuestProgress::Step(format!(
        "kernel: apt-get download {}={}",
        k.name, k.version
    )));
    let tmp = out_dir.join(format!(".kernel-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(tmp.join("deb"))
        .map_err(|e| internal("cannot create the kernel dir", e))?;
    let r = (|| {
        run_to(
            Command::new("apt-get")
                .args(["download", "-q", &format!("{}={}", k.name, k.version)])
                .current_dir(tmp.join("deb")),
            "apt-get download",
        )?;
        let deb = std::fs::read_dir(tmp.join("deb"))
            .map_err(|e| internal("cannot read the download dir", e))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or_else(|| internal_msg("apt-get download left no .deb"))?;
        progress(GuestProgress::Step("kernel: dpkg-deb -x".into()));
        run_to(
            Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(tmp.join("x")),
            "dpkg-deb",
        )?;
        let vmlinuz = std::fs::read_dir(tmp.join("x/boot"))
            .map_err(|e| internal("the package has no /boot", e))?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("vmlinuz-"))
            })
            .ok_or_else(|| internal_msg("the package has no vmlinuz"))?;
        let out = tmp.join("out");
        std::fs::create_dir_all(out.join("modules")).map_err(|e| internal("mkdir", e))?;
        std::fs::copy(&vmlinuz, out.join("vmlinuz"))
            .map_err(|e| internal("cannot copy vmlinuz", e))?;
        let mut found = Vec::new();
        find_modules(&tmp.join("x/lib/modules"), &mut found);
        for (name, path) in found {
            if MODULES.contains(&name.as_str()) {
                std::fs::copy(&path, out.join("modules").join(format!("{name}.ko")))
                    .map_err(|e| internal("cannot copy a module", e))?;
            }
        }
        if let Some(p) = dir.parent() {
            std::fs::create_dir_all(p).map_err(|e| internal("mkdir", e))?;
        }
        if std::fs::rename(&out, &dir).is_err() && !dir.join("vmlinuz").exists() {
            return Err(internal_msg("cannot move the kernel into place"));
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    r.map(|()| dir)
}

/// Every `NAME.ko` below `dir` (names with `-` and `_` both kept as the file has them).
fn find_modules(dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            find_modules(&p, out);
        } else if let Some(n) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".ko"))
        {
            out.push((n.to_owned(), p.clone()));
        }
    }
}

/// The template's identity: its path and when it was completed.
fn template_stamp(template: &Path) -> Result<String> {
    let marker = template.join(TEMPLATE_COMPLETE);
    let meta = std::fs::metadata(&marker).map_err(|_| ProviderError::Unavailable {
        message: format!(
            "microvm: the base template {} is not built (`tether template build base`)",
            template.display()
        ),
        retry_after: None,
        source: None,
    })?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{}@{mtime}", template.display()))
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| ProviderError::Unavailable {
        message: format!(
            "microvm: the guest agent {} cannot be read: {e}",
            path.display()
        ),
        retry_after: None,
        source: Some(Box::new(e)),
    })?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| internal("cannot read the agent", e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// The host tools the build needs, each checked up front so a missing one is named.
fn check_tools() -> Result<()> {
    let missing: Vec<&str> = [
        "apt-get",
        "apt-cache",
        "dpkg-deb",
        "cpio",
        "gzip",
        "mkfs.ext4",
        "cp",
    ]
    .into_iter()
    .filter(|t| which(t).is_none())
    .collect();
    if busybox().is_err() {
        return Err(unavailable(
            "busybox (static) is missing: apt-get install busybox-static",
        ));
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(unavailable(&format!(
            "missing host tools: {} (apt-get install cpio e2fsprogs)",
            missing.join(", ")
        )))
    }
}

/// A statically linked busybox (the initramfs has no libc): Debian's `busybox` package
/// installs a dynamic one at the same path.
fn busybox() -> Result<PathBuf> {
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        let p = Path::new(p);
        if p.exists() {
            return match std::fs::read(p).ok().and_then(|b| elf_interpreter(&b)) {
                Some(false) => Ok(p.to_owned()),
                _ => Err(unavailable(
                    "busybox is not statically linked: apt-get install busybox-static",
                )),
            };
        }
    }
    Err(unavailable("busybox is missing"))
}

/// Whether the 64-bit little-endian ELF image `b` asks for a program interpreter
/// (`PT_INTERP`: dynamically linked); `None` if it is not such an ELF file. Hand-written
/// because it reads three header fields, less than a dependency would cost.
pub(crate) fn elf_interpreter(b: &[u8]) -> Option<bool> {
    if b.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let p_type = u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?);
        if p_type == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// `prog` on `PATH`.
pub(crate) fn which(prog: &str) -> Option<PathBuf> {
    if prog.contains('/') {
        return Path::new(prog).exists().then(|| PathBuf::from(prog));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

fn unavailable(m: &str) -> ProviderError {
    ProviderError::Unavailable {
        message: format!("microvm: {m}"),
        retry_after: None,
        source: None,
    }
}

fn internal_msg(m: &str) -> ProviderError {
    ProviderError::Internal {
        message: format!("microvm image: {m}"),
        source: None,
    }
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Run `cmd` to its end; a failure carries the last lines of its stderr.
fn run_to(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| internal(&format!("cannot run {what}"), e))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(5).collect();
    Err(ProviderError::Unavailable {
        message: format!(
            "microvm image: {what} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ),
        retry_after: None,
        source: None,
    })
}

fn write_exec(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| internal("cannot write a script", e))?;
    set_mode(path, 0o755)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| internal("cannot chmod", e))
}

/// Subtract `base` from the owner and group of every file below `dir` that has them
/// shifted (the local provider's templates are owned by `base + n`), keeping set-id bits
/// (chown clears them).
fn unshift_tree(dir: &Path, base: u32) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    unshift_one(dir, &meta, base)?;
    if meta.is_dir() {
        for e in std::fs::read_dir(dir)? {
            let p = e?.path();
            let m = std::fs::symlink_metadata(&p)?;
            if m.is_dir() {
                unshift_tree(&p, base)?;
            } else {
                unshift_one(&p, &m, base)?;
            }
        }
    }
    Ok(())
}

fn unshift_one(p: &Path, m: &std::fs::Metadata, base: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let back = |id: u32| if id >= base { id - base } else { id };
    let (uid, gid) = (back(m.uid()), back(m.gid()));
    if (uid, gid) == (m.uid(), m.gid()) {
        return Ok(());
    }
    std::os::unix::fs::lchown(p, Some(uid), Some(gid))?;
    if !m.file_type().is_symlink() && m.mode() & 0o6000 != 0 {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m.mode() & 0o7777))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_script_loads_modules_mounts_the_root_and_hands_over_to_the_agent() {
        assert!(INIT_SCRIPT.contains("ip addr add 10.0.2.15/24 dev eth0"));
        assert!(INIT_SCRIPT.contains("ip route add default via 10.0.2.2"));
        assert!(INIT_SCRIPT.contains("mount -t ext4 -o rw /dev/vda /newroot"));
        assert!(INIT_SCRIPT.contains("exec switch_root /newroot /usr/local/bin/tether-guest init"));
        assert_eq!(
            format!("/{GUEST_AGENT_PATH}"),
            "/usr/local/bin/tether-guest"
        );
        // Dependency order: each module after the ones it needs.
        let pos = |m: &str| MODULES.iter().position(|x| *x == m).unwrap_or(usize::MAX);
        assert!(pos("virtio_ring") < pos("virtio"));
        assert!(pos("virtio") < pos("virtio_mmio"));
        assert!(pos("failover") < pos("net_failover"));
        assert!(pos("net_failover") < pos("virtio_net"));
        assert!(pos("virtio") < pos("virtio_blk"));
    }

    #[test]
    fn unshift_moves_owners_back_and_keeps_setid_bits() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("su");
        std::fs::write(&f, b"x").unwrap();
        std::os::unix::fs::lchown(&f, Some(100_000), Some(100_042)).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o4755)).unwrap();
        let l = d.path().join("link");
        std::os::unix::fs::symlink("su", &l).unwrap();
        std::os::unix::fs::lchown(&l, Some(100_007), Some(100_007)).unwrap();
        let plain = d.path().join("plain");
        std::fs::write(&plain, b"y").unwrap();
        std::os::unix::fs::lchown(&plain, Some(5), Some(5)).unwrap();
        unshift_tree(d.path(), 100_000).unwrap();
        let m = std::fs::metadata(&f).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 42));
        assert_eq!(m.mode() & 0o7777, 0o4755);
        let m = std::fs::symlink_metadata(&l).unwrap();
        assert_eq!((m.uid(), m.gid()), (7, 7));
        let m = std::fs::metadata(&plain).unwrap();
        assert_eq!((m.uid(), m.gid()), (5, 5));
    }

    #[test]
    fn a_dynamically_linked_program_is_told_from_a_static_one() {
        // This test binary is dynamically linked (or static-pie without an interpreter):
        // either way it is an ELF file the check reads.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(elf_interpreter(&me).is_some());
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(elf_interpreter(&sh), Some(true));
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_interpreter(b"\x7fELF"), None);
        if let Ok(bb) = std::fs::read("/bin/busybox") {
            assert!(elf_interpreter(&bb).is_some());
        }
    }

    #[test]
    fn a_missing_template_or_agent_is_unavailable_with_a_clear_code() {
        let d = tempfile::tempdir().unwrap();
        let e = template_stamp(&d.path().join("base")).unwrap_err();
        assert_eq!(e.code(), tether_protocol::ErrorCode::ProviderUnavailable);
        let e = sha256_file(&d.path().join("tether-guest")).unwrap_err();
        assert_eq!(e.code(), tether_protocol::ErrorCode::ProviderUnavailable);
    }
}
