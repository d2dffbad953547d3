//! What the microVM tests share: the configuration over this host's qemu, guest agent and
//! base template, or the reason the tests are skipped.

use std::path::PathBuf;

use tether_provider_microvm::MicrovmConfig;

/// The test configuration, or `None` (with the reason printed) where the host lacks
/// something.
pub fn config() -> Option<MicrovmConfig> {
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    tether_provider_microvm::testkit::test_config(&ws)
        .map_err(|why| eprintln!("SKIPPED: {why}"))
        .ok()
}
