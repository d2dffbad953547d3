//! Unit tests of the provider's pure parts: the config section, the qemu command line,
//! the cgroup choice, QMP message parsing and the VM table's stamps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsString;
use std::path::PathBuf;

use tether_protocol::ErrorCode;

use crate::client::{self, NetBackend, VmLaunch};
use crate::config::{Accel, MicrovmConfig};
use crate::image::GuestImage;

fn image() -> GuestImage {
    GuestImage {
        format: "tether-microvm-image/1".into(),
        key: "k".into(),
        dir: "/i".into(),
        kernel: "/i/vmlinuz".into(),
        initrd: "/i/initrd.gz".into(),
        rootfs: "/i/rootfs.ext4".into(),
        kernel_package: "linux-image-x_1".into(),
        disk_bytes: 1 << 30,
    }
}

fn launch(net: NetBackend, incoming: Option<&str>) -> VmLaunch {
    VmLaunch {
        dir: "/s/vms/vm-1".into(),
        disk: "/s/vms/vm-1/disk.qcow2".into(),
        port: 40001,
        net,
        memory_mib: 512,
        vcpus: 2,
        incoming: incoming.map(PathBuf::from),
    }
}

fn args(cfg: &MicrovmConfig, l: &VmLaunch) -> Vec<String> {
    client::qemu_args(cfg, &image(), l, "console=ttyS0")
        .into_iter()
        .map(|a: OsString| a.into_string().unwrap())
        .collect()
}

fn after<'a>(a: &'a [String], flag: &str) -> Vec<&'a str> {
    a.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

#[test]
fn the_config_section_parses_with_defaults_and_rejects_unknown_fields() {
    let c: MicrovmConfig = toml::from_str("root = \"/var/lib/t/vm\"\n").unwrap();
    assert_eq!(c.memory_mib, 512);
    assert_eq!(c.vcpus, 1);
    assert_eq!(c.accel, Accel::Auto);
    assert!(c.cgroup);
    c.validate().unwrap();
    assert_eq!(c.image_dir(), PathBuf::from("/var/lib/t/vm/image"));
    let c: MicrovmConfig =
        toml::from_str("root = \"/r\"\nmemory_mib = 1024\nvcpus = 2\naccel = \"tcg\"\n").unwrap();
    assert_eq!((c.memory_mib, c.vcpus, c.accel), (1024, 2, Accel::Tcg));
    assert!(toml::from_str::<MicrovmConfig>("root = \"/r\"\nmemory = 1\n").is_err());
}

#[test]
fn bad_config_values_are_invalid_requests() {
    let ok = MicrovmConfig::with_root("/r");
    ok.validate().unwrap();
    type Edit = Box<dyn Fn(&mut MicrovmConfig)>;
    let cases: Vec<Edit> = vec![
        Box::new(|c| c.root = PathBuf::from("relative")),
        Box::new(|c| c.memory_mib = 16),
        Box::new(|c| c.vcpus = 0),
        Box::new(|c| c.disk_mib = 10),
        Box::new(|c| c.qemu = " ".into()),
        Box::new(|c| c.boot_timeout_ms = 0),
        Box::new(|c| c.probe_timeout_ms = c.restore_timeout_ms),
    ];
    for (i, f) in cases.iter().enumerate() {
        let mut c = ok.clone();
        f(&mut c);
        let e = c.validate().expect_err(&format!("case {i} passed"));
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "case {i}");
    }
}

#[test]
fn the_command_line_is_a_microvm_with_slirp_restricted_to_the_agent_forward() {
    let mut cfg = MicrovmConfig::with_root("/s");
    cfg.accel = Accel::Tcg;
    let a = args(&cfg, &launch(NetBackend::Slirp, None));
    assert_eq!(after(&a, "-M"), ["microvm,pit=on,pic=on,rtc=on"]);
    assert_eq!(after(&a, "-accel"), ["tcg,tb-size=64"]);
    assert_eq!(after(&a, "-m"), ["512"]);
    assert_eq!(after(&a, "-smp"), ["2"]);
    assert_eq!(after(&a, "-serial"), ["file:/s/vms/vm-1/console.log"]);
    assert_eq!(after(&a, "-pidfile"), ["/s/vms/vm-1/qemu.pid"]);
    assert_eq!(
        after(&a, "-netdev"),
        ["user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:40001-:49983"]
    );
    assert!(after(&a, "-drive")[0].starts_with("id=d0,file=/s/vms/vm-1/disk.qcow2,format=qcow2"));
    assert!(a.iter().any(|x| x == "-nodefaults") && a.iter().any(|x| x == "-no-reboot"));
    assert!(after(&a, "-incoming").is_empty());
    assert_eq!(after(&a, "-kernel"), ["/i/vmlinuz"]);
    assert_eq!(after(&a, "-append"), ["console=ttyS0"]);
}

#[test]
fn passt_attaches_over_a_socket_pair_and_keeps_the_host_loopback_out_of_reach() {
    let mut cfg = MicrovmConfig::with_root("/s");
    cfg.accel = Accel::Tcg;
    let l = launch(NetBackend::Passt, Some("/s/templates/t/state"));
    let a = args(&cfg, &l);
    assert_eq!(
        after(&a, "-netdev"),
        ["stream,id=n0,server=off,addr.type=fd,addr.str=3"]
    );
    let p: Vec<String> = client::passt_args(&l)
        .into_iter()
        .map(|a: OsString| a.into_string().unwrap())
        .collect();
    assert_eq!(after(&p, "--fd"), ["3"]);
    assert_eq!(after(&p, "--tcp-ports"), ["127.0.0.1/40001:49983"]);
    assert_eq!(after(&p, "--udp-ports"), ["none"]);
    assert_eq!(after(&p, "--address"), ["10.0.2.15"]);
    assert_eq!(after(&p, "--gateway"), ["10.0.2.2"]);
    assert!(p.iter().any(|x| x == "--no-map-gw") && p.iter().any(|x| x == "--ipv4-only"));
    // A state saved under slirp carries slirp's own section: only slirp loads it.
    assert!(NetBackend::Passt.restores_into(NetBackend::Slirp));
    assert!(NetBackend::Passt.restores_into(NetBackend::Passt));
    assert!(!NetBackend::Slirp.restores_into(NetBackend::Passt));
    assert!(NetBackend::Slirp.restores_into(NetBackend::SlirpOpen));
    assert!(!NetBackend::Slirp.egress() && NetBackend::Passt.egress());
}

#[test]
fn a_restore_differs_from_its_boot_only_in_paths_port_and_egress() {
    let mut cfg = MicrovmConfig::with_root("/s");
    cfg.accel = Accel::Tcg;
    let boot = args(&cfg, &launch(NetBackend::Slirp, None));
    let restore = args(
        &cfg,
        &launch(NetBackend::SlirpOpen, Some("/s/templates/t/state")),
    );
    assert_eq!(
        after(&restore, "-incoming"),
        ["exec:cat '/s/templates/t/state'"]
    );
    assert_eq!(
        after(&restore, "-netdev"),
        ["user,id=n0,restrict=off,hostfwd=tcp:127.0.0.1:40001-:49983"]
    );
    // The machine and its devices are the boot's.
    for flag in [
        "-M", "-accel", "-cpu", "-m", "-smp", "-device", "-kernel", "-initrd", "-append",
    ] {
        assert_eq!(after(&boot, flag), after(&restore, flag), "{flag}");
    }
}

#[test]
fn the_kernel_command_line_carries_the_tsc_frequency_under_tcg_only() {
    let tcg = client::kernel_cmdline(false);
    assert!(tcg.contains("init_on_free=1") && tcg.contains("console=ttyS0"));
    if client::tsc_khz().is_some() {
        assert!(tcg.contains("tsc_early_khz="));
    }
    assert!(!client::kernel_cmdline(true).contains("tsc_early_khz"));
}

#[test]
fn kvm_is_used_only_where_it_is_real_hardware_virtualisation() {
    let mut cfg = MicrovmConfig::with_root("/s");
    cfg.accel = Accel::Tcg;
    assert!(!client::use_kvm(&cfg));
    cfg.accel = Accel::Kvm;
    assert!(client::use_kvm(&cfg));
    cfg.accel = Accel::Auto;
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    if pvm || !std::path::Path::new("/dev/kvm").exists() {
        assert!(!client::use_kvm(&cfg));
    }
    let mut cfg = MicrovmConfig::with_root("/s");
    cfg.accel = Accel::Kvm;
    let a = args(&cfg, &launch(NetBackend::Slirp, None));
    assert_eq!(after(&a, "-accel"), ["kvm"]);
    assert_eq!(after(&a, "-cpu"), ["host"]);
}

#[test]
fn migration_uris_quote_their_paths_for_the_shell() {
    assert_eq!(client::sh_quote("/a b/c"), "'/a b/c'");
    assert_eq!(client::sh_quote("it's"), r"'it'\''s'");
}

#[test]
fn usage_of_a_process_is_read_from_proc() {
    let (cpu, rss) = client::proc_usage(std::process::id()).unwrap();
    assert!(rss > 0);
    let _ = cpu;
    assert!(client::pid_alive(std::process::id()));
    assert!(!client::pid_alive(u32::MAX - 1));
    // This process's command line does not name a VM directory.
    assert!(!client::pid_is_vm(
        std::process::id(),
        std::path::Path::new("/nonexistent/vm-x")
    ));
}

#[test]
fn a_cgroup_is_made_on_v1_or_v2_and_removed() {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let id = format!("unit-{}", std::process::id());
    match client::Cgroup::create(root, &id, 64 << 20) {
        Some(cg) => {
            assert!(cg.procs().exists());
            assert_eq!(client::Cgroup::find(root, &id), Some(cg.clone()));
            cg.remove();
            assert_eq!(client::Cgroup::find(root, &id), None);
        }
        // A host without a writable memory controller: nothing is left either.
        None => assert_eq!(client::Cgroup::find(root, &id), None),
    }
}

/// A cgroup whose VM left a helper behind is still removed: what is in it is killed.
#[test]
fn a_cgroup_with_a_process_left_in_it_is_removed() {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let id = format!("unit-left-{}", std::process::id());
    let Some(cg) = client::Cgroup::create(root, &id, 64 << 20) else {
        // No writable memory controller here: nothing to leave behind.
        return;
    };
    let mut child = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .unwrap();
    std::fs::write(cg.procs(), child.id().to_string()).unwrap();
    cg.remove();
    assert_eq!(client::Cgroup::find(root, &id), None, "the cgroup is left");
    let status = child.wait().unwrap();
    assert!(!status.success(), "the process in it was not ended");
}

#[test]
fn entropy_and_tokens_differ_per_call() {
    let a = client::entropy().unwrap();
    let b = client::entropy().unwrap();
    assert_ne!(a, b);
    use base64::Engine;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(a)
            .unwrap()
            .len(),
        32
    );
}

/// The provider lists its own snapshots, finished ones and a `.tmp` cut short, and only
/// them, so that a starting daemon can delete the ones no record names.
#[tokio::test]
async fn its_snapshots_are_listed_and_deleted_by_id() {
    use tether_provider::Provider as _;
    let dir = tempfile::tempdir().unwrap();
    let p = crate::MicrovmProvider::new(MicrovmConfig::with_root(dir.path())).unwrap();
    let ctx = tether_provider::CallCtx::new("snapshots");
    assert!(p.list_snapshots(&ctx).await.unwrap().is_empty());
    let snaps = dir.path().join("snapshots");
    for d in ["snap-a", "snap-b.tmp", "not-a-snapshot"] {
        std::fs::create_dir_all(snaps.join(d)).unwrap();
    }
    let mut listed = p.list_snapshots(&ctx).await.unwrap();
    listed.sort();
    assert_eq!(listed, ["snap-a", "snap-b.tmp"]);
    p.delete_snapshot(&ctx, "snap-b.tmp").await.unwrap();
    assert_eq!(p.list_snapshots(&ctx).await.unwrap(), ["snap-a"]);
    assert!(snaps.join("not-a-snapshot").exists());
}
