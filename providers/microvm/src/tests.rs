//! Unit tests of the provider's pure parts: config, the qemu command line, QMP framing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::config::MicrovmConfig;
