//! The helper binary's entry point (`tether-confine`, or `tetherd __confine`).
//!
//! Verbs, all internal to the local provider:
//! - `holder`: the process that creates a sandbox's namespaces ([`crate::init`]);
//! - `pid1`: the sandbox's init, first process of its pid namespace;
//! - `ptyexec <argv...>`: run a command as the session leader of its pty;
//! - `fsop`: one file operation with the sandbox root's rights (the `elevated` module).
//!
//! A process that calls [`main`] must be single-threaded (creating a user namespace
//! demands it): `tetherd` dispatches `__confine` before it starts its runtime.

use std::ffi::OsString;
use std::process::ExitCode;

/// The hidden subcommand that routes a binary's `main` here.
pub const CONFINE_SUBCOMMAND: &str = "__confine";

/// The helper's entry point: `[argv0] [__confine] holder|pid1|ptyexec <argv...>`.
pub fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == CONFINE_SUBCOMMAND) {
        args.remove(0);
    }
    let verb = args.first().map(|a| a.to_string_lossy().into_owned());
    match (verb.as_deref(), args.len()) {
        (Some("holder"), 1) => crate::init::holder(),
        (Some("pid1"), 1) => crate::init::pid1(),
        (Some("ptyexec"), n) if n >= 2 => crate::init::ptyexec(&args[1..]),
        (Some("fsop"), 1) => crate::elevated::helper(),
        _ => {
            eprintln!("usage: tether-confine [__confine] holder|pid1|ptyexec <argv...>|fsop");
            ExitCode::from(2)
        }
    }
}
