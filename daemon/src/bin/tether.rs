//! `tether`: the command-line client of tetherd.
//!
//! `tether run` embeds a daemon whose local provider re-executes this binary as its
//! confinement trampoline (hidden subcommand `__confine`) when no `tether-confine` binary
//! sits beside it.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == tether_provider_local::CONFINE_SUBCOMMAND)
    {
        return tether_provider_local::confine::main();
    }
    let cli = tether_daemon::cli::Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tether: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(tether_daemon::cli::run(cli));
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}
