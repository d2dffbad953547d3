#!/usr/bin/env bash
# Coverage-guided runs of the fuzz targets (cargo-fuzz, nightly), each bounded by
# TETHER_FUZZ_SECONDS (default 20). Skipped, saying so, when nightly Rust or cargo-fuzz
# is not installed: the bounded runs of the same targets in the test suite
# (tests/fuzz/tests/inputs.rs) still run. A crash fails the run and leaves its input under
# tests/fuzz/harness/artifacts/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
secs="${TETHER_FUZZ_SECONDS:-20}"
if [[ "$secs" == 0 ]]; then
  echo "fuzz: TETHER_FUZZ_SECONDS=0, skipped"
  exit 0
fi
if ! cargo +nightly --version >/dev/null 2>&1 || ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: skipped (needs a nightly toolchain and cargo-fuzz: rustup toolchain install nightly --profile minimal; cargo install --locked cargo-fuzz)"
  exit 0
fi
for target in connect_frames e2b_requests native_requests multipart session_log_tail; do
  echo "fuzz: $target for ${secs}s"
  cargo +nightly fuzz run --fuzz-dir harness "$target" -- -max_total_time="$secs" 2>&1 | grep -E "^Done|ERROR|SUMMARY|panicked" || true
  if ls harness/artifacts/"$target"/crash-* >/dev/null 2>&1; then
    echo "fuzz: $target crashed: see tests/fuzz/harness/artifacts/$target/" >&2
    exit 1
  fi
done
