#!/usr/bin/env bash
# Creates <repo>/.venv-otlp with the receiver's pinned dependencies. Idempotent: a venv whose
# installed requirements match requirements.txt is left alone.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${OTLP_VENV:-$REPO/.venv-otlp}"
REQ="$HERE/requirements.txt"
STAMP="$VENV/.requirements.sha256"
# Tests running in parallel (one process each) may all call this on a fresh machine.
exec 9>"$VENV.lock"
flock 9
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VENV/bin/python" -c 'import grpc, google.protobuf, opentelemetry.proto' 2>/dev/null; then
  echo "otlp venv ready: $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ"
echo "$want" > "$STAMP"
echo "otlp venv ready: $VENV"
