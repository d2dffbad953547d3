"""Harness for the E2B Python SDK compatibility suite.

The suite drives tetherd's E2B front with the official, unmodified `e2b` package, exactly as a user
program would: the SDK finds the server through `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY`.
This file owns everything that is not a test:

* reading and checking the environment (two valid keys of different tenants and one invalid key);
* a one-time reachability probe, so that a missing server fails every test at once with a clear
  message instead of each test waiting on its own connection errors;
* hard per-test bounds: the body of each test runs in a worker thread that the harness stops waiting
  for after the test's budget, because a blocking SDK call can sit inside native code where a
  signal-based timeout would never be delivered;
* sandbox bookkeeping: every sandbox a test creates is killed in teardown, and a session finalizer
  kills anything a broken teardown left behind;
* the closing table, one row per SDK call tested, and the line `e2b-python: N passed, M failed`.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pytest

# The SDK decides between the control plane and its debug shortcut from E2B_DEBUG; the suite must
# always exercise the real control plane, whatever the caller's shell has set. Unset, not `false`:
# E2B's own suites take their debug branches when the variable is set at all.
os.environ.pop("E2B_DEBUG", None)

from e2b import Sandbox  # noqa: E402  (import after dropping E2B_DEBUG on purpose)

# === configuration ===

REQUIRED_ENV = (
    "E2B_API_URL",
    "E2B_SANDBOX_URL",
    "E2B_API_KEY",
    "TETHER_E2B_OTHER_KEY",
    "TETHER_E2B_BAD_KEY",
)

#: Default budget of one test body, seconds. Tests that move a lot of data raise it with
#: `@pytest.mark.bound(seconds)`.
DEFAULT_BOUND_S = 60.0

#: Budget of fixture work done outside the test body (create, kill), seconds.
FIXTURE_BOUND_S = 45.0

#: Client-side limit of each unary SDK request. Streaming calls carry their own `timeout`.
REQUEST_TIMEOUT_S = 20.0

#: Marks this run's sandboxes so list filters and the leak sweep never touch anybody else's.
RUN_ID = "py" + secrets.token_hex(6)


@dataclass
class Env:
    """The environment the suite was started with."""

    api_url: str
    sandbox_url: str
    api_key: str
    other_key: str
    bad_key: str


def _read_env() -> Optional[Env]:
    if any(not os.environ.get(name) for name in REQUIRED_ENV):
        return None
    return Env(
        api_url=os.environ["E2B_API_URL"],
        sandbox_url=os.environ["E2B_SANDBOX_URL"],
        api_key=os.environ["E2B_API_KEY"],
        other_key=os.environ["TETHER_E2B_OTHER_KEY"],
        bad_key=os.environ["TETHER_E2B_BAD_KEY"],
    )


ENV = _read_env()


# === impl bounded execution ===


class BoundExceeded(AssertionError):
    """A test body or fixture step outlived its budget."""


def bounded(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """Run `fn` in a daemon thread and give up waiting after `seconds`.

    A thread that overruns is abandoned (it is a daemon, so it never holds the process open); the
    caller gets `BoundExceeded`, the test fails, and teardown still runs and kills the sandbox,
    which usually unblocks the abandoned call as well.
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = e

    worker = threading.Thread(target=run, name=f"bounded:{what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise BoundExceeded(f"{what} did not finish within {seconds:.0f} s (server hang?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# === impl reachability probe ===

_probe_lock = threading.Lock()
_probe_result: Dict[str, Optional[str]] = {}


def _probe_once(url: str) -> Optional[str]:
    """TCP-connect to the host:port of `url` once; returns an error text or None."""
    with _probe_lock:
        if url in _probe_result:
            return _probe_result[url]
        parsed = urllib.parse.urlsplit(url)
        host = parsed.hostname or "127.0.0.1"
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        err: Optional[str] = None
        try:
            with socket.create_connection((host, port), timeout=3.0):
                pass
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        _probe_result[url] = err
        return err


def require_server() -> Env:
    """Fail the calling test immediately when the environment or the server is missing."""
    if ENV is None:
        missing = [n for n in REQUIRED_ENV if not os.environ.get(n)]
        pytest.fail(f"environment not set: {', '.join(missing)}", pytrace=False)
    for url in {ENV.api_url, ENV.sandbox_url}:
        err = _probe_once(url)
        if err is not None:
            pytest.fail(f"E2B front unreachable at {url}: {err}", pytrace=False)
    return ENV


# === impl sandbox bookkeeping ===


@dataclass
class Tracked:
    sandbox_id: str
    api_key: str


_all_created: List[Tracked] = []
_all_lock = threading.Lock()


def _kill_quietly(tracked: Tracked) -> Optional[BaseException]:
    try:
        bounded(
            lambda: Sandbox.kill(
                tracked.sandbox_id, api_key=tracked.api_key, request_timeout=REQUEST_TIMEOUT_S
            ),
            FIXTURE_BOUND_S,
            f"Sandbox.kill({tracked.sandbox_id})",
        )
        return None
    except BaseException as e:  # noqa: BLE001
        return e


@dataclass
class SandboxFactory:
    """Creates sandboxes for one test and remembers them for teardown."""

    env: Env
    created: List[Tracked] = field(default_factory=list)

    def __call__(self, api_key: Optional[str] = None, **create_opts: Any) -> Sandbox:
        key = api_key or self.env.api_key
        metadata = {"suite": "tether-e2b-python", "run": RUN_ID}
        metadata.update(create_opts.pop("metadata", None) or {})
        sbx = bounded(
            lambda: Sandbox.create(
                metadata=metadata,
                api_key=key,
                request_timeout=REQUEST_TIMEOUT_S,
                **create_opts,
            ),
            FIXTURE_BOUND_S,
            "Sandbox.create",
        )
        tracked = Tracked(sbx.sandbox_id, key)
        self.created.append(tracked)
        with _all_lock:
            _all_created.append(tracked)
        return sbx

    def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox the test killed itself (and asserted on) from teardown."""
        self.created = [t for t in self.created if t.sandbox_id != sandbox_id]


@pytest.fixture
def env() -> Env:
    return require_server()


@pytest.fixture
def make_sandbox(env: Env):
    factory = SandboxFactory(env)
    yield factory
    errors = []
    for tracked in factory.created:
        err = _kill_quietly(tracked)
        if err is not None:
            errors.append(f"{tracked.sandbox_id}: {type(err).__name__}: {err}")
        else:
            with _all_lock:
                if tracked in _all_created:
                    _all_created.remove(tracked)
    if errors:
        pytest.fail("teardown could not kill: " + "; ".join(errors), pytrace=False)


@pytest.fixture
def sandbox(make_sandbox: SandboxFactory) -> Sandbox:
    return make_sandbox()


def pytest_sessionfinish(session, exitstatus):
    # Whatever a failed teardown left behind is swept once more, best effort.
    with _all_lock:
        leftovers = list(_all_created)
    for tracked in leftovers:
        _kill_quietly(tracked)


# === impl per-test bound ===


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sdk(name): the SDK call a test is about (summary table row)"
    )
    config.addinivalue_line("markers", "bound(seconds): budget of the test body")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("bound")
    seconds = float(marker.args[0]) if marker else DEFAULT_BOUND_S
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames}
    bounded(lambda: pyfuncitem.obj(**kwargs), seconds, pyfuncitem.name)
    return True


# === impl summary table ===

_rows: Dict[str, Dict[str, str]] = {}
_row_order: List[str] = []
_notes: List[str] = []


def note(text: str) -> None:
    """Record a measured figure to print under the table."""
    _notes.append(text)


def _label(item) -> str:
    marker = item.get_closest_marker("sdk")
    return marker.args[0] if marker else item.name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.sdk_label = _label(item)


def pytest_runtest_logreport(report):
    label = getattr(report, "sdk_label", report.nodeid)
    if report.nodeid not in _rows:
        _rows[report.nodeid] = {"label": label, "result": "PASS", "why": ""}
        _row_order.append(report.nodeid)
    row = _rows[report.nodeid]
    if report.failed:
        if row["result"] != "FAIL":
            row["why"] = _short_reason(report)
        row["result"] = "FAIL"
    elif report.skipped and row["result"] == "PASS":
        row["result"] = "SKIP"


def _short_reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:110]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if not _row_order:
        return
    width = max(len(_rows[n]["label"]) for n in _row_order)
    tr.write_sep("=", "E2B SDK compatibility: python e2b")
    if ENV is not None:
        tr.write_line(f"server: {ENV.api_url} (envd {ENV.sandbox_url})")
    tr.write_line(f"{'SDK call'.ljust(width)}  result")
    passed = failed = 0
    for nodeid in _row_order:
        row = _rows[nodeid]
        line = f"{row['label'].ljust(width)}  {row['result']}"
        if row["result"] == "FAIL":
            failed += 1
            line += f"  ({row['why']})" if row["why"] else ""
        elif row["result"] == "PASS":
            passed += 1
        tr.write_line(line)
    for text in _notes:
        tr.write_line(text)
    tr.write_line(f"e2b-python: {passed} passed, {failed} failed")
