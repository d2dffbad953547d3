//! `tetherd`: the tether daemon.
//!
//! `tetherd serve` runs the daemon; `tetherd validate-config` checks a config file and
//! exits 64 (`EX_USAGE`) when it is invalid.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tether_daemon::config::Config;

/// `EX_USAGE` from sysexits.h: invalid configuration or arguments.
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    name = "tetherd",
    version,
    about = "The tether remote-sandbox orchestration daemon"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the native API and the E2B front.
    Serve {
        /// Config file (TOML). Without one, the documented defaults apply.
        #[arg(long, env = "TETHER_CONFIG")]
        config: Option<PathBuf>,
        /// Listen address (overrides the file).
        #[arg(long, env = "TETHER_LISTEN")]
        listen: Option<SocketAddr>,
        /// State directory (overrides the file).
        #[arg(long, env = "TETHER_STATE_DIR")]
        state_dir: Option<PathBuf>,
    },
    /// Validate a config file and exit (0: valid, 64: invalid).
    ValidateConfig {
        /// Config file (TOML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Confinement trampoline of the local provider (internal).
    #[command(hide = true, name = "__confine", disable_help_flag = true)]
    Confine {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        rest: Vec<String>,
    },
}

fn load(config: Option<&PathBuf>) -> Result<Config, String> {
    match config {
        Some(p) => Config::load(p).map_err(|e| format!("{e}: {}", chain(&e))),
        None => Ok(Config::default()),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(&s.to_string());
        out.push_str("; ");
        src = s.source();
    }
    out
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Command::Confine { .. } => tether_provider_local::confine::main(),
        Command::ValidateConfig { config } => match load(Some(&config)) {
            Ok(_) => {
                println!("{}: valid", config.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("tetherd: {e}");
                ExitCode::from(EX_USAGE)
            }
        },
        Command::Serve {
            config,
            listen,
            state_dir,
        } => {
            let mut cfg = match load(config.as_ref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("tetherd: {e}");
                    return ExitCode::from(EX_USAGE);
                }
            };
            if let Some(l) = listen {
                cfg.server.listen = l;
            }
            if let Some(d) = state_dir {
                cfg.server.state_dir = d;
            }
            if let Err(e) = cfg.validate() {
                eprintln!("tetherd: {e}");
                return ExitCode::from(EX_USAGE);
            }
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("tetherd: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let code = rt.block_on(serve(cfg));
            // A blocking exporter thread stuck on a dead collector must not hold the exit.
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
            code
        }
    }
}

async fn serve(cfg: Config) -> ExitCode {
    let telemetry =
        match tether_daemon::telemetry::init(&cfg.telemetry, &tether_daemon::telemetry::ProcessEnv)
        {
            Ok(g) => g,
            Err(e) => {
                eprintln!("tetherd: telemetry: {e}");
                return ExitCode::from(EX_USAGE);
            }
        };
    let e2b_cfg = cfg.e2b_front.clone();
    let daemon = match tether_daemon::server::Daemon::start(cfg).await {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "Start-up failed");
            eprintln!("tetherd: {e}");
            telemetry.shutdown().await;
            return ExitCode::FAILURE;
        }
    };
    let r = &daemon.recovery;
    tracing::info!(
        listen = %daemon.addr,
        state_dir = %daemon.state.config.server.state_dir.display(),
        repaired = r.repaired.len(),
        reconnected = r.reconnected.len(),
        detached = r.detached.len(),
        orphans_destroyed = r.orphans_destroyed.len(),
        snapshots_deleted = r.snapshots_deleted.len(),
        "tetherd is serving"
    );
    println!("tetherd listening on http://{}", daemon.addr);
    println!("native API: TETHER_URL=http://{}", daemon.addr);
    if e2b_cfg.enabled {
        println!(
            "{}",
            tether_daemon::e2b_front::recipe(
                daemon.addr,
                &e2b_cfg,
                !daemon.state.config.server.auth_tokens.is_empty()
            )
        );
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tetherd: cannot watch SIGTERM: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("Shutting down");
    daemon.shutdown().await;
    telemetry.shutdown().await;
    ExitCode::SUCCESS
}
