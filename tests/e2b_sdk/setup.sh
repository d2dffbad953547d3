#!/usr/bin/env bash
# Installs what the E2B SDK compatibility suites need: the Python venv <repo>/.venv-e2b with the
# pinned official `e2b` package and pytest, and the pinned official `e2b` npm package under js/.
# Idempotent and quick when nothing changed: each half is redone only when its pins are newer than
# the stamp it left behind.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$repo/.venv-e2b"

# --- Python ---
py_stamp="$venv/.tether-requirements"
if [[ ! -x "$venv/bin/python" ]] || ! cmp -s "$here/requirements.txt" "$py_stamp"; then
    echo "e2b_sdk setup: creating $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$py_stamp"
else
    echo "e2b_sdk setup: python venv up to date"
fi

# --- JavaScript ---
js="$here/js"
js_stamp="$js/node_modules/.tether-lock"
if [[ ! -d "$js/node_modules/e2b" ]] || ! cmp -s "$js/package-lock.json" "$js_stamp"; then
    echo "e2b_sdk setup: npm ci in $js"
    (cd "$js" && npm ci --no-audit --no-fund --loglevel=error)
    cp "$js/package-lock.json" "$js_stamp"
else
    echo "e2b_sdk setup: node_modules up to date"
fi
