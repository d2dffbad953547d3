#!/usr/bin/env bash
# Runs the OpenAI Agents SDK suite against a running tetherd.
#
#   tests/agents_sdk/run.sh [pytest args...]
#
# Expects E2B_API_URL, E2B_SANDBOX_URL (loopback URLs of tetherd's E2B front) and E2B_API_KEY (a
# valid key; e2b 2.31, which openai-agents[e2b] 0.24.0 pins, only sends keys of the form
# `e2b_<hex>`) in the environment and setup.sh to have run. Exits non-zero if any test fails. The
# suite is also bounded as a whole, so a misbehaving server can never hang the caller.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
suite_limit="${TETHER_AGENTS_SUITE_LIMIT_S:-900}"

missing=()
for var in E2B_API_URL E2B_SANDBOX_URL E2B_API_KEY; do
    [[ -n "${!var:-}" ]] || missing+=("$var")
done
if (( ${#missing[@]} )); then
    echo "agents_sdk: environment not set: ${missing[*]}" >&2
    exit 2
fi
# The SDK must exercise the real control plane: any E2B_DEBUG (even `false`) is dropped.
unset E2B_DEBUG E2B_DOMAIN E2B_ACCESS_TOKEN
# The model is scripted: no OpenAI key, no OpenAI endpoint but a closed loopback port.
unset OPENAI_API_KEY
export OPENAI_BASE_URL="http://127.0.0.1:9/v1"
export OPENAI_AGENTS_DISABLE_TRACING=1
export PYTHONDONTWRITEBYTECODE=1

py="$repo/.venv-agents/bin/python"
if [[ ! -x "$py" ]]; then
    echo "agents_sdk: $py missing; run tests/agents_sdk/setup.sh" >&2
    exit 2
fi
cd "$here" && exec timeout --kill-after=10 "$suite_limit" "$py" -m pytest test_agents.py "$@"
