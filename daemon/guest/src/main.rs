//! `tether-guest`: the agent inside a tether microVM.
//!
//! - `tether-guest init` is the guest's PID 1 (the initramfs `switch_root`s to it): it
//!   mounts the kernel file systems, then runs `tether-guest serve` and reaps every
//!   orphan, starting the server again if it ends.
//! - `tether-guest serve` is tetherd in its guest-agent mode (`[e2b_front.guest]`):
//!   envd on port 49983 for exactly one sandbox, this machine, through the local
//!   provider with `isolation = "none"` (the VM is the boundary). The same E2B front
//!   serves it as serves E2B sandboxes on the host, so journaled commands, re-attach and
//!   file operations behave alike. Its session log lives on the VM's own disk.
//! - `tether-guest __confine ...` is the local provider's helper.
//!
//! After a VM is restored from a saved state, the host's first `POST /init` sets a
//! fresh access token, the clock and new entropy.

use std::process::ExitCode;

mod init;

/// envd's port.
const ENVD_LISTEN: &str = "0.0.0.0:49983";

/// Where the agent keeps its state (session log, output journals) on the VM's disk.
const STATE_DIR: &str = "/var/lib/tether-guest";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some(tether_provider_local::CONFINE_SUBCOMMAND) => tether_provider_local::confine::main(),
        Some("init") => init::pid1(),
        Some("serve") => serve(
            args.get(1).map_or(ENVD_LISTEN, String::as_str),
            args.get(2).map_or(STATE_DIR, String::as_str),
        ),
        _ => {
            eprintln!("usage: tether-guest init | serve [LISTEN [STATE_DIR]]");
            ExitCode::from(2)
        }
    }
}

/// The guest agent's configuration.
fn config(listen: &str, state_dir: &str) -> Result<tether_daemon::config::Config, String> {
    let toml = format!(
        r#"
default_provider = "machine"

[server]
listen = "{listen}"
state_dir = "{state_dir}"

[providers.machine]
kind = "local"
isolation = "none"

[e2b_front]
enabled = true
provider = "machine"

[e2b_front.guest]
set_clock = true
"#
    );
    tether_daemon::config::Config::from_toml_str(&toml).map_err(|e| e.to_string())
}

fn serve(listen: &str, state_dir: &str) -> ExitCode {
    let cfg = match config(listen, state_dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tether-guest: {e}");
            return ExitCode::from(64);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tether-guest: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        // Logs go to stderr: the VM's console.
        let telemetry = match tether_daemon::telemetry::init(
            &cfg.telemetry,
            &tether_daemon::telemetry::ProcessEnv,
        ) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("tether-guest: telemetry: {e}");
                return ExitCode::from(64);
            }
        };
        let daemon = match tether_daemon::server::Daemon::start(cfg).await {
            Ok(d) => d,
            Err(e) => {
                eprintln!("tether-guest: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("TETHER_AGENT_READY {}", daemon.addr);
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("tether-guest: cannot watch SIGTERM: {e}");
                    return ExitCode::FAILURE;
                }
            };
        term.recv().await;
        daemon.shutdown().await;
        telemetry.shutdown().await;
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_guest_configuration_is_valid_and_a_guest() {
        let cfg = super::config(super::ENVD_LISTEN, super::STATE_DIR).unwrap();
        assert!(cfg.e2b_front.guest.is_some());
        assert_eq!(cfg.server.listen.port(), 49983);
        assert!(cfg.server.auth_tokens.is_empty());
    }
}
