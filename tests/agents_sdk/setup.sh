#!/usr/bin/env bash
# Installs what the OpenAI Agents SDK suite needs: the Python venv <repo>/.venv-agents with the
# pinned `openai-agents[e2b]` (and the `e2b` it pins), pytest and pytest-timeout.
# Idempotent and quick when nothing changed: the venv is redone only when requirements.txt differs
# from the stamp it left behind.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$repo/.venv-agents"

stamp="$venv/.tether-requirements"
if [[ ! -x "$venv/bin/python" ]] || ! cmp -s "$here/requirements.txt" "$stamp"; then
    echo "agents_sdk setup: creating $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$stamp"
else
    echo "agents_sdk setup: python venv up to date"
fi
