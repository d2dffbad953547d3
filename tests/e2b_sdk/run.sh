#!/usr/bin/env bash
# Runs the E2B SDK compatibility suites against a running tetherd.
#
#   tests/e2b_sdk/run.sh [python|js|all]        (default: all)
#
# Expects E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, TETHER_E2B_OTHER_KEY and TETHER_E2B_BAD_KEY in
# the environment and setup.sh to have run. Exits non-zero if any test of any selected suite fails.
# Each suite is also bounded as a whole, so a misbehaving server can never hang the caller.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
which="${1:-all}"
suite_limit="${TETHER_E2B_SUITE_LIMIT_S:-1200}"

case "$which" in
    python|js|all) ;;
    *) echo "usage: $0 [python|js|all]" >&2; exit 2 ;;
esac

missing=()
for var in E2B_API_URL E2B_SANDBOX_URL E2B_API_KEY TETHER_E2B_OTHER_KEY TETHER_E2B_BAD_KEY; do
    [[ -n "${!var:-}" ]] || missing+=("$var")
done
if (( ${#missing[@]} )); then
    echo "e2b_sdk: environment not set: ${missing[*]}" >&2
    exit 2
fi
# The SDKs must exercise the real control plane: any E2B_DEBUG (even `false`) is dropped.
unset E2B_DEBUG
export PYTHONDONTWRITEBYTECODE=1

status=0

run_python() {
    local py="$repo/.venv-e2b/bin/python"
    if [[ ! -x "$py" ]]; then
        echo "e2b_sdk: $py missing; run tests/e2b_sdk/setup.sh" >&2
        return 2
    fi
    (cd "$here/python" && timeout --kill-after=10 "$suite_limit" "$py" -m pytest test_sdk.py)
}

run_js() {
    if [[ ! -d "$here/js/node_modules/e2b" ]]; then
        echo "e2b_sdk: js/node_modules missing; run tests/e2b_sdk/setup.sh" >&2
        return 2
    fi
    (cd "$here/js" && timeout --kill-after=10 "$suite_limit" \
        node --test --test-concurrency=1 \
            --test-reporter=spec --test-reporter-destination=stdout \
            --test-reporter=./summary-reporter.mjs --test-reporter-destination=stdout \
            sdk.test.mjs)
}

if [[ "$which" == python || "$which" == all ]]; then
    run_python || status=1
fi
if [[ "$which" == js || "$which" == all ]]; then
    run_js || status=1
fi
exit "$status"
