//! `tether-confine`: the confinement trampoline of the local provider.
//!
//! Not meant to be run by hand: the provider starts every sandboxed command as
//! `tether-confine __confine run <spec.json>`. See `tether_provider_local::confine`.

fn main() -> std::process::ExitCode {
    tether_provider_local::confine::main()
}
