#!/usr/bin/env bash
# Runs the E2B SDK compatibility suites against a throwaway tetherd.
#
#   tests/e2b_sdk/with-tetherd.sh [python|js|all]        (default: all)
#
# Builds tetherd (or uses $TETHERD_BIN), starts it on a free loopback port with two E2B tenants
# and a fresh state directory, exports the variables run.sh expects, runs the suites, and stops
# that tetherd again. Its log is printed when a suite fails.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

bin="${TETHERD_BIN:-}"
if [[ -z "$bin" ]]; then
    (cd "$repo" && cargo build -q -p tether-daemon --bin tetherd) || exit 2
    bin="$repo/target/debug/tetherd"
fi

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
work="$(mktemp -d -t tether-e2b-sdk.XXXXXX)"
main_key="e2b_main_$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
other_key="e2b_other_$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
cat > "$work/tetherd.toml" <<TOML
[server]
listen = "127.0.0.1:$port"

[e2b_front]
api_keys = [{ key = "$main_key", tenant = "main" }, { key = "$other_key", tenant = "other" }]
TOML

"$bin" serve --config "$work/tetherd.toml" --state-dir "$work/state" >"$work/tetherd.log" 2>&1 &
pid=$!
cleanup() {
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

for _ in $(seq 1 150); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "e2b_sdk: tetherd exited during start-up:" >&2
        cat "$work/tetherd.log" >&2
        exit 2
    fi
    sleep 0.2
done

export E2B_API_URL="http://127.0.0.1:$port"
export E2B_SANDBOX_URL="http://127.0.0.1:$port"
export E2B_API_KEY="$main_key"
export TETHER_E2B_OTHER_KEY="$other_key"
export TETHER_E2B_BAD_KEY="e2b_not_a_key_$port"

"$here/run.sh" "${1:-all}"
status=$?
if (( status != 0 )); then
    echo "---- tetherd log (last 80 lines) ----" >&2
    tail -n 80 "$work/tetherd.log" >&2
fi
exit "$status"
