//! PID 1 of the guest: kernel file systems, the server, and the reaping of orphans.
//!
//! Single-threaded and without a runtime: it blocks in `waitpid(-1)`, which reaps every
//! process whose parent died (they are all re-parented here), and starts the server
//! again when it ends (its state, the session log, is on disk).

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

// Without a runtime this is the monotonic clock itself.
use tokio::time::Instant;

use nix::mount::{MsFlags, mount};
use nix::sys::wait::{WaitStatus, waitpid};

/// Least time between two starts of the server.
const RESTART_EVERY: Duration = Duration::from_secs(1);

/// The kernel file systems of the guest: (source, target, type, flags, data).
const MOUNTS: &[(&str, &str, &str, u64, &str)] = &[
    ("proc", "/proc", "proc", 0, ""),
    ("sysfs", "/sys", "sysfs", 0, ""),
    // One unified hierarchy with every controller, as a systemd distribution mounts it.
    ("cgroup2", "/sys/fs/cgroup", "cgroup2", 0, "nsdelegate"),
    ("devtmpfs", "/dev", "devtmpfs", 0, "mode=0755"),
    ("devpts", "/dev/pts", "devpts", 0, "mode=0620,ptmxmode=0666"),
    ("tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", 0, "mode=0755"),
];

fn mount_all() {
    for (src, target, fstype, flags, data) in MOUNTS {
        let _ = std::fs::create_dir_all(target);
        let data = (!data.is_empty()).then_some(*data);
        // Already mounted (the initramfs moved /dev here) is fine.
        if let Err(e) = mount(
            Some(*src),
            *target,
            Some(*fstype),
            MsFlags::from_bits_truncate(*flags) | MsFlags::MS_NOSUID,
            data,
        ) && e != nix::errno::Errno::EBUSY
        {
            eprintln!("tether-guest: mount {target}: {e}");
        }
    }
    let _ = std::os::unix::fs::symlink("/proc/self/fd", "/dev/fd");
    let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    for d in ["/tmp", "/var/tmp"] {
        let _ = std::fs::create_dir_all(d);
        let _ = nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            d,
            nix::sys::stat::Mode::from_bits_truncate(0o1777),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        );
    }
    if Path::new("/etc/hostname").exists()
        && let Ok(h) = std::fs::read_to_string("/etc/hostname")
    {
        let _ = nix::unistd::sethostname(h.trim());
    }
}

fn start_server() -> Option<u32> {
    match std::process::Command::new("/proc/self/exe")
        .arg("serve")
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("HOME", "/root")
        .spawn()
    {
        Ok(child) => Some(child.id()),
        Err(e) => {
            eprintln!("tether-guest: cannot start the server: {e}");
            None
        }
    }
}

/// `tether-guest init`.
pub(crate) fn pid1() -> ExitCode {
    mount_all();
    let mut last_start = Instant::now();
    let mut server = start_server();
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _))
                if server == Some(pid.as_raw() as u32) =>
            {
                eprintln!("tether-guest: the server ended; starting it again");
                let since = last_start.elapsed();
                if since < RESTART_EVERY {
                    std::thread::sleep(RESTART_EVERY - since);
                }
                last_start = Instant::now();
                server = start_server();
            }
            Ok(_) => {}
            Err(nix::errno::Errno::ECHILD) => {
                std::thread::sleep(RESTART_EVERY);
                if server.is_none() {
                    server = start_server();
                }
            }
            Err(_) => {}
        }
    }
}
