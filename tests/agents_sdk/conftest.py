"""Harness of the OpenAI Agents SDK suite.

The suite runs whole agent turns of `agents.extensions.sandbox.e2b` against tetherd's E2B front,
the SDK finding the server as any program would: `E2B_API_URL`, `E2B_SANDBOX_URL` and
`E2B_API_KEY`. This file owns everything that is not a test:

* the environment: the three variables, loopback URLs only (nothing here may send traffic
  anywhere else), no `E2B_DEBUG`, Agents SDK tracing off, any OpenAI client pointed at a closed
  loopback port, and a throwaway `XDG_STATE_HOME` so the SDK's default local snapshot directory
  is the run's own;
* a one-time reachability probe, so a missing server fails every test at once;
* bookkeeping: every sandbox and snapshot the suite sees is killed or deleted at the end;
* the closing table, one row per test with the trace of its scripted steps, and the line
  `agents-sdk: N passed, M failed`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
from typing import Dict, List, Optional, Set

import pytest

# === environment, fixed before the SDKs are imported ===

os.environ.pop("E2B_DEBUG", None)
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
# No model call may reach a network: the suite's model is scripted. Should anything still build an
# OpenAI client, it talks to a loopback port nothing listens on.
os.environ.pop("OPENAI_API_KEY", None)
os.environ["OPENAI_BASE_URL"] = "http://127.0.0.1:9/v1"
_STATE_HOME = tempfile.mkdtemp(prefix="tether-agents-state-")
os.environ["XDG_STATE_HOME"] = _STATE_HOME

REQUIRED_ENV = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")

#: Client-side limit of each request the harness itself sends, seconds.
REQUEST_TIMEOUT_S = 20.0


def state_home() -> str:
    return _STATE_HOME


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_probe_lock = threading.Lock()
_probe_result: Dict[str, Optional[str]] = {}


def _probe_once(url: str) -> Optional[str]:
    with _probe_lock:
        if url in _probe_result:
            return _probe_result[url]
        parsed = urllib.parse.urlsplit(url)
        host = parsed.hostname or "127.0.0.1"
        port = parsed.port or 80
        err: Optional[str] = None
        try:
            with socket.create_connection((host, port), timeout=3.0):
                pass
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        _probe_result[url] = err
        return err


@pytest.fixture
def server() -> str:
    """Fail the test at once when the environment or the server is missing."""
    missing = [n for n in REQUIRED_ENV if not os.environ.get(n)]
    if missing:
        pytest.fail(f"environment not set: {', '.join(missing)}", pytrace=False)
    for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        url = os.environ[name]
        if not _is_loopback(url):
            pytest.fail(f"{name}={url} is not a loopback URL; this suite only talks to loopback",
                        pytrace=False)
        err = _probe_once(url)
        if err is not None:
            pytest.fail(f"E2B front unreachable at {url}: {err}", pytrace=False)
    return os.environ["E2B_API_URL"]


# === bookkeeping: sandboxes and snapshots to sweep ===

_sandboxes: Set[str] = set()
_snapshots: Set[str] = set()
_book_lock = threading.Lock()


def saw_sandbox(sandbox_id: str) -> None:
    with _book_lock:
        _sandboxes.add(sandbox_id)


def saw_snapshot(snapshot_id: str) -> None:
    with _book_lock:
        _snapshots.add(snapshot_id)


async def _sweep() -> List[str]:
    from e2b import AsyncSandbox

    notes: List[str] = []
    with _book_lock:
        sandboxes, snapshots = sorted(_sandboxes), sorted(_snapshots)
    for sid in sandboxes:
        try:
            if await asyncio.wait_for(
                AsyncSandbox.kill(sid, request_timeout=REQUEST_TIMEOUT_S), REQUEST_TIMEOUT_S + 5
            ):
                notes.append(f"swept sandbox left running: {sid}")
        except Exception as e:  # noqa: BLE001  (best effort)
            notes.append(f"could not sweep sandbox {sid}: {type(e).__name__}: {e}")
    for snap in snapshots:
        try:
            await asyncio.wait_for(
                AsyncSandbox.delete_snapshot(snap, request_timeout=REQUEST_TIMEOUT_S),
                REQUEST_TIMEOUT_S + 5,
            )
        except Exception as e:  # noqa: BLE001
            notes.append(f"could not delete snapshot {snap}: {type(e).__name__}: {e}")
    return notes


# === per-test step traces and the closing table ===

_traces: Dict[str, List[str]] = {}
_notes: List[str] = []


class TurnLog:
    """Collects the step traces of one test's scripted turns for the closing table."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        _traces[nodeid] = []

    def add(self, turn: str, trace: List[str]) -> None:
        _traces[self.nodeid].extend(f"{turn}: {line}" for line in trace)

    def note(self, text: str) -> None:
        _traces[self.nodeid].append(f"note: {text}")


@pytest.fixture
def turns(request) -> TurnLog:
    return TurnLog(request.node.nodeid)


def pytest_configure(config):
    config.addinivalue_line("markers", "turn(name): the scenario a test drives (table row)")


_rows: Dict[str, Dict[str, str]] = {}
_row_order: List[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("turn")
    report.turn_label = marker.args[0] if marker else item.name


def pytest_runtest_logreport(report):
    label = getattr(report, "turn_label", report.nodeid)
    if report.nodeid not in _rows:
        _rows[report.nodeid] = {"label": label, "result": "PASS", "why": ""}
        _row_order.append(report.nodeid)
    row = _rows[report.nodeid]
    if report.failed:
        if row["result"] != "FAIL":
            row["why"] = _short_reason(report)
        row["result"] = "FAIL"
    elif report.skipped and row["result"] == "PASS":
        if hasattr(report, "wasxfail"):
            row["result"] = "XFAIL"
            row["why"] = str(report.wasxfail)[:110]
        else:
            row["result"] = "SKIP"
            longrepr = report.longrepr
            row["why"] = str(longrepr[2])[:110] if isinstance(longrepr, tuple) else ""


def _short_reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:110]


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("E2B_API_KEY") and (_sandboxes or _snapshots):
        try:
            _notes.extend(asyncio.run(asyncio.wait_for(_sweep(), 120)))
        except Exception as e:  # noqa: BLE001
            _notes.append(f"sweep failed: {type(e).__name__}: {e}")
    shutil.rmtree(_STATE_HOME, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if not _row_order:
        return
    width = max(len(_rows[n]["label"]) for n in _row_order)
    tr.write_sep("=", "OpenAI Agents SDK (agents.extensions.sandbox.e2b) against tetherd")
    tr.write_line(f"server: {os.environ.get('E2B_API_URL', '?')}")
    tr.write_line(f"{'scenario'.ljust(width)}  result")
    passed = failed = skipped = 0
    for nodeid in _row_order:
        row = _rows[nodeid]
        line = f"{row['label'].ljust(width)}  {row['result']}"
        if row["why"]:
            line += f"  ({row['why']})"
        if row["result"] == "FAIL":
            failed += 1
        elif row["result"] == "PASS":
            passed += 1
        else:
            skipped += 1
        tr.write_line(line)
        for step in _traces.get(nodeid, []):
            tr.write_line(f"    {step}")
    for text in _notes:
        tr.write_line(text)
    tr.write_line(f"agents-sdk: {passed} passed, {failed} failed, {skipped} skipped")
