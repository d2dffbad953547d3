#!/usr/bin/env bash
# Runs tether's whole test suite: installs the test fixtures it needs (idempotent: the
# official E2B SDKs in a venv and node_modules, the OpenAI Agents SDK in a venv, the OTLP
# receiver's venv), then every test of every crate, the end-to-end tests, the conformance
# suite and the SDK suites.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tests/e2b_sdk/setup.sh
bash tests/agents_sdk/setup.sh
bash tests/otlp/setup.sh

# The microVM guest agent: one static binary (glibc with crt-static), release, for the
# target triple so that the flag never reaches build scripts. Cached by cargo; the guest
# image the tests build from it is cached under target/ too.
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release -p tether-guest --target x86_64-unknown-linux-gnu
# The `base` template (Debian from Debian's packages), which the local provider's base
# tests and the microVM guest's root file system share; built once, then cached here.
cargo run -q -p tether-daemon --bin tether -- template build base --dir target/tether-templates

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi

# Coverage-guided fuzzing, bounded (TETHER_FUZZ_SECONDS per target; skipped without
# nightly Rust and cargo-fuzz).
bash tests/fuzz/run.sh

# Nothing the tests started is left on the host (processes, mounts, network namespaces,
# loop devices, cgroups).
bash tests/leftovers.sh
